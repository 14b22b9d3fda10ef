"""Batch-N signal models on NCNN: a float input [N, W] (N chunks of audio) lifted to batch 1.

pnnx takes a tensor's first axis for the batch and ncnn has none, so a model that runs a Conv1d
front end over N chunks at once and then an LSTM over the N chunks as its sequence (Silero VAD's
sequence model: input [8, 576] -> reflect Pad -> STFT Conv1d -> magnitude -> four Conv1d -> LSTM)
converts, but ncnn computes only the first chunk ("ncnn failed to compute output"). Lifted, every
tensor from that input on is batch 1.

[N, W] and [N, C, W] are held as [1, 1, N, W] and [1, C, N, W] ("rows"): a Conv1d becomes a
Conv2d with a one-high kernel (the N chunks stacked along H never mix), a Pad or Slice moves its
axes, Unsqueeze/Squeeze of the unit channel of [N, W] are identities, element-wise ops stay. The
lift ends where a Transpose makes [N, C, 1] into an LSTM's [N, 1, C] (sequence N, batch 1): held
[1, C, N, 1], that is Reshape [1, C, N] + Transpose (2, 0, 1), and pnnx, which follows the batch
axis through a Transpose, then sees the LSTM as torch exports it (batch on axis 1).

The Reshape that turns the model input into [1, 1, N, W] is pinned to TVM (partition_lift.PIN),
so the NCNN segment sees batch 1. Values are unchanged; any op outside the handled set, or a
model output still in the rows layout, leaves the graph as it was.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from .backends.ncnn.rewrite import _attr, _axes_of, _Graph, _slice_args
from .partition_lift import ELEMENTWISE, PIN

UNARY = frozenset({"Relu", "Sigmoid", "Tanh", "Exp", "Sqrt", "Neg", "Abs", "LeakyRelu", "Clip", "Log", "Softplus"})
BINARY = frozenset({"Add", "Sub", "Mul", "Div", "Max", "Min", "Pow"})


class _Refuse(Exception):
    """A node the lift does not handle: the graph stays as it was."""


def _inputs(gr: _Graph) -> list:
    """Float graph inputs of shape [N, W] with N > 1 (what the lift starts from)."""
    out = []
    for v in gr.g.input:
        shape = gr.shapes.get(v.name)
        if v.name not in gr.consts and v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT and shape \
                and len(shape) == 2 and shape[0] > 1:
            out.append(v.name)
    return out


def _rows_axis(rank: int, axis: int) -> int:
    """Where axis ``axis`` of an [N, W] / [N, C, W] tensor sits in its rows layout."""
    axis = axis + rank if axis < 0 else axis
    if axis == 0:
        raise _Refuse("an op on the chunk axis")
    return {2: {1: 3}, 3: {1: 1, 2: 3}}[rank][axis]


class _Lift:
    def __init__(self, gr: _Graph):
        self.gr = gr
        self.layout: dict[str, str] = {}  # lifted tensor -> its layout (only "rows" today)
        self.convs = 0
        self.alias: dict[str, str] = {}  # a tensor whose held form is another's (no node computes it)

    def const(self, base: str, arr) -> str:
        return self.gr.add_const(base, np.asarray(arr))

    def shape(self, name: str) -> tuple:
        s = self.gr.shapes.get(name)
        if s is None:
            raise _Refuse(f"{name}: no static shape")
        return s

    def operand(self, name: str, layout: str, rank: int) -> str:
        """A constant operand of an element-wise op, broadcast into ``layout``."""
        arr = np.asarray(self.gr.consts[name])
        if arr.size == 1:
            return name
        if arr.ndim > rank or (arr.ndim == rank and arr.shape[0] != 1):
            raise _Refuse(f"{name}: a constant along the chunk axis")
        full = arr.reshape((1,) * (rank - arr.ndim) + arr.shape)
        if layout == "rows":
            rep = full[:, None, :] if rank == 2 else full[:, :, None, :]
            return self.const("operand", rep.reshape((1,) + rep.shape) if rank == 2 else rep)
        raise _Refuse(f"{name}: a constant in layout {layout}")

    def node(self, node) -> list:
        """The replacement nodes for ``node``, some of whose inputs are lifted."""
        op, gr = node.op_type, self.gr
        lifted = [x for x in node.input if x in self.layout]
        layouts = {self.layout[x] for x in lifted}
        if len(layouts) != 1:
            raise _Refuse(f"{node.name}: mixes layouts")
        layout = layouts.pop()
        rank = len(self.shape(lifted[0]))
        for x in node.input:
            if x and x not in self.layout and x not in gr.consts:
                raise _Refuse(f"{node.name} mixes lifted and unlifted tensors")
        if op in BINARY:
            if any(len(self.shape(x)) != rank for x in lifted):
                # [N, C, W] + [N, W] broadcasts N against C in ONNX, chunk against chunk when held
                raise _Refuse(f"{node.name}: lifted operands of different ranks")
        elif lifted != [node.input[0]]:
            raise _Refuse(f"{node.name}: a lifted operand other than the first")
        out = node.output[0]
        if op in UNARY or (op in ELEMENTWISE and len(node.input) == 1):
            self.layout[out] = layout
            return [node]
        if op in BINARY:
            ins = [x if x in self.layout else self.operand(x, layout, rank) for x in node.input]
            self.layout[out] = layout
            return [helper.make_node(op, ins, [out], name=node.name)]
        if op in ("Unsqueeze", "Squeeze"):
            return self.unit_axis(node, layout, rank)
        if op == "Transpose":
            return self.transpose(node, layout, rank)
        if op == "Pad":
            return self.pad(node, rank)
        if op == "Slice":
            return self.slice(node, rank)
        if op == "Conv":
            return self.conv(node, rank)
        raise _Refuse(f"{node.name}: op {op}")

    def unit_axis(self, node, layout: str, rank: int) -> list:
        axes = _axes_of(self.gr, node)
        out = node.output[0]
        if axes is None or len(axes) != 1:
            raise _Refuse(f"{node.name}: not one axis")
        a = axes[0] + (rank + (node.op_type == "Unsqueeze") if axes[0] < 0 else 0)
        if layout == "rows" and a == 1 and (node.op_type == "Unsqueeze") == (rank == 2):
            self.layout[out] = "rows"  # [N, W] <-> [N, 1, W]: both held [1, 1, N, W], so no node
            self.alias[out] = self.alias.get(node.input[0], node.input[0])
            return []
        raise _Refuse(f"{node.name}: {node.op_type} axis {a} in layout {layout}")

    def transpose(self, node, layout: str, rank: int) -> list:
        perm = list(_attr(node, "perm") or [])
        x, out = node.input[0], node.output[0]
        shape = self.shape(x)
        if layout == "rows" and rank == 3 and perm == [0, 2, 1] and shape[2] == 1:
            # [N, C, 1] -> [N, 1, C] (an LSTM's sequence): held [1, C, N, 1]; the output is not lifted
            flat = self.gr.fresh(out + "_flat")
            return [helper.make_node("Reshape", [x, self.const("shape", np.array([1, shape[1], shape[0]], np.int64))],
                                     [flat], name=self.gr.fresh(node.name + "_flat")),
                    helper.make_node("Transpose", [flat], [out], name=node.name, perm=[2, 0, 1])]
        raise _Refuse(f"{node.name}: Transpose {perm} in layout {layout}")

    def pad(self, node, rank: int) -> list:
        pads = self.gr.const_ints(node.input[1]) if len(node.input) > 1 else None
        if pads is None or len(pads) != 2 * rank or pads[0] or pads[rank] or (len(node.input) > 3 and node.input[3]):
            raise _Refuse(f"{node.name}: not a constant Pad of the chunks' own axes")
        new = [0] * 8
        for a in range(1, rank):
            r = _rows_axis(rank, a)
            new[r], new[4 + r] = pads[a], pads[rank + a]
        self.layout[node.output[0]] = "rows"
        p = helper.make_node("Pad", [node.input[0], self.const("pads", np.array(new, np.int64)), *node.input[2:]],
                             list(node.output), name=node.name)
        p.attribute.extend(node.attribute)
        return [p]

    def slice(self, node, rank: int) -> list:
        args = _slice_args(self.gr, node)
        if args is None:
            raise _Refuse(f"{node.name}: a Slice with computed bounds")
        starts, ends, axes, steps = args
        self.layout[node.output[0]] = "rows"
        return [helper.make_node("Slice", [node.input[0], self.const("starts", np.array(starts, np.int64)),
                                           self.const("ends", np.array(ends, np.int64)),
                                           self.const("axes", np.array([_rows_axis(rank, a) for a in axes], np.int64)),
                                           self.const("steps", np.array(steps, np.int64))],
                                 list(node.output), name=node.name)]

    def conv(self, node, rank: int) -> list:
        """Conv1d over [N, C, W] -> Conv2d with a one-high kernel over [1, C, N, W]."""
        w = self.gr.consts.get(node.input[1])
        if rank != 3 or w is None or w.ndim != 3 or _attr(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            raise _Refuse(f"{node.name}: not a Conv1d with constant weights")
        k = int(w.shape[2])
        pads = list(_attr(node, "pads", [0, 0]))
        conv = helper.make_node("Conv", [node.input[0], self.const("w", w.reshape(w.shape[0], w.shape[1], 1, k)),
                                         *node.input[2:]], list(node.output), name=node.name,
                                kernel_shape=[1, k], strides=[1, *_attr(node, "strides", [1])],
                                dilations=[1, *_attr(node, "dilations", [1])], pads=[0, pads[0], 0, pads[1]],
                                group=_attr(node, "group", 1))
        self.layout[node.output[0]] = "rows"
        self.convs += 1
        return [conv]


def lift_signal(model: onnx.ModelProto) -> int:
    """Lift ``model`` in place (see the module docstring); returns how many inputs were lifted (0:
    unchanged)."""
    work = onnx.ModelProto()
    work.CopyFrom(model)
    gr = _Graph(work)
    starts = _inputs(gr)
    if not starts:
        return 0
    lift = _Lift(gr)
    nodes = []
    for name in starts:
        n, width = gr.shapes[name]
        held = gr.fresh(name + "_rows")
        nodes.append(helper.make_node("Reshape", [name, gr.add_const("shape", np.array([1, 1, n, width], np.int64))],
                                      [held], name=gr.fresh(name + "_rows") + PIN))
        lift.layout[name] = "rows"
    lift.alias.update({name: nodes[k].output[0] for k, name in enumerate(starts)})
    try:
        for node in list(gr.g.node):
            if not any(x in lift.layout for x in node.input if x):
                nodes.append(node)
                continue
            nodes += lift.node(node)
    except _Refuse:
        return 0
    if not lift.convs:
        return 0
    if any(out.name in lift.layout for out in gr.g.output):
        return 0  # a lifted model output would need its layout undone (Silero VAD has none)
    for n in nodes[len(starts):]:
        n.input[:] = [lift.alias.get(x, x) for x in n.input]
    del gr.g.node[:]
    gr.g.node.extend(nodes)
    del gr.g.value_info[:]
    model.CopyFrom(work)
    return len(starts)
