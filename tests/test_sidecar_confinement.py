"""Build inputs confined (issue 11): a `MODEL.edgepack.toml` next to a model may name labels only as a
plain file inside the model's folder (symlinks resolved). Otherwise a model folder from elsewhere could
pull e.g. ~/.ssh/id_ed25519 into the manifest that the artifact's /info serves. A path given on the
command line is the user's explicit choice and is taken as is."""
from __future__ import annotations

import os
import shutil

import pytest
from conftest import EXAMPLES, run_edgepack

from edgepack.errors import UsageError
from edgepack.prepost import load_config

SECRET = "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA\n"
LABELS = [f"class{i}" for i in range(10)]


@pytest.fixture
def folder(tmp_path):
    """A model folder as it might arrive from elsewhere, and a secret outside it."""
    secret = tmp_path / "home" / ".ssh" / "id_ed25519"
    secret.parent.mkdir(parents=True)
    secret.write_text(SECRET)
    d = tmp_path / "model"
    d.mkdir()
    shutil.copy(EXAMPLES / "tiny_cnn.onnx", d / "tiny_cnn.onnx")
    (d / "real_labels.txt").write_text("\n".join(LABELS) + "\n")
    return d, secret


def _toml(d, labels: str) -> None:
    (d / "tiny_cnn.edgepack.toml").write_text(f'[postprocess]\nsoftmax = true\ntopk = 3\nlabels = "{labels}"\n')


def test_sidecar_labels_outside_the_model_folder_are_refused(folder, tmp_path):
    """The command line as a user meets it: one `error:` line, exit 2, nothing built, nothing leaked."""
    d, secret = folder
    _toml(d, str(secret))
    out = tmp_path / "dist"
    p = run_edgepack("build", str(d / "tiny_cnn.onnx"), "--target", "x86_64", "--out", str(out), timeout=600)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.startswith("error: ") and "Traceback" not in p.stderr, p.stderr
    assert "tiny_cnn.edgepack.toml" in p.stderr and "outside the model's folder" in p.stderr, p.stderr
    assert "--postprocess labels=PATH" in p.stderr  # the fix: copy it in, or name it explicitly
    assert "PRIVATE KEY" not in p.stdout + p.stderr
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("how", ["dotdot", "symlink", "symlinked-dir"])
def test_every_way_out_of_the_folder_is_refused(folder, how):
    d, secret = folder
    if how == "dotdot":
        _toml(d, "../home/.ssh/id_ed25519")
    elif how == "symlink":
        (d / "labels.txt").symlink_to(secret)
        _toml(d, "labels.txt")
    else:
        (d / "keys").symlink_to(secret.parent)
        _toml(d, "keys/id_ed25519")
    with pytest.raises(UsageError, match="outside the model's folder") as exc:
        load_config(d / "tiny_cnn.onnx", None, None)
    assert exc.value.exit_code == 2 and str(secret) in exc.value.message


def test_sidecar_labels_that_are_no_plain_file_are_refused_without_hanging(folder):
    d, _ = folder
    os.mkfifo(d / "labels.txt")  # reading a FIFO would block the build forever
    _toml(d, "labels.txt")
    with pytest.raises(UsageError, match="is not a plain file"):
        load_config(d / "tiny_cnn.onnx", None, None)


def test_labels_inside_the_folder_and_explicit_paths_are_accepted(folder):
    d, secret = folder
    (d / "labels.txt").symlink_to("real_labels.txt")  # a link that stays inside the folder is fine
    _toml(d, "labels.txt")
    _, post = load_config(d / "tiny_cnn.onnx", None, None)
    assert post.labels == LABELS
    # on the command line the user names the file: taken as is, even outside the folder
    _, post = load_config(d / "tiny_cnn.onnx", None, f"softmax,topk=3,labels={secret}")
    assert post.labels == SECRET.strip().splitlines()
