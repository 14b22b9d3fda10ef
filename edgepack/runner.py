"""Running an artifact on the build machine: natively, or under qemu-user for other arches.

:class:`Artifact` is the one way the build's verification, the SDK, `edgepack run` and
verify-build run an artifact here; :func:`run_artifact` is its one-shot form for scripts.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import numpy as np

from .elf import read_elf
from .errors import ArtifactError, InputError, ToolMissingError

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


class Artifact:
    """An artifact and how to execute it here: on verification CPU ``cpu`` (``native`` or a qemu
    model), else natively or under qemu ``-cpu qemu_cpu`` for a foreign architecture."""

    def __init__(self, path: Path, *, cpu: str | None = None, qemu_cpu: str | None = None, timeout: float = 3600):
        self.path = Path(path).resolve()
        self.cpu = cpu
        self.argv = command_for_cpu(self.path, cpu) if cpu else command_for(self.path, qemu_cpu)
        self.timeout = timeout

    def run(self, args: list[str], *, check: bool = True, capture: bool = True,
            timeout: float | None = None) -> subprocess.CompletedProcess:
        """Run a subcommand; with ``check`` a non-zero exit raises InputError (the artifact's exit
        3, bad input) or ArtifactError carrying the artifact's own error line."""
        try:
            proc = subprocess.run(self.argv + args, capture_output=capture, text=True, errors="replace",
                                  timeout=timeout or self.timeout)
        except OSError as exc:
            raise ArtifactError(f"{self.path.name}: cannot run ({exc})") from None
        except subprocess.TimeoutExpired:
            raise ArtifactError(f"{self.path.name} {' '.join(args[:1])}: no answer within "
                                f"{timeout or self.timeout:.0f} s") from None
        if check and proc.returncode != 0:
            raise self.error(proc)
        return proc

    def error(self, proc: subprocess.CompletedProcess) -> ArtifactError | InputError:
        lines = [ln for ln in ((proc.stderr or "").strip() or (proc.stdout or "").strip()).splitlines()
                 if not ln.startswith("qemu-")]  # qemu's TCG feature warnings are not the artifact's words
        msg = lines[-1] if lines else f"exit {proc.returncode}"
        msg = msg[7:] if msg.startswith("error: ") else msg
        cls = InputError if proc.returncode == 3 else ArtifactError
        return cls(f"{self.path.name}: {msg[-300:]} (exit {proc.returncode})")

    def manifest(self) -> dict:
        try:
            return json.loads(self.run(["info", "--json"], timeout=120).stdout)
        except (ValueError, ArtifactError) as exc:
            raise ArtifactError(f"{self.path}: not an edgepack artifact (no manifest from `info --json`)") from exc

    def predict(self, inputs: dict[str, np.ndarray] | None, workdir: Path, *, threads: int = 1,
                files: list[str] = ()) -> dict[str, np.ndarray]:
        """One `run`: arrays (saved as .npy in ``workdir``) or files (``[NAME=]FILE``) in, outputs out."""
        workdir.mkdir(parents=True, exist_ok=True)
        args = ["run", "--threads", str(threads), "--output", str(workdir / "out")]
        for i, (name, arr) in enumerate((inputs or {}).items()):
            np.save(workdir / f"in{i}.npy", arr)
            args += ["--input", f"{name}={workdir / f'in{i}.npy'}"]
        for f in files:
            args += ["--input", f]
        proc = self.run(args)
        try:
            report = json.loads(proc.stdout)
            return {name: np.load(info["file"]) for name, info in report["outputs"].items()}
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
            raise ArtifactError(f"{self.path.name} gave no readable outputs ({type(exc).__name__}: "
                                f"{str(exc)[:120]}): {proc.stdout[-200:]}") from None
