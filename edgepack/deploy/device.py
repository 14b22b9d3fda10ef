"""The Device record: everything needed to reach one device, from whichever source named it."""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UsageError

LOCAL = "local"
_SPEC_RE = re.compile(r"^(?:(?P<user>[^@\s:/]+)@)?(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+)(?::(?P<port>\d+))?$")


@dataclass(frozen=True)
class Device:
    name: str                        # what tables and errors call it
    host: str                        # address or DNS name (after ~/.ssh/config HostName)
    port: int = 22
    user: str | None = None          # None: the local user name, as ssh does
    keys: tuple[str, ...] = ()       # private key files; empty: the SSH agent and ~/.ssh/id_* keys
    target: str | None = None        # the edgepack target this device is meant for (informative)
    dest: str | None = None          # install folder; None: the deploy's --dest or ~/edgepack
    tags: tuple[str, ...] = ()
    known_hosts: str | None = None   # per-inventory known_hosts file
    local: bool = False              # this machine, without SSH

    @property
    def address(self) -> str:
        if self.local:
            return LOCAL
        user = f"{self.user}@" if self.user else ""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{user}{host}:{self.port}"


def parse_spec(spec: str) -> tuple[str | None, str, int | None]:
    """``user@host[:port]`` (IPv6 in brackets) -> (user, host, port); raises a UsageError naming the spec."""
    m = _SPEC_RE.match(spec.strip())
    if not m:
        raise UsageError(f"invalid device {spec!r}",
                         hint="use an inventory name, an ~/.ssh/config alias, or user@host[:port]")
    port = int(m["port"]) if m["port"] else None
    if port is not None and not 0 < port < 65536:
        raise UsageError(f"invalid port {port} in device {spec!r}")
    return m["user"], m["host"].strip("[]"), port


def local_device(dest: str | None = None) -> Device:
    return Device(name=LOCAL, host="localhost", port=0, local=True, dest=dest)
