"""edgepack/backends/ncnn/tanh_gelu.py: tanh GELUs written out in arithmetic (jax2tf's and torch's
forms, the 0.5 anywhere in the product) become one ONNX Gelu(approximate="tanh"), with the graph
converted to opset 20 where older; checked against onnxruntime in-process. Near misses are left alone."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edgepack.backends.ncnn.tanh_gelu import tanh_gelus_as_gelu
from gelu_forms import divided_form, jax2tf_form, mk, reordered_torch_form, torch_form


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("make", [jax2tf_form, torch_form, reordered_torch_form])
def test_tanh_gelu_becomes_one_gelu_node_of_opset_20(make):
    model = make()
    rewritten, count = tanh_gelus_as_gelu(model)
    assert count == 1
    onnx.checker.check_model(rewritten)
    assert [n.op_type for n in rewritten.graph.node] == ["Relu", "Sub", "Gelu", "Add"]
    gelu = rewritten.graph.node[2]
    assert gelu.input[0] == "x0" and gelu.output[0] == "g"
    assert helper.get_attribute_value(gelu.attribute[0]) == b"tanh"
    assert [o.version for o in rewritten.opset_import if o.domain == ""] == [20]
    assert "Tanh" in [n.op_type for n in model.graph.node]  # the input model is not modified
    x = np.random.default_rng(1).uniform(-6, 6, (1, 16, 24)).astype(np.float32)
    np.testing.assert_allclose(run(rewritten, x), run(model, x), rtol=0, atol=2e-6)


def test_a_gelu_whose_half_is_a_division_is_matched_too():
    rewritten, count = tanh_gelus_as_gelu(divided_form())
    assert count == 1 and "Gelu" in [n.op_type for n in rewritten.graph.node]


def test_a_value_read_elsewhere_stays():
    """The Tanh is also an output's input: the Gelu replaces only the product; the Tanh stays."""
    model = jax2tf_form()
    model.graph.node.append(mk("Mul", ["t", "one"], ["t_out"]))
    model.graph.output.append(helper.make_tensor_value_info("t_out", TensorProto.FLOAT, [1, 16, 24]))
    rewritten, count = tanh_gelus_as_gelu(model)
    assert count == 1
    ops = [n.op_type for n in rewritten.graph.node]
    assert "Gelu" in ops and "Tanh" in ops
    x = np.random.default_rng(2).uniform(-4, 4, (1, 16, 24)).astype(np.float32)
    sess_a = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess_b = ort.InferenceSession(rewritten.SerializeToString(), providers=["CPUExecutionProvider"])
    for a, b in zip(sess_a.run(None, {"x": x}), sess_b.run(None, {"x": x})):
        np.testing.assert_allclose(b, a, rtol=0, atol=2e-6)


@pytest.mark.parametrize("kwargs", [{"cube": 0.0447}, {"sq": 0.8}, {"half": 0.25}])
def test_near_misses_are_left_alone(kwargs):
    model = jax2tf_form(**kwargs)
    rewritten, count = tanh_gelus_as_gelu(model)
    assert count == 0 and rewritten is model
