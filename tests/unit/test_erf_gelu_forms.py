"""edgepack/backends/ncnn/erf_gelu.py: an erf GELU whose 0.5 onnxsim folded into the next Conv, and the
forms pnnx does not fuse, written again in the form it fuses; checked against onnxruntime in-process,
and left alone where the pattern is not a GELU."""
from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgepack.backends.ncnn.erf_gelu import erf_gelus_as_gelu

C = 8


def gelu_model(scale_op: str = "Div", scale: float = math.sqrt(2.0), one: float = 1.0, half: bool = False,
               reader: str = "Conv", mul_x: str = "x", extra_reader: bool = False,
               half_first: bool = False) -> onnx.ModelProto:
    """x [1, 8, 6, 6] -> x * (erf(x op scale) + one) [* 0.5] -> a Conv 1x1 (or a Relu) -> y; half_first:
    ((erf(x op scale) + one) * 0.5) * x."""
    rng = np.random.default_rng(7)
    inits = [numpy_helper.from_array(np.array(v, dtype=np.float32), n)
             for n, v in (("s", scale), ("one", one), ("half", 0.5))]
    inits.append(numpy_helper.from_array(rng.standard_normal((C, C, 1, 1)).astype(np.float32), "w"))
    inits.append(numpy_helper.from_array(rng.standard_normal(C).astype(np.float32), "b"))
    nodes = [helper.make_node("Relu", ["x"], ["x2"]),  # another tensor, for a Mul that reads the wrong one
             helper.make_node(scale_op, ["x", "s"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["one", "e"], ["a"])]
    if half_first:
        nodes += [helper.make_node("Mul", ["half", "a"], ["h"]), helper.make_node("Mul", [mul_x, "h"], ["m"])]
    else:
        nodes.append(helper.make_node("Mul", ["a", mul_x], ["m"]))
    g = "m"
    if half:
        nodes.append(helper.make_node("Mul", ["m", "half"], ["g"]))
        g = "g"
    if reader == "Conv":
        nodes.append(helper.make_node("Conv", [g, "w", "b"], ["y0"], kernel_shape=[1, 1]))
    else:
        nodes.append(helper.make_node("Relu", [g], ["y0"]))
    nodes.append(helper.make_node("Add", ["y0", "x2"], ["y"]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, C, 6, 6])]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("d", TensorProto.FLOAT, [1, C, 6, 6]))
    graph = helper.make_graph(nodes, "gelu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, 6, 6])],
                              outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def run(model: onnx.ModelProto, x: np.ndarray) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def canonical_gelus(model: onnx.ModelProto) -> int:
    """How many Div(x, sqrt 2) -> Erf -> Add 1 -> Mul x -> Mul 0.5 chains the graph holds."""
    ops = [n.op_type for n in model.graph.node]
    return sum(ops[i:i + 5] == ["Div", "Erf", "Add", "Mul", "Mul"] for i in range(len(ops)))


@pytest.mark.parametrize("form, reader, doubled", [
    ({}, "Conv", "weights"),                                    # PP-OCRv6 after onnxsim: 2 GELU(x) -> Conv
    ({}, "Relu", "Mul"),                                        # 2 GELU(x) read by something else
    ({"scale_op": "Mul", "scale": 1 / math.sqrt(2.0)}, "Conv", "weights"),
    ({"half": True, "scale_op": "Mul", "scale": 1 / math.sqrt(2.0)}, "Relu", None),
    ({"half_first": True}, "Relu", None),                       # smart-turn v3: 0.5 (1 + erf) first, then x
    ({"half_first": True, "scale_op": "Mul", "scale": 1 / math.sqrt(2.0)}, "Conv", None),
])
def test_gelus_are_written_in_the_form_pnnx_fuses(form, reader, doubled):
    model = gelu_model(reader=reader, **form)
    rewritten, count = erf_gelus_as_gelu(model)
    assert count == 1
    onnx.checker.check_model(rewritten)
    assert canonical_gelus(rewritten) == 1
    ops = [n.op_type for n in rewritten.graph.node]
    # a Mul by 2 only where a reader other than a Conv takes 2 GELU(x)
    assert ops.count("Mul") == 2 + (doubled == "Mul")
    w = {i.name: numpy_helper.to_array(i) for i in rewritten.graph.initializer}
    conv = next((n for n in rewritten.graph.node if n.op_type == "Conv"), None)
    if conv is not None:
        np.testing.assert_array_equal(w[conv.input[1]], numpy_helper.to_array(model.graph.initializer[3])
                                      * (2 if doubled == "weights" else 1))
    x = np.random.default_rng(1).standard_normal((1, C, 6, 6)).astype(np.float32) * 3
    for got, want in zip(run(rewritten, x), run(model, x)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("form", [
    {"scale": 1.4},                 # not sqrt 2
    {"one": 2.0},                   # erf + 2
    {"mul_x": "x2"},                # multiplies another tensor than the erf's
    {"half_first": True, "mul_x": "x2"},  # the same, the half first
    {"extra_reader": True},         # x / sqrt 2 is read elsewhere too
    {"half": True},                 # the full GELU with x / sqrt 2: pnnx fuses it as it is
])
def test_other_patterns_are_left_alone(form):
    model = gelu_model(**form)
    rewritten, count = erf_gelus_as_gelu(model)
    assert count == 0 and rewritten == model
