"""What the user cache holds (`edgepack cache list`) and removing what is superseded or unused
(`edgepack cache prune`).

Keyed builds (libncnn, the TVM runtime) are ``current`` when a target of the matrix would use their
key now (computed by the builders' own key functions), ``superseded`` otherwise, ``incomplete``
without their done marker. Conversions, leftovers, OCI pulls and zig's caches are ``unkeyed``: judged
by when they were last used (a ``last-used`` stamp a cache hit touches, else the newest mtime inside).
Tuning databases are user work and the corpus is a download: prune leaves both alone unless named.
Every removal takes the builder's lock without waiting (a held lock: a build is running, skipped)
and never follows a symlink out of the cache.
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import re
import shutil
import stat
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .cache import cache_root, key_of, lock_file
from .errors import EdgepackError, UsageError

STAMP = "last-used"
STATES = ("current", "superseded", "incomplete", "unkeyed")
PROTECTED = ("tuning", "corpus")      # pruned only when named with --include
BUILD_KINDS = ("ncnn", "tvm-runtime", "source", "tools")  # what the post-build hint counts
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


@dataclass(frozen=True)
class Entry:
    kind: str            # ncnn, tvm-runtime, source, tools, ncnn-model, ncnn-leftover, oci, zig-cache,
                         # tuning, corpus, other
    path: Path
    bytes: int
    last_used: float     # epoch seconds
    state: str           # one of STATES
    lock: Path | None    # the builder's lock file, if it has one


@dataclass(frozen=True)
class Removal:
    entry: Entry
    removed: bool        # False: dry run, or skipped (see why)
    why: str = ""        # why it was skipped


@dataclass(frozen=True)
class CurrentKeys:
    """Entry names the known targets would use now, per kind; None: unknown (judge by age)."""
    ncnn: frozenset[str] | None
    tvm_runtime: frozenset[str] | None
    tuning: frozenset[str] | None
    sources: frozenset[str]
    tools: frozenset[str] | None


def parse_age(text: str) -> float:
    """'30d', '12h', '90m', '45s', '2w' or '0' -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text or "")
    if not m or (not m.group(2) and float(m.group(1)) != 0):
        raise UsageError(f"--older-than {text!r}: expected a number and a unit (s, m, h, d, w), e.g. 30d or 12h")
    return float(m.group(1)) * _UNITS.get(m.group(2) or "s", 1)


def current_keys(extra_dirs: list[Path] | None = None) -> CurrentKeys:
    """The cache entry names the target matrix would use now (no zig, no TVM import)."""
    from .backends.ncnn.library import library_key
    from .backends.tvm import runtime_lib
    from .backends.tvm.tuning import db_key
    from .sources import NCNN_SDIST
    from .targets import TargetMatrix
    from .toolchains import Toolchain
    targets = list(TargetMatrix.load(extra_dirs).targets.values())
    toolchains: dict[str, Toolchain] = {}
    ncnn: set[str] | None = set()
    tuning: set[str] | None = set()
    tvm: set[str] | None = set()
    spec = importlib.util.find_spec("tvm")
    tvm_root = Path(spec.origin).parent if spec and spec.origin else None
    for t in targets:
        try:
            tc = toolchains.get(t.toolchain) or toolchains.setdefault(t.toolchain, Toolchain.load(t.toolchain))
        except EdgepackError:
            ncnn = tvm = None   # a target we cannot key: its builds are judged by age, never as superseded
            continue
        if ncnn is not None:
            ncnn.add(f"{t.triple.zig}-{library_key(t, tc)[0]}")
        if tvm is not None and tvm_root is not None:
            try:
                tvm.add(f"{t.triple.zig}-{runtime_lib.runtime_key(t, tc, tvm_root)}")
            except (OSError, EdgepackError):
                tvm = None
        if tuning is not None:
            try:
                tuning.add(f"{t.name}-{db_key(t)}")
            except EdgepackError:
                tuning = None
    return CurrentKeys(_frozen(ncnn), _frozen(tvm) if tvm_root else None, _frozen(tuning),
                       frozenset({NCNN_SDIST.filename, runtime_lib.TVM_FFI_SDIST.filename}), _frozen_tools())


def _frozen(names: set[str] | None) -> frozenset[str] | None:
    return None if names is None else frozenset(names)


def _frozen_tools() -> frozenset[str] | None:
    base = getattr(sys, "_MEIPASS", None)
    if not getattr(sys, "frozen", False) or base is None:
        return None   # tools/ is a frozen edgepack's: from here, judged by age
    try:
        return frozenset({json.loads((Path(base) / "edgepack_tools" / "tools.json").read_text())["sha256"][:16]})
    except (OSError, ValueError, KeyError):
        return None


def _walk(path: Path) -> tuple[int, float]:
    """(apparent bytes, newest mtime) of a file or tree; symlinks count as themselves, never followed."""
    st = path.lstat()
    if not path.is_dir() or path.is_symlink():
        return st.st_size, st.st_mtime
    total, newest, seen = 0, st.st_mtime, set()
    for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
        for name in dirnames + filenames:
            try:
                s = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            newest = max(newest, s.st_mtime)
            if not stat.S_ISDIR(s.st_mode) and (s.st_dev, s.st_ino) not in seen:
                seen.add((s.st_dev, s.st_ino))
                total += s.st_size
    return total, newest


def _entry(kind: str, path: Path, state: str, lock: Path | None) -> Entry:
    size, newest = _walk(path)
    stamp = path / STAMP
    used = stamp.lstat().st_mtime if not path.is_symlink() and stamp.is_file() else newest
    return Entry(kind, path, size, used, state, lock)


def _keyed(names: frozenset[str] | None, name: str, done: bool) -> str:
    if not done:
        return "incomplete"
    if names is None:
        return "unkeyed"
    return "current" if name in names else "superseded"


def _children(folder: Path):
    """Entries of a kind folder; nothing when it is missing or a symlink (not walked out of the cache)."""
    if not folder.is_dir() or folder.is_symlink():
        return []
    return sorted(folder.iterdir())


def list_entries(extra_dirs: list[Path] | None = None, *, kinds: tuple[str, ...] | None = None,
                 keys: CurrentKeys | None = None) -> list[Entry]:
    """Every entry of the cache (or only ``kinds``), with its state."""
    root = cache_root()
    keys = keys or current_keys(extra_dirs)
    want = (lambda k: True) if kinds is None else (lambda k: k in kinds)
    out: list[Entry] = []
    if want("ncnn"):
        for p in _children(root / "ncnn"):
            key = p.name.rsplit("-", 1)[-1]
            out.append(_entry("ncnn", p, _keyed(keys.ncnn, p.name, (p / "done.json").is_file()),
                              lock_file("ncnn", key)))
    if want("tvm-runtime"):
        for p in _children(root / "tvm-runtime"):
            key = p.name.rsplit("-", 1)[-1]
            out.append(_entry("tvm-runtime", p, _keyed(keys.tvm_runtime, p.name, (p / "done.json").is_file()),
                              lock_file("tvm-runtime", key)))
    if want("source"):
        for p in _children(root / "src"):
            if p.suffix == ".part":  # a download cut short (sources.fetch writes <name>.with_suffix(".part"))
                name = next((n for n in keys.sources if Path(n).with_suffix(".part").name == p.name), None)
                out.append(_entry("source", p, "incomplete", lock_file("source", name) if name else None))
            else:
                out.append(_entry("source", p, "current" if p.name in keys.sources else "superseded",
                                  lock_file("source", p.name)))
    if want("tools"):
        for p in _children(root / "tools"):
            name = p.name.split(".", 1)[0]
            done = p.suffix != ".part" and (p / ".complete").is_file()
            out.append(_entry("tools", p, _keyed(keys.tools, name, done), lock_file("tools", name)))
    if want("ncnn-model"):
        for p in _children(root / "ncnn-models"):
            out.append(_entry("ncnn-model", p, "unkeyed" if (p / "convert.json").is_file() else "incomplete",
                              lock_file("ncnn-model", p.name)))
    if want("ncnn-leftover"):
        out += [_entry("ncnn-leftover", p, "unkeyed", None) for p in _children(root / "ncnn-leftovers")]
    if want("oci"):
        for p in _children(root / "oci"):
            if p.suffix == ".lock":
                continue
            out.append(_entry("oci", p, "unkeyed" if (p / ".edgepack-pulled").is_file() else "incomplete",
                              p.with_suffix(".lock")))
    if want("zig-cache"):
        out += [_entry("zig-cache", root / n, "unkeyed", None) for n in ("zig-global", "zig-local")
                if (root / n).exists() or (root / n).is_symlink()]
    if want("tuning"):
        for p in _children(root / "tvm-tuning"):
            state = "unkeyed" if keys.tuning is None else "current" if p.name in keys.tuning else "superseded"
            out.append(_entry("tuning", p, state, lock_file("tuning", key_of(str(p.resolve())))))
    if want("corpus") and ((root / "corpus").exists() or (root / "corpus").is_symlink()):
        out.append(_entry("corpus", root / "corpus", "unkeyed", None))
    if want("other"):
        known = {"ncnn", "tvm-runtime", "src", "tools", "ncnn-models", "ncnn-leftovers", "oci", "zig-global",
                 "zig-local", "tvm-tuning", "corpus", "locks"}
        out += [_entry("other", p, "unkeyed", None) for p in sorted(root.iterdir()) if p.name not in known]
    return out


def to_prune(entries: list[Entry], older_than_s: float, *, everything: bool = False,
             include: tuple[str, ...] = (), now: float | None = None) -> list[Entry]:
    """What prune removes: superseded and incomplete builds, unkeyed entries unused for ``older_than_s``
    (``everything``: every entry); tuning databases and the corpus only when in ``include``; never
    anything edgepack does not know."""
    now = time.time() if now is None else now

    def chosen(e: Entry) -> bool:
        if e.kind == "other" or (e.kind in PROTECTED and e.kind not in include):
            return False
        if everything or e.state in ("superseded", "incomplete"):
            return True
        return e.state == "unkeyed" and now - e.last_used > older_than_s
    return [e for e in entries if chosen(e)]


def _lock_nowait(path: Path):
    """The open, locked lock file, or None when another process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    f = open(path, "a")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        return None
    return f


def _any_lock_held(locks: Path) -> bool:
    for p in sorted(locks.glob("*.lock")) if locks.is_dir() else []:
        f = _lock_nowait(p)
        if f is None:
            return True
        f.close()
    return False


def _inside(path: Path, root: Path) -> bool:
    parent = Path(os.path.realpath(path.parent))
    return parent == root or root in parent.parents


def _delete(path: Path) -> None:
    """Remove a file, a symlink (the link, never its target) or a tree (rmtree does not follow links)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


def prune(entries: list[Entry], *, dry_run: bool = False) -> list[Removal]:
    """Remove ``entries`` (from :func:`to_prune`), each under its builder's lock taken without waiting."""
    root = Path(os.path.realpath(cache_root()))
    out: list[Removal] = []
    for e in entries:
        if not _inside(e.path, root) or (e.path.is_symlink() and not _inside(e.path.resolve() / "x", root)):
            out.append(Removal(e, False, "a symlink out of the cache: left alone"))
            continue
        if dry_run:
            out.append(Removal(e, False))
            continue
        held = _lock_nowait(e.lock) if e.lock else None
        if e.lock and held is None:
            out.append(Removal(e, False, "its lock is held (a build is running): skipped"))
            continue
        try:
            if e.kind == "zig-cache" and _any_lock_held(root / "locks"):
                out.append(Removal(e, False, "a build is running (zig's cache is in use): skipped"))
                continue
            _delete(e.path)
            out.append(Removal(e, True))
        except OSError as exc:
            out.append(Removal(e, False, f"cannot remove: {exc.strerror or exc}"))
        finally:
            if held is not None:
                held.close()
    return out


def reclaimable_build_bytes(extra_dirs: list[Path] | None = None) -> int:
    """Bytes of superseded or incomplete builds (libncnn, TVM runtime, sources, tools) whose lock is free:
    the post-build hint's number (no zig run, no TVM import)."""
    total = 0
    for e in list_entries(extra_dirs, kinds=BUILD_KINDS):
        if e.state not in ("superseded", "incomplete"):
            continue
        held = _lock_nowait(e.lock) if e.lock else True
        if held is None:
            continue
        if held is not True:
            held.close()
        total += e.bytes
    return total
