"""Running an artifact on the build machine: natively, or under qemu-user for other arches."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from .elf import read_elf
from .errors import ToolMissingError
from .triple import ARCHES

_MACHINE_QEMU = {"aarch64": "qemu-aarch64", "arm": "qemu-arm", "x86_64": "qemu-x86_64"}
NATIVE = "native"


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
    return _qemu(qemu, machine, qemu_cpu) + [str(artifact)]


def command_for_cpu(artifact: Path, cpu: str) -> list[str]:
    """argv prefix that executes ``artifact`` on one verification CPU: ``native`` runs it here
    directly; any other name is a qemu-user CPU model, also for this machine's own arch (so an
    x86_64 artifact can be checked on a CPU without this host's AVX-512)."""
    machine = read_elf(artifact).machine
    if cpu == NATIVE:
        if machine != host_arch():
            raise ToolMissingError(f"cannot run {machine} executables natively on this {host_arch()} machine",
                                   hint="name a qemu CPU model in the target's verify_cpus")
        return [str(artifact)]
    qemu = _MACHINE_QEMU.get(machine)
    if qemu is None:
        raise ToolMissingError(f"no qemu-user program for {machine} executables")
    return _qemu(qemu, machine, cpu) + [str(artifact)]


def _qemu(qemu: str, machine: str, cpu: str | None) -> list[str]:
    exe = shutil.which(qemu)
    if exe is None:
        raise ToolMissingError(f"{qemu} is not installed (needed to run {machine} artifacts here)",
                               hint="apt-get install qemu-user")
    return [exe] + (["-cpu", cpu] if cpu else [])


def run_artifact(artifact: Path, args: list[str], *, qemu_cpu: str | None = None, cpu: str | None = None,
                 timeout: float = 600, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run ``artifact`` with ``args``: on verification CPU ``cpu`` when given, else natively or
    under qemu ``-cpu qemu_cpu`` for a foreign arch."""
    cmd = command_for_cpu(artifact, cpu) if cpu else command_for(artifact, qemu_cpu)
    return subprocess.run(cmd + args, capture_output=True, text=True, timeout=timeout, cwd=cwd, errors="replace")
