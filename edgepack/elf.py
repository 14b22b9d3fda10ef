"""Read the few ELF header facts edgepack checks on every file it builds."""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import BuildError

_MACHINES = {62: "x86_64", 183: "aarch64", 40: "arm"}
_TYPES = {1: "REL", 2: "EXEC", 3: "DYN"}
PT_LOAD, PT_INTERP = 1, 3


@dataclass(frozen=True)
class ElfInfo:
    machine: str
    type: str
    bits: int
    has_interp: bool
    load_align: tuple[int, ...]

    @property
    def static_pie(self) -> bool:
        return self.type == "DYN" and not self.has_interp


def read_elf(path: Path) -> ElfInfo:
    data = Path(path).read_bytes()[:65536]
    if data[:4] != b"\x7fELF":
        raise BuildError(f"{path} is not an ELF file")
    bits = 64 if data[4] == 2 else 32
    end = "<" if data[5] == 1 else ">"
    e_type, e_machine = struct.unpack_from(end + "HH", data, 16)
    if bits == 64:
        e_phoff, = struct.unpack_from(end + "Q", data, 32)
        e_phentsize, e_phnum = struct.unpack_from(end + "HH", data, 54)
    else:
        e_phoff, = struct.unpack_from(end + "I", data, 28)
        e_phentsize, e_phnum = struct.unpack_from(end + "HH", data, 42)
    has_interp, aligns = False, []
    for i in range(e_phnum):
        off = e_phoff + i * e_phentsize
        p_type, = struct.unpack_from(end + "I", data, off)
        if bits == 64:
            p_align, = struct.unpack_from(end + "Q", data, off + 48)
        else:
            p_align, = struct.unpack_from(end + "I", data, off + 28)
        if p_type == PT_INTERP:
            has_interp = True
        elif p_type == PT_LOAD:
            aligns.append(p_align)
    return ElfInfo(_MACHINES.get(e_machine, f"machine-{e_machine}"), _TYPES.get(e_type, str(e_type)),
                   bits, has_interp, tuple(aligns))


def check_executable(path: Path, target) -> ElfInfo:
    """Fail loudly when a build produced the wrong architecture or link type for ``target``."""
    info = read_elf(path)
    if info.machine != target.arch:
        raise BuildError(f"{path.name}: built for {info.machine}, but target {target.name} is {target.arch}",
                         hint="the toolchain wrapper lost its -target flag; rebuild with a clean cache")
    if target.link == "static" and (info.has_interp or info.type != "EXEC"):
        raise BuildError(f"{path.name}: expected a static executable, got {info.type}"
                         f"{' with an interpreter' if info.has_interp else ''}")
    if target.link == "static-pie" and not info.static_pie:
        raise BuildError(f"{path.name}: expected a static-pie executable (DYN, no INTERP), got {info.type}")
    if target.link == "dynamic" and not info.has_interp:
        raise BuildError(f"{path.name}: expected a dynamically linked executable")
    small = [a for a in info.load_align if a < target.page_size]
    if small:
        raise BuildError(f"{path.name}: LOAD segments aligned to {min(small)} bytes, "
                         f"target {target.name} needs {target.page_size}")
    return info


def check_archive_arch(path: Path, target) -> None:
    """Check the first ELF member of a static archive (catches a library built for the host)."""
    data = Path(path).read_bytes()
    if not data.startswith(b"!<arch>\n"):
        raise BuildError(f"{path} is not a static archive")
    idx = data.find(b"\x7fELF")
    if idx < 0:
        raise BuildError(f"{path} holds no ELF objects")
    e_machine, = struct.unpack_from("<H", data, idx + 18)
    machine = _MACHINES.get(e_machine, f"machine-{e_machine}")
    if machine != target.arch:
        raise BuildError(f"{path.name}: objects are {machine}, target {target.name} is {target.arch}")
