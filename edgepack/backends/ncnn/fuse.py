"""Speed rewrite before pnnx: Gemm/MatMul nodes that share one weight initializer and whose
inputs do not depend on each other become one batched matrix product.

Why: an LSTM unrolled into per-time-step cells (captcha_crnn: `x_t @ W_ih^T` at each of 20 steps,
two directions) shares one [400, 4096] weight across 20 Gemms in ONNX, but pnnx writes one
InnerProduct per Gemm, each with its own copy of the weight: a 137 MB .bin (fp16) for a 19 MB
model, streamed from RAM on every inference, where onnxruntime keeps reading the same 6.5 MB.
Concat(x_1..x_k) -> one Gemm -> Split is the same arithmetic per row (the batched product computes
every output row exactly as the single-row one) with one copy of the weight; ncnn's InnerProduct
runs the [k, K] input as one matrix product.
Recurrent products (`h_{t-1} @ W_hh^T`) depend on the previous step's output and are left alone.
The build still compares the converted model with onnxruntime on the original graph.
"""
from __future__ import annotations

import collections
import heapq

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...onnx_index import tensor_infos

VERSION = 11  # part of the conversion cache key: bump when the rewritten graph changes; 2: gemv_as_gemm;
# 3: strided_conv.strided_convs_over_hops; 4: erf_gelu.erf_gelus_as_gelu; 5: zero taps trimmed;
# 6: strided_conv.strided_convs_as_rows instead of hop channels; 7: tanh_gelu.tanh_gelus_as_gelu;
# 8: dilated_conv.dilated_convs_as_phases; 9: strided_conv.wide_convs_as_rows;
# 10: not for pointwise Conv1Ds; 11: rewrite.split_sum_of_squares


def _attrs(node) -> tuple:
    return tuple(sorted((a.name, repr(helper.get_attribute_value(a))) for a in node.attribute))


def _static_rows(shapes: dict, name: str) -> int | None:
    """dim 0 of a rank-2 tensor whose two dims are known, else None."""
    dims = shapes.get(name)
    if dims is None or len(dims) != 2 or any(d is None for d in dims):
        return None
    return dims[0]


def _shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    return {name: list(info.dims) for name, info in tensor_infos(model, strict=True, initializers=False).items()
            if info.dims is not None}


def _descendants(graph, starts: set[str]) -> set[str]:
    """Every tensor computed (transitively) from ``starts``; nodes are in topological order."""
    reached = set(starts)
    for node in graph.node:
        if any(i in reached for i in node.input):
            reached.update(node.output)
    return reached


def _toposort(nodes: list) -> list:
    """Kahn's order, stable in the original order; tensors no node produces are graph inputs."""
    produced = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    deps = [{produced[x] for x in n.input if x in produced and produced[x] != i} for i, n in enumerate(nodes)]
    users = collections.defaultdict(list)
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    left = [len(d) for d in deps]
    ready = [i for i, n in enumerate(left) if n == 0]
    heapq.heapify(ready)
    order = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            left[u] -= 1
            if left[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(nodes):
        raise ValueError("graph has a cycle after batching shared-weight products")
    return [nodes[i] for i in order]


def batch_shared_products(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """(a copy of ``model`` with independent same-weight Gemm/MatMul nodes batched, products removed).

    Only rank-2 inputs with static shapes, one shared constant weight (and bias, and attributes),
    and no Gemm with transA are batched; anything else is left as it is."""
    graph = model.graph
    inits = {t.name for t in graph.initializer}
    groups: dict[tuple, list[int]] = collections.defaultdict(list)
    for i, n in enumerate(graph.node):
        if n.op_type == "Gemm" and len(n.input) >= 2 and n.input[1] in inits:
            if any(a.name == "transA" and a.i for a in n.attribute):
                continue
            bias = n.input[2] if len(n.input) > 2 else ""
            if bias and bias not in inits:
                continue
            groups[("Gemm", n.input[1], bias, _attrs(n))].append(i)
        elif n.op_type == "MatMul" and len(n.input) == 2 and n.input[1] in inits:
            groups[("MatMul", n.input[1], "", ())].append(i)
    groups = {k: v for k, v in groups.items() if len(v) > 1}
    if not groups:
        return model, 0
    shapes = _shapes(model)
    weight_rank = {t.name: len(t.dims) for t in graph.initializer}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = list(out.graph.node)
    opset = next((o.version for o in out.opset_import if o.domain in ("", "ai.onnx")), 13)
    drop, added, removed = set(), [], 0
    for g, (key, idx) in enumerate(groups.items()):
        if key[0] == "MatMul" and weight_rank.get(key[1]) != 2:
            continue
        members = [nodes[i] for i in idx]
        rows = [_static_rows(shapes, n.input[0]) for n in members]
        if any(r is None for r in rows):
            continue
        a_inputs = [n.input[0] for n in members]
        downstream = _descendants(out.graph, {o for n in members for o in n.output})
        if any(a in downstream for a in a_inputs):
            continue  # a recurrence: one product feeds the next one's input
        tag = f"edgepack_batched_{g}"
        cat, prod = f"{tag}_concat", f"{tag}_product"
        new = [helper.make_node("Concat", a_inputs, [cat], name=f"{tag}/Concat", axis=0)]
        body = helper.make_node(key[0], [cat, *members[0].input[1:]], [prod], name=f"{tag}/{key[0]}")
        body.attribute.extend(members[0].attribute)
        new.append(body)
        outputs = [n.output[0] for n in members]
        if opset >= 13:
            sizes = f"{tag}_sizes"
            out.graph.initializer.append(numpy_helper.from_array(
                np.array(rows, dtype=np.int64), sizes))
            new.append(helper.make_node("Split", [prod, sizes], outputs, name=f"{tag}/Split", axis=0))
        else:
            new.append(helper.make_node("Split", [prod], outputs, name=f"{tag}/Split", axis=0, split=rows))
        drop.update(idx)
        added.extend(new)
        removed += len(members) - 1
    if not drop:
        return model, 0
    kept = [n for i, n in enumerate(nodes) if i not in drop] + added
    del out.graph.node[:]
    out.graph.node.extend(_toposort(kept))
    return out, removed


def gemv_as_gemm(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """(a copy of ``model`` whose one-row products with a constant weight are Gemm(transB=1), count).

    pnnx writes MatMul(x, W) as ncnn's Gemm, which keeps W as packed fp32 and runs one row through
    its tiled matrix kernel; Gemm(x, W^T, transB=1) is nn.Linear to pnnx, ncnn's InnerProduct, whose
    vector kernel reads fp16 weights under fp16 storage. For the recurrent products an unrolled
    quantised LSTM leaves (one row per step, each with its own weight copy: ddddocr_old_int8's 40
    steps of [1, 1, 512] x [512, 2048]) that halves what every step streams. Only x of static
    shape [1, ..., 1, K] (reshaped to [1, K] and back) and rank-2 initializer W; W^T is added once."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    picked = [i for i, n in enumerate(graph.node) if n.op_type == "MatMul" and len(n.input) == 2
              and n.input[1] in inits and len(inits[n.input[1]].dims) == 2]
    if not picked:
        return model, 0
    shapes = _shapes(model)

    def one_row(name: str) -> bool:
        dims = shapes.get(name)
        return bool(dims) and len(dims) >= 2 and all(d == 1 for d in dims[:-1]) and dims[-1] is not None
    picked = [i for i in picked if one_row(graph.node[i].input[0])]
    if not picked:
        return model, 0
    out = onnx.ModelProto()
    out.CopyFrom(model)
    transposed: dict[str, str] = {}
    nodes = []
    picked_set = set(picked)
    for i, node in enumerate(out.graph.node):
        if i not in picked_set:
            nodes.append(node)
            continue
        w, x, y = node.input[1], node.input[0], node.output[0]
        if w not in transposed:
            transposed[w] = f"{w}_edgepack_transposed"
            out.graph.initializer.append(numpy_helper.from_array(
                np.ascontiguousarray(numpy_helper.to_array(inits[w]).T), transposed[w]))
        rank = len(shapes[x])
        if rank == 2:
            nodes.append(helper.make_node("Gemm", [x, transposed[w]], [y], name=node.name, transB=1))
            continue
        tag = f"{y}_edgepack_gemv"
        n_out = int(inits[w].dims[1])
        out.graph.initializer.extend([
            numpy_helper.from_array(np.array([1, shapes[x][-1]], np.int64), f"{tag}_in_shape"),
            numpy_helper.from_array(np.array([1] * (rank - 1) + [n_out], np.int64), f"{tag}_out_shape")])
        nodes += [helper.make_node("Reshape", [x, f"{tag}_in_shape"], [f"{tag}_row"], name=f"{tag}/in"),
                  helper.make_node("Gemm", [f"{tag}_row", transposed[w]], [f"{tag}_product"], name=node.name, transB=1),
                  helper.make_node("Reshape", [f"{tag}_product", f"{tag}_out_shape"], [y], name=f"{tag}/out")]
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out, len(picked)
