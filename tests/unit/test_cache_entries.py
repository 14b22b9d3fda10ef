"""`edgepack cache list/prune` on a fake cache: real folders named with the real current keys (computed
by edgepack/cache_entries.py with the builders' key functions) next to made-up superseded ones."""
from __future__ import annotations

import fcntl
import json
import os
import time

import pytest
from click.testing import CliRunner

from edgepack import errors
from edgepack.cache_entries import current_keys, list_entries, parse_age, prune, to_prune
from edgepack.cli import cli, main

OLD = time.time() - 60 * 86400   # two months ago
OLD_KEY = "0" * 20


def _put(path, size=1000, mtime=None, files=("data",)):
    """A folder holding ``files`` of ``size`` bytes each (mtime: set on everything)."""
    path.mkdir(parents=True, exist_ok=True)
    for f in files:
        (path / f).write_bytes(b"x" * size)
    if mtime is not None:
        for p in [*path.rglob("*"), path]:
            os.utime(p, (mtime, mtime), follow_symlinks=False)
    return path


@pytest.fixture
def fake(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("EDGEPACK_CACHE", str(root))
    keys = current_keys()
    cur_ncnn = sorted(keys.ncnn)[0]
    outside = _put(tmp_path / "outside", 500, files=("precious",))
    p = {
        "ncnn_cur": _put(root / "ncnn" / cur_ncnn, 1000, OLD, ("lib", "done.json")),
        "ncnn_old": _put(root / "ncnn" / f"x86_64-linux-musl-{OLD_KEY}", 2000, None, ("lib", "done.json")),
        "ncnn_part": _put(root / "ncnn" / f"aarch64-linux-musl-{'1' * 20}", 300, None, ("lib",)),
        "src_cur": root / "src" / "ncnn-1.0.20261020.tar.gz",
        "src_old": root / "src" / "ncnn-1.0.20240101.tar.gz",
        "model_old": _put(root / "ncnn-models" / ("a" * 20), 400, OLD, ("model.ncnn.bin", "convert.json")),
        "model_used": _put(root / "ncnn-models" / ("b" * 20), 400, OLD, ("model.ncnn.bin", "convert.json")),
        "model_new": _put(root / "ncnn-models" / ("c" * 20), 400, None, ("model.ncnn.bin", "convert.json")),
        "leftover": root / "ncnn-leftovers" / "d.json",
        "oci": _put(root / "oci" / ("e" * 64), 100, OLD, ("model", ".edgepack-pulled")),
        "zig_old": _put(root / "zig-global", 100, OLD, ("h",)),
        "zig_new": _put(root / "zig-local", 100, None, ("h",)),
        "tune_cur": _put(root / "tvm-tuning" / sorted(keys.tuning)[0], 50, OLD, ("database_workload.json",)),
        "tune_old": _put(root / "tvm-tuning" / f"x86_64-{OLD_KEY}", 50, OLD, ("database_workload.json",)),
        "corpus": _put(root / "corpus", 700, OLD, ("model.onnx",)),
        "mine": _put(root / "my-notes", 10, OLD),
        "link": root / "ncnn-models" / ("f" * 20),
        "outside": outside,
    }
    for k, size in (("src_cur", 5), ("src_old", 7)):
        p[k].parent.mkdir(parents=True, exist_ok=True)
        p[k].write_bytes(b"s" * size)
    p["leftover"].parent.mkdir(parents=True)
    p["leftover"].write_text("{}")
    os.utime(p["leftover"], (OLD, OLD))
    (p["model_used"] / "last-used").touch()            # a cache hit stamped it today
    (p["ncnn_old"] / "src").mkdir()
    (p["ncnn_old"] / "src" / "out").symlink_to(outside)  # inside a removed entry: the link goes, not its target
    p["link"].symlink_to(outside)                      # an entry that is a link out of the cache
    os.utime(p["link"], (OLD, OLD), follow_symlinks=False)
    if keys.tvm_runtime:
        p["tvm_cur"] = _put(root / "tvm-runtime" / sorted(keys.tvm_runtime)[0], 100, None, ("done.json",))
    p["tvm_old"] = _put(root / "tvm-runtime" / f"x86_64-linux-musl-{OLD_KEY}", 100, None, ("done.json",))
    p["root"] = root
    p["keys"] = keys
    return p


def _states(entries):
    return {str(e.path.relative_to(e.path.parent.parent) if e.path.parent.name != "cache" else e.path.name):
            (e.kind, e.state) for e in entries}


def test_list_states_and_sizes(fake):
    entries = list_entries()
    by = {e.path: e for e in entries}
    s = _states(entries)
    assert s[f"ncnn/{fake['ncnn_cur'].name}"] == ("ncnn", "current")
    assert s[f"ncnn/x86_64-linux-musl-{OLD_KEY}"] == ("ncnn", "superseded")
    assert s[f"ncnn/{fake['ncnn_part'].name}"] == ("ncnn", "incomplete")
    assert s["src/ncnn-1.0.20261020.tar.gz"] == ("source", "current")
    assert s["src/ncnn-1.0.20240101.tar.gz"] == ("source", "superseded")
    assert s[f"ncnn-models/{'a' * 20}"] == ("ncnn-model", "unkeyed") and s[f"oci/{'e' * 64}"] == ("oci", "unkeyed")
    assert s["zig-global"] == ("zig-cache", "unkeyed") and s["corpus"] == ("corpus", "unkeyed")
    assert s[f"tvm-tuning/{fake['tune_cur'].name}"] == ("tuning", "current")
    assert s[f"tvm-tuning/x86_64-{OLD_KEY}"] == ("tuning", "superseded")
    assert s["my-notes"] == ("other", "unkeyed")
    assert s[f"tvm-runtime/x86_64-linux-musl-{OLD_KEY}"] == (
        "tvm-runtime", "superseded" if fake["keys"].tvm_runtime else "unkeyed")
    assert "locks" not in s
    assert by[fake["ncnn_cur"]].bytes == 2000 and by[fake["ncnn_old"]].bytes > 4000
    assert by[fake["link"]].bytes < 500                # the link itself, not what it points at
    assert by[fake["model_used"]].last_used > time.time() - 60 > by[fake["model_old"]].last_used
    assert by[fake["ncnn_old"]].lock == fake["root"] / "locks" / f"ncnn-{OLD_KEY}.lock"


def test_prune_removes_superseded_incomplete_and_old(fake):
    chosen = to_prune(list_entries(), parse_age("30d"))
    removed = {r.entry.path for r in prune(chosen) if r.removed}
    gone = {fake[k] for k in ("ncnn_old", "ncnn_part", "src_old", "model_old", "leftover", "oci", "zig_old")}
    if fake["keys"].tvm_runtime:
        gone.add(fake["tvm_old"])
    assert removed == gone
    assert not any(p.exists() for p in gone)
    kept = ("ncnn_cur", "src_cur", "model_used", "model_new", "zig_new", "tune_cur", "tune_old", "corpus", "mine",
            "outside")
    assert all(fake[k].exists() for k in kept)
    assert fake["link"].is_symlink() and (fake["outside"] / "precious").stat().st_size == 500


def test_dry_run_removes_nothing(fake):
    before = sorted(p for p in fake["root"].rglob("*"))
    results = prune(to_prune(list_entries(), 0.0, everything=True), dry_run=True)
    assert results and not any(r.removed for r in results)
    assert sorted(p for p in fake["root"].rglob("*")) == before


def test_held_lock_is_skipped(fake):
    lock = fake["root"] / "locks" / f"ncnn-{OLD_KEY}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)              # a build of that key is running
        results = {r.entry.path: r for r in prune(to_prune(list_entries(), parse_age("30d")))}
    assert not results[fake["ncnn_old"]].removed and "lock" in results[fake["ncnn_old"]].why
    assert fake["ncnn_old"].is_dir() and not fake["ncnn_part"].exists()
    assert not results[fake["zig_old"]].removed and fake["zig_old"].is_dir()  # zig's cache waits for builds too


def test_all_and_include(fake):
    prune(to_prune(list_entries(), parse_age("30d"), everything=True))
    assert not fake["ncnn_cur"].exists() and not fake["zig_new"].exists()
    assert fake["tune_cur"].is_dir() and fake["tune_old"].is_dir() and fake["corpus"].is_dir()
    assert fake["mine"].is_dir() and (fake["outside"] / "precious").is_file()
    prune(to_prune(list_entries(), parse_age("30d"), include=("tuning",)))
    assert fake["tune_cur"].is_dir() and not fake["tune_old"].exists() and fake["corpus"].is_dir()
    prune(to_prune(list_entries(), parse_age("30d"), include=("corpus",)))
    assert not fake["corpus"].exists()


@pytest.mark.parametrize("text,seconds", [("30d", 30 * 86400), ("12h", 43200), ("90m", 5400), ("0", 0),
                                          ("2w", 14 * 86400), ("1.5d", 1.5 * 86400)])
def test_parse_age(text, seconds):
    assert parse_age(text) == seconds


@pytest.mark.parametrize("text", ["3x", "30", "d", "", "-1d"])
def test_parse_age_rejects(text):
    with pytest.raises(errors.UsageError):
        parse_age(text)


def test_cli_list_and_prune(fake):
    res = CliRunner().invoke(cli, ["cache", "list"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "superseded" in res.output and "total:" in res.output.splitlines()[-1]
    res = CliRunner().invoke(cli, ["cache", "list", "--json"], catch_exceptions=False)
    assert {e["state"] for e in json.loads(res.output)["entries"]} >= {"current", "superseded", "incomplete"}
    res = CliRunner().invoke(cli, ["cache", "prune", "--dry-run"], catch_exceptions=False)
    assert res.exit_code == 0 and "would remove ncnn" in res.output and "would free" in res.output
    assert fake["ncnn_old"].is_dir()
    res = CliRunner().invoke(cli, ["cache", "prune"], catch_exceptions=False)
    assert res.exit_code == 0 and "freed" in res.output.splitlines()[-1], res.output
    assert not fake["ncnn_old"].exists() and fake["ncnn_cur"].is_dir() and fake["tune_old"].is_dir()


def test_cli_bad_older_than_is_a_usage_error(fake, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["cache", "prune", "--older-than", "soon"])
    err = capsys.readouterr().err
    assert exc.value.code == errors.UsageError.exit_code
    assert [ln for ln in err.splitlines() if ln.strip()] == [ln for ln in err.splitlines() if "--older-than" in ln]
    assert fake["ncnn_old"].is_dir()


def test_build_hint_counts_only_superseded_builds(fake):
    from edgepack.cache_entries import reclaimable_build_bytes
    expected = sum(e.bytes for e in list_entries() if e.kind in ("ncnn", "tvm-runtime", "source", "tools")
                   and e.state in ("superseded", "incomplete"))
    assert reclaimable_build_bytes() == expected > 4000


def test_build_prints_the_hint_over_200_mb(fake, monkeypatch, capsys):
    from edgepack import cache_entries
    from edgepack.commands import build
    monkeypatch.setattr(cache_entries, "reclaimable_build_bytes", lambda extra=None: 150e6)
    build._cache_hint([])
    assert "cache prune" not in capsys.readouterr().err
    monkeypatch.setattr(cache_entries, "reclaimable_build_bytes", lambda extra=None: 350e6)
    build._cache_hint([])
    err = capsys.readouterr().err
    assert "the cache holds 350 MB of superseded builds: `edgepack cache prune` frees them" in err


def test_cache_hit_stamp(tmp_path):
    from edgepack.cache import touch_used
    touch_used(tmp_path)
    assert (tmp_path / "last-used").is_file()
    touch_used(tmp_path / "missing")  # never raises
