"""OCI references, platforms, entry choice and credential lookup (no registry, no subprocess)."""
from __future__ import annotations

import base64
import json

import pytest

from edgepack.errors import PlatformNotFound, RegistryAuthError, RegistryError, UsageError
from edgepack.oci import layout
from edgepack.oci.credentials import find_credentials
from edgepack.oci.ref import looks_like_reference, parse_platform, parse_reference, platform_for_arch


def test_references():
    r = parse_reference("127.0.0.1:5000/models/tiny_cnn:1.0")
    assert (r.registry, r.repository, r.tag, r.digest) == ("127.0.0.1:5000", "models/tiny_cnn", "1.0", None)
    d = "sha256:" + "a" * 64
    r = parse_reference(f"registry.example/m@{d}")
    assert r.reference == d and str(r) == f"registry.example/m@{d}"
    assert parse_reference("localhost:5000/m").reference == "latest"
    for bad in ("tiny_cnn:1", "models/tiny_cnn:1", "reg.example/Models:1", "reg.example/m:bad tag", "reg.example/",
                "reg.example/m@sha256:abc"):
        with pytest.raises(UsageError):
            parse_reference(bad)
    with pytest.raises(UsageError, match="no tag"):
        parse_reference("reg.example/m", need_tag=True)
    assert looks_like_reference("127.0.0.1:5000/m:1") and looks_like_reference("reg.example/a/b")
    assert not looks_like_reference("dist/tiny_cnn-x86_64") and not looks_like_reference("tiny_cnn-arm64")


def test_platforms():
    assert str(platform_for_arch("x86_64")) == "linux/amd64"
    assert str(platform_for_arch("aarch64")) == "linux/arm64/v8"
    assert parse_platform("linux/aarch64") == parse_platform("linux/arm64")
    assert platform_for_arch("aarch64").matches(parse_platform("linux/arm64"))
    assert not platform_for_arch("aarch64").matches(parse_platform("linux/arm64/v7"))
    with pytest.raises(UsageError):
        parse_platform("linux")


def _entry(arch: str, target: str, n: int) -> dict:
    return {"mediaType": "x", "digest": "sha256:" + f"{n:064x}", "size": 10,
            "platform": platform_for_arch(arch).to_json(), "annotations": {layout.A_TARGET: target}}


def test_choose_prefers_the_generic_target_and_names_what_exists():
    ms = [_entry("x86_64", "x86_64", 1), _entry("aarch64", "jetson-orin", 2), _entry("aarch64", "arm64", 3),
          _entry("aarch64", "android-arm64", 4)]
    assert layout.choose(ms, "r", parse_platform("linux/arm64"), None)["digest"].endswith("3")
    assert layout.choose(ms, "r", None, "jetson-orin")["digest"].endswith("2")
    with pytest.raises(PlatformNotFound, match="linux/amd64 \\(x86_64\\)"):
        layout.choose(ms, "r", parse_platform("linux/riscv64"), None)
    with pytest.raises(PlatformNotFound, match="several entries"):
        layout.choose(ms[1:2] + ms[3:], "r", parse_platform("linux/arm64"), None)


def test_registry_file_names_are_plain_names():
    assert layout.safe_name("tiny_cnn-arm64.json", "w") == "tiny_cnn-arm64.json"
    for bad in ("../x", "/etc/passwd", ".bashrc", "a/b", "", None, "x" * 300):
        with pytest.raises(RegistryError):
            layout.safe_name(bad, "w")
    with pytest.raises(RegistryError):
        layout.entries({"manifests": [{"digest": "sha256:zz", "size": 1}]}, "w")


def test_credentials_order_and_formats(tmp_path, monkeypatch):
    for var in ("EDGEPACK_REGISTRY_USER", "EDGEPACK_REGISTRY_PASSWORD", "REGISTRY_AUTH_FILE", "DOCKER_CONFIG",
                "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert find_credentials("reg.example:5000") is None
    (tmp_path / ".docker").mkdir()
    tok = base64.b64encode(b"u1:p:w1").decode()
    (tmp_path / ".docker" / "config.json").write_text(json.dumps({"auths": {"https://reg.example:5000": {"auth": tok}}}))
    c = find_credentials("reg.example:5000")
    assert (c.username, c.password) == ("u1", "p:w1") and "p:w1" not in repr(c)
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"auths": {"reg.example:5000": {"username": "u2", "password": "p2"}}}))
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(auth))
    assert find_credentials("reg.example:5000").username == "u2"
    monkeypatch.setenv("EDGEPACK_REGISTRY_USER", "u3")
    with pytest.raises(RegistryAuthError, match="only one"):
        find_credentials("reg.example:5000")
    monkeypatch.setenv("EDGEPACK_REGISTRY_PASSWORD", "p3")
    assert find_credentials("reg.example:5000").password == "p3"
    monkeypatch.delenv("EDGEPACK_REGISTRY_USER")
    monkeypatch.delenv("EDGEPACK_REGISTRY_PASSWORD")
    auth.write_text(json.dumps({"auths": {"reg.example:5000": {"auth": "!!notbase64"}}}))
    with pytest.raises(RegistryAuthError, match="not base64"):
        find_credentials("reg.example:5000")
