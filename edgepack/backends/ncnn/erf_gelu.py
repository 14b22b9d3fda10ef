"""An erf GELU whose 0.5 was folded away, given back to pnnx in the form it fuses into ncnn's GELU.

GELU(x) = x * 0.5 * (1 + erf(x / sqrt 2)). Paddle's exporter writes it as Div, Erf, Add, Mul, Mul(0.5),
which pnnx fuses into one GELU layer. But onnxsim (the build's simplify stage) folds the trailing
Mul(0.5) into the Conv that reads it, and what is left, x * (1 + erf(x / sqrt 2)) = 2 GELU(x), pnnx
does not recognise: ncnn then runs four layers (a division, an erf, an addition and a two-input
multiplication, plus a Split to keep x alive) where one in-place GELU would do. On PP-OCRv6 tiny det
(13 such GELUs), those layers were ~20% of its time on x86 (binary_op_vector 11%, erf 7%, copies).

The rewrite writes each match in Paddle's form again, GELU(x), and puts the factor 2 back where
onnxsim took the 0.5 from: into the weights of the Convs that read it (2 W is exact in binary floating
point, fp16 included), or, where something else reads it, as a Mul by 2. Also matched: x * (1/sqrt 2)
instead of x / sqrt 2 (pnnx fuses neither the half nor the full GELU written so), either operand
order of the Add and Muls, and the half taken before the x, 0.5 * (1 + erf(x / sqrt 2)) * x (smart-turn
v3's eight GELUs: five layers and a Split each, where one GELU layer does).
"""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper

SQRT2 = math.sqrt(2.0)


def _scalar(gr, name: str) -> float | None:
    arr = gr.consts.get(name)
    if arr is None or arr.size != 1 or arr.dtype != np.float32:
        return None
    return float(arr.reshape(-1)[0])


def _near(value: float | None, want: float) -> bool:
    return value is not None and abs(value - want) <= 1e-6 * want


def _other(node, name: str) -> str | None:
    """The input of a two-input node that is not ``name`` (None unless exactly one input is)."""
    if len(node.input) != 2 or list(node.input).count(name) != 1:
        return None
    return node.input[1] if node.input[0] == name else node.input[0]


def _match(gr, erf):
    """(x, the nodes that make GELU or 2 GELU of x, the name that holds it, factor 1 or 2), else None."""
    scaled = gr.producer.get(erf.input[0])
    if scaled is None or len(scaled.input) != 2 or gr.only_reader(scaled.output[0]) is not erf:
        return None
    if scaled.op_type == "Div" and _near(_scalar(gr, scaled.input[1]), SQRT2):
        x = scaled.input[0]
    elif scaled.op_type == "Mul":
        consts = [i for i in scaled.input if _near(_scalar(gr, i), 1 / SQRT2)]
        if len(consts) != 1:
            return None
        x = _other(scaled, consts[0])
    else:
        return None
    add = gr.only_reader(erf.output[0])
    if add is None or add.op_type != "Add" or not _near(_scalar(gr, _other(add, erf.output[0]) or ""), 1.0):
        return None
    mul = gr.only_reader(add.output[0])
    if mul is not None and mul.op_type == "Mul" and _near(_scalar(gr, _other(mul, add.output[0]) or ""), 0.5):
        # the half before the x: 0.5 (1 + erf) then x (smart-turn's quantised Whisper encoder), the same
        # bits as Paddle's order (a half is exact either way), which pnnx does not fuse
        by_x = gr.only_reader(mul.output[0])
        if by_x is None or by_x.op_type != "Mul" or _other(by_x, mul.output[0]) != x:
            return None
        return x, [scaled, erf, add, mul, by_x], by_x.output[0], 1
    if mul is None or mul.op_type != "Mul" or _other(mul, add.output[0]) != x:
        return None
    nodes = [scaled, erf, add, mul]
    half = gr.only_reader(mul.output[0])
    if half is not None and half.op_type == "Mul" and _near(_scalar(gr, _other(half, mul.output[0]) or ""), 0.5):
        # with x / sqrt 2, pnnx fuses it already
        return None if scaled.op_type == "Div" else (x, nodes + [half], half.output[0], 1)
    return x, nodes, mul.output[0], 2


def _doubled_convs(gr, name: str) -> list | None:
    """The Convs that read ``name`` as their data input, when nothing else reads it and each has its
    weights as an initializer; else None."""
    users = gr.consumers.get(name, [])
    if not users or name in gr.outputs:
        return None
    inits = {i.name for i in gr.g.initializer}
    for node in users:
        if node.op_type != "Conv" or node.input[0] != name or len(node.input) < 2 or node.input[1] not in inits \
                or name in node.input[1:]:
            return None
    return users


def erf_gelu_to_gelu(model: onnx.ModelProto) -> int:
    """Rewrite ``model`` in place; how many GELUs it rewrote."""
    from .rewrite import _apply, _Graph
    gr = _Graph(model)
    plan, count = {}, 0
    position = {id(n): i for i, n in enumerate(gr.g.node)}
    taken: set[int] = set()
    consts: dict[float, str] = {}  # one initializer per scalar, shared by every rewritten GELU

    def const(v: float) -> str:
        if v not in consts:
            consts[v] = gr.add_const("gelu_c", np.array(v, dtype=np.float32))
        return consts[v]

    for erf in list(gr.g.node):
        if erf.op_type != "Erf":
            continue
        found = _match(gr, erf)
        if found is None or any(id(n) in taken for n in found[1]):
            continue
        x, nodes, out, factor = found
        taken.update(id(n) for n in nodes)
        d, e, a, m = (gr.fresh("gelu") for _ in range(4))
        gelu = out if factor == 1 else gr.fresh("gelu")
        new = [helper.make_node("Div", [x, const(SQRT2)], [d]), helper.make_node("Erf", [d], [e]),
               helper.make_node("Add", [e, const(1.0)], [a]), helper.make_node("Mul", [x, a], [m]),
               helper.make_node("Mul", [m, const(0.5)], [gelu])]
        if factor == 2:
            convs = _doubled_convs(gr, out)
            if convs is None:
                new.append(helper.make_node("Mul", [gelu, const(2.0)], [out]))
            else:
                for conv in convs:
                    conv.input[0] = gelu
                    conv.input[1] = gr.add_const(conv.input[1], (gr.consts[conv.input[1]] * 2).astype(np.float32))
        # the new nodes take the place of the last matched one, where x and every reader's order hold
        plan[max(position[id(n)] for n in nodes)] = new
        for n in nodes:
            plan.setdefault(position[id(n)], [])
        count += 1
    _apply(gr.g, plan, count)
    return count


def erf_gelus_as_gelu(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """erf_gelu_to_gelu on a copy, the replaced constants dropped: (the copy, how many it rewrote)."""
    from .rewrite import on_copy
    return on_copy(erf_gelu_to_gelu, model)
