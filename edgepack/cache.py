"""The user cache: heavy builds (libncnn, zig's libc) keyed by content hashes."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from pathlib import Path


def cache_root() -> Path:
    env = os.environ.get("EDGEPACK_CACHE")
    if env:
        root = Path(env)
    else:
        root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "edgepack"
    root.mkdir(parents=True, exist_ok=True)
    return root


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def key_of(obj) -> str:
    """A short stable hash of a JSON-able description of a build's inputs."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:20]


# The lock file of each kind of cache entry, by name: builders take it while they build, and
# `edgepack cache prune` takes the same one (without waiting) before it removes the entry.
_LOCK_PREFIX = {"ncnn": "ncnn-", "tvm-runtime": "tvm-runtime-", "source": "", "tools": "tools-",
                "ncnn-model": "ncnn-model-", "tuning": "tvm-tune-"}


def lock_file(kind: str, name: str) -> Path:
    """The lock of the ``kind`` cache entry called ``name`` (a key, a file name or a digest)."""
    return cache_root() / "locks" / f"{_LOCK_PREFIX[kind]}{name}.lock"


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock so two edgepack processes never build the same cache entry at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def touch_used(entry: Path) -> None:
    """Stamp a cache entry as used now (`edgepack cache prune` judges unused entries by it)."""
    try:
        (entry / "last-used").touch()
    except OSError:  # a read-only cache still builds
        pass
