"""If nodes whose condition is only known at run time, as Where: both branches computed, the
condition picks each output.

Neither backend takes If (ncnn has no layer; TVM 0.27's relax importer refuses it). An If whose
condition is a constant is folded away by onnxsim; what is left decides on data, e.g.
openWakeWord's "hey jarvis" model runs a second, verifier MLP only when the first one's score
passes a threshold. Computing both branches and selecting with Where gives the same outputs as long
as the branch not taken cannot fail or change anything, and both give outputs of one static shape.
So a branch is inlined only when:
- its outputs have the same static shape and type as the other branch's;
- it holds no loop, random or sequence op;
- every index or shape input of its ops (Gather's indices, Reshape's shape, Slice's bounds, ...) is a
  constant: an index computed from data could be out of range exactly when the branch is not taken.
Other Ifs stay, and the backends refuse them by name as before. Nested Ifs are lowered inside out.
The cost: the branch not taken is computed too (the build log says how many nodes each If adds).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .model import LoadedModel, _with

_NEVER = frozenset({"Loop", "Scan", "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                    "Multinomial", "Bernoulli", "SequenceConstruct", "SequenceInsert", "SequenceAt",
                    "SequenceEmpty", "SplitToSequence", "ConcatFromSequence", "Optional", "OptionalGetElement"})
# input positions that index or shape: must be constants inside an inlined branch
_INDEX_INPUTS = {"Reshape": (1,), "Expand": (1,), "Tile": (1,), "Range": (0, 1, 2), "ConstantOfShape": (0,),
                 "Slice": (1, 2, 3, 4), "Gather": (1,), "GatherElements": (1,), "GatherND": (1,),
                 "ScatterND": (1,), "ScatterElements": (1,), "OneHot": (0, 1), "Resize": (1, 2, 3), "Pad": (1, 2),
                 "Unsqueeze": (1,), "Squeeze": (1,), "TopK": (1,), "Split": (1,), "Upsample": (1,),
                 "ReduceSum": (1,), "ReduceMean": (1,), "ReduceMax": (1,), "ReduceMin": (1,), "ReduceProd": (1,),
                 "ReduceL1": (1,), "ReduceL2": (1,), "ReduceLogSumExp": (1,), "ReduceSumSquare": (1,)}


def lower_if(model: LoadedModel) -> LoadedModel:
    """The model with each If that qualifies computed as Where; unchanged without one."""
    if "If" not in model.ops():
        return model
    proto = onnx.ModelProto()
    proto.CopyFrom(model.proto)
    lowered, added, kept = _lower_graph(proto, proto.graph, _constants(proto.graph, set()), "")
    if not lowered:
        return model
    note = f"If as Where: {lowered} If node(s), both branches computed (+{added} nodes)"
    if kept:
        note += f"; {kept} left (a branch with a computed index or shape, or outputs of another shape)"
    return _with(model, proto, note)


def _constants(graph: onnx.GraphProto, outer: set[str]) -> set[str]:
    return outer | {i.name for i in graph.initializer} | {n.output[0] for n in graph.node if n.op_type == "Constant"}


def _lower_graph(model: onnx.ModelProto, graph: onnx.GraphProto, consts: set[str], scope: str) -> tuple[int, int, int]:
    """Lower the qualifying Ifs of ``graph`` in place; (lowered, nodes added, Ifs kept)."""
    lowered = added = kept = 0
    nodes = []
    for k, node in enumerate(graph.node):
        if node.op_type != "If" or node.domain not in ("", "ai.onnx"):
            nodes.append(node)
            continue
        branches = {a.name: a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH}
        for g in branches.values():  # inside out: a nested If first
            sub = _lower_graph(model, g, _constants(g, consts), f"{scope}{node.name or k}/")
            lowered, added, kept = lowered + sub[0], added + sub[1], kept + sub[2]
        inlined = _inline(model, graph, node, branches, consts, f"{scope}{node.name or f'if{k}'}")
        if inlined is None:
            nodes.append(node)
            kept += 1
        else:
            nodes.extend(inlined)
            lowered += 1
            added += len(inlined) - 1
    del graph.node[:]
    graph.node.extend(nodes)
    return lowered, added, kept


def _inline(model, graph: onnx.GraphProto, node, branches: dict, consts: set[str], prefix: str) -> list | None:
    """The nodes that replace ``node`` (an If in ``graph``, which gets their initializers), or None."""
    then_g, else_g = branches.get("then_branch"), branches.get("else_branch")
    if then_g is None or else_g is None or not _safe(then_g, consts) or not _safe(else_g, consts):
        return None
    if not _same_outputs(model, node, len(node.output)):
        return None
    out, ends = [], []
    for tag, g in (("then", then_g), ("else", else_g)):
        rename = {}
        for init in g.initializer:
            new = onnx.TensorProto()
            new.CopyFrom(init)
            new.name = rename[init.name] = f"{prefix}/{tag}/{init.name}"
            graph.initializer.append(new)
        for n in g.node:
            copy = onnx.NodeProto()
            copy.CopyFrom(n)
            del copy.input[:]
            copy.input.extend(rename.get(i, i) for i in n.input)
            for j, o in enumerate(n.output):
                if o:
                    rename[o] = f"{prefix}/{tag}/{o}"
                    copy.output[j] = rename[o]
            copy.name = f"{prefix}/{tag}/{n.name}" if n.name else ""
            out.append(copy)
        ends.append([rename.get(o.name, o.name) for o in g.output])
    cond = f"{prefix}/cond_scalar"
    shape = f"{prefix}/scalar_shape"
    graph.initializer.append(numpy_helper.from_array(np.zeros(0, np.int64), shape))
    out.append(helper.make_node("Reshape", [node.input[0], shape], [cond], name=f"{prefix}/cond"))
    for j, name in enumerate(node.output):
        if name:
            out.append(helper.make_node("Where", [cond, ends[0][j], ends[1][j]], [name], name=f"{prefix}/where{j}"))
    return out


def _safe(g: onnx.GraphProto, outer_consts: set[str]) -> bool:
    consts = _constants(g, outer_consts)
    for n in g.node:
        if n.op_type in _NEVER or n.op_type == "If" or n.domain not in ("", "ai.onnx"):
            return False
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
            return False
        for pos in _INDEX_INPUTS.get(n.op_type, ()):
            if pos < len(n.input) and n.input[pos] and n.input[pos] not in consts:
                return False
    return True


def _same_outputs(model: onnx.ModelProto, node, n_out: int) -> bool:
    """Both branches give n_out outputs of one static shape and type each (shape inference of the
    whole model types each branch's outputs in place)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - an uninferable graph keeps its If
        return False
    twin = _find(inferred.graph, list(node.output))
    if twin is None:
        return False
    branches = {a.name: a.g for a in twin.attribute if a.type == onnx.AttributeProto.GRAPH}

    def spec(v):
        t = v.type.tensor_type
        if not t.HasField("shape") or not all(d.HasField("dim_value") for d in t.shape.dim):
            return None
        return t.elem_type, tuple(d.dim_value for d in t.shape.dim)
    outs = [list(branches[b].output) for b in ("then_branch", "else_branch")]
    if any(len(o) != n_out for o in outs):
        return False
    return all(spec(a) is not None and spec(a) == spec(b) for a, b in zip(*outs))


def _find(graph: onnx.GraphProto, outputs: list[str]):
    """The node with these outputs, in ``graph`` or any of its subgraphs."""
    for n in graph.node:
        if list(n.output) == outputs:
            return n
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                found = _find(a.g, outputs)
                if found is not None:
                    return found
    return None
