"""One deploy or rollback at a time per install folder: a lock directory on the device.

    DEST/.edgepack-lock/owner    host, pid, token, what and for which device; its time is the folder's
                                 mtime (the device's clock, set by mkdir: no extra process to read a clock)

mkdir(2) is atomic on every filesystem a device has, so whoever creates the folder holds the lock; two
edgepack runs (or two inventory names for one host in one run) then work one after the other instead of
deleting each other's releases. A lock is stale, and taken over, when it is older than ``stale_after``
seconds by the device's clock, or when its holder ran on this machine (same boot, same PID namespace)
and that process has ended (or, in this process, no longer holds it). A cut connection leaves the lock
behind; these rules make the next deploy proceed without anyone logging in to remove it.
"""
from __future__ import annotations

import os
import secrets
import shlex
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import DeployError
from .connector import Connector

LOCK = ".edgepack-lock"
_held: set[str] = set()          # tokens this process holds now (for the same-process rule)
_held_guard = threading.Lock()


class LockHeld(DeployError):
    pass


def _read(path: str) -> str:
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _me() -> dict[str, str]:
    """Who we are, precisely enough to tell later whether our process still exists."""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    return {"host": socket.gethostname(), "pid": str(os.getpid()),
            "boot": _read("/proc/sys/kernel/random/boot_id"), "pidns": pidns}


@dataclass(frozen=True)
class Holder:
    fields: dict
    now: int | None          # the device's clock when we looked
    mtime: int | None        # the lock folder's mtime: when it was taken

    @property
    def age(self) -> int | None:
        return self.now - self.mtime if self.now is not None and self.mtime is not None else None

    def describe(self) -> str:
        f = self.fields
        who = f"{f.get('op', 'deploy')} of device {f.get('device', '?')} from {f.get('host', '?')} " \
              f"pid {f.get('pid', '?')}"
        return who + (f", {self.age} s ago" if self.age is not None else "")

    def stale(self, stale_after: float) -> bool:
        if self.age is not None and self.age > stale_after:
            return True
        f, me = self.fields, _me()
        if not (me["boot"] and me["pidns"] and f.get("boot") == me["boot"] and f.get("pidns") == me["pidns"]):
            return False  # another machine or PID namespace: only its age can tell
        pid = f.get("pid", "")
        if not pid.isdigit():
            return False
        if int(pid) == os.getpid():
            with _held_guard:
                return f.get("token") not in _held
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
        return False


def _acquire_script(dest: str, owner: dict[str, str], then: str) -> str:
    q = shlex.quote
    lines = " ".join(q(f"{k}={v}") for k, v in owner.items() if "\n" not in v)
    return f"""D={q(dest)}; L="$D/{LOCK}"
[ -d "$D" ] || mkdir -p -- "$D" || exit 3
if mkdir -- "$L" 2>/dev/null; then
  printf '%s\\n' {lines} > "$L/owner"
  echo "@locked"
{then}
else
  echo "@held"
  echo "@now $(date +%s)"
  echo "@mtime $(stat -c %Y -- "$L" 2>/dev/null)"
  [ -f "$L/owner" ] && while IFS= read -r l; do echo "@owner $l"; done < "$L/owner"
fi
true
"""


def _parse_held(text: str) -> Holder:
    fields, now, mtime = {}, None, None
    for line in text.splitlines():
        if line.startswith("@owner "):
            k, _, v = line[7:].partition("=")
            fields[k.strip()] = v.strip()
        elif line.startswith("@now ") and line[5:].strip().isdigit():
            now = int(line[5:].strip())
        elif line.startswith("@mtime ") and line[7:].strip().isdigit():
            mtime = int(line[7:].strip())
    return Holder(fields, now, mtime)


def _take_over(conn: Connector, dest: str, holder: Holder, timeout: float) -> None:
    """Remove a stale lock, but only the one we judged (same token, or still no owner file)."""
    q = shlex.quote
    token = holder.fields.get("token", "")
    conn.run(f"""L={q(dest + '/' + LOCK)}; t=""
[ -f "$L/owner" ] && while IFS='=' read -r k v; do [ "$k" = token ] && t="$v"; done < "$L/owner"
if [ "$t" = {q(token)} ]; then g="$L.stale-{secrets.token_hex(4)}"; mv -- "$L" "$g" && rm -rf -- "$g"; fi
true""", timeout)


def acquire(conn: Connector, dest: str, *, device: str, op: str, wait: float, stale_after: float,
            then: str = "", timeout: float = 60) -> tuple[str, str]:
    """Take DEST's lock, waiting up to ``wait`` seconds for a live holder. Returns (token, what the
    ``then`` script printed, run right after taking the lock in the same round trip)."""
    token = secrets.token_hex(8)
    owner = {**_me(), "token": token, "device": device.replace("\n", " "), "op": op}
    deadline = time.monotonic() + wait
    with _held_guard:  # before the mkdir: another thread of ours must never judge it stale
        _held.add(token)
    try:
        return token, _acquire(conn, dest, owner, then, wait, deadline, stale_after, timeout)
    except BaseException:
        with _held_guard:
            _held.discard(token)
        raise


def _acquire(conn: Connector, dest: str, owner: dict, then: str, wait: float, deadline: float,
             stale_after: float, timeout: float) -> str:
    takeovers = 0
    for attempt in range(100000):  # bounded by `deadline` and the take-over count
        res = conn.run(_acquire_script(dest, owner, then), timeout)
        if "@locked" in res.stdout:
            return res.stdout
        if "@held" not in res.stdout:
            raise DeployError(f"cannot create the lock {dest}/{LOCK} on the device: {res.output[-300:]}",
                              hint="pick a writable --dest (or `dest` in the inventory)")
        holder = _parse_held(res.stdout)
        if holder.stale(stale_after):
            takeovers += 1
            if takeovers > 3:
                raise LockHeld(f"{dest}/{LOCK} is stale ({holder.describe()}) but could not be removed",
                               hint=f"remove {dest}/{LOCK} on the device (check the folder's permissions)")
            _take_over(conn, dest, holder, timeout)
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            raise LockHeld(
                f"{dest} is locked by another edgepack run ({holder.describe()}); waited {wait:g} s, "
                "nothing was changed",
                hint=f"let that run finish and retry (or raise --lock-wait); a lock older than "
                     f"{stale_after / 60:g} min, or whose process on this machine has ended, is taken over "
                     f"by itself; if no edgepack run is using the device, remove {dest}/{LOCK} on it")
        time.sleep(min(0.5 + 0.1 * attempt, 2.0, left))
    raise LockHeld(f"{dest}: could not take the lock")  # unreachable in practice


def release(conn: Connector, dest: str, token: str) -> None:
    """Remove the lock if it is still ours, with SFTP requests only (no remote process: on a slow board
    every process costs). Never raises: a lost connection leaves the lock to the stale rule."""
    with _held_guard:
        _held.discard(token)
    lock_dir = f"{dest}/{LOCK}"
    try:
        owner = conn.read_bytes(f"{lock_dir}/owner").decode(errors="replace")
        if f"token={token}" not in owner.splitlines():
            return  # taken over meanwhile (we were judged stale): that lock is someone else's now
        conn.remove(f"{lock_dir}/owner")
        conn.rmdir(lock_dir)
    except Exception:  # noqa: BLE001 - the deploy's own result matters more than the cleanup
        pass


@contextmanager
def held(conn: Connector, dest: str, *, device: str, op: str, wait: float, stale_after: float,
         then: str = ""):
    token, out = acquire(conn, dest, device=device, op=op, wait=wait, stale_after=stale_after, then=then)
    try:
        yield out
    finally:
        release(conn, dest, token)
