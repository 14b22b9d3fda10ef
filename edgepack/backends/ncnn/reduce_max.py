"""A ReduceMax over trailing axes as a GlobalMaxPool, so NCNN keeps it.

Log-mel front ends clamp to the loudest value less 8 (Whisper's, openWakeWord's): ReduceMax over every
axis. pnnx converts ONNX's ReduceMax only in some forms (all axes left implicit, not an axes list), and
ncnn's op table lists it as unsupported, so the plan cut every such model in two: NCNN, then a TVM
segment for the last few element-wise ops, with a copy at the cut. The maximum over the trailing axes
a..r-1 of x [d0, ..., dr-1] is GlobalMaxPool of x viewed as [1, d0 * ... * d(a-1), da * ... * dr-1]:
the same values compared, so the same result, and GlobalMaxPool is ncnn's Pooling. A Transpose that
moved those axes inwards first (keras' global max pooling) is looked through: the pool reads its input.
"""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper


def _reduced_axes(gr, node, rank: int) -> list[int] | None:
    """The sorted axes a ReduceMax reduces, or None where they are only known at run time."""
    from .rewrite import _attr, _axes_of
    axes = _axes_of(gr, node)
    if len(node.input) > 1 and node.input[1] and axes is None:
        return None  # axes computed at run time
    if not axes:  # absent or empty: every axis, unless the op is then told to do nothing
        return None if _attr(node, "noop_with_empty_axes", 0) else list(range(rank))
    return sorted({a + rank if a < 0 else a for a in axes})


def _pooled_source(gr, node, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...], int] | None:
    """(tensor, its shape, a) such that the ReduceMax is the maximum over that tensor's axes a..r-1,
    the kept values in the same order; None where there is none. That is the ReduceMax's own input
    when it reduces trailing axes, or the input of a Transpose before it that moved trailing axes
    inwards: keras' GlobalMaxPooling2D exports as Transpose(NCHW -> NHWC) + ReduceMax(axes 1, 2)."""
    from .rewrite import _attr
    rank = len(shape)
    axes = _reduced_axes(gr, node, rank)
    if not axes:
        return None
    if axes == list(range(axes[0], rank)):
        return node.input[0], shape, axes[0]
    before = gr.producer.get(node.input[0])
    if before is None or before.op_type != "Transpose" or gr.shapes.get(before.input[0]) is None:
        return None
    perm = _attr(before, "perm") or list(range(rank))[::-1]
    reduced = sorted(perm[a] for a in axes)
    kept = [perm[a] for a in range(rank) if a not in axes]
    if kept != sorted(kept) or reduced != list(range(rank - len(axes), rank)):
        return None
    return before.input[0], gr.shapes[before.input[0]], rank - len(axes)


def reduce_max_as_global_pool(model: onnx.ModelProto) -> int:
    """Rewrite ``model`` in place; how many ReduceMax it replaced. Only static shapes, and with
    keepdims=0 only where no Max or Min reads the result: magika's softmax (keepdims=0, then Max with a
    constant -inf) rewritten so made pnnx crash in that Max, and the plan then moved its whole NCNN
    segment to TVM (2.7x onnxruntime instead of 1.03x); with the max left to TVM it keeps its NCNN segment."""
    from .rewrite import _apply, _attr, _Graph
    gr, plan = _Graph(model), {}
    for pos, node in enumerate(gr.g.node):
        if node.op_type != "ReduceMax" or not node.input:
            continue
        shape, out_shape = gr.shapes.get(node.input[0]), gr.shapes.get(node.output[0])
        if not shape or any(d <= 0 for d in shape) or out_shape is None:
            continue
        source = _pooled_source(gr, node, shape)
        if source is None:
            continue
        if not _attr(node, "keepdims", 1) and (not out_shape or any(
                c.op_type in ("Max", "Min") for c in gr.consumers.get(node.output[0], []))):
            continue
        src, src_shape, first = source
        rows, length = math.prod(src_shape[:first]), math.prod(src_shape[first:])
        view, pooled = gr.fresh(node.output[0] + "_rows"), gr.fresh(node.output[0] + "_pooled")
        name = node.name or gr.fresh("reduce_max")
        plan[pos] = [
            helper.make_node("Reshape", [src, gr.add_const("shape", np.array([1, rows, length], np.int64))],
                             [view], name=f"{name}_view"),
            helper.make_node("GlobalMaxPool", [view], [pooled], name=f"{name}_pool"),
            helper.make_node("Reshape", [pooled, gr.add_const("shape", np.array(out_shape, np.int64))],
                             [node.output[0]], name=f"{name}_shape")]
    return _apply(gr.g, plan)


def max_rewrites() -> tuple:
    """The exact in-place rewrites that give NCNN the ReduceMax forms it lacks (rewrite.stack_max_to_max,
    reduce_max_as_global_pool): the NCNN backend's and the partition planner's one list."""
    from .rewrite import stack_max_to_max
    return stack_max_to_max, reduce_max_as_global_pool


def reduce_maxes_for_ncnn(model: onnx.ModelProto) -> tuple[onnx.ModelProto, tuple[str, ...]]:
    """max_rewrites on a copy: (the copy, "name xN" per rewrite that fired); the model itself where it
    has no ReduceMax or none fired. They are exact, so the NCNN backend checks ops on, and converts,
    what they give."""
    from .rewrite import remove_dead_nodes
    if not any(n.op_type == "ReduceMax" for n in model.graph.node):
        return model, ()
    out = onnx.ModelProto()
    out.CopyFrom(model)
    notes = []
    for rewrite in max_rewrites():
        count = rewrite(out)
        if count:
            remove_dead_nodes(out)
            notes.append(f"{rewrite.__name__} x{count}")
    return (out, tuple(notes)) if notes else (model, ())
