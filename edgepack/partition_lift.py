"""Batch-N text models on NCNN: every tensor after the embedding lookups gets a leading unit axis.

pnnx takes a tensor's first axis for the batch and ncnn has none, so a graph that runs 32
character windows at once (DeepCut: ids [32, 21] -> embeddings -> convolutions over each window)
fails in ncnn, and the split used to send all its convolutions to untuned TVM (1.2 s against
onnxruntime's 10-77 ms). Lifted, the same graph is batch 1: [32, 21, 32] becomes [1, 32, 21, 32],
a Transpose's perm and a Concat's axis move by one, a Reshape's target gains the unit axis, a
Gemm becomes MatMul + Add (any rank), a zero Pad becomes a Concat with a constant (pnnx leaves a
lone Pad as a layer ncnn lacks), and a convolution over [N, C, 1, W] with a one-high kernel runs
as one over [1, C, N, W] (the N windows stacked along H never mix). Values are unchanged.

The Unsqueeze after each lookup and the Reshape back to each model output are pinned to TVM
(their names end in PIN; partition.plan honours it), so the NCNN segment between them sees
batch 1 on both sides. Any op outside the handled set downstream of a lookup leaves the graph
as it was.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from .backends.ncnn.rewrite import _attr, _axes_of, _Graph

PIN = "__eppin"  # a node whose name ends so is planned on TVM (the lift's boundary nodes)
ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Max", "Min", "Relu", "Sigmoid", "Tanh", "Exp", "Sqrt",
                         "Neg", "Abs", "LeakyRelu", "Clip"})


class _Refuse(Exception):
    """A node the lift does not handle: the graph stays as it was."""


def _lookups(gr: _Graph) -> list:
    """Embedding lookups whose output has a leading axis > 1: Gather(constant table, ids, axis 0)."""
    out = []
    for n in gr.g.node:
        shape = gr.shapes.get(n.output[0]) if n.output else None
        if n.op_type == "Gather" and n.input[0] in gr.consts and _attr(n, "axis", 0) == 0 and shape \
                and len(shape) >= 2 and shape[0] > 1 and n.input[1] not in gr.consts:
            out.append(n)
    return out


def _lift_node(gr: _Graph, node, lifted: set[str]) -> list:
    """The replacement nodes for ``node``, whose lifted inputs carry one more leading unit axis."""
    op = node.op_type
    for x in node.input:
        if x and x not in lifted and x not in gr.consts:
            raise _Refuse(f"{node.name} mixes lifted and unlifted tensors")
    const = (lambda base, arr: gr.add_const(base, np.asarray(arr)))
    if op in ELEMENTWISE:
        return [node]  # constants broadcast from the right: the new leading axis is untouched
    if op in ("Unsqueeze", "Squeeze"):
        axes = _axes_of(gr, node)
        if axes is None:
            raise _Refuse(f"{node.name}: no axes")
        new = helper.make_node(op, [node.input[0], const("axes", np.array([a + 1 if a >= 0 else a for a in axes],
                                                                          np.int64))], list(node.output), name=node.name)
        return [new]
    if op == "Transpose":
        perm = _attr(node, "perm")
        if perm is None:
            raise _Refuse(f"{node.name}: no perm")
        return [helper.make_node("Transpose", [node.input[0]], list(node.output), name=node.name,
                                 perm=[0] + [p + 1 for p in perm])]
    if op == "Reshape":
        shape = gr.const_ints(node.input[1])
        if shape is None or 0 in shape:
            raise _Refuse(f"{node.name}: shape not constant or copies a dim")
        return [helper.make_node("Reshape", [node.input[0], const("shape", np.array([1] + shape, np.int64))],
                                 list(node.output), name=node.name)]
    if op == "Concat":
        if any(x not in lifted for x in node.input):
            raise _Refuse(f"{node.name}: a constant operand")
        ax = _attr(node, "axis")
        return [helper.make_node("Concat", list(node.input), list(node.output), name=node.name,
                                 axis=ax + 1 if ax >= 0 else ax)]
    if op == "MatMul":
        if node.input[0] not in lifted or len(gr.shapes.get(node.input[1], ())) > len(gr.shapes[node.input[0]]):
            raise _Refuse(f"{node.name}: lifted right operand only")
        return [node]
    if op == "Gemm":
        if _attr(node, "transA", 0) or _attr(node, "alpha", 1.0) != 1.0 or _attr(node, "beta", 1.0) != 1.0 \
                or node.input[1] not in gr.consts:
            raise _Refuse(f"{node.name}: a Gemm other than x @ W + b")
        w = node.input[1] if not _attr(node, "transB", 0) else const("w", gr.consts[node.input[1]].T.copy())
        if len(node.input) < 3 or not node.input[2]:
            return [helper.make_node("MatMul", [node.input[0], w], list(node.output), name=node.name)]
        mm = gr.fresh(node.output[0] + "_mm")
        return [helper.make_node("MatMul", [node.input[0], w], [mm], name=node.name),
                helper.make_node("Add", [mm, node.input[2]], list(node.output), name=gr.fresh(node.name + "_bias"))]
    if op == "Pad":
        return _pad_as_concat(gr, node, const)
    if op == "Conv":
        return _conv_rows(gr, node, const)
    raise _Refuse(f"{node.name}: op {op}")


def _pad_as_concat(gr: _Graph, node, const) -> list:
    """A constant Pad that only grows: one Concat with constant blocks per padded axis."""
    pads = gr.const_ints(node.input[1]) if len(node.input) > 1 else None
    mode = _attr(node, "mode", b"constant")
    value = gr.consts.get(node.input[2]) if len(node.input) > 2 and node.input[2] else np.float32(0)
    if pads is None or mode not in (b"constant", "constant") or value is None or min(pads) < 0 \
            or (len(node.input) > 3 and node.input[3]):
        raise _Refuse(f"{node.name}: not a constant, growing Pad")
    shape = [1, *gr.shapes[node.input[0]]]
    n = len(pads) // 2
    axes = [a for a in range(n) if pads[a] or pads[n + a]]
    if not axes:
        return [helper.make_node("Identity", [node.input[0]], list(node.output), name=node.name)]
    out, cur = [], node.input[0]
    for k, a in enumerate(axes):
        parts = []
        for count in (pads[a], pads[n + a]):
            sh = list(shape)
            sh[a + 1] = count
            parts.append(const("pad", np.full(sh, float(value), np.float32)) if count else None)
        shape[a + 1] += pads[a] + pads[n + a]
        dst = node.output[0] if k == len(axes) - 1 else gr.fresh(node.output[0] + "_pad")
        out.append(helper.make_node("Concat", [x for x in (parts[0], cur, parts[1]) if x], [dst],
                                    name=gr.fresh(node.name), axis=a + 1))
        cur = dst
    return out


def _conv_rows(gr: _Graph, node, const) -> list:
    """Conv over [N, C, 1, W] with a one-high kernel, lifted: [1, C, N, W] (the N rows never mix)."""
    shape, out_shape, w = gr.shapes.get(node.input[0]), gr.shapes.get(node.output[0]), gr.consts.get(node.input[1])
    pads = _attr(node, "pads", [0, 0, 0, 0])
    strides = _attr(node, "strides", [1, 1])
    dil = _attr(node, "dilations", [1, 1])
    if shape is None or out_shape is None or w is None or len(shape) != 4 or shape[2] != 1 or w.shape[2] != 1 \
            or pads[0] or pads[2] or strides[0] != 1 or dil[0] != 1 or _attr(node, "auto_pad", b"NOTSET") not in \
            (b"NOTSET", "NOTSET"):
        raise _Refuse(f"{node.name}: not a one-high convolution over [N, C, 1, W]")
    n, c, _, width = shape
    o, length = out_shape[1], out_shape[3]
    r, t, y, t2 = (gr.fresh(node.output[0] + s) for s in ("_rows", "_t", "_conv", "_t2"))
    conv = helper.make_node("Conv", [t, *node.input[1:]], [y], name=node.name)
    conv.attribute.extend(node.attribute)
    return [helper.make_node("Reshape", [node.input[0], const("shape", np.array([1, n, c, width], np.int64))], [r],
                             name=gr.fresh(node.name + "_rows")),
            helper.make_node("Transpose", [r], [t], name=gr.fresh(node.name + "_t"), perm=[0, 2, 1, 3]),
            conv,
            helper.make_node("Transpose", [y], [t2], name=gr.fresh(node.name + "_t2"), perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", [t2, const("shape", np.array([1, n, o, 1, length], np.int64))],
                             list(node.output), name=gr.fresh(node.name + "_back"))]


def lift_batch(model: onnx.ModelProto) -> int:
    """Lift ``model`` in place (see the module docstring); returns how many lookups were lifted (0:
    unchanged)."""
    work = onnx.ModelProto()
    work.CopyFrom(model)
    gr = _Graph(work)
    lookups = _lookups(gr)
    if not lookups:
        return 0
    lifted: set[str] = set()
    nodes = []
    try:
        for node in list(gr.g.node):
            if node in lookups:
                raw = gr.fresh(node.output[0] + "_batch")
                orig = node.output[0]
                node.output[0] = raw
                nodes += [node, helper.make_node("Unsqueeze", [raw, gr.add_const("axes", np.array([0], np.int64))],
                                                 [orig], name=gr.fresh(node.name) + PIN)]
                lifted.add(orig)
                continue
            if not any(x in lifted for x in node.input if x):
                nodes.append(node)
                continue
            nodes += _lift_node(gr, node, lifted)
            lifted.update(o for o in node.output if o)
    except _Refuse:
        return 0
    # every model output computed from a lookup goes back to its own shape (a TVM Reshape)
    for out in gr.g.output:
        if out.name not in lifted:
            continue
        inner = gr.fresh(out.name + "_lifted")
        for n in nodes:
            n.output[:] = [inner if o == out.name else o for o in n.output]
            n.input[:] = [inner if x == out.name else x for x in n.input]
        shape = [d.dim_value for d in out.type.tensor_type.shape.dim]
        nodes.append(helper.make_node("Reshape", [inner, gr.add_const("shape", np.array(shape, np.int64))],
                                      [out.name], name=gr.fresh(out.name) + PIN))
    del gr.g.node[:]
    gr.g.node.extend(nodes)
    del gr.g.value_info[:]
    model.CopyFrom(work)
    return len(lookups)
