"""Hostile situations for `edgepack deploy` (issue 11), each against a real sshd device of the lab: a cut
or a timeout during the on-device selftest, two deploys at once (also two inventory names for one host),
a lock left by someone else, foreign entries and a symlinked `releases`, file names with `\\` and newlines,
and rollback to a previous release that is gone, damaged or failing. After each: a tested version is
current and runs, and nothing that edgepack did not make was touched.

One lab for the module (one x86_64 device); every test deploys into its own folder in the device's home.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from lab.fixtures import REPO, by_device, edgepack, edgepack_json, module_lab  # noqa: F401 (fixture)
from lab.standin import make_standin

from edgepack.deploy.artifact import inspect_artifact
from edgepack.deploy.lock import LOCK

SLEEP, STARTED = ".standin-sleep", ".standin-started"


@pytest.fixture(scope="module")
def dev(module_lab):
    d = module_lab.add("h1", "x86_64")
    module_lab.write_inventory()
    return d


@pytest.fixture
def inv(module_lab, dev):
    yield module_lab.root / "devices.toml"
    for f in dev.home.glob(".standin-*"):  # test hooks never leak into the next test
        f.unlink()


@pytest.fixture
def arts(tmp_path):
    """Three passing versions of a stand-in artifact: {1: path, 2: path, 3: path}."""
    return {i: make_standin(tmp_path / f"v{i}", version=str(i)) for i in (1, 2, 3)}


def short(art) -> str:
    return inspect_artifact(art).short


def deploy(inv, art, dest, *extra, expect: str | None = "deployed"):
    rc, data, err = edgepack_json("deploy", art, "-I", inv, "-d", "h1", "--dest", dest, *extra)
    r = by_device(data)["h1"]
    if expect is not None:
        assert r["status"] == expect and rc == (0 if r["ok"] else 9), (r, err)
    return rc, r, err


def smoke_sha(inv, dest) -> str:
    rc, data, err = edgepack_json("smoke", "-I", inv, "-d", "h1", "--dest", dest)
    r = by_device(data)["h1"]
    assert rc == 0 and r["status"] == "pass", (r, err)
    return r["sha256"]


def links(root) -> tuple[str | None, str | None]:
    return tuple(os.readlink(root / n) if os.path.lexists(root / n) else None for n in ("current", "previous"))


def popen_deploy(inv, art, dest, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "edgepack", "deploy", str(art), "-I", str(inv), "-d", "h1",
                             "--dest", dest, "--json", *extra], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "250"})


def wait_for(path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def result_of(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, dict]:
    import json
    out, err = proc.communicate(timeout=timeout)
    try:
        return proc.returncode, by_device(json.loads(out))["h1"]
    except ValueError:
        raise AssertionError(f"no JSON (exit {proc.returncode}): {out}\n{err}") from None


def test_connection_cut_during_selftest_keeps_previous_current(inv, dev, arts):
    root, dest = dev.home / "cut", "~/cut"
    deploy(inv, arts[1], dest)
    (dev.home / SLEEP).write_text("60")
    proc = popen_deploy(inv, arts[2], dest)
    wait_for(dev.home / STARTED)         # the new version's selftest is running on the device
    dev.kill_connections()               # ...and the device's sshd for that session dies
    rc, r = result_of(proc)
    assert rc == 9 and r["status"] == "failed", r
    assert "connection lost" in r["message"] and "during the on-device selftest" in r["message"], r
    assert f"{short(arts[1])[:8]} stays current" in r["message"] and "selftested again" in r["hint"], r
    # the previous, tested release is current and runs
    assert links(root)[0] == f"releases/{short(arts[1])}"
    (dev.home / SLEEP).unlink()
    assert smoke_sha(inv, dest) == inspect_artifact(arts[1]).sha256
    # the re-run tests the new version again instead of saying "no change" (the dead run's lock is
    # taken over: its process has ended)
    _, r, _ = deploy(inv, arts[2], dest)
    assert links(root) == (f"releases/{short(arts[2])}", f"releases/{short(arts[1])}")
    assert not (root / LOCK).exists()


def test_selftest_timeout_keeps_previous_current(inv, dev, arts):
    root, dest = dev.home / "slow", "~/slow"
    deploy(inv, arts[1], dest)
    (dev.home / SLEEP).write_text("30")
    t0 = time.monotonic()
    rc, r, _ = deploy(inv, arts[2], dest, "--selftest-timeout", "2", expect="rolled back")
    assert time.monotonic() - t0 < 25
    assert "did not finish within 2 s" in r["message"] and "--selftest-timeout" in r["hint"], r
    assert links(root)[0] == f"releases/{short(arts[1])}" and r["sha256"] == inspect_artifact(arts[1]).sha256
    assert not (root / "releases" / short(arts[2])).exists() and not (root / LOCK).exists()
    (dev.home / SLEEP).unlink()
    assert smoke_sha(inv, dest) == inspect_artifact(arts[1]).sha256
    deploy(inv, arts[2], dest)


def test_two_deploys_at_once_work_one_after_the_other(inv, dev, arts):
    root, dest = dev.home / "race", "~/race"
    deploy(inv, arts[1], dest)
    (dev.home / SLEEP).write_text("1")   # a selftest that takes a while widens the window
    procs = {v: popen_deploy(inv, arts[v], dest) for v in (2, 3)}
    res = {v: result_of(p) for v, p in procs.items()}
    for v, (rc, r) in res.items():
        assert rc == 0 and r["status"] == "deployed", r
    cur, prev = links(root)
    assert {cur, prev} == {f"releases/{short(arts[2])}", f"releases/{short(arts[3])}"}, (cur, prev)
    for rel in (cur, prev):  # neither deleted the other's release
        name = next(p.name for p in (root / rel).iterdir() if p.name.startswith("tiny_cnn"))
        assert subprocess.run([root / rel / name, "selftest"], capture_output=True, timeout=30).returncode == 0
    assert not (root / LOCK).exists()


def test_two_inventory_names_for_one_host(inv, dev, module_lab, arts, tmp_path):
    root = dev.home / "alias"
    toml = inv.read_text()
    alias = toml + "\n" + dev.inventory_toml().replace("[devices.h1]", "[devices.h1-again]")
    inv2 = tmp_path / "two-names.toml"
    inv2.write_text(alias)
    rc, data, err = edgepack_json("deploy", arts[1], "-I", inv2, "-d", "h1,h1-again", "-j", "2", "--dest", "~/alias")
    assert rc == 0, err
    assert sorted(r["status"] for r in data["results"]) == ["deployed", "no change"], data
    assert links(root) == (f"releases/{short(arts[1])}", None)
    assert [p.name for p in (root / "releases").iterdir()] == [short(arts[1])]


def _fake_lock(root, age_s: float):
    lock = root / LOCK
    lock.mkdir(parents=True)
    (lock / "owner").write_text("host=ci-runner-7\npid=4242\ntoken=0123abcd\ndevice=cam-07\nop=deploy\n")
    t = time.time() - age_s
    os.utime(lock, (t, t))  # the lock's time is its folder's mtime
    return lock


def test_lock_held_by_another_run_is_a_clear_error_then_stale_is_taken_over(inv, dev, arts):
    root, dest = dev.home / "held", "~/held"
    deploy(inv, arts[1], dest)
    lock = _fake_lock(root, 5)
    rc, r, err = deploy(inv, arts[2], dest, "--lock-wait", "1", expect="failed")
    assert "locked by another edgepack run" in r["message"] and "cam-07 from ci-runner-7 pid 4242" in r["message"]
    assert "nothing was changed" in r["message"] and LOCK in r["hint"], r
    assert links(root) == (f"releases/{short(arts[1])}", None) and lock.exists()
    assert not (root / "releases" / short(arts[2])).exists()  # refused before uploading anything
    # the same lock, two hours old (the holder died without a word): taken over
    lock.joinpath("owner").unlink()
    lock.rmdir()
    _fake_lock(root, 7200)
    deploy(inv, arts[2], dest, "--lock-wait", "0")
    assert links(root)[0] == f"releases/{short(arts[2])}" and not lock.exists()


def test_prune_removes_only_edgepack_releases(inv, dev, arts, tmp_path):
    root, dest = dev.home / "mixed", "~/mixed"
    deploy(inv, arts[1], dest)
    rel = root / "releases"
    outside = dev.home / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not edgepack's")
    foreign = {"notes.txt": "file", "backup": "dir", "0123456789abcdef": "dir", ".incoming-x": "dir",
               "link-out": "symlink"}
    (rel / "notes.txt").write_text("mine")
    for name in ("backup", "0123456789abcdef", ".incoming-x"):
        (rel / name).mkdir()
        (rel / name / "data.bin").write_bytes(b"\0" * 10)
    (rel / "link-out").symlink_to(outside)
    legacy = rel / "fedcba9876543210"  # made by an edgepack from before the marker: release.json says so
    legacy.mkdir()
    (legacy / "release.json").write_text('{"artifact": "old", "sha256": "fedcba9876543210%s"}\n' % ("0" * 48))
    for v in (2, 3):
        deploy(inv, arts[v], dest)
    left = {p.name for p in rel.iterdir()}
    assert left == set(foreign) | {short(arts[2]), short(arts[3])}, left  # v1 and legacy pruned, nothing else
    assert (rel / "backup" / "data.bin").exists() and (outside / "keep.txt").read_text() == "not edgepack's"
    assert (rel / "notes.txt").read_text() == "mine"


def test_symlinked_releases_is_refused(inv, dev, arts):
    root, dest = dev.home / "linked", "~/linked"
    deploy(inv, arts[1], dest)
    deploy(inv, arts[2], dest)
    bigdisk = dev.home / "bigdisk"
    bigdisk.mkdir()
    (root / "releases").rename(bigdisk / "releases")
    (root / "releases").symlink_to(bigdisk / "releases")
    (bigdisk / "releases" / "other-project").mkdir()
    before = sorted(p.name for p in (bigdisk / "releases").iterdir())
    rc, r, err = deploy(inv, arts[3], dest, expect="failed")
    assert "releases is a symlink" in r["message"] and "nothing was changed" in r["message"], r
    assert "real folder" in r["hint"]
    rc, data, _ = edgepack_json("rollback", "-I", inv, "-d", "h1", "--dest", dest)
    assert rc == 9 and "is a symlink" in by_device(data)["h1"]["message"]
    assert sorted(p.name for p in (bigdisk / "releases").iterdir()) == before
    assert links(root) == (f"releases/{short(arts[2])}", f"releases/{short(arts[1])}")


@pytest.mark.parametrize("model", ["tiny\\cnn", "tiny\ncnn", "-tiny cnn"])
def test_odd_file_names(inv, dev, tmp_path, model):
    dest = f"~/odd{abs(hash(model)) % 1000}"
    art = make_standin(tmp_path / "v1", model=model)
    deploy(inv, art, dest)
    assert smoke_sha(inv, dest) == inspect_artifact(art).sha256
    deploy(inv, art, dest, expect="no change")  # the installed hash was read back correctly


def test_rollback_checks_the_previous_release_first(inv, dev, arts):
    root, dest = dev.home / "rb", "~/rb"
    deploy(inv, arts[1], dest)
    deploy(inv, arts[2], dest)
    before = links(root)
    # previous fails its own selftest on the device: nothing changes
    (dev.home / ".standin-fail-1").write_text("")
    rc, data, _ = edgepack_json("rollback", "-I", inv, "-d", "h1", "--dest", dest)
    r = by_device(data)["h1"]
    assert rc == 9 and r["status"] == "failed" and "fails its selftest" in r["message"], r
    assert "nothing was changed" in r["message"] and links(root) == before
    (dev.home / ".standin-fail-1").unlink()
    # previous damaged (its artifact no longer has the recorded hash)
    exe = root / "releases" / short(arts[1]) / arts[1].name
    good = exe.read_bytes()
    exe.write_bytes(good + b"# tampered\n")
    rc, data, _ = edgepack_json("rollback", "-I", inv, "-d", "h1", "--dest", dest)
    r = by_device(data)["h1"]
    assert rc == 9 and "damaged" in r["message"] and links(root) == before, r
    exe.write_bytes(good)
    # previous dangling: its release folder is gone
    import shutil
    shutil.rmtree(root / "releases" / short(arts[1]))
    rc, data, _ = edgepack_json("rollback", "-I", inv, "-d", "h1", "--dest", dest)
    r = by_device(data)["h1"]
    assert rc == 9 and "not an edgepack release" in r["message"] and "stays current" in r["message"], r
    assert links(root) == before
    assert smoke_sha(inv, dest) == inspect_artifact(arts[2]).sha256
    # a healthy previous: rolled back after its selftest passed
    deploy(inv, arts[3], dest)
    rc, data, err = edgepack_json("rollback", "-I", inv, "-d", "h1", "--dest", dest)
    assert rc == 0 and by_device(data)["h1"]["status"] == "rolled back", err
    assert links(root) == (f"releases/{short(arts[2])}", f"releases/{short(arts[3])}")
