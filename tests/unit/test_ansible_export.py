"""The Ansible path without Ansible: batches, the files written, the filter plugin's readings, and how
ansible-runner events become per-device results (the real runs are in tests/test_ansible.py)."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest

from edgepack.deploy import ansible_filters as f
from edgepack.deploy.ansible import AnsibleOptions, batches, export, serial
from edgepack.deploy.ansible_run import Collector
from edgepack.deploy.artifact import ArtifactInfo
from edgepack.deploy.device import Device
from edgepack.errors import UsageError


def _art(tmp_path: Path) -> ArtifactInfo:
    p = tmp_path / "m-x86_64"
    p.write_bytes(b"\x7fELF-not-really")
    return ArtifactInfo(path=p, name=p.name, sha256="ab" * 32, size=p.stat().st_size, target="x86_64",
                        arch="x86_64", link="static", glibc=None, model="m")


def _devs(n: int) -> list[Device]:
    return [Device(name=f"d{i}", host=f"127.0.0.{10 + i}", port=2200 + i, user="edge", keys=("/k/id",),
                    tags=("line-1",) if i % 2 else ("line 2",), known_hosts="/kh/known_hosts") for i in range(n)]


def test_serial_and_batches_like_ansible():
    s = serial(AnsibleOptions(canary=1, batch="25%"))
    assert s == [1, "25%", "100%"]
    names = [f"d{i}" for i in range(10)]
    assert batches(names, s) == [["d0"], ["d1", "d2"], names[3:]]
    assert batches(names, serial(AnsibleOptions(canary=2, batch="3"))) == [["d0", "d1"], ["d2", "d3", "d4"],
                                                                             names[5:]]
    assert batches(["a"], s) == [["a"]]
    for bad in (AnsibleOptions(batch="0"), AnsibleOptions(batch="x%"), AnsibleOptions(batch="101%"),
                AnsibleOptions(canary=0), AnsibleOptions(max_fail=101)):
        with pytest.raises(UsageError):
            serial(bad)


def test_export_writes_inventory_config_and_plugins(tmp_path):
    art = _art(tmp_path)
    ex = export(art, _devs(3), tmp_path / "out", AnsibleOptions(forks=7, accept_new_host_key=True))
    inv = ex.inventory.read_text()
    assert '"d1":' in inv and '"ansible_host": "127.0.0.11"' not in inv  # YAML keys are plain, values JSON
    assert 'ansible_host: "127.0.0.11"' in inv and "ansible_port: 2201" in inv
    assert "StrictHostKeyChecking=accept-new" in inv and "UserKnownHostsFile=/kh/known_hosts" in inv
    assert "tag_line_1:" in inv and "tag_line_2:" in inv
    cfg = ex.config.read_text()
    assert "forks = 7" in cfg and "host_key_checking = True" in cfg
    assert "ssh_args = -o StrictHostKeyChecking=accept-new" in cfg  # first: wins over Ansible's own "=no"
    assert (ex.folder / "files" / art.name).read_bytes() == art.path.read_bytes()
    assert (ex.folder / "files" / f"{art.name}.run").read_bytes().endswith(art.path.read_bytes())
    step = (ex.folder / "edgepack-step.sh").read_text()
    assert set(re.findall(r"@@[A-Z]+@@", step)) == {"@@WHEN@@"} and art.sha256 in step  # WHEN: install time
    assert "class FilterModule" in (ex.folder / "filter_plugins" / "edgepack.py").read_text()
    assert "edgepack_summary" in (ex.folder / "callback_plugins" / "edgepack_summary.py").read_text()
    assert ex.batches == [["d0"], ["d1"], ["d2"]]
    assert "batch 1 (canary): d0" in ex.plan and "raw/script" in ex.plan

    ini = export(art, _devs(2), tmp_path / "ini", AnsibleOptions(inventory_format="ini")).inventory.read_text()
    assert "d0 ansible_host=127.0.0.10 ansible_port=2200" in ini and "[tag_line_1]\nd1" in ini


def test_export_refuses_local_device(tmp_path):
    with pytest.raises(UsageError, match="needs SSH devices"):
        export(_art(tmp_path), [Device(name="local", host="localhost", local=True)], tmp_path / "o",
               AnsibleOptions())


def test_filter_parse_selftest_and_failure():
    p = f.edgepack_parse("noise\n@arch x86_64\r\n@current releases/abc\n@owner pid=12\n@owner token=t1\n")
    assert p == {"arch": "x86_64", "current": "releases/abc", "owner_pid": "12", "owner_token": "t1"}
    ok = f.edgepack_selftest('{"result": "PASS", "latency_ms": 1.5}\r\n@rc 0\r\n', 300)
    assert ok["passed"] and ok["latency_ms"] == 1.5 and not ok["hint"]
    bad = f.edgepack_selftest('{"result": "FAIL", "latency_ms": 1.5}\n@rc 1\n', 300)
    assert not bad["passed"] and bad["message"] == "selftest failed on the device (exit 1)" and "FAIL" in bad["output"]
    liar = f.edgepack_selftest("PASS model=m latency_ms=2.0\n@rc 3\n", 300)  # PASS with a crash exit
    assert not liar["passed"] and liar["latency_ms"] == 2.0
    hung = f.edgepack_selftest("@rc 124\n", 30)
    assert hung["message"] == "selftest did not finish within 30 s on the device"
    assert f.edgepack_failure({"rc": 5, "stderr": "upload corrupted: sha256 ...\n"}) == "upload corrupted: sha256 ..."
    assert f.edgepack_failure({"msg": "the device is arm"}) == "the device is arm"


def test_lock_stale_rules():
    me = dict(line.split("=", 1) for line in f.edgepack_owner("d0", "tok", "deploy"))
    held = "@held\n@now 1000\n@mtime 990\n" + "".join(f"@owner {k}={v}\n" for k, v in me.items())
    assert me["pid"] == str(os.getppid())
    assert not f.edgepack_lock_stale(held, 3600)                       # our own run's parent: alive
    assert f.edgepack_lock_stale(held.replace("@mtime 990", "@mtime 10"), 60)   # older than allowed
    dead = held.replace(f"pid={me['pid']}", "pid=999999999")
    assert f.edgepack_lock_stale(dead, 3600)                           # this machine, process gone
    elsewhere = dead.replace(f"boot={me['boot']}", "boot=another-machine")
    assert not f.edgepack_lock_stale(elsewhere, 3600)                  # only age can tell
    assert not f.edgepack_lock_stale("@locked tok\n", 0)
    assert "deploy of device d0" in f.edgepack_holder(held) and "10 s ago" in f.edgepack_holder(held)


def _event(kind: str, host: str, **res) -> dict:
    return {"event": kind, "event_data": {"host": host, "task": "edgepack result" if kind == "runner_on_ok" else "x",
                                          "res": res}}


def test_events_become_device_results(tmp_path):
    art = _art(tmp_path)
    devs = _devs(4)
    col = Collector()
    col(_event("runner_on_ok", "d0", msg=json.dumps({"status": "deployed", "message": "abababab installed",
                                                      "latency_ms": "1.25", "seconds": 3.5, "arch": "x86_64",
                                                      "emulates": "aarch64", "raw": False,
                                                      "sha256": art.sha256})))
    col(_event("runner_on_ok", "d1", msg=json.dumps({"status": "rolled back", "message": "selftest failed",
                                                      "raw": True, "output": "FAIL"})))
    col(_event("runner_on_unreachable", "d2", msg="Failed to connect to the host via ssh: Connection refused"))
    r = [col.result(d, art) for d in devs]
    assert [x.status for x in r] == ["deployed", "rolled back", "unreachable", "skipped"]
    assert r[0].latency_ms == 1.25 and r[0].arch == "x86_64 (+aarch64 via binfmt)" and r[0].ok
    assert "raw/script modules only" in r[1].message and not r[1].ok and r[1].output == "FAIL"
    assert "Connection refused" in r[2].message
    assert "failure threshold" in r[3].message


def test_callback_plugin_source_is_valid_python():
    src = (Path(sys.modules["edgepack.deploy.ansible"].__file__).with_name("ansible_summary.py")).read_text()
    compile(src, "edgepack_summary.py", "exec")
