"""Inventory, device specs, ~/.ssh/config, and the parsers of device output (no devices needed)."""
from __future__ import annotations

import json

import pytest
from lab.standin import make_standin

from edgepack.deploy.artifact import inspect_artifact
from edgepack.deploy.device import parse_spec
from edgepack.deploy.inventory import load_inventory, select_devices
from edgepack.deploy.probe import check_fits, parse_probe, shell_path
from edgepack.deploy.selftest import parse_selftest
from edgepack.errors import ArtifactError, DeployError, UsageError


@pytest.mark.parametrize("spec,want", [
    ("pi", (None, "pi", None)),
    ("edge@10.1.2.3", ("edge", "10.1.2.3", None)),
    ("edge@cam-01.lan:2222", ("edge", "cam-01.lan", 2222)),
    ("root@[::1]:22", ("root", "::1", 22)),
])
def test_parse_spec(spec, want):
    assert parse_spec(spec) == want


@pytest.mark.parametrize("bad", ["a b", "user@", "host:99999", "x@y:z", "http://x"])
def test_parse_spec_rejects(bad):
    with pytest.raises(UsageError, match="device"):
        parse_spec(bad)


INV = """
known_hosts = "/tmp/kh"
[defaults]
user = "edge"
dest = "/opt/ep"
[devices.cam-01]
host = "10.0.0.1"
tags = ["jetson", "line1"]
target = "jetson-orin"
[devices.box]
host = "boxalias"
user = "root"
port = 2200
key = ["/k1", "/k2"]
dest = "/srv/ep"
tags = ["x86"]
"""


def test_inventory_defaults_and_tags(tmp_path):
    p = tmp_path / "devices.toml"
    p.write_text(INV)
    inv = load_inventory(p)
    cam, box = inv.devices["cam-01"], inv.devices["box"]
    assert (cam.user, cam.dest, cam.target, cam.known_hosts) == ("edge", "/opt/ep", "jetson-orin", "/tmp/kh")
    assert (box.user, box.port, box.keys, box.dest) == ("root", 2200, ("/k1", "/k2"), "/srv/ep")
    got = select_devices([], ["jetson"], inv, None)
    assert [d.name for d in got] == ["cam-01"] and got[0].port == 22
    both = select_devices(["box", "cam-01"], ["line1"], inv, None)  # no duplicates, order kept
    assert [d.name for d in both] == ["box", "cam-01"]


def test_ssh_config_fills_what_inventory_leaves_open(tmp_path):
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host boxalias\n  HostName 192.0.2.7\n  User nobody\n  Port 2022\n  IdentityFile ~/id_x\n"
                   "Host gw\n  HostName 192.0.2.8\n  User ops\n")
    p = tmp_path / "devices.toml"
    p.write_text(INV)
    box, = select_devices(["box"], [], load_inventory(p), cfg)
    assert (box.host, box.user, box.port, box.keys) == ("192.0.2.7", "root", 2200, ("/k1", "/k2"))
    gw, = select_devices(["gw"], [], None, cfg)
    assert (gw.host, gw.user, gw.port, gw.keys) == ("192.0.2.8", "ops", 22, ())
    plain, = select_devices(["me@192.0.2.9:2"], [], None, cfg)
    assert (plain.host, plain.user, plain.port) == ("192.0.2.9", "me", 2)


@pytest.mark.parametrize("text,match", [
    ('[devices.a]\nhots = "x"\n', "did you mean 'host'"),
    ('[devices.a]\nport = 22\n', "'host' is required"),
    ('[devices.a]\nhost = "x"\nport = "22"\n', "'port' must be an integer"),
    ('devices = 3\n', "no \\[devices.NAME\\]"),
    ('[devices.a\n', "not valid TOML"),
])
def test_inventory_errors_name_the_file(tmp_path, text, match):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(UsageError, match=match) as exc:
        load_inventory(p)
    assert "bad.toml" in exc.value.message


def test_selection_errors(tmp_path):
    p = tmp_path / "devices.toml"
    p.write_text(INV)
    inv = load_inventory(p)
    with pytest.raises(UsageError, match="no device selected .*box, cam-01"):
        select_devices([], [], inv, None)
    with pytest.raises(UsageError, match="no device .* has tag 'nope'") as exc:
        select_devices([], ["nope"], inv, None)
    assert "jetson" in exc.value.hint
    with pytest.raises(UsageError, match="does not exist"):
        load_inventory(tmp_path / "missing.toml")


PROBE = """@arch aarch64
@glibc glibc 2.31
@home /root
@dest /opt/edgepack
@binfmt magic 7f454c460201010000000000000000000200b700
@df overlay 524288 1024 523264 1%% /
@current releases/0123456789abcdef
@previous
@release 0123456789abcdef
@file %s  tiny_cnn-arm64
@file %s  release.json
""" % ("a" * 64, "b" * 64)


def test_parse_probe():
    f = parse_probe(PROBE)
    assert (f.arch, f.glibc, f.dest, f.free_bytes) == ("aarch64", "2.31", "/opt/edgepack", 523264 * 1024)
    assert f.current == "releases/0123456789abcdef" and f.previous is None
    assert f.current_sha() == "a" * 64 and f.releases == ("0123456789abcdef",)
    x = parse_probe("@arch x86_64\n@glibc ldd (Debian GLIBC 2.36-9) 2.36\n@dest /d\n"
                    "@binfmt magic 7f454c460201010000000000000000000200b700\n@df /dev/vda 10 5 5 50% /\n")
    assert x.glibc == "2.36" and x.runs("aarch64") and x.runs("x86_64") and not x.runs("arm")
    assert "aarch64 via binfmt" in x.arch_label()
    musl = parse_probe("@arch armv7l\n@glibc musl libc (armhf)\n@dest /d\n")
    assert musl.arch == "arm" and musl.glibc is None and musl.free_bytes is None


def test_check_fits(tmp_path):
    from edgepack.deploy.device import Device
    dev = Device("j1", "h")
    jetson = parse_probe(PROBE)
    check_fits(dev, inspect_artifact(make_standin(tmp_path / "a", "arm64")), jetson)
    with pytest.raises(DeployError, match="j1 is aarch64, but tiny_cnn-x86_64 is built for x86_64"):
        check_fits(dev, inspect_artifact(make_standin(tmp_path / "b", "x86_64")), jetson)
    with pytest.raises(DeployError, match="glibc 2.31, but .* needs glibc >= 2.35"):
        check_fits(dev, inspect_artifact(make_standin(tmp_path / "c", "glibc235-arm64")), jetson)


@pytest.mark.parametrize("rc,out,passed,lat", [
    (0, '{"result": "PASS", "latency_ms": 2.5, "max_abs_err": 0.001}', True, 2.5),
    (1, '{"result": "FAIL", "latency_ms": 2.5}', False, 2.5),
    (0, '{"result": "FAIL"}', False, None),             # exit 0 but FAIL: still a failure
    (139, '{"result": "PASS", "latency_ms": 1}', False, 1.0),  # crashed after printing PASS
    (0, "PASS model=m target=t backend=ncnn max_abs_err=1e-4 bound=1e-2 latency_ms=3.25 threads=1", True, 3.25),
    (0, "garbage", False, None),
])
def test_parse_selftest(rc, out, passed, lat):
    r = parse_selftest(rc, out, "")
    assert (r.passed, r.latency_ms) == (passed, lat)


def test_shell_path_quotes():
    assert shell_path("~/a b") == "\"$HOME\"/'a b'"
    assert shell_path("/x/$(reboot)") == "'/x/$(reboot)'"
    assert shell_path("rel;rm -rf /") == "\"$HOME\"/'rel;rm -rf /'"


def test_artifact_sidecar_must_match_elf(tmp_path):
    elf = tmp_path / "m-x86_64"
    elf.write_bytes(open("/bin/true", "rb").read())
    (tmp_path / "m-x86_64.json").write_text(json.dumps({"target": {"name": "arm64", "triple": "aarch64-linux-musl"}}))
    with pytest.raises(ArtifactError, match="x86_64 executable but m-x86_64.json says aarch64"):
        inspect_artifact(elf)
    (tmp_path / "m-x86_64.json").unlink()
    info = inspect_artifact(elf)  # no sidecar: the ELF header decides
    assert info.arch == "x86_64"
    with pytest.raises(ArtifactError, match="not an edgepack artifact"):
        (tmp_path / "notes.txt").write_text("hello")
        inspect_artifact(tmp_path / "notes.txt")
    with pytest.raises(ArtifactError, match="does not exist"):
        inspect_artifact(tmp_path / "nope")


def test_unknown_bare_device_name_is_named_not_a_dns_error(tmp_path):
    p = tmp_path / "devices.toml"
    p.write_text(INV)
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host gw\n  HostName 192.0.2.8\n")
    with pytest.raises(UsageError, match="device 'orin-1' is neither in the inventory .*devices.toml.* nor a Host") as e:
        select_devices(["orin-1"], [], load_inventory(p), cfg)
    assert "box, cam-01" in e.value.hint and "user@host" in e.value.hint
    # what may be a real host still passes: ssh aliases, DNS names, addresses, localhost
    for spec in ("gw", "cam-02.lan", "192.0.2.9", "localhost", "me@orin-1"):
        assert select_devices([spec], [], None, cfg)
