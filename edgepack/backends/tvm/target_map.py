"""An edgepack target -> the TVM (LLVM) target dict: mtriple, mcpu, mattr, num-cores.

zig spells CPUs with underscores (cortex_a78ae), LLVM with dashes (cortex-a78ae). Arm targets get
their CPU plus the target file's ``features`` as LLVM attributes (Orin: +fullfp16, +dotprod).

The x86_64 target promises "any x86-64": its base kernels (and the VM bytecode + weights) are
compiled for the x86-64 baseline, and the same kernels again for each of ``ISA_LEVELS`` under a
system-lib symbol prefix; the engine picks the best level the CPU has at start-up (CPUID), and
looks up a kernel missing from that level in the baseline. The target's ``[tvm]`` table::

    [tvm]
    mcpu = "x86-64-v3"        # LLVM CPU name for the base kernels
    mattr = ["+avx2", "+fma"] # extra LLVM features
    num-cores = 8             # thread count TVM (and MetaSchedule) plan for
    isa-levels = ["x86-64-v3"] # extra x86-64 levels carried in the artifact ([] = base only)
"""
from __future__ import annotations

from ...errors import TargetError
from ...targets import Target

_ZIG_TO_LLVM_CPU = {"x86_64": "x86-64", "generic": "generic"}
_KNOWN_KEYS = {"mcpu", "mattr", "num-cores", "opt-level", "isa-levels"}
DEFAULT_NUM_CORES = 4
# x86-64 micro-architecture levels carried next to the baseline, best first. v2 (SSE4.2) gains
# little over the SSE2 baseline for float kernels; v3 is AVX2+FMA, v4 adds AVX-512.
X86_ISA_LEVELS = ("x86-64-v4", "x86-64-v3")
# TVM 0.27 cannot read back a system-lib prefix of 7 bytes or fewer (a "SmallStr" attribute
# fails get_attr in relax.build): prefixes are long on purpose.
_PREFIX = "edgepack_{}_"
# target-file feature -> LLVM attribute for Arm CPUs
_ARM_MATTR = {"neon": "+neon", "fp16": "+fullfp16", "dotprod": "+dotprod", "i8mm": "+i8mm", "bf16": "+bf16",
              "sve": "+sve"}


def llvm_triple(target: Target) -> str:
    t = target.triple
    return f"{t.arch}-unknown-{t.os}-{t.abi}"


def llvm_cpu(target: Target) -> str:
    return _ZIG_TO_LLVM_CPU.get(target.cpu, target.cpu.replace("_", "-"))


def tvm_options(target: Target) -> dict:
    opts = dict(target.backend_options.get("tvm", {}))
    unknown = set(opts) - _KNOWN_KEYS
    if unknown:
        raise TargetError(f"{target.source}: unknown key(s) in [tvm]: {', '.join(sorted(unknown))}",
                          hint=f"known: {', '.join(sorted(_KNOWN_KEYS))}")
    return opts


def target_dict(target: Target) -> dict:
    """The JSON-able TVM target for the model's kernels (also part of every cache key)."""
    opts = tvm_options(target)
    d = {"kind": "llvm", "mtriple": llvm_triple(target), "mcpu": str(opts.get("mcpu", llvm_cpu(target))),
         "num-cores": int(opts.get("num-cores", DEFAULT_NUM_CORES))}
    mattr = list(opts.get("mattr", []))
    if target.arch == "aarch64":
        for f in ("neon", *target.features):
            a = _ARM_MATTR.get(f)
            if a and a not in mattr:
                mattr.append(a)
    if mattr:
        d["mattr"] = mattr
    if target.link in ("static-pie", "dynamic"):
        pass  # TVM's LLVM codegen emits position-independent code already
    return d


def isa_variants(target: Target) -> list[tuple[str, str, dict]]:
    """(level, system-lib prefix, TVM target dict) for each extra ISA copy of the kernels, best first."""
    if target.arch != "x86_64":
        return []
    levels = tvm_options(target).get("isa-levels", list(X86_ISA_LEVELS))
    if not isinstance(levels, list) or any(lv not in X86_ISA_LEVELS + ("x86-64-v2",) for lv in levels):
        raise TargetError(f"{target.source}: [tvm] isa-levels must list x86-64-v2/-v3/-v4, got {levels!r}")
    order = ("x86-64-v4", "x86-64-v3", "x86-64-v2")
    out = []
    base = target_dict(target)
    for lv in sorted(set(levels), key=order.index):
        if lv == base["mcpu"]:
            continue
        d = dict(base, mcpu=lv)
        out.append((lv, _PREFIX.format(lv.rsplit("-", 1)[1]), d))
    return out


def tvm_target(target: Target):
    return tvm_target_of(target, target_dict(target))


def tvm_target_of(target: Target, d: dict):
    import tvm
    try:
        return tvm.target.Target(d)
    except Exception as exc:  # TVM raises its own error types for bad CPU names etc.
        raise TargetError(f"TVM does not accept the target for {target.name}: {str(exc).strip().splitlines()[-1][:200]}",
                          hint="check mcpu/mattr in the target file's [tvm] table") from exc
