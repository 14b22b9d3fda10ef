"""Outputs whose length the model computes: a decoder's answer is its buffer up to the step it stopped at
(``Slice(buffer, 0, steps)`` after the loop, then ops that treat each row alone: Softmax over the last
axis). The artifact computes such an output whole, at the largest length, and its runtime cuts it to
the length the model computed after each run (runtimes/common/ep_engine_seq.c, the segment table's
trims), so `run`, `serve` and the selftest give exactly onnxruntime's shape. The length is an extra
graph output the plan keeps; the output's TensorSpec records the cut, the model's metadata the list
(``apply_trims`` gives onnxruntime's answer in the original form from it)."""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from .loops import set_static_shape
from .model import LoadedModel, TensorSpec

TRIM_KEY = "edgepack.trim"  # model metadata: the outputs whose length the model decides (trim_outputs)
# ops that act on each position of the cut axis alone: cutting before or after them is the same
_ELEMENTWISE = frozenset({"Identity", "Cast", "Relu", "Sigmoid", "Tanh", "Exp", "Log", "Abs", "Neg", "Sqrt",
                          "Reciprocal", "Floor", "Ceil", "Round", "Sign", "Erf", "HardSigmoid", "HardSwish",
                          "LeakyRelu", "Elu", "Selu", "Softplus", "Softsign", "Clip", "Not"})
_ALONG_AXIS = frozenset({"Softmax", "LogSoftmax", "Hardmax"})


@dataclass(frozen=True)
class Trim:
    output: str     # model output
    axis: int       # the axis cut
    length: str     # the tensor holding the length (Slice's end)
    added: bool     # the length is a graph output only for the cut (not one of the model's own)

    def to_json(self) -> dict:
        return {"output": self.output, "axis": self.axis, "length": self.length, "added": self.added}


def trims_of(proto: onnx.ModelProto) -> list[Trim]:
    for p in proto.metadata_props:
        if p.key == TRIM_KEY:
            return [Trim(**t) for t in json.loads(p.value)]
    return []


def _const_ints(name: str, consts: dict) -> list[int] | None:
    if name not in consts:
        return None
    return [int(v) for v in np.asarray(consts[name]).reshape(-1)]


def trim_outputs(model: LoadedModel) -> LoadedModel:
    """Each output that is a Slice from 0 up to a computed end along one axis (then only ops that treat
    each position of that axis alone) is computed whole; the end becomes an extra graph output and the
    output's spec records the cut (TensorSpec.trim). Only for models with a Loop: elsewhere a computed
    end is a fixed one once the input shapes are (onnxsim folds it)."""
    from .onnx_index import constants, tensor_infos
    proto = model.proto
    if not any(n.op_type == "Loop" for n in proto.graph.node):
        return model
    consts = constants(proto)
    producer = {o: n for n in proto.graph.node for o in n.output}
    readers: dict[str, int] = {}
    for n in proto.graph.node:
        for x in n.input:
            readers[x] = readers.get(x, 0) + 1
    graph_outputs = {o.name for o in proto.graph.output}
    flat_from_13 = model.opset >= 13
    found: list[tuple[str, onnx.NodeProto, int, list[int]]] = []
    for out in model.outputs:
        # back from the output through ops that treat each position alone, to the Slice; each value on
        # the way read by the next op only (another reader would get the whole tensor once cut later)
        node, along, ok = producer.get(out.name), [], readers.get(out.name, 0) == 0
        while ok and node is not None and node.op_type != "Slice":
            ok = node.op_type in _ELEMENTWISE or node.op_type in _ALONG_AXIS
            if node.op_type in _ALONG_AXIS:  # before opset 13 these flatten from their axis on (default 1)
                along.append(next((int(a.i) for a in node.attribute if a.name == "axis"), -1 if flat_from_13 else 1))
            node = producer.get(node.input[0])
            ok = ok and node is not None and readers.get(node.output[0], 0) == 1
        if not ok or node is None or len(node.input) < 4:
            continue
        starts, axes = _const_ints(node.input[1], consts), _const_ints(node.input[3], consts)
        steps = _const_ints(node.input[4], consts) if len(node.input) > 4 and node.input[4] else [1]
        if starts != [0] or axes is None or len(axes) != 1 or steps != [1] or node.input[2] in consts:
            continue
        found.append((out.name, node, axes[0], along))
    if not found:
        return model
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    infos = tensor_infos(m)
    trims, specs = [], list(model.outputs)
    for name, slice_node, axis, along in found:
        data = slice_node.input[0]
        full = infos.get(data)
        if full is None or full.static is None:
            continue
        shape = full.static
        rank = len(shape)
        axis = axis + rank if axis < 0 else axis
        # the softmaxes on the way must not mix positions of the cut axis: not along it (opset 13 on), or
        # (before) flattening only the axes after it
        mixed = [a + rank if a < 0 else a for a in along]
        if not 0 <= axis < rank or any(a == axis if flat_from_13 else a <= axis for a in mixed):
            continue
        sliced = slice_node.output[0]
        # the chain reads the whole tensor; the Slice stays for nothing and onnx prunes it
        for n in m.graph.node:
            for i, x in enumerate(n.input):
                if x == sliced:
                    n.input[i] = data
        if sliced == name:  # the Slice is the output itself: an Identity of the whole tensor instead
            keep = [n for n in m.graph.node if n.output[0] != sliced]
            del m.graph.node[:]
            m.graph.node.extend(keep + [helper.make_node("Identity", [data], [name], name=f"{name}_untrimmed")])
        length = slice_node.input[2]
        added = length not in graph_outputs  # a length the model also answers stays an output
        if added and length not in {o.name for o in m.graph.output}:
            m.graph.output.append(helper.make_tensor_value_info(length, onnx.TensorProto.INT64, None))
        trims.append(Trim(name, axis, length, added))
        k = next(i for i, s in enumerate(specs) if s.name == name)
        specs[k] = TensorSpec(name, shape, specs[k].dtype, trim=(axis, length))
        for o in m.graph.output:
            if o.name == name:
                set_static_shape(o, shape)
    if not trims:
        return model
    from .onnx_index import remove_dead_nodes
    remove_dead_nodes(m)
    m.metadata_props.add(key=TRIM_KEY, value=json.dumps([t.to_json() for t in trims]))
    note = "outputs cut to a computed length at run time: " + ", ".join(
        f"{t.output} (axis {t.axis} up to {t.length})" for t in trims)
    return LoadedModel(model.path, m, model.inputs, tuple(specs), model.opset, model.notes + (note,))


def apply_trims(proto: onnx.ModelProto, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """onnxruntime's answer for a trimmed model as the original model gives it: each cut output at its
    length, the lengths themselves dropped (the artifact's runtime does the same)."""
    trims = trims_of(proto)
    if not trims:
        return outputs
    out = dict(outputs)
    for t in trims:
        arr = out[t.output]
        n = arr.shape[t.axis]
        end = int(np.asarray(outputs[t.length]).reshape(-1)[0])
        end = min(max(end + n if end < 0 else end, 0), n)
        out[t.output] = arr[(slice(None),) * t.axis + (slice(0, end),)]
    for t in trims:
        if t.added:
            out.pop(t.length, None)
    return out
