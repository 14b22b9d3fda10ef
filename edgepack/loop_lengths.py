"""Slices and ranges of a computed start but a fixed length, in a loop body, as static shapes with a check.

A decoder body writes step i's result into row i of a buffer: Paddle's exporter spells it
``Slice(buf, i, min(501, i + 1))``, its shape, a ``Range(i, i + 1)`` of indices, a Tile to that shape and
a ScatterElements. Neither backend compiles shapes that depend on data, yet the length is 1 at every
step the decoder takes. Here each such Slice becomes a Gather of ``start + [0, k)`` and each such Range
``start + [0, k)``, k read off the graph: the end is the start plus a constant, through the casts,
reshapes and clamps the exporter puts between them. onnxsim then folds the rest to static shapes.

The length holds only while the start stays inside the tensor and the clamp does not bite (ONNX's
Slice would give fewer rows there). So the body gets one more output, true while every such length
is what the rewrite assumed, and the loop engine stops with an error at a step where it is not
(runtimes/common/ep_engine_loop.c, option loop.guard): never a silently different answer.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .onnx_index import constants, tensor_infos

_PASS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Identity", "Cast"})  # keep the (single) value
GUARD = "edgepack_loop_lengths_ok"


def _affine(name: str, producer: dict, consts: dict, depth: int = 0) -> tuple[str, float] | None:
    """(base tensor, offset) with name = base + offset, read through the ops the exporter puts between
    a counter and its uses; a clamp (Min/Max with a constant) is read through too: the check catches it."""
    if depth > 24:
        return None
    node = producer.get(name)
    if node is None or name in consts:
        return (name, 0.0) if name not in consts else None
    if node.op_type in _PASS:
        return _affine(node.input[0], producer, consts, depth + 1)
    if node.op_type in ("Add", "Sub", "Min", "Max") and len(node.input) == 2:
        a, b = node.input
        if b in consts and consts[b].size == 1 and a not in consts:
            var, c = a, float(consts[b].reshape(-1)[0])
        elif a in consts and consts[a].size == 1 and b not in consts and node.op_type != "Sub":
            var, c = b, float(consts[a].reshape(-1)[0])
        else:
            return None
        inner = _affine(var, producer, consts, depth + 1)
        if inner is None:
            return None
        if node.op_type == "Add":
            return inner[0], inner[1] + c
        if node.op_type == "Sub":
            return inner[0], inner[1] - c
        return inner  # Min/Max: the clamp, checked at run time
    return (name, 0.0)


def _length(start: str, end: str, producer: dict, consts: dict) -> int | None:
    s, e = _affine(start, producer, consts), _affine(end, producer, consts)
    if s is None or e is None or s[0] != e[0]:
        return None
    k = e[1] - s[1]
    return int(k) if k == int(k) and k >= 1 else None


def specialise_lengths(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """(the body with each computed-start, fixed-length Slice and Range rewritten and a GUARD output
    appended, how many); the body unchanged and 0 when there is none."""
    consts = constants(proto)
    infos = tensor_infos(proto)
    producer = {o: n for n in proto.graph.node for o in n.output}
    plans = []
    for n in proto.graph.node:
        if n.op_type == "Slice" and len(n.input) >= 4 and n.input[1] not in consts:
            axes = consts.get(n.input[3])
            steps = consts.get(n.input[4]) if len(n.input) > 4 and n.input[4] else np.ones(1)
            data = infos.get(n.input[0])
            if axes is None or axes.size != 1 or steps is None or steps.size != 1 or int(steps.reshape(-1)[0]) != 1 \
                    or data is None or data.static is None:
                continue
            k = _length(n.input[1], n.input[2], producer, consts)
            axis = int(axes.reshape(-1)[0]) % len(data.static)
            if k is not None and k <= data.static[axis]:
                plans.append((n, k, axis, data.static[axis]))
        elif n.op_type == "Range" and n.input[0] not in consts:
            delta = consts.get(n.input[2])
            if delta is None or delta.size != 1 or float(delta.reshape(-1)[0]) != 1:
                continue
            k = _length(n.input[0], n.input[1], producer, consts)
            if k is not None:
                plans.append((n, k, None, None))
    if not plans:
        return proto, 0
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    by_out = {n.output[0]: n for n in m.graph.node}
    new_nodes: dict[str, list] = {}
    checks = []
    for i, (old, k, axis, dim) in enumerate(plans):
        node = by_out[old.output[0]]
        p = f"edgepack_len{i}"
        start, end = node.input[0 if axis is None else 1], node.input[1 if axis is None else 2]
        m.graph.initializer.extend([numpy_helper.from_array(np.arange(k, dtype=np.int64), f"{p}_steps"),
                                    numpy_helper.from_array(np.asarray([], np.int64), f"{p}_scalar"),
                                    numpy_helper.from_array(np.asarray(k, np.int64), f"{p}_k")])
        nodes = [helper.make_node("Cast", [start], [f"{p}_s64"], to=onnx.TensorProto.INT64),
                 helper.make_node("Reshape", [f"{p}_s64", f"{p}_scalar"], [f"{p}_s"]),
                 helper.make_node("Cast", [end], [f"{p}_e64"], to=onnx.TensorProto.INT64),
                 helper.make_node("Reshape", [f"{p}_e64", f"{p}_scalar"], [f"{p}_e"])]
        if axis is None:  # Range: start + [0, k), in the Range's type; the check: limit - start == k
            dtype = infos[node.output[0]].elem_type if node.output[0] in infos else onnx.TensorProto.INT64
            nodes += [helper.make_node("Add", [f"{p}_s", f"{p}_steps"], [f"{p}_idx"]),
                      helper.make_node("Cast", [f"{p}_idx"], [node.output[0]], to=dtype or onnx.TensorProto.INT64),
                      helper.make_node("Sub", [f"{p}_e", f"{p}_s"], [f"{p}_len"]),
                      helper.make_node("Equal", [f"{p}_len", f"{p}_k"], [f"{p}_ok"])]
        else:  # Slice: Gather of start + [0, k); the check: 0 <= start, start + k <= dim, min(end, dim) - start == k
            m.graph.initializer.extend([numpy_helper.from_array(np.asarray(dim, np.int64), f"{p}_dim"),
                                        numpy_helper.from_array(np.asarray(dim - k, np.int64), f"{p}_last"),
                                        numpy_helper.from_array(np.asarray(0, np.int64), f"{p}_zero")])
            # the rows read are kept inside the tensor (a Gather must not read past it), the check uses the real start
            nodes += [helper.make_node("Min", [f"{p}_s", f"{p}_last"], [f"{p}_low"]),
                      helper.make_node("Max", [f"{p}_low", f"{p}_zero"], [f"{p}_first"]),
                      helper.make_node("Add", [f"{p}_first", f"{p}_steps"], [f"{p}_idx"]),
                      helper.make_node("Gather", [node.input[0], f"{p}_idx"], [node.output[0]], axis=axis),
                      helper.make_node("Min", [f"{p}_e", f"{p}_dim"], [f"{p}_end"]),
                      helper.make_node("Sub", [f"{p}_end", f"{p}_s"], [f"{p}_len"]),
                      helper.make_node("Equal", [f"{p}_len", f"{p}_k"], [f"{p}_fits"]),
                      helper.make_node("GreaterOrEqual", [f"{p}_s", f"{p}_zero"], [f"{p}_from"]),
                      helper.make_node("LessOrEqual", [f"{p}_s", f"{p}_last"], [f"{p}_to"]),
                      helper.make_node("And", [f"{p}_from", f"{p}_to"], [f"{p}_in"]),
                      helper.make_node("And", [f"{p}_in", f"{p}_fits"], [f"{p}_ok"])]
        new_nodes[node.output[0]] = nodes
        checks.append(f"{p}_ok")
    out = []
    for n in m.graph.node:
        out += new_nodes.get(n.output[0], [n]) if n.output and n.output[0] in new_nodes else [n]
    guard = checks[0]
    for i, c in enumerate(checks[1:]):
        out.append(helper.make_node("And", [guard, c], [f"edgepack_len_all{i}"]))
        guard = f"edgepack_len_all{i}"
    out.append(helper.make_node("Identity", [guard], [GUARD]))
    del m.graph.node[:]
    m.graph.node.extend(out)
    m.graph.output.append(helper.make_tensor_value_info(GUARD, onnx.TensorProto.BOOL, []))
    return m, len(plans)
