"""The newest GLIBC_x.y symbol version that anything inside a one-file edgepack needs.

Usage: python3 packaging/glibc_needed.py dist/frozen/edgepack  ->  prints e.g. "2.35"
The bootloader itself and every bundled ELF file (libpython, extension modules, their libs) are
scanned for the version names they reference; the pre-compressed tools archive is not scanned
(zig is static, pnnx is a manylinux binary; both run as separate processes).
"""
from __future__ import annotations

import re
import sys

from PyInstaller.archive.readers import CArchiveReader

_VER = re.compile(rb"GLIBC_(2\.\d+(?:\.\d+)?)\x00")


def _key(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def needed(path: str) -> tuple[str, str]:
    """(version, the file that needs it)."""
    best, who = "2.0", "bootloader"
    with open(path, "rb") as f:
        head = f.read(4 << 20)  # the bootloader part
    for v in _VER.findall(head):
        if _key(v.decode()) > _key(best):
            best = v.decode()
    reader = CArchiveReader(path)
    for name in reader.toc:
        if name.startswith("edgepack_tools/"):
            continue
        data = reader.extract(name)
        if not data or not data.startswith(b"\x7fELF"):
            continue
        for v in _VER.findall(data):
            if _key(v.decode()) > _key(best):
                best, who = v.decode(), name
    return best, who


if __name__ == "__main__":
    v, who = needed(sys.argv[1])
    print(v if "-v" not in sys.argv else f"{v} ({who})")
