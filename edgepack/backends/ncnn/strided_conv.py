"""A 1-D convolution with few input channels and a long stride, as a 2-D Convolution of one row.

A short-time Fourier transform written as a Conv (openWakeWord's log-mel front end: 1 input channel,
257 outputs, kernel 512, stride 160; Whisper's: 402 outputs, kernel 400, over 480,400 samples) is the
worst case for ncnn's Convolution1D: with one input channel nothing packs, and for every output frame
it streams the whole weight matrix again, one multiply per loaded weight (70% of openWakeWord's time
on x86). ncnn's 2-D Convolution has no such weakness: for a 1 x K kernel with stride (1, s) it cuts
the frames out once (im2col) and runs one GEMM, each weight loaded once for all frames. So the signal
becomes one row, [1, C, 1, L], and the Conv a 2-D one with the same taps.

Only the live taps run: a 400-sample window in a 512-point frame (onnx-asr's kaldi and NeMo front
ends) has 112 taps that are zero for every output; the signal is sliced to start at the first live
tap and end after the last frame's last live tap.

Forms measured and dropped (x86_64, AVX2, side by side with onnxruntime): the hop layout (the signal
cut into hops of s samples that become channels, a stride-1 1 x ceil(K/s) Conv over them) pads the
kernel to whole hops (400 taps run as 480) and on two threads split badly: Whisper 1.26x / 1.43x
onnxruntime against 1.14x / 1.25x for this form on 1 / 2 threads, openWakeWord 0.89x against 0.71x;
a Convolution1D of the hop layout still streams the weights per frame; the product as a MatMul over
concatenated frames is slower still (ncnn's batch-aware Reshape around it costs more than the product).

Conv1Ds with many input channels go the same way, whatever their stride (`conv1d_to_row`): ncnn packs
their channels, but its Convolution1D is still a direct kernel, while its 2-D Convolution with a 1 x K
kernel runs im2col + its packed GEMM. Whisper's encoder front (smart-turn v3: 80 -> 384 and 384 -> 384
channels, kernel 3, over 800 frames) spent 14% of smart-turn's time in Convolution1D.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

# only where ncnn cannot pack the input channels (its widest pack is 16) and the frames are long
MAX_IN_CHANNELS = 8
MIN_TAPS = 16
MIN_OPSET = 10  # Slice takes its bounds as inputs from opset 10 on


def _row_form(gr, node) -> tuple[int, int, int, int, int, int] | None:
    """(C, L, O, K, stride, first tap) of a Conv this rewrite applies to, else None. K counts the taps
    from the first to the last that is not zero for every output."""
    from .rewrite import _attr, _plain_conv
    plain = _plain_conv(gr, node, 3)
    if plain is None:
        return None
    shape, weight = plain
    strides, dilations, pads = _attr(node, "strides", [1]), _attr(node, "dilations", [1]), _attr(node, "pads", [0, 0])
    if list(dilations) != [1] or any(pads) or len(strides) != 1 or weight.dtype != np.float32:
        return None
    (c, length), (o, wc, k), s = shape[1:], weight.shape, int(strides[0])
    if wc != c or s < 2 or k < MIN_TAPS or c > MAX_IN_CHANNELS or length < k:
        return None
    live = np.flatnonzero(np.abs(weight).max(axis=(0, 1)))
    first, k = (int(live[0]), int(live[-1]) + 1 - int(live[0])) if live.size else (0, k)
    return c, length, o, k, s, first


def strided_conv_to_row(model) -> int:
    """Conv1D(x [1, C, L], W [O, C, K], stride s) with few channels -> Conv2D(x' [1, C, 1, L'],
    W' [O, C, 1, K'], stride (1, s)) -> Reshape [1, O, F], where W' holds the live taps and x' the
    samples from the first live tap to the last one the last frame reads. Convs reading the same
    signal from the same tap share one x'."""
    from .rewrite import _Graph, _apply, _opset
    if model.opset_import and _opset(model) < MIN_OPSET:
        return 0
    gr, plan, rows = _Graph(model), {}, {}
    for pos, node in enumerate(list(gr.g.node)):
        if node.op_type != "Conv":
            continue
        form = _row_form(gr, node)
        if form is None:
            continue
        c, length, o, k, s, first = form
        frames = (length - gr.consts[node.input[1]].shape[2]) // s + 1  # the Conv's output length, unchanged
        end = first + (frames - 1) * s + k      # one past the last sample a live tap reads
        key = (node.input[0], first, end)
        new_nodes = []
        if key not in rows:
            new_nodes, rows[key] = _row(gr, node.input[0], c, length, first, end)
        plan[pos] = [*new_nodes, *_row_conv(gr, node, rows[key], first, k, s, (0, 0), o, frames)]
    return _apply(gr.g, plan)


def _row_conv(gr, node, row: str, first: int, k: int, s: int, pads: tuple[int, int], o: int,
              frames: int, dilation: int = 1) -> list:
    """Conv1D ``node`` as a 2-D Conv over ``row`` ([1, C, 1, L']: its taps first..first+k-1, stride
    (1, s), left/right ``pads``, taps ``dilation`` apart) -> Reshape [1, O, frames], which writes the
    Conv1D's output."""
    w = np.ascontiguousarray(gr.consts[node.input[1]][:, :, None, first:first + k])
    wide = gr.fresh(node.output[0] + "_2d")
    return [helper.make_node("Conv", [row, gr.add_const("row_w", w), *node.input[2:]], [wide],
                             kernel_shape=[1, k], strides=[1, s], pads=[0, pads[0], 0, pads[1]], dilations=[1, dilation],
                             group=1, name=node.name or gr.fresh("row_conv")),
            helper.make_node("Reshape", [wide, gr.add_const("shape", np.array([1, o, frames], np.int64))],
                             list(node.output), name=gr.fresh("row_out"))]


def _row(gr, x: str, c: int, length: int, first: int, end: int) -> tuple[list, str]:
    """Nodes that make x' [1, C, 1, end - first] of signal x [1, C, L] (its samples first..end-1), its name."""
    nodes = []
    if first or end < length:  # samples before the first live tap or past the last frame's last one
        cut = gr.fresh(x + "_cut")
        nodes.append(helper.make_node(
            "Slice", [x, gr.add_const("starts", np.array([first], np.int64)),
                      gr.add_const("ends", np.array([end], np.int64)),
                      gr.add_const("axes", np.array([2], np.int64))], [cut], name=gr.fresh("row")))
        x = cut
    out = gr.fresh(x + "_row")
    nodes.append(helper.make_node("Reshape", [x, gr.add_const("shape", np.array([1, c, 1, end - first], np.int64))],
                                  [out], name=gr.fresh("row")))
    return nodes, out


def _wide_form(gr, node) -> tuple[int, int, int, int, int, tuple[int, int], int] | None:
    """(C, L, O, K, stride, [left pad, right pad], dilation) of a group-1 Conv1D of constant weights with
    more than MAX_IN_CHANNELS input channels and a kernel of at least 2 taps, else None."""
    from .rewrite import _attr, _plain_conv
    plain = _plain_conv(gr, node, 3)
    if plain is None or gr.shapes.get(node.output[0]) is None:
        return None
    shape, weight = plain
    strides, dilations, pads = _attr(node, "strides", [1]), _attr(node, "dilations", [1]), _attr(node, "pads", [0, 0])
    if len(dilations) != 1 or len(strides) != 1 or len(pads) != 2 or weight.dtype != np.float32:
        return None
    if shape[1] <= MAX_IN_CHANNELS or weight.shape[1] != shape[1] or weight.shape[2] < 2:
        return None  # (a pointwise Conv1D: no faster as a row on x86, and less exact on Arm's fp16 GEMM)
    return (shape[1], shape[2], weight.shape[0], weight.shape[2], int(strides[0]), (int(pads[0]), int(pads[1])),
            int(dilations[0]))


def conv1d_to_row(model) -> int:
    """Conv1D(x [1, C, L], W [O, C, K], stride s, pads, dilation d) with many channels -> Reshape
    [1, C, 1, L] -> Conv2D(W [O, C, 1, K], stride (1, s), pads (0, l, 0, r), dilations (1, d)) ->
    Reshape [1, O, F], in place; how many Convs it rewrote. (ncnn runs a dilated 2-D Convolution as
    im2col + GEMM too; its dilated Convolution1D stays on the direct kernel: AttaCut's 48 -> 196
    channel, 5- and 9-tap dilated Conv1Ds were 78% of its time there.)"""
    from .rewrite import _Graph, _apply
    gr, plan = _Graph(model), {}
    for pos, node in enumerate(list(gr.g.node)):
        if node.op_type != "Conv":
            continue
        form = _wide_form(gr, node)
        if form is None:
            continue
        c, length, o, k, s, pads, d = form
        row_nodes, row = _row(gr, node.input[0], c, length, 0, length)
        plan[pos] = [*row_nodes, *_row_conv(gr, node, row, 0, k, s, pads, o, gr.shapes[node.output[0]][2], d)]
    return _apply(gr.g, plan)


def wide_convs_as_rows(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """conv1d_to_row on a copy, the replaced kernels dropped: (the copy, how many Convs it rewrote)."""
    from .rewrite import on_copy
    return on_copy(conv1d_to_row, model)


def strided_convs_as_rows(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """strided_conv_to_row on a copy, the replaced kernels dropped: (the copy, how many Convs it
    rewrote)."""
    from .rewrite import on_copy
    return on_copy(strided_conv_to_row, model)
