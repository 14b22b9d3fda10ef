"""A 3x3 convolution dilated along its height only, as an undilated one over the row phases side by side.

PLCMOS v2 (speechmos) runs three 3x3 convolutions with dilation (2, 1) over a 500-frame spectrogram.
ncnn's x86 and Arm convolutions take Winograd only without dilation, and their own dilation split
only without packing and with equal dilations, so these ran as im2col + sgemm: 71% of the model's
time, 1.5x onnxruntime. With dilation d along H, the output rows of one phase p (y = d*i + p) read
only the input rows of that phase, through an undilated kernel. Rows are contiguous, so a free
Reshape of the padded input [C, Hp, Wp] to [C, Hp/d, d*Wp] puts the d phases of each row pair side by
side; one undilated Conv over that computes every output row at once (the kw - 1 columns where the
kernel straddles two phases are computed and dropped), and a Reshape back to [O, Hp - d*(kh-1), Wp]
interleaves the phases again. The same multiplies per output, so ncnn's Winograd applies; the
arithmetic differs from the direct sum only by Winograd's rounding, which the build's check bounds.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

MIN_OPSET = 11      # Pad takes its pads as an input from opset 11 on
KERNEL = (3, 3)     # the only kernel ncnn's Winograd takes
MIN_CHANNELS = 9    # ncnn prefers Winograd only where one side has more than 8 channels
# element-wise activations moved from after the Slice to right after the Conv, where pnnx fuses them
# into ncnn's Convolution (else they run as a layer of their own over the output)
ACTIVATIONS = {"Relu", "LeakyRelu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Elu", "Tanh", "Mish"}


def _phase_form(gr, node) -> tuple[tuple[int, ...], int, list[int]] | None:
    """(input shape [1, C, H, W], dilation d along H, pads [top, left, bottom, right]) of a Conv this
    rewrite applies to, else None."""
    from .rewrite import _attr, _plain_conv
    plain = _plain_conv(gr, node, 4)
    if plain is None:
        return None
    shape, weight = plain
    dilations, strides = list(_attr(node, "dilations", [1, 1])), list(_attr(node, "strides", [1, 1]))
    pads = list(_attr(node, "pads", [0, 0, 0, 0]))
    if tuple(weight.shape[2:]) != KERNEL or strides != [1, 1] or len(dilations) != 2 or len(pads) != 4:
        return None
    d = int(dilations[0])
    if d < 2 or dilations[1] != 1 or max(weight.shape[0], weight.shape[1]) < MIN_CHANNELS:
        return None
    if len(node.input) > 2 and node.input[2] and node.input[2] not in gr.consts:
        return None  # a bias computed at run time: nothing real exports one
    pt, pl, pb, pr = (int(p) for p in pads)
    if shape[2] + pt + pb < d * (KERNEL[0] - 1) + 1 or shape[3] + pl + pr < KERNEL[1]:
        return None
    return tuple(int(s) for s in shape), d, [pt, pl, pb, pr]


def dilated_conv_to_phases(model: onnx.ModelProto) -> int:
    """Conv(x [1, C, H, W], 3x3, dilation (d, 1), pads) -> Pad -> Reshape [1, C, Hp/d, d*Wp] ->
    Conv(3x3, undilated, right pad 2) -> Reshape [1, O, Hp - 2d, Wp] -> Slice to the Conv's output, in
    place; how many Convs it rewrote. Hp is the padded height rounded up to a multiple of d (the extra
    bottom rows make extra output rows, sliced off). A pooling that reads the Conv (or its activation)
    moves before the Slice, which then crops the pooled rows, or goes where pooling drops the extra
    rows and columns anyway (PLCMOS: every crop; each had cost a pass over a conv output, 11% of it)."""
    from .rewrite import _Graph, _apply, _attr, _opset
    if model.opset_import and _opset(model) < MIN_OPSET:
        return 0
    gr, plan, fired = _Graph(model), {}, 0
    position = {id(n): i for i, n in enumerate(gr.g.node)}
    kh, kw = KERNEL
    for pos, node in enumerate(list(gr.g.node)):
        if node.op_type != "Conv":
            continue
        form = _phase_form(gr, node)
        if form is None:
            continue
        (_, c, h, w), d, (pt, pl, pb, pr) = form
        o = int(gr.consts[node.input[1]].shape[0])
        height, wp = h + pt + pb, w + pl + pr
        extra = -height % d
        rows = (height + extra) // d
        out_h, out_w = height - d * (kh - 1), wp - (kw - 1)
        name = node.name or gr.fresh("dilated_conv")
        x, nodes = node.input[0], []
        if pt or pl or pb + extra or pr:
            padded = gr.fresh(x + "_padded")
            nodes.append(helper.make_node(
                "Pad", [x, gr.add_const("pads", np.array([0, 0, pt, pl, 0, 0, pb + extra, pr], np.int64))],
                [padded], mode="constant", name=f"{name}_pad"))
            x = padded
        phases, conv, rows_out = gr.fresh(x + "_phases"), gr.fresh(name + "_phased"), gr.fresh(name + "_rows")
        nodes += [
            helper.make_node("Reshape", [x, gr.add_const("shape", np.array([1, c, rows, d * wp], np.int64))],
                             [phases], name=f"{name}_phases"),
            helper.make_node("Conv", [phases, *node.input[1:]], [conv], kernel_shape=[kh, kw], strides=[1, 1],
                             dilations=[1, 1], pads=[0, 0, 0, kw - 1], group=1, name=name)]
        out = node.output[0]
        act = _activation_after(gr, node)
        if act is not None:  # Conv -> act -> Reshape -> Slice, which writes what the act wrote
            acted = gr.fresh(name + "_act")
            nodes.append(helper.make_node(act.op_type, [conv, *act.input[1:]], [acted], name=act.name))
            nodes[-1].attribute.extend(act.attribute)
            conv, out = acted, act.output[0]
            plan[position[id(act)]] = []
        full = (d * (rows - kh + 1), wp)  # the interleaved rows before the crop to (out_h, out_w)
        nodes.append(helper.make_node("Reshape", [conv, gr.add_const("shape", np.array([1, o, *full], np.int64))],
                                      [rows_out], name=f"{name}_interleave"))
        crop, pool = (out_h, out_w), _pool_after(gr, act or node)
        if pool is not None:  # pooled before the crop: the same windows, and often nothing left to crop
            pooled = gr.fresh(name + "_pooled")
            nodes.append(helper.make_node(pool.op_type, [rows_out], [pooled], name=pool.name))
            nodes[-1].attribute.extend(pool.attribute)
            kernel, strides = _attr(pool, "kernel_shape"), _attr(pool, "strides", [1, 1])
            crop = tuple((n - k) // s + 1 for n, k, s in zip(crop, kernel, strides))
            full = tuple((n - k) // s + 1 for n, k, s in zip(full, kernel, strides))
            rows_out, out = pooled, pool.output[0]
            plan[position[id(pool)]] = []
        if crop == full:  # the last node writes the output itself
            nodes[-1].output[0] = out
        else:
            nodes.append(helper.make_node("Slice", [rows_out, gr.add_const("starts", np.array([0, 0], np.int64)),
                                                    gr.add_const("ends", np.array(crop, np.int64)),
                                                    gr.add_const("axes", np.array([2, 3], np.int64))],
                                          [out], name=f"{name}_crop"))
        plan[pos] = nodes
        fired += 1
    return _apply(gr.g, plan, fired)


def _pool_after(gr, node):
    """The 2-D MaxPool or AveragePool without padding, dilation or ceil mode that is the only reader of
    ``node``'s output, else None: pooling the uncropped rows gives the cropped rows' windows first
    (a window lies wholly inside the crop or starts after the windows the crop keeps)."""
    from .rewrite import _attr
    pool = gr.only_reader(node.output[0])
    if pool is None or pool.op_type not in ("MaxPool", "AveragePool") or len([o for o in pool.output if o]) != 1:
        return None
    kernel = _attr(pool, "kernel_shape")
    if kernel is None or len(kernel) != 2 or _attr(pool, "ceil_mode", 0) or _attr(pool, "storage_order", 0):
        return None
    if any(_attr(pool, "pads", [0] * 4)) or any(v != 1 for v in _attr(pool, "dilations", [1, 1])):
        return None
    if _attr(pool, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET", b"VALID", "VALID"):
        return None
    return pool


def _activation_after(gr, node):
    """The element-wise activation that is the only reader of ``node``'s output, else None."""
    act = gr.only_reader(node.output[0])
    if act is None:
        return None
    initializers = {i.name for i in gr.g.initializer}  # (a Constant node might come after the Conv)
    if act.op_type not in ACTIVATIONS or any(x and x not in initializers for x in act.input[1:]):
        return None
    return act


def dilated_convs_as_phases(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """dilated_conv_to_phases on a copy: (the copy, how many Convs it rewrote)."""
    from .rewrite import on_copy
    return on_copy(dilated_conv_to_phases, model)
