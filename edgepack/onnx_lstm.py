"""LSTM and GRU as primitive ONNX ops, unrolled over the static sequence length.

For backends that refuse the recurrent ops (TVM 0.27's relax importer has neither): the input
projection of every time step is one MatMul, then each step adds the recurrent MatMul and applies
the gates with Sigmoid/Tanh/Mul/Add on [1, batch, H] tensors. Constant weights (the usual case after
simplification) are pre-transposed and the biases folded into one; weights fed as graph inputs are
sliced and transposed in the graph. The sequence length must be static. A node this cannot rewrite
exactly (sequence_lens that vary, layout 1, input_forget, activations with alpha/beta) is left alone and
`refusals` says why, so callers report it as an unsupported op instead of building something wrong.
Users: the TVM backend (compile.import_onnx; ops.DECOMPOSED) and quantized.py, which finds each
step's recurrent MatMul by its constant R^T ([H, gates*H] per direction) and the steps as Slices
on axis 0 of [T, batch, K]: keep that shape of the output when changing this module.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .onnx_index import constants, node_attrs, tensor_infos

RECURRENT = frozenset({"LSTM", "GRU"})
_GATES = {"LSTM": 4, "GRU": 3}
# RNN activation names that are plain ONNX ops without parameters
_PLAIN = {"Sigmoid", "Tanh", "Relu", "Softsign", "Softplus"}


def _shapes(model: onnx.ModelProto) -> dict[str, tuple[list, object]]:
    """tensor -> (dims, None where unknown; numpy dtype); an uninferable graph keeps what it records
    (the static-length check refuses what that leaves unknown)."""
    return {name: (list(info.dims), info.np_dtype) for name, info in tensor_infos(model, initializers=False).items()
            if info.dims is not None}


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def refusal(node, consts: dict, shapes: dict) -> str | None:
    """Why this LSTM/GRU node cannot be decomposed exactly, or None when it can."""
    a = node_attrs(node)
    ins = list(node.input) + [""] * (8 - len(node.input))
    if a.get("layout", 0) != 0:
        return "layout=1 (batch-major) is not decomposed"
    if a.get("input_forget", 0):
        return "input_forget=1 is not decomposed"
    if "activation_alpha" in a or "activation_beta" in a:
        return "activations with alpha/beta are not decomposed"
    acts = [s.decode() if isinstance(s, bytes) else s for s in a.get("activations", [])]
    if any(x not in _PLAIN for x in acts):
        return f"activations {acts} (only {sorted(_PLAIN)} are decomposed)"
    x = shapes.get(ins[0], (None, None))[0]
    if not x or len(x) != 3 or x[0] is None:
        return "its sequence length is not static (fix the input shapes)"
    if ins[4]:
        lens = consts.get(ins[4])
        if lens is None or not np.all(lens == x[0]):
            return "sequence_lens is given and not the full length"
    return None


class _Emitter:
    """Appends nodes and initializers under one unique prefix, in the model's opset."""

    def __init__(self, prefix: str, opset: int, dtype):
        self.prefix, self.opset, self.dtype = prefix, opset, dtype
        self.nodes: list = []
        self.inits: list = []
        self.n = 0

    def name(self, hint: str) -> str:
        self.n += 1
        return f"{self.prefix}/{hint}_{self.n}"

    def const(self, arr, hint: str) -> str:
        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), name))
        return name

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs) -> str:
        out = out or self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out

    def slice(self, x: str, axis: int, start: int, end: int) -> str:
        if self.opset < 10:
            return self.op("Slice", [x], axes=[axis], starts=[start], ends=[end])
        ints = lambda v: self.const(np.array([v], np.int64), "i")  # noqa: E731
        return self.op("Slice", [x, ints(start), ints(end), ints(axis)])

    def unsqueeze(self, x: str, axis: int, out: str | None = None) -> str:
        if self.opset < 13:
            return self.op("Unsqueeze", [x], out, axes=[axis])
        return self.op("Unsqueeze", [x, self.const(np.array([axis], np.int64), "axes")], out)

    def act(self, kind: str, x: str, clip) -> str:
        if clip is not None:
            if self.opset < 11:
                x = self.op("Clip", [x], min=-float(clip), max=float(clip))
            else:
                lo, hi = (self.const(np.array(v, self.dtype), "clip") for v in (-clip, clip))
                x = self.op("Clip", [x, lo, hi])
        return self.op(kind, [x])


def _direction(e: _Emitter, node, d: int, reverse: bool, consts: dict, seq: int, acts: list[str]):
    """One direction: returns (list of H_t in time order, last H, last C or None)."""
    a = node_attrs(node)
    ins = list(node.input) + [""] * (8 - len(node.input))
    lstm = node.op_type == "LSTM"
    hs = int(a["hidden_size"])
    g = _GATES[node.op_type]
    clip = a.get("clip")
    f, gg, hh = acts[0], acts[1], acts[2] if lstm else None
    lbr = bool(a.get("linear_before_reset", 0))
    split_h = not lstm and not lbr   # GRU without lbr multiplies r * H before R_h

    def mat(i: int, lo: int, hi: int, hint: str) -> str:
        """Rows lo:hi of input i's direction d, transposed: a constant [K, n], or [1, K, n] from graph
        inputs (weights fed at run time: MatMul broadcasts the leading 1)."""
        if ins[i] in consts:
            return e.const(consts[ins[i]][d][lo:hi].astype(e.dtype).T, hint)
        return e.op("Transpose", [e.slice(e.slice(ins[i], 0, d, d + 1), 1, lo, hi)], perm=[0, 2, 1])

    def vec(i: int, lo: int, hi: int, hint: str) -> str:
        if ins[i] in consts:
            return e.const(consts[ins[i]][d][lo:hi].astype(e.dtype), hint)
        return e.slice(e.slice(ins[i], 0, d, d + 1), 1, lo, hi)         # [1, n]

    xw = e.op("MatMul", [ins[0], mat(1, 0, g * hs, "W")])
    # every bias folds into the input projection except GRU's Rbh under linear_before_reset,
    # which sits inside r * (H R_h^T + Rbh)
    rb_out = 2 * hs if lbr and not lstm else g * hs                       # Rb entries folded
    if ins[3] in consts:
        b = consts[ins[3]][d].astype(e.dtype)
        folded = b[:g * hs].copy()
        folded[:rb_out] += b[g * hs:g * hs + rb_out]
        xw = e.op("Add", [xw, e.const(folded, "Wb")])
    elif ins[3]:
        rbv = vec(3, g * hs, g * hs + rb_out, "Rb")
        if rb_out < g * hs:
            rbv = e.op("Concat", [rbv, e.const(np.zeros((1, hs), e.dtype), "zero")], axis=1)
        xw = e.op("Add", [e.op("Add", [xw, vec(3, 0, g * hs, "Wb")]), rbv])
    h = e.slice(ins[5], 0, d, d + 1) if ins[5] else None     # [1, batch, H]
    c = e.slice(ins[6], 0, d, d + 1) if lstm and ins[6] else None
    peep = [vec(7, k * hs, (k + 1) * hs, "P") for k in range(3)] if lstm and ins[7] else None
    rt = mat(2, 0, 2 * hs if split_h else g * hs, "R")          # [H, g*H] (GRU: [H, 2H] for z, r)
    rh = mat(2, 2 * hs, 3 * hs, "Rh") if split_h else None
    rbh = None
    if not lstm and lbr:
        rbh = vec(3, 5 * hs, 6 * hs, "Rbh") if ins[3] else e.const(np.zeros(hs, e.dtype), "Rbh")
    steps = range(seq - 1, -1, -1) if reverse else range(seq)
    out = {}
    for t in steps:
        x_t = e.slice(xw, 0, t, t + 1)                        # [1, batch, g*H]
        rec = e.op("MatMul", [h, rt]) if h is not None else None
        gate = lambda k, v: e.slice(v, 2, k * hs, (k + 1) * hs)  # noqa: E731
        if lstm:
            pre = e.op("Add", [x_t, rec]) if rec else x_t
            i, o, fg, cc = (gate(k, pre) for k in range(4))
            if peep is not None and c is not None:
                i = e.op("Add", [i, e.op("Mul", [peep[0], c])])
                fg = e.op("Add", [fg, e.op("Mul", [peep[2], c])])
            i, fg, cc = e.act(f, i, clip), e.act(f, fg, clip), e.act(gg, cc, clip)
            new_c = e.op("Mul", [i, cc])
            if c is not None:
                new_c = e.op("Add", [e.op("Mul", [fg, c]), new_c])
            if peep is not None:
                o = e.op("Add", [o, e.op("Mul", [peep[1], new_c])])
            c = new_c
            h = e.op("Mul", [e.act(f, o, clip), e.act(hh, c, None)])  # clip bounds gate inputs, not C
        else:
            if rec is None:  # H_prev = 0: the recurrent terms vanish, leaving r * Rbh under lbr
                z, rr, hx = (gate(k, x_t) for k in range(3))
                z, rr = e.act(f, z, clip), e.act(f, rr, clip)
                if lbr:
                    hx = e.op("Add", [hx, e.op("Mul", [rr, rbh])])
                hx = e.act(gg, hx, clip)
                h = e.op("Sub", [hx, e.op("Mul", [z, hx])])      # (1 - z) * h~
            else:
                zr = e.op("Add", [e.slice(x_t, 2, 0, 2 * hs), rec if not lbr else e.slice(rec, 2, 0, 2 * hs)])
                z, rr = e.act(f, gate(0, zr), clip), e.act(f, gate(1, zr), clip)
                if lbr:
                    rec_h = e.op("Add", [e.slice(rec, 2, 2 * hs, 3 * hs), rbh])
                    hx = e.op("Add", [gate(2, x_t), e.op("Mul", [rr, rec_h])])
                else:
                    hx = e.op("Add", [gate(2, x_t), e.op("MatMul", [e.op("Mul", [rr, h]), rh])])
                hx = e.act(gg, hx, clip)
                # H = (1 - z) * h~ + z * H_prev = h~ + z * (H_prev - h~)
                h = e.op("Add", [hx, e.op("Mul", [z, e.op("Sub", [h, hx])])])
        out[t] = h
    return [out[t] for t in range(seq)], h, c


def _rewrite(model: onnx.ModelProto, node, consts: dict, shapes: dict, taken: set[str]) -> tuple[list, list]:
    a = node_attrs(node)
    direction = a.get("direction", b"forward")
    direction = direction.decode() if isinstance(direction, bytes) else direction
    dirs = {"forward": [False], "reverse": [True], "bidirectional": [False, True]}[direction]
    n_act = 3 if node.op_type == "LSTM" else 2
    acts = [s.decode() if isinstance(s, bytes) else s for s in a.get("activations", [])]
    acts = acts or (["Sigmoid", "Tanh", "Tanh"] if n_act == 3 else ["Sigmoid", "Tanh"]) * len(dirs)
    base = prefix = (node.name or node.op_type.lower()) + "/unrolled"
    k = 0
    while any(t.startswith(prefix + "/") for t in taken):
        k += 1
        prefix = f"{base}{k}"
    dtype = consts[node.input[1]].dtype if node.input[1] in consts else shapes[node.input[0]][1]
    e = _Emitter(prefix, _opset(model), dtype)
    seq = shapes[node.input[0]][0][0]
    ys, hns, cns = [], [], []
    for d, rev in enumerate(dirs):
        hs_t, h, c = _direction(e, node, d, rev, consts, seq, acts[d * n_act:(d + 1) * n_act])
        ys.append(e.op("Concat", hs_t, axis=0) if seq > 1 else hs_t[0])   # [seq, batch, H]
        hns.append(h)
        cns.append(c)
    outs = list(node.output) + [""] * (3 - len(node.output))
    if outs[0]:
        per_dir = [e.unsqueeze(y, 1) for y in ys]                          # [seq, 1, batch, H]
        e.op("Concat", per_dir, outs[0], axis=1) if len(per_dir) > 1 else e.op("Identity", per_dir, outs[0])
    if outs[1]:
        e.op("Concat", hns, outs[1], axis=0) if len(hns) > 1 else e.op("Identity", hns, outs[1])
    if node.op_type == "LSTM" and outs[2]:
        e.op("Concat", cns, outs[2], axis=0) if len(cns) > 1 else e.op("Identity", cns, outs[2])
    return e.nodes, e.inits


def _node_name(node, i: int) -> str:
    return node.name or f"{node.op_type}_{i}"   # as LoadedModel.ops() names nodes


def refusals(model: onnx.ModelProto) -> dict[str, str]:
    """node name -> why, for the recurrent nodes of the main graph that `decompose` would leave."""
    nodes = [(i, n) for i, n in enumerate(model.graph.node) if n.op_type in RECURRENT]
    if not nodes:
        return {}
    consts, shapes = constants(model), _shapes(model)
    return {_node_name(n, i): why for i, n in nodes if (why := refusal(n, consts, shapes))}


def decomposable(model: onnx.ModelProto) -> set[str]:
    """Names of the recurrent nodes `decompose` rewrites (main graph only: not inside If/Loop bodies)."""
    refused = refusals(model)
    return {name for i, n in enumerate(model.graph.node)
            if n.op_type in RECURRENT and (name := _node_name(n, i)) not in refused}


def decompose(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the model with every decomposable LSTM/GRU node of the main graph unrolled
    (the model itself when there is none)."""
    if not any(n.op_type in RECURRENT for n in model.graph.node):
        return model
    consts, shapes = constants(model), _shapes(model)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    taken = {o for n in model.graph.node for o in n.output} | set(consts)
    new_nodes = []
    for node in out.graph.node:
        if node.op_type not in RECURRENT or refusal(node, consts, shapes):
            new_nodes.append(node)
            continue
        nodes, inits = _rewrite(out, node, consts, shapes, taken)
        new_nodes.extend(nodes)
        out.graph.initializer.extend(inits)
        taken |= {n.output[0] for n in nodes}
    del out.graph.node[:]
    out.graph.node.extend(new_nodes)
    return out
