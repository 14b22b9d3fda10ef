"""Which x86 kernel families an x86_64 build's verification could not run.

ncnn and TVM pick AVX-512 code (and ncnn its VNNI int8 kernels) at run time, on CPUs that have them.
qemu's TCG emulates neither AVX-512 nor VNNI, so that code runs during verification only when the
build machine itself has it and `native` is among the verification CPUs. A build elsewhere ships it
unrun: the manifest says so (`verification.not_run`) and the build prints one line, so nobody reads
"verified" as covering it. `edgepack deploy` runs the selftest (the golden input against the build's
bound) on each device, which is then the first run of that code.
"""
from __future__ import annotations

from pathlib import Path

from .runner import NATIVE
from .targets import Target

# (what a user knows it as, the /proc/cpuinfo flag that makes ncnn or TVM take it)
X86_FAMILIES = (("AVX-512", "avx512f"), ("AVX-512 VNNI", "avx512_vnni"), ("AVX-VNNI", "avx_vnni"))


def host_cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This machine's CPU flags as the kernel lists them (empty where it lists none)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    line = next((s for s in text.splitlines() if s.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def kernels_not_run(target: Target, flags: frozenset[str] | None = None) -> tuple[str, ...]:
    """The x86 kernel families no verification CPU of ``target`` ran (none for other arches).
    ``flags``: the build machine's (read from /proc/cpuinfo when None)."""
    if target.arch != "x86_64":
        return ()
    if NATIVE not in target.verify_cpus:
        flags = frozenset()  # every qemu model lacks them
    elif flags is None:
        flags = host_cpu_flags()
    return tuple(name for name, flag in X86_FAMILIES if flag not in flags)


def not_run_line(target: Target, families: tuple[str, ...]) -> str:
    return (f"[{target.name}] note: {', '.join(families)} code was not run by this verification (this machine "
            f"lacks it and qemu cannot emulate it); CPUs that have it run it, and `edgepack deploy` checks "
            f"the golden output on each device")
