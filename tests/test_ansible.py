"""The Ansible path: `edgepack fleet export-ansible` and `edgepack deploy --via ansible`, run by real
ansible-playbook / ansible-runner against the lab's real sshd devices (x86_64, arm64 under qemu, and the
Jetson-like arm64 chroot, which has no Python and so gets only raw/script modules)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

from lab.fixtures import by_device, edgepack, edgepack_json, lab  # noqa: F401 (lab is a fixture)
from lab.standin import make_standin

from edgepack.deploy.artifact import inspect_artifact


def _ansible_tool(name: str) -> str:
    path = shutil.which(name)
    assert path, f"{name} is missing: .ci/deps-ansible.sh installs it"
    return path


def _via(*args, timeout: float = 400):
    return edgepack_json("deploy", *args, "--via", "ansible", timeout=timeout)


def _current(dev) -> str | None:
    link = dev.home / "edgepack" / "current"
    return os.readlink(link) if os.path.islink(link) else None


def test_export_only_files_pass_ansible_own_checks(lab, tmp_path):
    """Nothing is contacted: the files must satisfy ansible-playbook --syntax-check and
    ansible-inventory --list, with host key checking on and the inventory's known_hosts."""
    for name in ("a1", "a2", "b1"):
        lab.add(name, "x86_64" if name.startswith("a") else "arm64", start=False, tags=("line-1",))
    for d in lab.devices.values():
        d.port = 2200
    inv = lab.write_inventory()
    art = make_standin(tmp_path / "v1")
    for fmt in ("yaml", "ini"):
        out = tmp_path / f"out-{fmt}"
        p = edgepack("fleet", "export-ansible", art, "-I", inv, "--tag", "line-1", "-o", out, "--inventory-format",
                     fmt, "--canary", "1", "--batch", "1", "--max-fail", "0", "--json", timeout=60)
        assert p.returncode == 0, p.stderr
        plan = json.loads(p.stdout)
        assert plan["batches"] == [["a1"], ["a2"], ["b1"]]
        inv_file = out / ("inventory.yml" if fmt == "yaml" else "inventory.ini")
        assert (out / "files" / art.name).read_bytes() == art.read_bytes()
        assert (out / "files" / f"{art.name}.run").read_bytes().endswith(art.read_bytes())
        syn = subprocess.run([_ansible_tool("ansible-playbook"), "--syntax-check", "site.yml"], cwd=out,
                             capture_output=True, text=True, timeout=120)
        assert syn.returncode == 0, syn.stdout + syn.stderr
        lst = subprocess.run([_ansible_tool("ansible-inventory"), "-i", inv_file.name, "--list"], cwd=out,
                             capture_output=True, text=True, timeout=120)
        assert lst.returncode == 0, lst.stderr
        data = json.loads(lst.stdout)
        hv = data["_meta"]["hostvars"]
        assert sorted(data["edgepack"]["hosts"]) == ["a1", "a2", "b1"]
        assert sorted(data["tag_line_1"]["hosts"]) == ["a1", "a2", "b1"]
        a1 = lab.devices["a1"]
        assert hv["a1"]["ansible_host"] == a1.addr and hv["a1"]["ansible_port"] == 2200
        assert hv["a1"]["ansible_ssh_private_key_file"] == str(lab.client_key)
        assert hv["a1"]["edgepack_dest"] == a1.dest
        ssh_args = hv["a1"]["ansible_ssh_common_args"]
        assert f"UserKnownHostsFile={lab.known_hosts}" in ssh_args and "StrictHostKeyChecking=yes" in ssh_args
        cfg = (out / "ansible.cfg").read_text()
        assert "host_key_checking = True" in cfg
        site = (out / "site.yml").read_text()
        assert 'serial: [1, 1, "100%"]' in site and "max_fail_percentage: 0" in site and "rescue:" in site
        # no secret in what was written: key paths only, never key material
        key = lab.client_key.read_text().splitlines()[1]
        for f in out.rglob("*"):
            if f.is_file() and not f.name.startswith(art.name):
                assert key not in f.read_text(errors="replace"), f


def test_rollout_both_architectures_raw_device_and_idempotent_rerun(lab, tiny_artifacts, tmp_path):
    pc1, pc2 = lab.add("pc1", "x86_64"), lab.add("pc2", "x86_64")
    pi = lab.add("pi", "arm64")
    orin = lab.add("orin", "jetson")   # Debian 11 minbase chroot: no Python at all
    inv = lab.write_inventory()
    x86, arm = tiny_artifacts["x86_64"], tiny_artifacts["arm64"]

    rc, data, err = _via(x86, "-I", inv, "--tag", "x86_64", "-j", "4")
    assert rc == 0, err
    assert data["via"] == "ansible"
    for name, dev in (("pc1", pc1), ("pc2", pc2)):
        r = by_device(data)[name]
        assert r["status"] == "deployed" and r["latency_ms"] > 0, r
        assert r["sha256"] == inspect_artifact(x86).sha256
        assert _current(dev) == f"releases/{inspect_artifact(x86).short}"
        assert (dev.home / "edgepack" / "current" / x86.name).read_bytes() == x86.read_bytes()
        assert not (dev.home / "edgepack" / ".edgepack-lock").exists()

    rc, data, err = _via(arm, "-I", inv, "-d", "pi")
    assert rc == 0, err
    r = by_device(data)["pi"]
    assert r["status"] == "deployed" and r["latency_ms"] > 0 and "aarch64 via binfmt" in r["arch"], r
    assert _current(pi) == f"releases/{inspect_artifact(arm).short}"

    # the Jetson-like device has no Python: probe, upload (a self-unpacking script) and switch run with
    # raw/script only; a stand-in keeps the qemu-emulated shell's work small
    good = make_standin(tmp_path / "good", "arm64", version="7")
    rc, data, err = _via(good, "-I", inv, "-d", "orin")
    r = by_device(data)["orin"]
    assert rc == 0 and r["status"] == "deployed", (r, err)
    assert "raw/script modules only" in r["message"] and r["arch"] == "aarch64" and r["glibc"] == "2.31"
    check = subprocess.run(["ssh", "-i", str(lab.client_key), "-o", f"UserKnownHostsFile={lab.known_hosts}",
                            "-o", "BatchMode=yes", "-p", str(orin.port), f"root@{orin.addr}",
                            f"sha256sum /opt/edgepack/current/{good.name}; readlink /opt/edgepack/current"],
                           capture_output=True, text=True, timeout=120)
    assert check.stdout.split()[0] == inspect_artifact(good).sha256, check
    assert check.stdout.split()[-1] == f"releases/{inspect_artifact(good).short}"

    # idempotent: the same roll-out again changes nothing on any device
    before = {d.name: os.lstat(d.home / "edgepack" / "current").st_mtime_ns for d in (pc1, pc2)}
    rc, data, err = _via(x86, "-I", inv, "--tag", "x86_64", "-j", "4")
    assert rc == 0, err
    assert [r["status"] for r in data["results"]] == ["no change", "no change"]
    assert before == {d.name: os.lstat(d.home / "edgepack" / "current").st_mtime_ns for d in (pc1, pc2)}


def test_failed_selftest_rolled_back_and_threshold_stops_rollout(lab, tmp_path):
    devs = [lab.add(f"d{i}", "x86_64") for i in range(4)]
    inv = lab.write_inventory()
    v1 = make_standin(tmp_path / "v1", version="1")
    v2 = make_standin(tmp_path / "v2", version="2")
    rc, data, err = edgepack_json("deploy", v1, "-I", inv, "--tag", "x86_64", "-j", "4")  # paramiko path
    assert rc == 0, err
    (devs[1].home / ".standin-fail-2").write_text("")  # version 2 fails its selftest on d1 only
    t0 = time.monotonic()
    rc, data, err = _via(v2, "-I", inv, "--tag", "x86_64", "--canary", "1", "--batch", "1", "--max-fail", "0")
    elapsed = time.monotonic() - t0
    res = by_device(data)
    assert rc == 9, err
    assert res["d0"]["status"] == "deployed"                      # the canary passed
    assert res["d1"]["status"] == "rolled back", res["d1"]        # batch 2 failed its selftest...
    assert "selftest failed on the device (exit 1)" in res["d1"]["message"] and "FAIL" in res["d1"]["output"]
    assert res["d1"]["sha256"] == inspect_artifact(v1).sha256
    for name in ("d2", "d3"):                                     # ...so batches 3 and 4 never started
        assert res[name]["status"] == "skipped" and "failure threshold" in res[name]["message"]
    s1, s2 = inspect_artifact(v1).short, inspect_artifact(v2).short
    assert _current(devs[0]) == f"releases/{s2}"
    for d in devs[1:]:
        assert _current(d) == f"releases/{s1}"
        assert not (d.home / "edgepack" / "releases" / s2).exists()
        assert not (d.home / "edgepack" / ".edgepack-lock").exists()
    assert "2 of 4" not in err and "3 of 4" in err
    assert elapsed < 300, elapsed


def test_unreachable_device_reported(lab, tmp_path):
    lab.add("ok", "x86_64")
    inv = lab.write_inventory()
    art = make_standin(tmp_path / "v1")
    port = lab.devices["ok"].port + 1 if lab.devices["ok"].port < 65535 else 1025
    rc, data, err = _via(art, "-I", inv, "-d", f"ok,root@127.0.0.251:{port}", "--max-fail", "100",
                         "--canary", "2", "--connect-timeout", "3")
    res = by_device(data)
    assert rc == 9, err
    assert res["ok"]["status"] == "deployed"
    bad = res[f"root@127.0.0.251:{port}"]
    assert bad["status"] == "unreachable" and "Connection refused" in bad["message"], bad
    assert "1 of 2" in err


def test_wrong_architecture_refused_before_upload(lab, tmp_path):
    dev = lab.add("x1", "x86_64")
    inv = lab.write_inventory()
    arm = make_standin(tmp_path / "arm", "arm64")
    rc, data, err = _via(arm, "-I", inv, "-d", "x1")
    r = by_device(data)["x1"]
    assert rc == 9 and r["status"] == "failed", r
    assert "wrong architecture, nothing was uploaded" in r["message"], r
    assert not (dev.home / "edgepack" / "releases").exists()
    assert not (dev.home / "edgepack" / ".edgepack-lock").exists()


def test_lock_of_an_ended_run_on_this_machine_is_taken_over(lab, tmp_path):
    """The lock format and stale rule are deploy/lock.py's: a lock left by an edgepack process of this
    machine that has ended is taken over at once (the filter plugin judges it on the controller)."""
    from edgepack.deploy.lock import _me
    dev = lab.add("x1", "x86_64")
    inv = lab.write_inventory()
    dead = subprocess.Popen(["true"])
    dead.wait(timeout=30)
    lock = dev.home / "edgepack" / ".edgepack-lock"
    lock.mkdir(parents=True)
    me = {**_me(), "pid": str(dead.pid), "token": "0123456789abcdef", "device": "x1", "op": "deploy"}
    (lock / "owner").write_text("".join(f"{k}={v}\n" for k, v in me.items()))
    t0 = time.monotonic()
    rc, data, err = _via(make_standin(tmp_path / "v1"), "-I", inv, "-d", "x1", "--lock-wait", "100")
    assert rc == 0 and by_device(data)["x1"]["status"] == "deployed", err
    assert time.monotonic() - t0 < 90  # taken over, not waited for
    assert not lock.exists()


def test_unknown_host_key_is_refused(lab, tmp_path):
    """Host key checking is on: a device whose key is not in the inventory's known_hosts gets nothing."""
    dev = lab.add("x1", "x86_64", trust=False)
    inv = lab.write_inventory()
    rc, data, err = _via(make_standin(tmp_path / "v1"), "-I", inv, "-d", "x1")
    r = by_device(data)["x1"]
    assert rc == 9 and r["status"] == "unreachable", r
    assert "Host key verification failed" in r["message"] and "known_hosts" in r["hint"], r
    assert not (dev.home / "edgepack").exists()


def test_exported_playbook_run_by_ansible_playbook_prints_one_line_per_device(lab, tmp_path):
    """What teams that run Ansible themselves get: plain `ansible-playbook site.yml` in the exported folder."""
    dev = lab.add("pc", "x86_64")
    inv = tmp_path / "devices.toml"
    inv.write_text(lab.write_inventory().read_text()
                   + '\n[devices.gone]\nhost = "127.0.0.252"\nport = 1\nuser = "root"\n')
    art = make_standin(tmp_path / "v1")
    out = tmp_path / "rollout"
    p = edgepack("fleet", "export-ansible", art, "-I", inv, "-d", "pc,gone", "-o", out, "--max-fail", "100",
                 "--canary", "2", timeout=60)
    assert p.returncode == 0, p.stderr
    run = subprocess.run([_ansible_tool("ansible-playbook"), "site.yml"], cwd=out, capture_output=True, text=True,
                         timeout=300)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("edgepack: ")]
    assert run.returncode != 0 and len(lines) == 2, run.stdout[-3000:]
    assert lines[0].startswith("edgepack: pc deployed") and lines[1].startswith("edgepack: gone unreachable")
    assert _current(dev) == f"releases/{inspect_artifact(art).short}"
