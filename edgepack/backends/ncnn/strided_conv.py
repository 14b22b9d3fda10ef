"""A 1-D convolution with few input channels and a long stride, as a stride-1 one over hop channels.

A short-time Fourier transform written as a Conv (openWakeWord's log-mel front end: 1 input channel,
257 outputs, kernel 512, stride 160) is the worst case for ncnn's Convolution1D: with one input
channel nothing packs, and for every output frame it streams the whole weight matrix again, one
multiply per loaded weight (70% of that model's time on x86). Cut the signal into hops of `stride`
samples and let the samples of a hop be channels: out[o, j] = sum over taps t of W[o, c, t] x[c, s*j + t]
= sum over (c, p, q) of W'[o, c*s + p, q] X[c*s + p, j + q], with X[c*s + p, m] = x[c, s*m + p] and W'
the kernel zero-padded to whole hops. The same sums plus zeros, as a 2-D Convolution with a 1 x K'
kernel over C*s packed channels, which ncnn runs as im2col + GEMM: each weight loaded once for all
frames. (A 1-D Convolution of that form still streams the weights per frame: 0.16 instead of 0.19 ms
for the whole model; the same product written as MatMul over concatenated frames was slower still,
ncnn's batch-aware Reshape around it costing more than the product.)
"""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

# only where ncnn cannot pack the input channels (its widest pack is 16) and a hop is long enough to pack
MAX_IN_CHANNELS = 8
MIN_HOP_CHANNELS = 16
MAX_PADDED_SHARE = 1.5  # zero taps added to reach a whole number of hops, at most half the kernel
MIN_OPSET = 11  # the hops' Slice takes its bounds and Pad its pads as inputs from opset 10 / 11 on


def _hop_form(gr, node) -> tuple[int, int, int, int, int, int] | None:
    """(C, L, O, K, stride, first tap) of a Conv this rewrite applies to, else None. K counts the taps
    from the first to the last that is not zero for every output: a 400-sample analysis window in a
    512-point frame (onnx-asr's kaldi and NeMo front ends) leaves 114 zero taps, and 4 hops of 160
    would then run 640 taps where 3 hops run all 398 that count."""
    from .rewrite import _attr
    shape, weight = gr.shapes.get(node.input[0]), gr.consts.get(node.input[1])
    if shape is None or weight is None or len(shape) != 3 or shape[0] != 1 or weight.ndim != 3:
        return None
    if _attr(node, "group", 1) != 1 or _attr(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        return None
    strides, dilations, pads = _attr(node, "strides", [1]), _attr(node, "dilations", [1]), _attr(node, "pads", [0, 0])
    if list(dilations) != [1] or any(pads) or len(strides) != 1 or weight.dtype != np.float32:
        return None
    (c, length), (o, wc, k), s = shape[1:], weight.shape, int(strides[0])
    if wc != c or s < 2 or k < s or c > MAX_IN_CHANNELS or c * s < MIN_HOP_CHANNELS or length < k:
        return None
    live = np.flatnonzero(np.abs(weight).max(axis=(0, 1)))
    first, k = (int(live[0]), int(live[-1]) + 1 - int(live[0])) if live.size else (0, k)
    if math.ceil(k / s) * s > MAX_PADDED_SHARE * k:
        return None
    return c, length, o, k, s, first


def strided_conv_to_hop_channels(model) -> int:
    """Conv1D(x [1, C, L], W [O, C, K], stride s) with few channels -> Conv2D(X [1, C*s, 1, M],
    W' [O, C*s, 1, ceil(K/s)], stride 1) -> Reshape [1, O, F], where X is x cut into hops (Slice or zero
    Pad to M*s samples, Reshape, Transpose, Reshape). Convs reading the same signal with the same
    stride share one X."""
    from .rewrite import _Graph, _apply, _opset
    if model.opset_import and _opset(model) < MIN_OPSET:
        return 0
    gr, plan, hops = _Graph(model), {}, {}
    for pos, node in enumerate(list(gr.g.node)):
        if node.op_type != "Conv":
            continue
        form = _hop_form(gr, node)
        if form is None:
            continue
        c, length, o, k, s, first = form
        kh = math.ceil(k / s)                   # taps of the padded kernel, in hops
        frames = (length - gr.consts[node.input[1]].shape[2]) // s + 1  # the Conv's output length, unchanged
        m = frames + kh - 1                     # hops the new Conv reads
        key = (node.input[0], s, m, first)
        new_nodes = []
        if key not in hops:
            new_nodes, hops[key] = _hops(gr, node.input[0], c, length, s, m, first)
        padded = np.zeros((o, c, kh * s), np.float32)
        padded[:, :, :k] = gr.consts[node.input[1]][:, :, first:first + k]
        # W'[o, c*s + p, 0, q] = W[o, c, q*s + p]
        w = np.ascontiguousarray(padded.reshape(o, c, kh, s).transpose(0, 1, 3, 2).reshape(o, c * s, 1, kh))
        wide = gr.fresh(node.output[0] + "_2d")
        plan[pos] = [*new_nodes,
                     helper.make_node("Conv", [hops[key], gr.add_const("hop_w", w), *node.input[2:]], [wide],
                                      kernel_shape=[1, kh], strides=[1, 1], pads=[0, 0, 0, 0], dilations=[1, 1],
                                      group=1, name=node.name or gr.fresh("hop_conv")),
                     helper.make_node("Reshape", [wide, gr.add_const("shape", np.array([1, o, frames], np.int64))],
                                      list(node.output), name=gr.fresh("hop_out"))]
    return _apply(gr.g, plan)


def _hops(gr, x: str, c: int, length: int, s: int, m: int, first: int = 0) -> tuple[list, str]:
    """Nodes that make X [1, C*s, 1, M] of signal x [1, C, L] from sample ``first`` on
    (X[c*s + p, m] = x[c, first + s*m + p]), its name."""
    nodes, want, avail = [], m * s, length - first
    if first or want < avail:  # samples before the first live tap or past the last frame
        cut = gr.fresh(x + "_cut")
        nodes.append(helper.make_node(
            "Slice", [x, gr.add_const("starts", np.array([first], np.int64)),
                      gr.add_const("ends", np.array([first + min(want, avail)], np.int64)),
                      gr.add_const("axes", np.array([2], np.int64))], [cut], name=gr.fresh("hops")))
        x = cut
    if want > avail:  # read only by the zero taps of the padded kernel
        fitted = gr.fresh(x + "_fit")
        nodes.append(helper.make_node(
            "Pad", [x, gr.add_const("pads", np.array([0, 0, 0, 0, 0, want - avail], np.int64))],
            [fitted], mode="constant", name=gr.fresh("hops")))
        x = fitted
    grid, moved, out = gr.fresh(x + "_grid"), gr.fresh(x + "_moved"), gr.fresh(x + "_hops")
    nodes += [
        helper.make_node("Reshape", [x, gr.add_const("shape", np.array([1, c, m, s], np.int64))], [grid],
                         name=gr.fresh("hops")),
        helper.make_node("Transpose", [grid], [moved], perm=[0, 1, 3, 2], name=gr.fresh("hops")),
        helper.make_node("Reshape", [moved, gr.add_const("shape", np.array([1, c * s, 1, m], np.int64))], [out],
                         name=gr.fresh("hops"))]
    return nodes, out


def strided_convs_over_hops(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """strided_conv_to_hop_channels on a copy, the replaced kernels dropped: (the copy, how many Convs
    it rewrote)."""
    from .rewrite import on_copy
    return on_copy(strided_conv_to_hop_channels, model)
