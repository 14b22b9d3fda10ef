"""A sequence-first tail made batch-first for pnnx: [T, C] chains lifted to [1, T, C].

A CRNN run with a time-major recurrence (ONNX LSTM/GRU layout 0, or an unrolled one) flattens its
[T, 1, C] sequence to a 2-D [T, C] for the classifier MatMul and reshapes the answer back to
[T, 1, K]. pnnx tracks one batch axis per tensor, and takes axis 0 of a tensor for the batch as
soon as anything tagged "batch 0" meets it: a per-tensor scale (dynamic quantisation's max over a
GlobalMaxPool, batch 0 by pnnx's rules) broadcast into [T, C] tags the T axis. ncnn layers then
drop that axis: the last Reshape gives (1, K) instead of (T, 1, K).

With a unit batch, [T, C] and [1, T, C] hold the same values in the same order, so the chain from
that Reshape to the next Reshape (or the graph output) computes the same numbers on [1, T, C],
where axis 0 is the unit axis and pnnx's batch tag lands where it does no harm. The rewrite lifts
the whole chain or nothing: element-wise ops (the other operand broadcasts the same way against
the extra leading 1), MatMul with a constant right-hand side, and Gemm with constant weights
(as MatMul + Add: Gemm takes only 2-D); anything else leaves it alone. It fires only when some op
of the chain also reads a tensor computed at run time (constants carry no batch tag in pnnx), so
tails pnnx already converts right (a CRNN's plain classifier) stay as they are. A lifted graph
output keeps its ONNX shape through a final Reshape.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

# Ops whose result is computed element by element (with numpy broadcasting): a leading unit axis
# on one operand changes nothing but the result's rank.
_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Relu", "Floor", "Ceil", "Round", "Neg",
                "Abs", "Sqrt", "Exp", "Log", "Sigmoid", "Tanh", "Clip", "Identity", "LeakyRelu", "HardSigmoid",
                "HardSwish", "Erf", "Softplus", "Reciprocal", "Cast"}
_MAX_REGION = 4096   # nodes one lift may touch: bounded work on any graph


def lift_sequence_tail(model: onnx.ModelProto) -> int:
    """Reshape(x with a unit axis -> [T, C], T > 1) and the ops after it -> the same on [1, T, C]."""
    from .rewrite import _Graph  # rewrite.py calls this module: imported late, no cycle at load
    gr, fired = _Graph(model), 0
    for node in list(gr.g.node):
        if node.op_type != "Reshape" or node.output[0] in gr.outputs:
            continue
        src, out = gr.shapes.get(node.input[0]), gr.shapes.get(node.output[0])
        if not src or not out or len(out) != 2 or out[0] <= 1 or len(src) < 3 or 1 not in src:
            continue
        region = _region(gr, node.output[0])
        if region is None or not _meets_runtime_tensor(gr, region[0], node.output[0]):
            continue
        _lift(gr, node, region, out)
        fired += 1
        gr = _Graph(model)   # shapes changed: index again before the next candidate
    return fired


def _region(gr, start: str) -> tuple[list, list, list] | None:
    """(nodes to lift, Reshapes that end the chain, graph outputs in it) from `start` on, or None
    when some reader of a lifted tensor cannot take the extra leading axis."""
    lifted, nodes, ends, outs, todo, seen = {start}, [], [], [], [start], set()
    while todo:
        name = todo.pop()
        if name in gr.outputs:
            outs.append(name)
        for reader in gr.consumers.get(name, []):
            if id(reader) in seen:
                continue
            seen.add(id(reader))
            if reader.op_type == "Reshape" and reader.input[0] == name:
                shape = gr.const_ints(reader.input[1]) if len(reader.input) > 1 else None
                if shape is None or 0 in shape:   # a copied dim would now copy the wrong axis
                    return None
                ends.append(reader)
                continue
            if not _liftable(gr, reader, lifted):
                return None
            nodes.append(reader)
            if len(nodes) > _MAX_REGION:
                return None
            for o in reader.output:
                if o and o not in lifted:
                    lifted.add(o)
                    todo.append(o)
    return nodes, ends, outs


def _liftable(gr, node, lifted: set) -> bool:
    rank = {i: len(gr.shapes[i]) for i in node.input if i in gr.shapes}
    if len(node.output) != 1 or any(i and i not in rank for i in node.input):
        return False
    if node.op_type in _ELEMENTWISE:
        # the other operands broadcast against [T, C] with rank <= 2, so also against [1, T, C]
        return all(rank[i] <= 2 for i in node.input if i and i not in lifted) and \
            all(rank[i] == 2 for i in node.input if i in lifted)
    if node.op_type == "MatMul":
        a, b = node.input
        return a in lifted and b not in lifted and rank[a] == 2 and rank[b] == 2 and b in gr.consts
    if node.op_type == "Gemm":
        from .rewrite import _attr
        plain = _attr(node, "alpha", 1.0) == 1.0 and _attr(node, "beta", 1.0) == 1.0 and not _attr(node, "transA", 0)
        return plain and node.input[0] in lifted and all(i in gr.consts for i in node.input[1:] if i)
    return False


def _meets_runtime_tensor(gr, nodes: list, start: str) -> bool:
    """Whether an op of the chain reads a tensor that is neither in the chain nor a constant."""
    inside = {start} | {o for n in nodes for o in n.output}
    return any(i and i not in inside and i not in gr.consts for n in nodes for i in n.input)


def _lift(gr, reshape, region: tuple[list, list, list], out_shape: tuple) -> None:
    nodes, _, outs = region
    shape = gr.add_const("shape", np.array([1, *out_shape], np.int64))
    reshape.input[1] = shape
    renamed = {}
    for name in outs:   # the graph output keeps its ONNX shape: lifted under a new name, reshaped back
        inner = gr.fresh(name + "_lifted")
        renamed[name] = inner
    producers = [reshape, *nodes]
    for n in producers:
        for k, o in enumerate(n.output):
            if o in renamed:
                n.output[k] = renamed[o]
        for k, i in enumerate(n.input):
            if i in renamed:
                n.input[k] = renamed[i]
    g = gr.g
    for n in nodes:
        if n.op_type == "Gemm":
            _gemm_to_matmul(gr, n)
    for name, inner in renamed.items():
        back = gr.add_const("shape", np.array(gr.shapes[name], np.int64))
        last = max(k for k, n in enumerate(g.node) if inner in n.output)
        g.node.insert(last + 1, helper.make_node("Reshape", [inner, back], [name], name=gr.fresh("unlift")))
    stale = {o for n in producers for o in n.output}
    keep = [v for v in g.value_info if v.name not in stale]
    del g.value_info[:]
    g.value_info.extend(keep)


def _gemm_to_matmul(gr, node) -> None:
    """Gemm(A, B, C) with alpha = beta = 1, A not transposed -> MatMul(A, B or B^T) (+ Add C), in place:
    the same sums, on an A of any rank."""
    new = gemm_as_matmul(gr, node, node.input[0])
    out = node.output[0]
    pos = next(k for k, n in enumerate(gr.g.node) if n is node or list(n.output) == [out])
    del gr.g.node[pos]
    for k, n in enumerate(new):
        gr.g.node.insert(pos + k, n)


def gemm_as_matmul(gr, node, a: str) -> list:
    """The nodes computing Gemm ``node`` (A not transposed, B and C constant) as MatMul(``a``, alpha·B or
    alpha·Bᵀ) (+ Add beta·C), writing the Gemm's output: MatMul and Add take an A of any rank. Also
    unit_batch.py's Gemm rule."""
    from .rewrite import _attr
    b = gr.consts[node.input[1]]
    if _attr(node, "transB", 0):
        b = np.ascontiguousarray(b.T)
    alpha, beta = _attr(node, "alpha", 1.0), _attr(node, "beta", 1.0)
    if alpha != 1.0:
        b = np.ascontiguousarray(b * np.asarray(alpha, b.dtype))
    bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
    out = node.output[0]
    product = gr.fresh(out + "_mm") if bias else out
    mm = helper.make_node("MatMul", [a, gr.add_const(node.input[1] + "_w", b)], [product],
                          name=node.name or gr.fresh("gemm"))
    if not bias:
        return [mm]
    if beta != 1.0:
        c = gr.consts[bias]
        bias = gr.add_const(bias + "_b", np.ascontiguousarray(c * np.asarray(beta, c.dtype)))
    return [mm, helper.make_node("Add", [product, bias], [out], name=gr.fresh("gemm_bias"))]
