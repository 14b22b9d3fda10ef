"""An edgepack target -> the TVM (LLVM) target dict: mtriple, mcpu, mattr, num-cores.

zig spells CPUs with underscores (cortex_a78ae), LLVM with dashes (cortex-a78ae). The x86_64
target promises "any x86-64", so its kernels are compiled for the x86-64 baseline unless the
target file says otherwise in its ``[tvm]`` table::

    [tvm]
    mcpu = "x86-64-v3"        # LLVM CPU name for the model's kernels
    mattr = ["+avx2", "+fma"] # extra LLVM features
    num-cores = 8             # thread count TVM (and MetaSchedule) plan for
"""
from __future__ import annotations

from ...errors import TargetError
from ...targets import Target

_ZIG_TO_LLVM_CPU = {"x86_64": "x86-64", "generic": "generic"}
_KNOWN_KEYS = {"mcpu", "mattr", "num-cores", "opt-level"}
DEFAULT_NUM_CORES = 4


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
    if target.arch == "aarch64" and "+neon" not in mattr:
        mattr.insert(0, "+neon")
    if mattr:
        d["mattr"] = mattr
    if target.link in ("static-pie", "dynamic"):
        pass  # TVM's LLVM codegen emits position-independent code already
    return d


def tvm_target(target: Target):
    import tvm
    try:
        return tvm.target.Target(target_dict(target))
    except Exception as exc:  # TVM raises its own error types for bad CPU names etc.
        raise TargetError(f"TVM does not accept the target for {target.name}: {str(exc).strip().splitlines()[-1][:200]}",
                          hint="check mcpu/mattr in the target file's [tvm] table") from exc
