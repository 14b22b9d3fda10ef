"""Same model + same target -> the same bytes, whatever the folder, time or environment."""
import hashlib
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import REPO


def _build(model, target, out, cwd, extra_env=None):
    env = dict(os.environ)
    env.update(extra_env or {})
    proc = subprocess.run([sys.executable, "-m", "edgepack", "build", str(model), "--target", target, "--backend",
                           "ncnn", "--out", str(out), "--no-verify", "--json"], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    path = out / f"{model.stem}-{target}"
    return hashlib.sha256(path.read_bytes()).hexdigest(), path


@pytest.mark.parametrize("target", ["x86_64", "arm64"])
def test_two_builds_are_bit_identical(tiny_cnn, target, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b" / "deeper").mkdir(parents=True)
    sha_a, _ = _build(tiny_cnn, target, tmp_path / "a" / "dist", tmp_path / "a", {"TZ": "UTC"})
    time.sleep(1.1)  # a timestamp anywhere in the output would now differ
    sha_b, _ = _build(tiny_cnn, target, tmp_path / "b" / "deeper" / "out", tmp_path / "b" / "deeper",
                      {"TZ": "Asia/Tokyo", "SOURCE_DATE_EPOCH": "1234567890", "LC_ALL": "C"})
    assert sha_a == sha_b


def test_verify_build_rebuilds_identically(tiny_artifacts, tiny_cnn):
    art = tiny_artifacts["x86_64"]
    proc = subprocess.run([sys.executable, "-m", "edgepack", "verify-build", str(art), str(tiny_cnn), "--json"],
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["identical"] and report["sha256"] == hashlib.sha256(art.read_bytes()).hexdigest()
    assert report["rebuilt"] is None  # an identical rebuild is not left behind in the temporary folder


def test_verify_build_rebuilds_each_target_of_a_verify_on_build(tiny_cnn, tmp_path):
    """--verify-on names CPUs of several targets; each manifest keeps its own, so one target rebuilds alone."""
    proc = subprocess.run([sys.executable, "-m", "edgepack", "build", str(tiny_cnn), "--target", "x86_64,arm64",
                           "--verify-on", "native,cortex-a53", "--out", str(tmp_path), "--json"],
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for target, cpu in (("x86_64", "native"), ("arm64", "cortex-a53")):
        art = tmp_path / f"{tiny_cnn.stem}-{target}"
        assert json.loads(art.with_name(art.name + ".json").read_text())["build"]["verify_on"] == [cpu]
        proc = subprocess.run([sys.executable, "-m", "edgepack", "verify-build", str(art), str(tiny_cnn), "--json"],
                              capture_output=True, text=True, timeout=3600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(proc.stdout)["identical"], proc.stdout


def test_verify_build_refuses_another_model(tiny_artifacts, tmp_path):
    other = tmp_path / "other.onnx"
    other.write_bytes((REPO / "examples" / "tiny_cnn.onnx").read_bytes() + b"")
    from models import transformer_block
    transformer_block(other)
    proc = subprocess.run([sys.executable, "-m", "edgepack", "verify-build", str(tiny_artifacts["x86_64"]), str(other)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 4 and "not the model" in proc.stderr and "Traceback" not in proc.stderr


def test_verify_build_of_a_tvm_artifact_is_identical(tiny_cnn, tmp_path):
    """TVM records how long it compiled: that stays in the sidecar, out of the executable's bytes."""
    proc = subprocess.run([sys.executable, "-m", "edgepack", "build", str(tiny_cnn), "--target", "x86_64",
                           "--backend", "tvm", "--verify-on", "native", "--out", str(tmp_path), "--json"],
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    art = tmp_path / f"{tiny_cnn.stem}-x86_64"
    assert json.loads(art.with_name(art.name + ".json").read_text())["backend"]["compile_seconds"]
    proc = subprocess.run([sys.executable, "-m", "edgepack", "verify-build", str(art), str(tiny_cnn), "--json"],
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["identical"], proc.stdout
