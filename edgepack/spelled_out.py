"""Ops that exporters spell out, folded back into the one op the backends run well.

- **One-hot products as a lookup.** jax2tf writes `jax.nn.one_hot(ids, D) @ W` as Equal(ids[..., 1],
  arange(D)) -> Cast(float) -> MatMul(W[D, F]) (torch and tf2onnx as ONNX's OneHot with values (0, 1), whose
  ids -D..-1 count from the end: those are wrapped first) (Magika's byte embedding: a [2048, 257] one-hot
  tensor, a 67 MFLOP product, and an Equal that keeps the model's head off NCNN). The product picks
  row `ids` of W, so it is Gather(W, ids). Exact, including ids outside 0..D-1, whose one-hot row is
  all zeros: W gets one zero row at index D and the ids are clipped to -1..D (-1 counts from the end,
  so it picks that zero row too). Values: the product sums W[i, f] once with D - 1 zeros, which is W[i, f]
  for every finite weight; a table with inf or NaN stays a product (0 x inf is NaN there).
- **Softmax.** Exporters that lower softmax (jax2tf, TF's own) write max, subtract, exp, sum, divide:
  ReduceMax(x) [-> Max(-inf, .)] [-> Reshape/Unsqueeze] -> Sub(x, .) -> Exp -> ReduceSum [-> Reshape]
  -> Div. As Softmax(x, axis) it is one layer (NCNN has no ReduceMax reading every axis, so the
  written-out form became its own TVM segment). Softmax computes the same formula; the last bits
  may round differently, which verification bounds like any other build.

Both need static shapes (the build fixes them) and leave every other form alone.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .model import LoadedModel, _with
from .onnx_index import constants, node_attrs, remove_dead_nodes, tensor_infos

_INT_IDS = {TensorProto.INT32: np.int32, TensorProto.INT64: np.int64}
# ops between a reduction and its use that only move unit axes (values unchanged)
_UNIT_AXIS_OPS = ("Reshape", "Unsqueeze", "Squeeze", "Flatten")


def fold_spelled_out(model: LoadedModel) -> LoadedModel:
    """The model with its one-hot products as Gathers and written-out softmaxes as Softmax; unchanged
    where there is neither."""
    ops = model.ops()
    if not (("Equal" in ops or "OneHot" in ops) and "MatMul" in ops) and not ("ReduceMax" in ops and "Exp" in ops):
        return model
    proto = onnx.ModelProto()
    proto.CopyFrom(model.proto)
    g = _Index(proto)
    lookups = sum(_one_hot_as_gather(g, n) for n in list(proto.graph.node) if n.op_type == "MatMul")
    softmaxes = sum(_softmax(g, n) for n in list(proto.graph.node) if n.op_type == "Div")
    if not (lookups or softmaxes):
        return model
    remove_dead_nodes(proto)
    del proto.graph.value_info[:]  # recorded shapes of removed values
    said = [f"{lookups} one-hot product(s) as a Gather"] * bool(lookups) + \
        [f"{softmaxes} written-out softmax(es) as Softmax"] * bool(softmaxes)
    return _with(model, proto, "; ".join(said))


class _Index:
    def __init__(self, proto: onnx.ModelProto):
        self.proto, self.graph = proto, proto.graph
        self.opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
        self.consts = constants(proto)
        self.infos = tensor_infos(proto)
        self.producer = {o: n for n in self.graph.node for o in n.output}
        self.outputs = {o.name for o in self.graph.output}
        self._uid = 0

    def readers(self, name: str) -> list:
        return [n for n in self.graph.node if name in n.input]

    def only_reader(self, name: str):
        users = self.readers(name)
        return users[0] if len(users) == 1 and name not in self.outputs else None

    def dims(self, name: str) -> tuple[int, ...] | None:
        info = self.infos.get(name)
        return info.static if info else None

    def fresh(self, base: str) -> str:
        self._uid += 1
        return f"{base}__ep_so{self._uid}"

    def const(self, base: str, arr: np.ndarray) -> str:
        name = self.fresh(base)
        self.graph.initializer.append(numpy_helper.from_array(arr, name))
        return name

    def replace(self, node, new_nodes: list) -> None:
        """Put new_nodes where node was (the node list stays topologically sorted)."""
        nodes = self.graph.node
        at = list(nodes).index(node)
        del nodes[at]
        for k, n in enumerate(new_nodes):
            nodes.insert(at + k, n)


def _one_hot_as_gather(g: _Index, matmul) -> int:
    table = g.consts.get(matmul.input[1])
    if table is None or table.ndim != 2 or table.dtype != np.float32 or not np.isfinite(table).all() \
            or g.opset < 12:  # Clip on integers
        return 0
    depth = table.shape[0]
    hot = g.producer.get(matmul.input[0])
    if hot is None or g.only_reader(matmul.input[0]) is not matmul:
        return 0
    if hot.op_type == "OneHot":
        found = _one_hot_op_ids(g, hot, depth)
        if found is None:
            return 0
        ids, id_dims, from_end = found
    else:
        equal = g.producer.get(hot.input[0]) if hot.op_type == "Cast" else None
        if equal is None or equal.op_type != "Equal" or node_attrs(hot).get("to") != TensorProto.FLOAT:
            return 0
        ids = _ids_against_range(g, equal, depth)
        hot_dims, id_dims = g.dims(equal.output[0]), g.dims(ids) if ids else None
        if hot_dims is None or not id_dims or id_dims[-1] != 1 or hot_dims != (*id_dims[:-1], depth):
            return 0
        id_dims, from_end = id_dims[:-1], False
    np_int = _INT_IDS[g.infos[ids].elem_type]
    padded = np.concatenate([table, np.zeros((1, table.shape[1]), np.float32)])
    base = matmul.output[0]
    const = lambda name, v: g.const(f"{base}_{name}", np.array(v, np_int))  # noqa: E731
    flat, clipped = g.fresh(f"{base}_ids"), g.fresh(f"{base}_ids_clipped")
    if from_end:
        # OneHot counts -depth..-1 from the end (Equal with arange matches none of them): wrap those first
        neg, shifted = g.fresh(f"{base}_ids_negative"), g.fresh(f"{base}_ids_shifted")
        nodes = [helper.make_node("Less", [ids, const("zero", 0)], [neg], name=g.fresh(f"{base}_ids_less")),
                 helper.make_node("Add", [ids, const("depth", depth)], [shifted], name=g.fresh(f"{base}_ids_add")),
                 helper.make_node("Where", [neg, shifted, ids], [flat], name=g.fresh(f"{base}_ids_where"))]
    else:
        nodes = [helper.make_node("Reshape", [ids, g.const(f"{base}_ids_shape", np.array(id_dims, np.int64))],
                                  [flat], name=g.fresh(f"{base}_ids_reshape"))]
    nodes += [
        # ids outside 0..depth-1 pick the appended zero row (-1 counts from the end)
        helper.make_node("Clip", [flat, const("lo", -1), const("hi", depth)], [clipped], name=g.fresh(f"{base}_ids_clip")),
        helper.make_node("Gather", [g.const(f"{base}_table", padded), clipped], [base], axis=0,
                         name=g.fresh(f"{base}_lookup")),
    ]
    g.replace(matmul, nodes)
    return 1


def _one_hot_op_ids(g: _Index, node, depth: int) -> tuple[str, tuple[int, ...], bool] | None:
    """(integer ids, their dims, True) of an ONNX OneHot of ``depth`` on the last axis with values
    (0, 1) in float32, else None."""
    ids, d, values = node.input
    dv, vv, info = g.consts.get(d), g.consts.get(values), g.infos.get(ids)
    if dv is None or vv is None or info is None or info.elem_type not in _INT_IDS or dv.size != 1:
        return None
    id_dims = g.dims(ids)
    axis = int(node_attrs(node).get("axis", -1))
    if id_dims is None or int(dv.reshape(-1)[0]) != depth or vv.dtype != np.float32 \
            or [float(v) for v in vv.reshape(-1)] != [0.0, 1.0] or axis not in (-1, len(id_dims)):
        return None
    return ids, id_dims, True


def _ids_against_range(g: _Index, equal, depth: int) -> str | None:
    """The integer ids an Equal compares with arange(depth) along its last axis, else None."""
    for ids, rng in ((equal.input[0], equal.input[1]), (equal.input[1], equal.input[0])):
        values = g.consts.get(rng)
        info = g.infos.get(ids)
        if values is None or info is None or info.elem_type not in _INT_IDS or values.ndim == 0:
            continue
        if values.shape[-1] != depth or not np.array_equal(values, np.broadcast_to(np.arange(depth), values.shape)):
            continue
        expand = g.producer.get(ids)
        if expand is not None and expand.op_type == "Expand" and (g.dims(expand.input[0]) or (0,))[-1:] == (1,):
            ids = expand.input[0]  # ids broadcast to [..., depth] first: compare the [..., 1] ids
        return ids
    return None


def _softmax(g: _Index, div) -> int:
    exp = g.producer.get(div.input[0])
    if exp is None or exp.op_type != "Exp":
        return 0
    total = _through_unit_axes(g, div.input[1])
    sub = g.producer.get(exp.input[0])
    if total is None or total.op_type != "ReduceSum" or total.input[0] != exp.output[0] \
            or sub is None or sub.op_type != "Sub" or g.only_reader(sub.output[0]) is not exp:
        return 0
    if sorted(id(n) for n in g.readers(exp.output[0])) != sorted((id(total), id(div))) or exp.output[0] in g.outputs:
        return 0
    x = sub.input[0]
    peak = _through_unit_axes(g, sub.input[1], allow_neg_inf_max=True)
    x_dims = g.dims(x)
    if peak is None or peak.op_type != "ReduceMax" or peak.input[0] != x or x_dims is None:
        return 0
    axis = _one_axis(g, peak, len(x_dims))
    if axis is None or axis != _one_axis(g, total, len(x_dims)):
        return 0
    kept = tuple(1 if k == axis else d for k, d in enumerate(x_dims))
    if g.dims(sub.input[1]) != kept or g.dims(div.input[1]) != kept or g.dims(div.output[0]) != x_dims:
        return 0
    if g.opset < 13 and axis != len(x_dims) - 1:
        return 0  # before opset 13 Softmax flattens from its axis on: the same only for the last axis
    g.replace(div, [helper.make_node("Softmax", [x], list(div.output), axis=axis, name=g.fresh(div.output[0]))])
    return 1


def _through_unit_axes(g: _Index, name: str, allow_neg_inf_max: bool = False):
    """The node that made ``name``, looking back through ops that only move unit axes (and, for a
    maximum, a Max with -inf, which changes no value but NaN's)."""
    node = g.producer.get(name)
    for _ in range(8):  # bounded: a chain of reshapes is short
        if node is None:
            return None
        if node.op_type in _UNIT_AXIS_OPS:
            node = g.producer.get(node.input[0])
            continue
        if allow_neg_inf_max and node.op_type == "Max" and len(node.input) == 2:
            other = [i for i in node.input if (c := g.consts.get(i)) is not None and c.size == 1
                     and np.isneginf(c).all()]
            if len(other) == 1:
                node = g.producer.get(next(i for i in node.input if i != other[0]))
                continue
        return node
    return None


def _one_axis(g: _Index, reduce, rank: int) -> int | None:
    """The one axis a ReduceMax/ReduceSum reduces (normalised), else None."""
    attrs = node_attrs(reduce)
    axes = attrs.get("axes")
    if axes is None and len(reduce.input) > 1 and reduce.input[1]:
        c = g.consts.get(reduce.input[1])
        axes = None if c is None else [int(v) for v in c.reshape(-1)]
    if axes is None or len(axes) != 1:
        return None
    return axes[0] % rank
