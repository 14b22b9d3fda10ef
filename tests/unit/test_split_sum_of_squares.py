"""rewrite.split_sum_of_squares: an STFT-as-Conv's ReduceSumSquare over its real / imaginary halves
(Reshape [1, K*F, T] -> [1, K, F, T], summed over K) becomes K channel Slices squared and added; the
same values as onnxruntime's ReduceSumSquare, and other reductions are left alone."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from edgepack.backends.ncnn.rewrite import split_sum_of_squares


def _model(k: int, axes: list[int], keepdims: int = 0, opset: int = 13, reshape_readers: int = 1):
    rng = np.random.default_rng(k)
    f, t = 5, 91
    reduce = (h.make_node("ReduceSumSquare", ["r"], ["y"], axes=axes, keepdims=keepdims) if opset < 18 else
              h.make_node("ReduceSumSquare", ["r", "axes"], ["y"], keepdims=keepdims))
    nodes = [h.make_node("Conv", ["x", "w"], ["c"]), h.make_node("Reshape", ["c", "s"], ["r"]), reduce]
    outputs = [h.make_tensor_value_info("y", T.FLOAT, None)]
    if reshape_readers > 1:
        nodes.append(h.make_node("Relu", ["r"], ["z"]))
        outputs.append(h.make_tensor_value_info("z", T.FLOAT, None))
    inits = [nh.from_array(rng.standard_normal((k * f, 1, 10)).astype(np.float32), "w"),
             nh.from_array(np.array([1, k, f, t], np.int64), "s"), nh.from_array(np.array(axes, np.int64), "axes")]
    graph = h.make_graph(nodes, "sq", [h.make_tensor_value_info("x", T.FLOAT, [1, 1, 100])], outputs, inits)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])


def _run(model, x):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})


@pytest.mark.parametrize("k, opset", [(2, 13), (2, 18), (3, 13)])
def test_squared_channel_ranges_sum_as_reduce_sum_square_does(k, opset):
    model = _model(k, [1], opset=opset)
    out, fired = split_sum_of_squares(model)
    assert fired == 1
    ops = [n.op_type for n in out.graph.node]
    assert "ReduceSumSquare" not in ops and "Reshape" not in ops
    assert ops.count("Slice") == k and ops.count("Mul") == k and ops.count("Add") == k - 1
    x = np.random.default_rng(9).standard_normal((1, 1, 100)).astype(np.float32)
    want, got = _run(model, x)[0], _run(out, x)[0]
    assert got.shape == want.shape == (1, 5, 91)
    np.testing.assert_allclose(got, want, rtol=2e-7, atol=0)


@pytest.mark.parametrize("axes, keepdims, readers", [([2], 0, 1), ([1], 1, 1), ([1], 0, 2)])
def test_other_reductions_are_left_alone(axes, keepdims, readers):
    model = _model(2, axes, keepdims=keepdims, reshape_readers=readers)
    out, fired = split_sum_of_squares(model)
    assert fired == 0 and [n.op_type for n in out.graph.node] == [n.op_type for n in model.graph.node]
