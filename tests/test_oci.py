"""edgepack push / pull / deploy REGISTRY/REPO:TAG against a real registry (Debian's docker-registry,
started here on 127.0.0.1 with its own config and storage), read back by a second OCI client (skopeo),
and deployed to the lab's sshd devices (x86_64, arm64 under qemu)."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
from lab.fixtures import by_device, edgepack, lab  # noqa: F401 (lab is a fixture)
from oci_registry import Registry, free_port

from edgepack.deploy.artifact import inspect_artifact

USER, PASSWORD = "edge", "s3cret-Pa55-for-test-only"


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    r = Registry(tmp_path_factory.mktemp("registry"))
    yield r
    r.close()


@pytest.fixture(scope="module")
def auth_registry(tmp_path_factory):
    root = tmp_path_factory.mktemp("auth-registry")
    # bcrypt through htpasswd, the password on stdin (-i), never in its argv
    p = subprocess.run(["htpasswd", "-B", "-i", "-n", USER], input=PASSWORD, capture_output=True, text=True,
                       timeout=30, check=True)
    (root / "htpasswd").write_text(p.stdout)
    r = Registry(root, htpasswd=root / "htpasswd")
    yield r
    r.close()


@pytest.fixture(scope="module")
def dist(tiny_artifacts, tmp_path_factory) -> Path:
    """The session's x86_64 + arm64 builds (with their manifest JSON) in one dist/ folder."""
    d = tmp_path_factory.mktemp("oci-dist")
    for art in tiny_artifacts.values():
        for f in (art, Path(str(art) + ".json")):
            shutil.copy2(f, d / f.name)
    return d


def _json(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _one_error(proc, code: int, *words: str) -> str:
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for w in words:
        assert w in proc.stderr, proc.stderr
    return errors[0]


def test_push_pull_bit_identical_and_second_push_uploads_nothing(registry, dist, tmp_path):
    ref = f"{registry.host}/models/tiny_cnn:1"
    first = _json(edgepack("push", dist, ref, "--insecure-registry", "--json"))
    assert {e["target"]: e["platform"] for e in first["entries"]} == {"x86_64": "linux/amd64",
                                                                      "arm64": "linux/arm64/v8"}
    # per target: executable, manifest JSON, SHA256SUMS, config, manifest; then the index
    assert first["uploaded_blobs"] == 11 and first["already_present"] == 0, first
    again = _json(edgepack("push", dist, ref, "--insecure-registry", "--json"))
    assert again["uploaded_blobs"] == 0 and again["uploaded_bytes"] == 0 and again["digest"] == first["digest"]

    for platform, target in (("linux/amd64", "x86_64"), ("linux/arm64", "arm64")):
        out = tmp_path / target
        got = _json(edgepack("pull", ref, "--platform", platform, "-o", out, "--insecure-registry", "--json"))
        assert got["target"] == target
        name = f"tiny_cnn-{target}"
        assert sorted(p.name for p in out.iterdir()) == sorted([name, f"{name}.json", "SHA256SUMS"])
        for f in (name, f"{name}.json"):
            assert (out / f).read_bytes() == (dist / f).read_bytes(), f
        assert os.stat(out / name).st_mode & 0o777 == 0o755
        check = subprocess.run(["sha256sum", "-c", "SHA256SUMS"], cwd=out, capture_output=True, text=True, timeout=60)
        assert check.returncode == 0 and check.stdout.count(": OK") == 2, check.stdout + check.stderr
    # the pulled x86_64 artifact still passes its own selftest
    run = subprocess.run([str(tmp_path / "x86_64" / "tiny_cnn-x86_64"), "selftest"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("PASS"), run.stdout + run.stderr


def test_a_second_oci_client_reads_the_index(registry, dist, tmp_path):
    ref = f"{registry.host}/models/tiny_cnn:skopeo"
    _json(edgepack("push", dist, ref, "--insecure-registry", "--json"))
    raw = subprocess.run(["skopeo", "inspect", "--raw", "--tls-verify=false", f"docker://{ref}"],
                         capture_output=True, text=True, timeout=60)
    assert raw.returncode == 0, raw.stderr
    index = json.loads(raw.stdout)
    assert index["mediaType"] == "application/vnd.oci.image.index.v1+json"
    plats = {(m["platform"]["architecture"], m["platform"].get("variant")): m["annotations"]["org.edgepack.target"]
             for m in index["manifests"]}
    assert plats == {("amd64", None): "x86_64", ("arm64", "v8"): "arm64"}
    # skopeo picks the arm64 entry by platform and stores its blobs by digest: the executable is among them
    arm = dist / "tiny_cnn-arm64"
    out = tmp_path / "copy"
    cp = subprocess.run(["skopeo", "copy", "--src-tls-verify=false", "--override-arch", "arm64",
                         f"docker://{ref}", f"dir:{out}"], capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr
    sha = hashlib.sha256(arm.read_bytes()).hexdigest()
    assert (out / sha).read_bytes() == arm.read_bytes()
    manifest = json.loads((out / "manifest.json").read_text())
    titles = {layer["annotations"]["org.opencontainers.image.title"]: layer["mediaType"] for layer in manifest["layers"]}
    assert titles == {"tiny_cnn-arm64": "application/vnd.edgepack.artifact.v1.executable",
                      "tiny_cnn-arm64.json": "application/vnd.edgepack.artifact.v1.manifest+json",
                      "SHA256SUMS": "application/vnd.edgepack.artifact.v1.sha256sums"}
    # and the oras library's own high-level pull of that entry (by digest) writes the files by their titles
    import oras.client
    arm_entry = next(m for m in index["manifests"] if m["platform"]["architecture"] == "arm64")
    files = oras.client.OrasClient(insecure=True).pull(target=f"{registry.host}/models/tiny_cnn@{arm_entry['digest']}",
                                                       outdir=str(tmp_path / "oras"))
    assert sorted(Path(f).name for f in files) == sorted(titles)
    assert (tmp_path / "oras" / "tiny_cnn-arm64").read_bytes() == arm.read_bytes()


def test_plain_http_needs_the_flag_and_bad_references_fail_clearly(registry, dist, tmp_path):
    ref = f"{registry.host}/models/tiny_cnn:errors"
    _one_error(edgepack("push", dist, ref), 20, "plain HTTP", "--insecure-registry")
    _one_error(edgepack("deploy", ref, "-d", "local"), 20, "plain HTTP", "--insecure-registry")
    # only the x86_64 build under this tag
    _json(edgepack("push", dist / "tiny_cnn-x86_64", ref, "--insecure-registry", "--json"))
    out = tmp_path / "o"
    _one_error(edgepack("pull", ref, "--platform", "linux/arm64", "-o", out, "--insecure-registry"), 23,
               "no entry for platform linux/arm64", "linux/amd64 (x86_64)")
    _one_error(edgepack("pull", ref, "--target", "jetson-orin", "-o", out, "--insecure-registry"), 23, "jetson-orin")
    _one_error(edgepack("pull", f"{registry.host}/models/tiny_cnn:nope", "-o", out, "--insecure-registry"), 22,
               "tag nope not found")
    _one_error(edgepack("pull", f"{registry.host}/models/absent:1", "-o", out, "--insecure-registry"), 22)
    _one_error(edgepack("pull", "Models/Tiny:1", "-o", out, "--insecure-registry"), 2, "invalid registry reference")
    _one_error(edgepack("push", dist, f"{registry.host}/models/tiny_cnn", "--insecure-registry"), 2, "no tag")
    _one_error(edgepack("pull", f"127.0.0.1:{free_port()}/models/tiny_cnn:1", "-o", out, "--insecure-registry"), 20,
               "cannot reach registry")
    _one_error(edgepack("pull", ref, "--platform", "linux", "-o", out, "--insecure-registry"), 2, "invalid platform")
    assert not out.exists() or not any(out.iterdir())


def _argv_recorder(tmp_path: Path) -> Path:
    """A docker credential helper that records its argv and stdin, and answers the test's credentials."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    helper = bin_dir / "docker-credential-edgepacktest"
    helper.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {tmp_path}/helper-argv\ncat > {tmp_path}/helper-stdin\n"
                      f"printf '{{\"Username\":\"{USER}\",\"Secret\":\"{PASSWORD}\"}}'\n")
    helper.chmod(helper.stat().st_mode | stat.S_IXUSR)
    return bin_dir


def test_credentials_from_env_and_files_never_in_output_or_argv(auth_registry, dist, tmp_path):
    ref = f"{auth_registry.host}/models/tiny_cnn:auth"
    home = tmp_path / "home"
    home.mkdir()
    clean = {"HOME": str(home), "DOCKER_CONFIG": "", "REGISTRY_AUTH_FILE": "", "XDG_RUNTIME_DIR": "",
             "EDGEPACK_REGISTRY_USER": "", "EDGEPACK_REGISTRY_PASSWORD": ""}
    _one_error(edgepack("push", dist, ref, "--insecure-registry", env=clean), 21, "requires credentials")
    wrong = {**clean, "EDGEPACK_REGISTRY_USER": USER, "EDGEPACK_REGISTRY_PASSWORD": "wrong-password"}
    _one_error(edgepack("push", dist, ref, "--insecure-registry", env=wrong), 21, "refused the credentials", USER)

    right = {**clean, "EDGEPACK_REGISTRY_USER": USER, "EDGEPACK_REGISTRY_PASSWORD": PASSWORD}
    p = edgepack("--debug", "push", dist, ref, "--insecure-registry", env=right)
    assert p.returncode == 0, p.stderr
    assert PASSWORD not in p.stdout + p.stderr

    # a Docker config.json (auths) through $DOCKER_CONFIG
    conf = tmp_path / "docker"
    conf.mkdir()
    token = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    (conf / "config.json").write_text(json.dumps({"auths": {auth_registry.host: {"auth": token}}}))
    p = edgepack("pull", ref, "--platform", "linux/amd64", "-o", tmp_path / "a", "--insecure-registry",
                 env={**clean, "DOCKER_CONFIG": str(conf)})
    assert p.returncode == 0, p.stderr
    assert PASSWORD not in p.stdout + p.stderr and token not in p.stdout + p.stderr

    # a credential helper ($REGISTRY_AUTH_FILE with credsStore): the secret travels on its stdout only
    bin_dir = _argv_recorder(tmp_path)
    (tmp_path / "auth.json").write_text(json.dumps({"credsStore": "edgepacktest"}))
    p = edgepack("pull", ref, "--platform", "linux/arm64", "-o", tmp_path / "b", "--insecure-registry",
                 env={**clean, "REGISTRY_AUTH_FILE": str(tmp_path / "auth.json"),
                      "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "helper-argv").read_text().split() == ["get"]
    assert (tmp_path / "helper-stdin").read_text() == auth_registry.host
    assert (tmp_path / "b" / "tiny_cnn-arm64").read_bytes() == (dist / "tiny_cnn-arm64").read_bytes()


def test_deploy_from_registry_to_both_architectures(registry, dist, lab, tmp_path):  # noqa: F811
    ref = f"{registry.host}/models/tiny_cnn:deploy"
    _json(edgepack("push", dist, ref, "--insecure-registry", "--json"))
    lab.add("pc", "x86_64")
    lab.add("pi", "arm64")
    lab.add("orin", "jetson")
    inv = lab.write_inventory()
    # Without a target in the inventory the entry follows the device's `uname -m`: pc says x86_64 and the
    # Jetson-like chroot says aarch64 (the lab's "arm64" device is an x86_64 userland running aarch64 code
    # through binfmt, so it keeps its inventory target).
    text = inv.read_text().split("[devices.")
    inv.write_text("[devices.".join(t if t.startswith("pi]") else t.replace('target = "x86_64"\n', "")
                                    .replace('target = "arm64"\n', "") for t in text))
    cache = tmp_path / "cache"
    env = {"EDGEPACK_CACHE": str(cache)}
    p = edgepack("deploy", ref, "-I", inv, "-d", "pc,pi,orin", "--insecure-registry", "--json", env=env)
    rows = by_device(json.loads(p.stdout))
    for dev, target in (("pc", "x86_64"), ("pi", "arm64")):
        art = inspect_artifact(dist / f"tiny_cnn-{target}")
        assert rows[dev]["status"] == "deployed" and rows[dev]["latency_ms"] > 0, rows[dev]
        assert rows[dev]["sha256"] == art.sha256 and rows[dev]["target"] == target
        installed = lab.devices[dev].home / "edgepack" / "current" / art.name
        assert installed.read_bytes() == art.path.read_bytes()
    # orin got the arm64 entry; as in test_deploy, its own selftest on the glibc-2.31 chroot decides
    assert rows["orin"]["target"] == "arm64" and "aarch64" in rows["orin"]["arch"], rows["orin"]
    assert rows["orin"]["status"] == "deployed" or (rows["orin"]["status"] == "rolled back"
                                                    and "FAIL" in rows["orin"]["output"]), rows["orin"]
    assert p.returncode == (0 if rows["orin"]["status"] == "deployed" else 9), p.stderr
    # the operator's cache holds one folder per entry digest
    assert len([d for d in (cache / "oci").iterdir() if d.is_dir()]) == 2
    again = _json(edgepack("deploy", ref, "-I", inv, "-d", "pc,pi", "--insecure-registry", "--json", env=env))
    assert [r["status"] for r in again["results"]] == ["no change", "no change"]

    # a tag without an arm64 build: orin fails with the platform named (pc is already current)
    only = f"{registry.host}/models/tiny_cnn:x86only"
    _json(edgepack("push", dist / "tiny_cnn-x86_64", only, "--insecure-registry", "--json"))
    p = edgepack("deploy", only, "-I", inv, "-d", "pc,orin", "--insecure-registry", "--json", env=env)
    assert p.returncode == 9, p.stderr
    rows = by_device(json.loads(p.stdout))
    assert rows["pc"]["status"] == "no change"
    assert rows["orin"]["status"] == "failed" and "no entry for platform linux/arm64/v8" in rows["orin"]["message"]
    # a bad tag fails once, before any device is touched
    _one_error(edgepack("deploy", f"{registry.host}/models/tiny_cnn:absent", "-I", inv, "-d", "pc",
                        "--insecure-registry", env=env), 22, "tag absent not found")


def test_pull_on_device_with_credentials(auth_registry, dist, lab, tmp_path):  # noqa: F811
    """--pull-on-device: the device fetches its own entry with curl (credentials in a 0600 curl config in
    the upload folder, removed after); the engine's sha256 check, selftest and switch are unchanged."""
    ref = f"{auth_registry.host}/models/tiny_cnn:ondevice"
    env = {"EDGEPACK_REGISTRY_USER": USER, "EDGEPACK_REGISTRY_PASSWORD": PASSWORD, "EDGEPACK_CACHE": str(tmp_path / "c")}
    _json(edgepack("push", dist, ref, "--insecure-registry", "--json", env=env))
    lab.add("pc", "x86_64")
    lab.add("pi", "arm64")
    inv = lab.write_inventory()
    p = edgepack("deploy", ref, "-I", inv, "-d", "pc,pi", "--insecure-registry", "--pull-on-device", "--json",
                 env=env)
    assert PASSWORD not in p.stdout + p.stderr
    rows = by_device(_json(p))
    for dev, target in (("pc", "x86_64"), ("pi", "arm64")):
        art = inspect_artifact(dist / f"tiny_cnn-{target}")
        assert rows[dev]["status"] == "deployed" and rows[dev]["sha256"] == art.sha256, rows[dev]
        root = lab.devices[dev].home / "edgepack"
        assert (root / "current" / art.name).read_bytes() == art.path.read_bytes()
        assert not list(root.rglob(".edgepack-curl"))
    # the operator downloaded no executable: its cache has no pulled entry
    assert not (tmp_path / "c" / "oci").exists()
    # wrong credentials: the whole deploy stops before any device
    bad = {**env, "EDGEPACK_REGISTRY_PASSWORD": "nope"}
    _one_error(edgepack("deploy", ref, "-I", inv, "-d", "pc", "--insecure-registry", "--pull-on-device", env=bad),
               21, "refused the credentials")


def test_a_tampered_blob_is_refused_and_nothing_is_written(dist, tmp_path):
    """Flip one byte of the executable in the registry's own storage: pull names it and writes nothing."""
    reg = Registry(tmp_path / "registry")
    try:
        ref = f"{reg.host}/models/tiny_cnn:tampered"
        _json(edgepack("push", dist / "tiny_cnn-x86_64", ref, "--insecure-registry", "--json"))
        sha = hashlib.sha256((dist / "tiny_cnn-x86_64").read_bytes()).hexdigest()
        blob = tmp_path / "registry" / "data" / "docker" / "registry" / "v2" / "blobs" / "sha256" / sha[:2] / sha / "data"
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))
        out = tmp_path / "out"
        _one_error(edgepack("pull", ref, "--platform", "linux/amd64", "-o", out, "--insecure-registry"), 24,
                   "tiny_cnn-x86_64", "nothing was written")
        assert not out.exists() or not list(out.iterdir())
    finally:
        reg.close()
