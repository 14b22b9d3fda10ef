"""Cached inputs of the arm64 devices: a Debian 11 (bullseye, glibc 2.31) arm64 root filesystem and a
static qemu-aarch64 that binfmt_misc can run inside that chroot.

Both are slow to fetch (debootstrap ~30 s, 200 MB), so they live in a cache folder shared by test runs
(``EDGEPACK_LAB_CACHE``, default /var/cache/edgepack-lab) and are built under a lock, into a temporary
name, then renamed: a half-built rootfs is never used. ``.ci/deps-deploy.sh`` calls ``python -m
tests.lab.rootfs`` to build them before the tests; the test fixtures call the same functions lazily.

The mirror is read from this machine's apt configuration, never written into the repository.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

SUITE = "bullseye"
DEFAULT_CACHE = Path("/var/cache/edgepack-lab")


def cache_dir() -> Path:
    d = Path(os.environ.get("EDGEPACK_LAB_CACHE", DEFAULT_CACHE))
    d.mkdir(parents=True, exist_ok=True)
    # sshd's ChrootDirectory demands root-owned, non-writable-by-others components all the way up.
    os.chmod(d, 0o755)
    return d


@contextmanager
def _lock(name: str, timeout: float = 900):
    path = cache_dir() / f".{name}.lock"
    with open(path, "w") as fh:
        deadline = time.monotonic() + timeout
        while True:  # bounded: gives up after `timeout` seconds
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited {timeout:.0f} s for {path}")
                time.sleep(1)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _deb822_entries(text: str):
    entry: dict[str, str] = {}
    for line in text.splitlines() + [""]:
        if not line.strip():
            if entry:
                yield entry
            entry = {}
            continue
        if line.startswith("#") or line[0].isspace() or ":" not in line:
            continue
        key, _, value = line.partition(":")
        entry[key.strip().lower()] = value.strip()


def apt_mirror() -> str:
    """The Debian archive URI this machine's apt uses (not the security archive)."""
    candidates: list[tuple[str, list[str]]] = []
    src = Path("/etc/apt/sources.list.d")
    for f in sorted(src.glob("*.sources")) if src.is_dir() else []:
        for e in _deb822_entries(f.read_text(errors="replace")):
            if "deb" in e.get("types", "").split() and e.get("enabled", "yes").lower() != "no":
                for uri in e.get("uris", "").split():
                    candidates.append((uri, e.get("suites", "").split()))
    lists = [Path("/etc/apt/sources.list")] + (sorted(src.glob("*.list")) if src.is_dir() else [])
    for f in lists:
        if not f.is_file():
            continue
        for line in f.read_text(errors="replace").splitlines():
            parts = line.split("#", 1)[0].split()
            if len(parts) >= 3 and parts[0] == "deb":
                rest = [p for p in parts[1:] if not p.startswith("[")]
                if len(rest) >= 2:
                    candidates.append((rest[0], [rest[1]]))
    for uri, suites in candidates:
        main = [s for s in suites if "-" not in s]  # bookworm, not bookworm-security / -updates
        if main and "security" not in uri and uri.rstrip("/").endswith("/debian"):
            return uri
    raise RuntimeError("no Debian archive found in /etc/apt/sources.list(.d); debootstrap needs a mirror")


def arm64_rootfs() -> Path:
    """Path of the cached bullseye arm64 root filesystem (first debootstrap stage), built if missing."""
    dest = cache_dir() / f"{SUITE}-arm64"
    if (dest / ".complete").exists():
        return dest
    with _lock("rootfs"):
        if (dest / ".complete").exists():
            return dest
        debootstrap = shutil.which("debootstrap")
        if debootstrap is None:
            raise RuntimeError("debootstrap is not installed (apt-get install debootstrap)")
        tmp = cache_dir() / f".{SUITE}-arm64.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o755)
        cmd = [debootstrap, "--foreign", "--arch=arm64", "--variant=minbase", SUITE, str(tmp), apt_mirror()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        if proc.returncode != 0:
            raise RuntimeError(f"debootstrap failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        _finish_rootfs(tmp)
        (tmp / ".complete").write_text("ok\n")
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
    return dest


def _finish_rootfs(root: Path) -> None:
    # The first stage unpacks but does not configure packages: /bin/sh and a few config files that
    # maintainer scripts would write are missing. Create the few the device's shell needs.
    sh = root / "bin" / "sh"
    if not sh.exists() and not sh.is_symlink():
        sh.symlink_to("dash" if (root / "bin" / "dash").exists() else "bash")
    for d in ("tmp", "var/tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(root / d, 0o1777)
    (root / "opt").mkdir(exist_ok=True)


def qemu_aarch64_static() -> Path:
    """A statically linked qemu-aarch64 (binfmt with flag F must open it outside the chroot and it must
    need no libraries inside). Extracted from the qemu-user-static .deb, never installed: that package
    conflicts with qemu-user-binfmt."""
    dest = cache_dir() / "qemu-aarch64-static"
    if dest.exists():
        return dest
    system = Path("/usr/bin/qemu-aarch64-static")
    with _lock("qemu"):
        if dest.exists():
            return dest
        if system.exists():
            shutil.copy2(system, dest)
            return dest
        with tempfile.TemporaryDirectory() as tmp:
            proc = subprocess.run(["apt-get", "download", "qemu-user-static"], cwd=tmp,
                                  capture_output=True, text=True, timeout=600)
            debs = list(Path(tmp).glob("qemu-user-static_*.deb"))
            if proc.returncode != 0 or not debs:
                raise RuntimeError(f"apt-get download qemu-user-static failed:\n{proc.stderr[-2000:]}")
            subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(Path(tmp) / "x")], check=True, timeout=300)
            shutil.copy2(Path(tmp) / "x/usr/bin/qemu-aarch64-static", dest.with_suffix(".partial"))
            dest.with_suffix(".partial").rename(dest)
    return dest


def main() -> int:
    t0 = time.monotonic()
    print(f"qemu-aarch64-static: {qemu_aarch64_static()}")
    print(f"{SUITE} arm64 rootfs: {arm64_rootfs()} ({time.monotonic() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
