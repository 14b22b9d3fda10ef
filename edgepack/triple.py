"""One strict parser for target strings such as ``aarch64-linux-gnu.2.31``.

Grammar: ``ARCH-linux-ABI[.MAJOR.MINOR]``; the version suffix is a glibc baseline and is
only allowed with a gnu ABI (as cargo-zigbuild reads ``aarch64-unknown-linux-gnu.2.31``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import TargetError

# arch -> (ELF e_machine, qemu-user program or None when it runs natively on x86_64 hosts)
ARCHES = {
    "x86_64": {"elf_machine": 62, "qemu": None, "bits": 64},
    "aarch64": {"elf_machine": 183, "qemu": "qemu-aarch64", "bits": 64},
    "arm": {"elf_machine": 40, "qemu": "qemu-arm", "bits": 32},
}
ABIS = {"musl", "gnu", "musleabihf", "gnueabihf"}
_VALID_ABI_FOR_ARCH = {
    "x86_64": {"musl", "gnu"},
    "aarch64": {"musl", "gnu"},
    "arm": {"musleabihf", "gnueabihf"},
}
_TRIPLE_RE = re.compile(r"^(?P<arch>[a-z0-9_]+)-(?P<os>[a-z]+)-(?P<abi>[a-z]+)(?:\.(?P<ver>\d+\.\d+))?$")


@dataclass(frozen=True)
class Triple:
    arch: str
    os: str
    abi: str
    glibc: str | None = None  # "2.31" baseline for gnu triples, None otherwise

    @property
    def is_glibc(self) -> bool:
        return self.abi.startswith("gnu")

    @property
    def zig(self) -> str:
        """The target as zig spells it."""
        base = f"{self.arch}-{self.os}-{self.abi}"
        return f"{base}.{self.glibc}" if self.glibc else base

    def __str__(self) -> str:
        return self.zig


def parse_triple(text: str) -> Triple:
    m = _TRIPLE_RE.match(text.strip())
    if not m:
        raise TargetError(f"invalid target string {text!r}",
                          hint="expected ARCH-linux-ABI[.GLIBC], e.g. aarch64-linux-musl or aarch64-linux-gnu.2.31")
    arch, os_, abi, ver = m["arch"], m["os"], m["abi"], m["ver"]
    if arch not in ARCHES:
        raise TargetError(f"unknown architecture {arch!r} in {text!r}",
                          hint=f"supported: {', '.join(sorted(ARCHES))}")
    if os_ != "linux":
        raise TargetError(f"unsupported OS {os_!r} in {text!r}", hint="only linux targets are supported")
    if abi not in ABIS:
        raise TargetError(f"unknown ABI {abi!r} in {text!r}", hint=f"supported: {', '.join(sorted(ABIS))}")
    if abi not in _VALID_ABI_FOR_ARCH[arch]:
        raise TargetError(f"ABI {abi!r} does not fit architecture {arch!r} in {text!r}",
                          hint=f"use one of: {', '.join(sorted(_VALID_ABI_FOR_ARCH[arch]))}")
    if ver is not None:
        if not abi.startswith("gnu"):
            raise TargetError(f"a glibc version suffix needs a gnu ABI: {text!r}",
                              hint=f"write {arch}-linux-gnu.{ver}")
        major, minor = (int(x) for x in ver.split("."))
        if major != 2 or minor < 17:
            raise TargetError(f"glibc baseline {ver} in {text!r} is out of range", hint="use 2.17 or newer")
    return Triple(arch, os_, abi, ver)
