"""Running an artifact on the build machine: natively, or under qemu-user for other arches."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from .elf import read_elf
from .errors import ToolMissingError
from .triple import ARCHES

_MACHINE_QEMU = {"aarch64": "qemu-aarch64", "arm": "qemu-arm"}


def host_arch() -> str:
    import platform
    m = platform.machine()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def command_for(artifact: Path, qemu_cpu: str | None = None) -> list[str]:
    """argv prefix that executes ``artifact`` here (qemu for foreign architectures)."""
    machine = read_elf(artifact).machine
    if machine == host_arch():
        return [str(artifact)]
    qemu = _MACHINE_QEMU.get(machine)
    if qemu is None:
        raise ToolMissingError(f"cannot run {machine} executables on this {host_arch()} machine")
    exe = shutil.which(qemu)
    if exe is None:
        raise ToolMissingError(f"{qemu} is not installed (needed to run {machine} artifacts here)",
                               hint="apt-get install qemu-user")
    cmd = [exe]
    if qemu_cpu:
        cmd += ["-cpu", qemu_cpu]
    return cmd + [str(artifact)]


def run_artifact(artifact: Path, args: list[str], *, qemu_cpu: str | None = None, timeout: float = 600,
                 cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command_for(artifact, qemu_cpu) + args, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, errors="replace")
