"""Fault tests of `edgepack deploy` against real sshd devices: each fault must be reported clearly and
leave the previous version installed and working."""
from __future__ import annotations

import os
import time

from lab.fixtures import by_device, edgepack, edgepack_json, lab  # noqa: F401 (lab is a fixture)
from lab.lab import silent_server
from lab.standin import make_standin

from edgepack.deploy.artifact import inspect_artifact
from edgepack.deploy.engine import Options, deploy_one
from edgepack.deploy.inventory import load_inventory
from edgepack.deploy.ssh import SSHOptions


def _current(dev) -> str:
    """The release `current` points at, read on this machine (x86 device homes are host folders)."""
    return os.readlink(dev.home / "edgepack" / "current")


def _deploy_ok(inv, art, name):
    rc, data, err = edgepack_json("deploy", art, "-I", inv, "-d", name)
    assert rc == 0, err
    assert by_device(data)[name]["status"] == "deployed"
    return data


def test_selftest_failure_rolls_back(lab, tmp_path):
    dev = lab.add("x1", "x86_64")
    inv = lab.write_inventory()
    v1 = make_standin(tmp_path / "v1", version="1")
    bad = make_standin(tmp_path / "bad", version="2", verdict="FAIL")
    _deploy_ok(inv, v1, "x1")
    before = _current(dev)

    p = edgepack("deploy", bad, "-I", inv, "-d", "x1")
    assert p.returncode == 9, p.stdout + p.stderr
    assert "ROLLED BACK" in p.stdout and "selftest failed on the device" in p.stdout
    assert "FAIL" in p.stdout  # the selftest's own output is shown
    assert "Traceback" not in p.stderr
    assert _current(dev) == before
    assert not (dev.home / "edgepack/releases" / inspect_artifact(bad).short).exists()
    rc, data, _ = edgepack_json("smoke", "-I", inv, "-d", "x1")
    assert rc == 0 and by_device(data)["x1"]["sha256"] == inspect_artifact(v1).sha256


def test_selftest_failure_on_first_install_leaves_nothing_current(lab, tmp_path):
    dev = lab.add("x1", "x86_64")
    inv = lab.write_inventory()
    bad = make_standin(tmp_path / "bad", verdict="FAIL")
    rc, data, _ = edgepack_json("deploy", bad, "-I", inv, "-d", "x1")
    r = by_device(data)["x1"]
    assert rc == 9 and r["status"] == "rolled back" and "nothing was installed before" in r["message"]
    assert not os.path.lexists(dev.home / "edgepack" / "current")


def test_wrong_architecture_refused_before_upload(lab, tmp_path):
    x86 = lab.add("x1", "x86_64")
    jet = lab.add("j1", "jetson")
    inv = lab.write_inventory()
    arm = make_standin(tmp_path / "arm", "arm64")
    x = make_standin(tmp_path / "x", "x86_64")
    rc, data, _ = edgepack_json("deploy", arm, "-I", inv, "-d", "x1")
    r = by_device(data)["x1"]
    assert rc == 9 and r["status"] == "failed"
    assert "x1 is x86_64" in r["message"] and "aarch64" in r["message"] and "wrong architecture" in r["message"]
    assert not (x86.home / "edgepack").exists()  # nothing uploaded, not even a folder
    rc, data, _ = edgepack_json("deploy", x, "-I", inv, "-d", "j1")
    r = by_device(data)["j1"]
    assert rc == 9 and "j1 is aarch64" in r["message"] and r["arch"] == "aarch64"
    assert jet.kind == "jetson"


def test_glibc_too_old_on_jetson_refused(lab, tmp_path):
    lab.add("j1", "jetson")
    inv = lab.write_inventory()
    art = make_standin(tmp_path / "g", "glibc235-arm64")
    rc, data, _ = edgepack_json("deploy", art, "-I", inv, "-d", "j1")
    r = by_device(data)["j1"]
    assert rc == 9 and r["status"] == "failed"
    assert "glibc 2.31" in r["message"] and ">= 2.35" in r["message"], r
    assert "musl" in r["hint"]


def test_disk_full_keeps_previous(lab, tmp_path):
    dev = lab.add("small", "x86_64", tmpfs_size="400k")
    inv = lab.write_inventory()
    v1 = make_standin(tmp_path / "v1", version="1", pad_kb=150)
    v2 = make_standin(tmp_path / "v2", version="2", pad_kb=300)
    _deploy_ok(inv, v1, "small")
    rc, data, err = edgepack_json("deploy", v2, "-I", inv, "-d", "small")
    r = by_device(data)["small"]
    assert rc == 9 and r["status"] == "failed" and "disk full" in r["message"], r
    assert "error: deploy: 1 of 1" in err and "Traceback" not in err
    rc, data, _ = edgepack_json("smoke", "-I", inv, "-d", "small")
    assert rc == 0 and by_device(data)["small"]["sha256"] == inspect_artifact(v1).sha256
    assert dev.tmpfs_size


def test_connection_cut_mid_upload_keeps_previous(lab, tmp_path):
    dev = lab.add("x1", "x86_64")
    inv = load_inventory(lab.write_inventory())
    v1 = inspect_artifact(make_standin(tmp_path / "v1", version="1"))
    v2 = inspect_artifact(make_standin(tmp_path / "v2", version="2", pad_kb=16 * 1024))
    opts = Options(ssh=SSHOptions(connect_timeout=5))
    assert deploy_one(inv.devices["x1"], v1, opts).status == "deployed"
    cut = []

    def pull_the_cable(sent, total):
        if sent > total // 4 and not cut:
            cut.append(sent)
            dev.kill_connections()  # the device's sshd for this session dies: no goodbye, no EOF handling

    t0 = time.monotonic()
    res = deploy_one(inv.devices["x1"], v2, opts, progress=pull_the_cable)
    assert cut, "the upload finished before the cut: make the artifact bigger"
    assert res.status == "failed" and "connection lost" in res.message, res
    assert "previous version is still installed" in res.hint
    assert time.monotonic() - t0 < 30
    assert _current(dev) == f"releases/{v1.short}"
    # no half-written release: only a hidden .incoming folder, removed by the next successful deploy
    assert not (dev.home / "edgepack/releases" / v2.short).exists()
    assert deploy_one(inv.devices["x1"], v1, opts).status == "no change"
    again = deploy_one(inv.devices["x1"], v2, opts)
    assert again.status == "deployed", again
    assert [p.name for p in (dev.home / "edgepack/releases").iterdir() if p.name.startswith(".incoming")] == []


def test_unknown_host_key_refused_then_accept_new(lab, tmp_path):
    lab.add("x1", "x86_64", trust=False)
    inv = lab.write_inventory()
    art = make_standin(tmp_path / "v1")
    rc, data, _ = edgepack_json("deploy", art, "-I", inv, "-d", "x1")
    r = by_device(data)["x1"]
    assert rc == 9 and r["status"] == "failed" and "is not in" in r["message"] and "SHA256:" in r["message"]
    assert "--accept-new-host-key" in r["hint"]
    assert lab.known_hosts.read_text() == ""
    rc, data, err = edgepack_json("deploy", art, "-I", inv, "-d", "x1", "--accept-new-host-key")
    assert rc == 0, err
    assert lab.devices["x1"].addr in lab.known_hosts.read_text()
    rc, data, _ = edgepack_json("deploy", art, "-I", inv, "-d", "x1")  # now known: no flag needed
    assert rc == 0 and by_device(data)["x1"]["status"] == "no change"


def test_changed_host_key_refused_even_with_accept_new(lab, tmp_path):
    dev = lab.add("x1", "x86_64")
    inv = lab.write_inventory()
    v1 = make_standin(tmp_path / "v1", version="1")
    v2 = make_standin(tmp_path / "v2", version="2")
    _deploy_ok(inv, v1, "x1")
    port = dev.port
    dev.stop()
    dev.new_host_key()
    dev.start()
    if dev.port != port:  # the old port was taken meanwhile: the known key must follow the device
        lab.known_hosts.write_text(lab.known_hosts.read_text().replace(f":{port} ", f":{dev.port} "))
    inv = lab.write_inventory()
    known = lab.known_hosts.read_text()
    rc, data, _ = edgepack_json("deploy", v2, "-I", inv, "-d", "x1", "--accept-new-host-key")
    r = by_device(data)["x1"]
    assert "CHANGED" in r["message"] and "ssh-keygen -f" in r["hint"] and " -R " in r["hint"], r
    assert lab.known_hosts.read_text() == known  # accept-new never replaces a known key
    assert rc == 9 and r["status"] == "failed"
    assert _current(dev) == f"releases/{inspect_artifact(v1).short}"


def test_unreachable_devices_time_out_and_others_still_deploy(lab, tmp_path):
    lab.add("ok", "x86_64")
    inv = lab.write_inventory()
    art = make_standin(tmp_path / "v1")
    silent = silent_server("127.0.0.250")  # accepts TCP, never sends an SSH banner
    try:
        host, port = silent.getsockname()
        refused_port = lab.devices["ok"].port + 1 if lab.devices["ok"].port < 65535 else 1025
        t0 = time.monotonic()
        rc, data, err = edgepack_json("deploy", art, "-I", inv, "-d", f"ok,root@{host}:{port},root@127.0.0.251:{refused_port}",
                                      "--connect-timeout", "1", "-j", "3", timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        silent.close()
    res = by_device(data)
    assert rc == 9
    assert res["ok"]["status"] == "deployed"
    assert res[f"root@{host}:{port}"]["status"] == "unreachable"
    assert "timed out" in res[f"root@{host}:{port}"]["message"] or "banner" in res[f"root@{host}:{port}"]["message"]
    assert res[f"root@127.0.0.251:{refused_port}"]["status"] == "unreachable"
    assert elapsed < 20, elapsed
    assert "2 of 3" in err


def test_fail_fast_skips_devices_not_started(lab, tmp_path):
    lab.add("ok1", "x86_64")
    lab.add("ok2", "x86_64")
    inv = lab.write_inventory()
    art = make_standin(tmp_path / "v1")
    rc, data, _ = edgepack_json("deploy", art, "-I", inv, "-d", "root@127.0.0.251:1,ok1,ok2", "-j", "1",
                                "--fail-fast", "--connect-timeout", "2")
    statuses = [r["status"] for r in data["results"]]
    assert rc == 9 and statuses == ["unreachable", "skipped", "skipped"]


def test_output_written_after_the_exit_status_is_not_lost(lab):
    # sshd sends exit-status when the shell exits, while its pipe may still hold output (here: a child
    # that outlives the shell and writes later). A reader that stops at exit-status loses that output;
    # under load this made a device's probe come back empty ("did not answer the probe").
    from edgepack.deploy.ssh import connect
    lab.add("x1", "x86_64")
    inv = load_inventory(lab.write_inventory())
    with connect(inv.devices["x1"], SSHOptions(connect_timeout=5)) as conn:
        res = conn.run("(sleep 0.5; echo late; echo late-err >&2) & echo early; exit 3", 20)
        assert (res.rc, res.stdout, res.stderr) == (3, "early\nlate\n", "late-err\n"), res
        # a child that keeps the pipe open far longer is not waited for beyond a short grace
        t0 = time.monotonic()
        res = conn.run("(sleep 60) & echo now", 20)
        assert res.rc == 0 and res.stdout == "now\n" and time.monotonic() - t0 < 15, res
