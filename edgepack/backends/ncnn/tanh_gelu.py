"""A tanh GELU written out in arithmetic, given to pnnx as ONNX's Gelu(approximate="tanh").

GELU's tanh form is 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). Exporters write it out: jax2tf
(magika) as x * 0.044715, three Muls by x, Add, Mul, Tanh, Add 1, Mul 0.5, Mul x; torch (GPT-2's
NewGELU) with Pow(x, 3). pnnx does not fuse the first form at all: ncnn then runs nine layers and a
Split where one in-place GELU would do (magika on x86: binary_op_vector 5.4% and tanh 3.3% of its time).
The second it fuses into ncnn's GELU *without* the tanh flag, that is, into the erf GELU: a different
function, up to 4.7e-4 away.

ONNX's Gelu op with approximate="tanh" (opset 20) pnnx converts right, to GELU with fast_gelu=1, the
same formula. So every match, in any order of the Muls and with the 0.5 anywhere in the product,
becomes one Gelu node. A graph of an older opset is first converted to opset 20 by onnx's version
converter (the copy pnnx gets only; the build checks the result against onnxruntime on the original).
"""
from __future__ import annotations

import math
from collections import Counter

import numpy as np
import onnx
from onnx import helper

GELU_OPSET = 20
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
CUBE_COEF = 0.044715
MAX_DEPTH = 8  # Muls followed back from one value


def _near(value: float, want: float) -> bool:
    return abs(value - want) <= 1e-4 * abs(want)


def _product(gr, name: str, leaves: frozenset = frozenset(), depth: int = 0) -> tuple[float, Counter]:
    """``name`` as coefficient x product of leaf values: Muls, Pows by 2 or 3 and Divs by scalars are
    followed back, scalar constants fold into the coefficient, everything else (and every name in
    ``leaves``) is a leaf."""
    arr = gr.consts.get(name)
    if arr is not None and arr.size == 1 and arr.dtype == np.float32:
        return float(arr.reshape(-1)[0]), Counter()
    node = gr.producer.get(name)
    if name in leaves or node is None or depth >= MAX_DEPTH or len(node.input) != 2:
        return 1.0, Counter({name: 1})
    if node.op_type == "Mul":
        (c1, f1), (c2, f2) = (_product(gr, i, leaves, depth + 1) for i in node.input)
        return c1 * c2, f1 + f2
    exponent = gr.consts.get(node.input[1])
    if node.op_type == "Pow" and exponent is not None and exponent.size == 1 and float(exponent) in (2.0, 3.0):
        c, f = _product(gr, node.input[0], leaves, depth + 1)
        e = int(float(exponent))
        return c ** e, Counter({k: v * e for k, v in f.items()})
    if node.op_type == "Div" and exponent is not None and exponent.size == 1 and float(exponent) != 0.0:
        c, f = _product(gr, node.input[0], leaves, depth + 1)
        return c / float(exponent), f
    return 1.0, Counter({name: 1})


def _inner_x(gr, tanh) -> str | None:
    """x where the Tanh reads sqrt(2/pi) (x + 0.044715 x^3), else None."""
    coef, factors = _product(gr, tanh.input[0])
    if not _near(coef, SQRT_2_OVER_PI) or len(factors) != 1 or sum(factors.values()) != 1:
        return None
    add = gr.producer.get(next(iter(factors)))
    if add is None or add.op_type != "Add" or len(add.input) != 2:
        return None
    for x, rest in (add.input, reversed(add.input)):
        c, f = _product(gr, rest, frozenset({x}))
        if _near(c, CUBE_COEF) and f == Counter({x: 3}):
            return x
    return None


def _gelu_output(gr, tanh, x: str):
    """The node whose output is 0.5 x (1 + tanh(...)), found among the Muls (and Divs) after tanh + 1,
    else None."""
    def is_one(name: str) -> bool:
        coef, factors = _product(gr, name)
        return not factors and _near(coef, 1.0)

    plus_one = [n for n in gr.consumers.get(tanh.output[0], []) if n.op_type == "Add" and len(n.input) == 2
                and any(i != tanh.output[0] and is_one(i) for i in n.input)]
    if len(plus_one) != 1:
        return None
    u = plus_one[0].output[0]
    frontier, seen = [u], set()
    for _ in range(3):  # x, u and 0.5 meet within three nodes
        nxt = []
        for value in frontier:
            for node in gr.consumers.get(value, []):
                if node.op_type not in ("Mul", "Div") or id(node) in seen:
                    continue
                seen.add(id(node))
                c, f = _product(gr, node.output[0], frozenset({x, u}))
                if _near(c, 0.5) and f == Counter({x: 1, u: 1}):
                    return node
                nxt.append(node.output[0])
        frontier = nxt
    return None


def _matches(model: onnx.ModelProto) -> list[tuple[int, str, str]]:
    """(position of the node that writes the GELU, x, the GELU's name) for every tanh GELU."""
    from .rewrite import _Graph
    gr = _Graph(model)
    position = {id(n): i for i, n in enumerate(gr.g.node)}
    found = []
    for tanh in gr.g.node:
        if tanh.op_type != "Tanh":
            continue
        x = _inner_x(gr, tanh)
        out = _gelu_output(gr, tanh, x) if x is not None else None
        if out is not None:
            found.append((position[id(out)], x, out.output[0]))
    return found


def tanh_gelu_to_gelu(model: onnx.ModelProto, matches: list | None = None) -> int:
    """Rewrite ``model`` (of opset >= 20) in place, at ``matches`` (_matches of it, found here if not
    given); how many GELUs it rewrote."""
    from .rewrite import _apply
    plan = {pos: [helper.make_node("Gelu", [x], [out], approximate="tanh", name=f"{out}_gelu")]
            for pos, x, out in (_matches(model) if matches is None else matches)}
    _apply(model.graph, plan, len(plan))
    return len(plan)


def tanh_gelus_as_gelu(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """tanh_gelu_to_gelu on a copy (converted to opset 20 first where older), what nothing reads any
    more dropped: (the copy, how many it rewrote); the model itself where there is no match."""
    from onnx import version_converter
    from .rewrite import _opset, on_copy
    matches = _matches(model)
    if not matches:
        return model, 0
    if _opset(model) < GELU_OPSET:
        model = version_converter.convert_version(model, GELU_OPSET)
        matches = None  # the converter may add or move nodes: found again in what it gives
    return on_copy(lambda m: tanh_gelu_to_gelu(m, matches), model)
