"""A sequence-first graph with a leading unit axis on every tensor, so pnnx's batch axis is that axis.

PyTorch's nn.Transformer and nn.MultiheadAttention (batch_first=False, their default) export
[T, 1, C] activations: the unit batch is axis 1. pnnx takes axis 0 of every tensor for the batch,
so ncnn drops the sequence axis: a Reshape to [-1, C] becomes a reshape to [C] on one time step and
the next Reshape back to [T, ...] fails at run time ("ncnn failed to compute output"; g2p_id's
seq2seq transformer, every encoder layer and decode step). seq_first.py lifts only a time-major
tail; here the whole graph is lifted: each graph input is reshaped to [1, *shape] first, every op
then works on tensors one rank higher whose axis 0 has size 1 (pnnx's batch, harmless), and each
graph output is reshaped back. The values are the same, element for element:

- element-wise ops: operands right-align, so a leading 1 on the lifted ones broadcasts as before;
- Reshape/Expand targets and Transpose perms gain the leading axis; axis arguments (Slice, Softmax,
  Concat, Gather, Split, reductions, Squeeze/Unsqueeze, LayerNormalization) move up by one when
  counted from the front, and stay when counted from the back (opset < 13 Softmax flattens from
  its axis to 2-D: a leading 1 before the axis changes neither factor);
- Gemm (2-D only) becomes MatMul (+ Add), which takes any rank; MatMul keeps its meaning while
  neither operand is a lifted vector (a 1-D operand would turn into a matrix).

Anything else (a convolution, a shape computation, an op whose axes cannot be moved) leaves the
graph as it is: ``lift_unit_batch`` returns None. Used only as the NCNN conversion's last retry,
and its result is checked against onnxruntime like every conversion.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from .seq_first import gemm_as_matmul

_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Relu", "Sqrt", "Exp", "Log", "Neg", "Abs",
                "Sigmoid", "Tanh", "Erf", "Clip", "Identity", "Reciprocal", "LeakyRelu", "HardSigmoid",
                "HardSwish", "Softplus", "Where", "Equal", "Less", "Greater", "Not", "Cast", "Gelu"}
_AXIS_OPS = {"Softmax": -1, "LogSoftmax": -1, "Concat": None, "Split": 0, "LayerNormalization": -1}
_REDUCE = {"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL2", "ReduceSumSquare"}
_MAX_NODES = 20000   # bounded work on any graph


class _Refuse(Exception):
    pass


def lift_unit_batch(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of the static-shape ``model`` with every tensor one rank higher (a leading 1), or
    None when it has no input whose axis 0 is longer than 1 (pnnx's batch guess is right there)
    or an op this cannot lift."""
    from .rewrite import _Graph
    out = onnx.ModelProto()
    out.CopyFrom(model)
    gr = _Graph(out)
    runtime_inputs = [i for i in gr.g.input if i.name not in gr.consts]
    if len(gr.g.node) > _MAX_NODES or not any(len(gr.shapes.get(i.name, ())) >= 2 and gr.shapes[i.name][0] > 1
                                              for i in runtime_inputs):
        return None
    try:
        nodes = _lifted_nodes(gr, runtime_inputs)
    except (_Refuse, KeyError):
        return None
    del gr.g.node[:]
    gr.g.node.extend(nodes)
    del gr.g.value_info[:]   # every inner shape changed: inference fills them again
    return out


def _lifted_nodes(gr, runtime_inputs) -> list:
    lifted: dict[str, str] = {}   # original name -> its lifted tensor
    nodes = []
    for i in runtime_inputs:
        name = gr.fresh(i.name + "_lifted")
        nodes.append(helper.make_node("Reshape", [i.name, _shape(gr, gr.shapes[i.name])], [name], name=gr.fresh("lift")))
        lifted[i.name] = name
    outputs = {o.name for o in gr.g.output}
    for node in gr.g.node:
        if node.op_type == "Constant":
            nodes.append(node)
            continue
        new = _lift_node(gr, node, lifted)
        for o in node.output:
            if o:
                lifted[o] = o if o not in outputs else gr.fresh(o + "_lifted")
        for n in new:
            for k, o in enumerate(n.output):
                if o in lifted and lifted[o] != o:
                    n.output[k] = lifted[o]
        nodes.extend(new)
    for o in gr.g.output:
        if o.name not in lifted or o.name in gr.consts:
            raise _Refuse(o.name)
        nodes.append(helper.make_node("Reshape", [lifted[o.name], _shape(gr, gr.shapes[o.name], lead=False)], [o.name],
                                      name=gr.fresh("unlift")))
    return nodes


def _shape(gr, dims, lead: bool = True) -> str:
    return gr.add_const("shape", np.array(([1] if lead else []) + [int(d) for d in dims], np.int64))


def _up(axis: int) -> int:
    return axis + 1 if axis >= 0 else axis


def _set_attr(node, name: str, value) -> None:
    keep = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(keep + [helper.make_attribute(name, value)])


def _lift_node(gr, node, lifted: dict[str, str]) -> list:
    from .rewrite import _attr
    op = node.op_type
    ins = list(node.input)
    is_lifted = [bool(i) and i in lifted for i in ins]
    if not any(is_lifted):
        raise _Refuse(op)   # computed from constants only: onnxsim folds these, not expected here
    new = onnx.NodeProto()
    new.CopyFrom(node)
    for k, i in enumerate(ins):
        if is_lifted[k]:
            new.input[k] = lifted[i]
    rank = {i: len(gr.shapes[i]) for i in ins if i}

    def const_in(k):
        if k >= len(ins) or not ins[k]:
            return None
        if ins[k] not in gr.consts:
            raise _Refuse(op)
        return [int(v) for v in np.asarray(gr.consts[ins[k]]).reshape(-1)]

    def set_const_in(k, values):
        while len(new.input) <= k:
            new.input.append("")
        new.input[k] = gr.add_const("axes", np.array(values, np.int64))

    if op in _ELEMENTWISE:
        return [new]
    if op == "MatMul":
        if any(rank[i] < 2 for i in ins):
            raise _Refuse(op)
        return [new]
    if op == "Gemm":
        return _gemm(gr, node, lifted)
    if op in ("Reshape", "Expand"):
        dims = const_in(1)
        if dims is None or (op == "Reshape" and 0 in dims) or not is_lifted[0]:
            raise _Refuse(op)
        new.input[1] = _shape(gr, dims)
        return [new]
    if op == "Transpose":
        perm = _attr(node, "perm", None) or list(reversed(range(rank[ins[0]])))
        _set_attr(new, "perm", [0] + [p + 1 for p in perm])
        return [new]
    if op == "Slice":
        starts = const_in(1)
        axes = const_in(3) if len(ins) > 3 and ins[3] else list(range(len(starts or [])))
        if starts is None or not is_lifted[0] or any(is_lifted[1:]):
            raise _Refuse(op)
        set_const_in(3, [_up(a) for a in axes])
        return [new]
    if op in _REDUCE or op in ("Squeeze", "Unsqueeze"):
        axes = _attr(node, "axes", None)
        if axes is not None:
            _set_attr(new, "axes", [_up(a) for a in axes])
        elif len(ins) > 1 and ins[1]:
            set_const_in(1, [_up(a) for a in const_in(1)])
        else:
            raise _Refuse(op)   # every axis (every unit axis for Squeeze): the lifted one too
        return [new]
    if op in _AXIS_OPS:
        if op == "Concat" and not all(is_lifted):
            raise _Refuse(op)   # a constant part would need the leading axis too
        if op == "Split" and any(is_lifted[1:]):
            raise _Refuse(op)
        default = _AXIS_OPS[op]
        _set_attr(new, "axis", _up(_attr(node, "axis", default if default is not None else 0)))
        return [new]
    if op == "Gather":
        if is_lifted[0] and not is_lifted[1]:
            _set_attr(new, "axis", _up(_attr(node, "axis", 0)))
            return [new]
        if not is_lifted[0] and is_lifted[1] and _attr(node, "axis", 0) == 0:
            return [new]   # an embedding lookup: the ids' leading 1 leads the result
        raise _Refuse(op)
    raise _Refuse(op)


def _gemm(gr, node, lifted) -> list:
    """Gemm(A, B, C), A lifted, B and C constant -> MatMul (+ Add): the same sums on any rank."""
    from .rewrite import _attr
    ins = list(node.input)
    if (_attr(node, "transA", 0) or ins[0] not in lifted or ins[1] not in gr.consts
            or (len(ins) > 2 and ins[2] and ins[2] not in gr.consts)):
        raise _Refuse("Gemm")
    return gemm_as_matmul(gr, node, lifted[ins[0]])
