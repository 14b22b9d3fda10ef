"""End to end: `edgepack deploy` of real artifacts to real sshd devices (x86_64, arm64 via binfmt+qemu,
and a Jetson-like arm64 glibc-2.31 chroot), plus layout, rollback, parallelism and CLI behaviour."""
from __future__ import annotations

import os
import time

import pytest
from lab.fixtures import by_device, edgepack, edgepack_json, lab  # noqa: F401 (lab is a fixture)
from lab.standin import make_standin

from edgepack.deploy.artifact import inspect_artifact


def _on_device_selftest(lab, dev, exe: str) -> bool:
    """The artifact's own verdict, asked directly over SSH (no edgepack code involved)."""
    import subprocess
    p = subprocess.run(["ssh", "-i", str(lab.client_key), "-o", f"UserKnownHostsFile={lab.known_hosts}",
                        "-o", "BatchMode=yes", "-p", str(dev.port), f"root@{dev.addr}", f"{exe} selftest"],
                       capture_output=True, text=True, timeout=300)
    return p.returncode == 0 and p.stdout.startswith("PASS")


def test_real_artifacts_deploy_and_smoke_on_all_device_kinds(lab, tiny_artifacts, tmp_path):
    lab.add("pc", "x86_64")
    lab.add("pi", "arm64")
    orin = lab.add("orin", "jetson")
    inv = lab.write_inventory()
    x86, arm = tiny_artifacts["x86_64"], tiny_artifacts["arm64"]

    rc, data, err = edgepack_json("deploy", x86, "-I", inv, "--tag", "x86_64")
    assert rc == 0, err
    assert by_device(data)["pc"]["status"] == "deployed"
    assert by_device(data)["pc"]["latency_ms"] > 0

    rc, data, err = edgepack_json("deploy", arm, "-I", inv, "-d", "pi")
    assert rc == 0, err
    pi = by_device(data)["pi"]
    assert pi["status"] == "deployed" and pi["latency_ms"] > 0, pi
    assert pi["sha256"] == inspect_artifact(arm).sha256
    assert "aarch64 via binfmt" in pi["arch"]

    # The Jetson-like device: a known-good version first (a stand-in), then the real artifact. Whatever
    # the artifact's own selftest says on that device decides: deployed, or rolled back to the stand-in.
    good = make_standin(tmp_path / "good", "arm64")
    rc, data, err = edgepack_json("deploy", good, "-I", inv, "-d", "orin")
    assert rc == 0, err
    rc, data, err = edgepack_json("deploy", arm, "-I", inv, "-d", "orin")
    r = by_device(data)["orin"]
    assert r["arch"] == "aarch64" and r["glibc"] == "2.31"
    passes = _on_device_selftest(lab, orin, f"/opt/edgepack/releases/{inspect_artifact(arm).short}/{arm.name}") \
        if r["status"] == "deployed" else None
    if r["status"] == "deployed":
        assert rc == 0 and passes and r["latency_ms"] > 0
    else:
        assert rc == 9 and r["status"] == "rolled back", r
        assert "FAIL" in r["output"], r
        rc2, data2, _ = edgepack_json("smoke", "-I", inv, "-d", "orin")
        assert rc2 == 0 and by_device(data2)["orin"]["sha256"] == inspect_artifact(good).sha256

    # compare before acting: the same artifact again changes nothing and runs nothing
    rc, data, _ = edgepack_json("deploy", arm, "-I", inv, "-d", "pi")
    assert rc == 0 and by_device(data)["pi"]["status"] == "no change"

    rc, data, err = edgepack_json("smoke", "-I", inv, "-d", "pc,pi", "--bench", "-j", "2")
    assert rc == 0, err
    for r in data["results"]:
        assert r["status"] == "pass" and r["latency_ms"] > 0
        assert r["bench"] and r["bench"]["median_ms"] > 0, r
    # the arm64 device runs the artifact through qemu-user (binfmt): its timings say so
    emulated = {r["device"]: r["bench"]["emulated"] for r in data["results"]}
    assert emulated == {"pc": False, "pi": True}, emulated


def test_versioned_layout_rollback_and_roll_forward(lab, tmp_path):
    dev = lab.add("x1", "x86_64")
    inv = lab.write_inventory()
    v1, v2, v3 = (make_standin(tmp_path / f"v{i}", version=str(i)) for i in (1, 2, 3))
    s1, s2, s3 = (inspect_artifact(v).short for v in (v1, v2, v3))
    root = dev.home / "edgepack"
    for v in (v1, v2):
        assert edgepack("deploy", v, "-I", inv, "-d", "x1").returncode == 0
    assert os.readlink(root / "current") == f"releases/{s2}" and os.readlink(root / "previous") == f"releases/{s1}"
    assert (root / "releases" / s2 / v2.name).read_bytes() == v2.read_bytes()
    assert os.access(root / "current" / v2.name, os.X_OK)
    assert edgepack("deploy", v3, "-I", inv, "-d", "x1").returncode == 0
    # only current and previous are kept
    assert sorted(p.name for p in (root / "releases").iterdir()) == sorted([s2, s3])

    p = edgepack("rollback", "-I", inv, "-d", "x1")
    assert p.returncode == 0, p.stderr
    assert "ROLLED BACK" in p.stdout
    assert os.readlink(root / "current") == f"releases/{s2}" and os.readlink(root / "previous") == f"releases/{s3}"
    assert edgepack("rollback", "-I", inv, "-d", "x1").returncode == 0  # again: forward
    assert os.readlink(root / "current") == f"releases/{s3}"
    # deploying a version that is still in releases/ re-uses it (no upload) and keeps the pair
    rc, data, _ = edgepack_json("deploy", v2, "-I", inv, "-d", "x1")
    assert rc == 0 and by_device(data)["x1"]["status"] == "deployed"
    assert os.readlink(root / "current") == f"releases/{s2}" and os.readlink(root / "previous") == f"releases/{s3}"


def test_rollback_without_previous_fails_clearly(lab, tmp_path):
    lab.add("x1", "x86_64")
    inv = lab.write_inventory()
    assert edgepack("deploy", make_standin(tmp_path / "v1"), "-I", inv, "-d", "x1").returncode == 0
    rc, data, err = edgepack_json("rollback", "-I", inv, "-d", "x1")
    assert rc == 9 and "no previous version" in by_device(data)["x1"]["message"]


def test_eight_devices_in_parallel(lab, tmp_path):
    for i in range(8):
        lab.add(f"d{i}", "x86_64" if i % 2 else "arm64")
    inv = lab.write_inventory()
    art = make_standin(tmp_path / "v1")
    t0 = time.monotonic()
    rc, data, err = edgepack_json("deploy", art, "-I", inv, "--tag", "x86_64", "--tag", "arm64", "-j", "8")
    assert rc == 0, (err, [(r["device"], r.get("message")) for r in (data or {}).get("results", [])])
    assert [r["status"] for r in data["results"]] == ["deployed"] * 8
    assert time.monotonic() - t0 < 60


def test_devices_check_reports_arch_glibc_and_space(lab):
    lab.add("pc", "x86_64")
    lab.add("pi", "arm64")
    lab.add("orin", "jetson")
    inv = lab.write_inventory()
    rc, data, err = edgepack_json("devices", "check", "-I", inv, "-d", "pc,pi,orin", "-j", "3")
    assert rc == 0, err
    r = by_device(data)
    assert r["pc"]["arch"] == "x86_64"  # the lab gives each device a private, empty binfmt_misc
    assert r["pi"]["arch"].startswith("x86_64 (+aarch64 via binfmt)")
    assert r["orin"]["arch"] == "aarch64" and r["orin"]["glibc"] == "2.31"
    assert all(x["free_bytes"] and x["free_bytes"] > 0 for x in data["results"])
    p = edgepack("devices", "check", "-I", inv, "-d", "orin")
    assert p.returncode == 0 and "2.31" in p.stdout and "nothing installed" in p.stdout


def test_ssh_config_alias_and_key_from_config(lab, tmp_path):
    dev = lab.add("x1", "x86_64")
    cfg = tmp_path / "ssh_config"
    cfg.write_text(f"Host edge-box\n  HostName {dev.addr}\n  Port {dev.port}\n  User root\n"
                   f"  IdentityFile {lab.client_key}\n")
    rc, data, err = edgepack_json("deploy", make_standin(tmp_path / "v1"), "-d", "edge-box", "--ssh-config", cfg,
                                  "--known-hosts", lab.known_hosts)
    assert rc == 0, err
    assert by_device(data)["edge-box"]["address"] == f"root@{dev.addr}:{dev.port}"
    assert (dev.home / "edgepack" / "current").exists()


def test_remote_paths_are_quoted(lab, tmp_path):
    dev = lab.add("x1", "x86_64")
    inv = lab.write_inventory()
    odd = "~/odd dir/$(touch pwned);x'y"
    rc, data, err = edgepack_json("deploy", make_standin(tmp_path / "v1"), "-I", inv, "-d", "x1", "--dest", odd)
    assert rc == 0, err
    assert (dev.home / "odd dir" / "$(touch pwned);x'y" / "current").exists()
    assert not any(p.name == "pwned" for p in dev.home.rglob("*"))


def test_local_device(tmp_path):
    dest = tmp_path / "installed"
    rc, data, err = edgepack_json("deploy", make_standin(tmp_path / "v1"), "-d", "local", "--dest", dest)
    assert rc == 0, err
    assert by_device(data)["local"]["status"] == "deployed"
    assert (dest / "current").is_symlink()


@pytest.mark.parametrize("args,code,msg", [
    (["deploy", "ART"], 2, "no device selected"),
    (["deploy", "ART", "-I", "NOPE.toml", "-d", "x"], 2, "inventory NOPE.toml does not exist"),
    (["deploy", "missing-artifact", "-d", "local"], 11, "missing-artifact does not exist"),
    (["deploy", "ART", "-d", "bad host"], 2, "invalid device 'bad host'"),
])
def test_bad_input_one_line_error(tmp_path, args, code, msg):
    art = make_standin(tmp_path / "v1")
    p = edgepack(*[str(art) if a == "ART" else a for a in args])
    assert p.returncode == code, p.stderr
    assert p.stderr.startswith("error: ") and msg in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and "hint:" in p.stderr


def _ssh_config(tmp_path, dev, key):
    cfg = tmp_path / "ssh_config_key"
    cfg.write_text(f"Host {dev.addr}\n  IdentityFile {key}\n")
    return cfg


def test_key_from_ssh_agent(lab, tmp_path):
    """No key file anywhere: the client key is only in an ssh-agent, as on a developer's laptop."""
    import shutil
    import subprocess
    dev = lab.add("x1", "x86_64")
    sock = tmp_path / "agent.sock"
    agent = subprocess.Popen([shutil.which("ssh-agent"), "-D", "-a", str(sock)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):  # bounded: 2 s
            if sock.exists():
                break
            time.sleep(0.01)
        env = {**os.environ, "SSH_AUTH_SOCK": str(sock), "HOME": str(tmp_path / "emptyhome")}
        subprocess.run(["ssh-add", "-q", str(lab.client_key)], env=env, check=True, timeout=10,
                       capture_output=True)
        art = make_standin(tmp_path / "v1")
        p = edgepack("deploy", art, "-d", dev.spec, "--known-hosts", lab.known_hosts, "--json", env=env)
        assert p.returncode == 0, p.stdout + p.stderr
        # and without the agent the same command is refused by the device, with a one-line reason
        env.pop("SSH_AUTH_SOCK")
        p = edgepack("deploy", art, "-d", dev.spec, "--known-hosts", lab.known_hosts, "--json", env=env)
        assert p.returncode == 9 and "no SSH key to offer" in p.stdout, p.stdout
        # a key the device does not know is refused by the device, with a one-line reason
        stranger = tmp_path / "stranger"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True, timeout=30)
        p = edgepack("deploy", art, "-d", dev.spec, "--known-hosts", lab.known_hosts, "--json", "--ssh-config",
                     _ssh_config(tmp_path, dev, stranger), env=env)
        assert p.returncode == 9 and f"refused key {stranger}" in p.stdout, p.stdout
    finally:
        agent.kill()
        agent.wait(timeout=5)


def test_devices_list(lab, tmp_path):
    lab.add("x1", "x86_64")
    inv = lab.write_inventory()
    p = edgepack("devices", "list", "-I", inv)
    assert p.returncode == 0 and "x1" in p.stdout and "root@127.0.0." in p.stdout
