"""edgepack/backends/ncnn/reduce_max.py: ReduceMax over trailing axes as Reshape -> GlobalMaxPool ->
Reshape, bit-equal in onnxruntime (the same values compared); other reductions left alone."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgepack.backends.ncnn.reduce_max import reduce_max_as_global_pool

SHAPE = [1, 6, 40, 30]


def _model(opset: int, axes: list[int] | None, keepdims: int | None = None, as_input: bool = False,
           **extra) -> onnx.ModelProto:
    """x -> ReduceMax -> Sub 8 -> Max with x (broadcast back) -> y, as Whisper's log-mel clamp."""
    inits = [numpy_helper.from_array(np.array(8.0, np.float32), "eight")]
    ins, attrs = ["x"], dict(extra)
    if axes is not None and as_input:
        inits.append(numpy_helper.from_array(np.array(axes, np.int64), "axes"))
        ins.append("axes")
    elif axes is not None:
        attrs["axes"] = axes
    if keepdims is not None:
        attrs["keepdims"] = keepdims
    nodes = [helper.make_node("ReduceMax", ins, ["m"], **attrs), helper.make_node("Sub", ["m", "eight"], ["s"])]
    kept = keepdims is None or keepdims
    if kept:
        nodes.append(helper.make_node("Max", ["x", "s"], ["y"]))
        out = SHAPE
    else:
        nodes.append(helper.make_node("Relu", ["s"], ["y"]))
        out = SHAPE[:len(SHAPE) - len(axes)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def _run(model, x):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("opset, axes, keepdims, as_input, rows", [
    (18, None, None, False, 1),         # Whisper's: every axis, implicit
    (13, None, 1, False, 1),
    (13, [1, 2, 3], 1, False, 1),       # every axis, listed
    (18, [2, -1], 1, True, 6),          # the last two: one row per channel
    (13, [3], 1, False, 240),           # the last axis
    (13, [2, 3], 0, False, 6),          # the axes dropped
])
def test_trailing_reduce_max_is_a_global_max_pool(opset, axes, keepdims, as_input, rows):
    model = _model(opset, axes, keepdims, as_input)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    assert reduce_max_as_global_pool(m) == 1
    ops = [n.op_type for n in m.graph.node]
    assert "ReduceMax" not in ops and ops.count("GlobalMaxPool") == 1
    view = next(n for n in m.graph.node if n.op_type == "Reshape")
    dims = next(numpy_helper.to_array(i) for i in m.graph.initializer if i.name == view.input[1])
    assert dims.tolist() == [1, rows, int(np.prod(SHAPE)) // rows]
    x = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32) * 5
    np.testing.assert_array_equal(_run(m, x), _run(model, x))


@pytest.mark.parametrize("opset, axes, keepdims, extra", [
    (13, [1], 1, {}),                   # not trailing
    (13, [1, 3], 1, {}),                # not contiguous
    (18, [], 1, {"noop_with_empty_axes": 1}),  # told to do nothing
])
def test_other_reductions_are_left_alone(opset, axes, keepdims, extra):
    model = _model(opset, axes, keepdims, as_input=opset >= 18, **extra)
    assert reduce_max_as_global_pool(model) == 0
    assert "ReduceMax" in [n.op_type for n in model.graph.node]


def test_a_reduction_to_a_scalar_is_left_alone():
    """keepdims=0 over every axis gives a 0-d tensor."""
    nodes = [helper.make_node("ReduceMax", ["x"], ["y"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    assert reduce_max_as_global_pool(model) == 0


def _transposed(perm: list[int], axes: list[int], keepdims: int, reader: str = "Relu") -> onnx.ModelProto:
    """x -> Transpose(perm) -> ReduceMax(axes) -> reader -> y (keras' GlobalMaxPooling2D: NHWC, axes 1, 2)."""
    t_shape = [SHAPE[p] for p in perm]
    out = [1 if a in axes else d for a, d in enumerate(t_shape)] if keepdims else \
        [d for a, d in enumerate(t_shape) if a not in axes]
    inits = [numpy_helper.from_array(np.array(-np.inf, np.float32), "ninf")]
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=perm),
             helper.make_node("ReduceMax", ["t"], ["m"], axes=axes, keepdims=keepdims),
             helper.make_node(reader, ["m", "ninf"] if reader == "Max" else ["m"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


@pytest.mark.parametrize("perm, axes, keepdims", [
    ([0, 2, 3, 1], [1, 2], 0),   # DNSMOS (keras2onnx): NCHW -> NHWC, max over H and W
    ([0, 2, 3, 1], [1, 2], 1),
    ([0, 3, 1, 2], [2, 3], 0),   # already trailing after the Transpose: pooled as it is
    ([0, 3, 2, 1], [1, 2], 1),   # W and H swapped: the same values compared
])
def test_a_max_over_axes_a_transpose_moved_is_pooled_on_its_input(perm, axes, keepdims):
    model = _transposed(perm, axes, keepdims)
    m = onnx.ModelProto()
    m.CopyFrom(model)
    assert reduce_max_as_global_pool(m) == 1
    assert "ReduceMax" not in [n.op_type for n in m.graph.node]
    x = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32) * 5
    np.testing.assert_array_equal(_run(m, x), _run(model, x))


@pytest.mark.parametrize("perm, axes, keepdims, reader", [
    ([0, 2, 3, 1], [1, 2], 0, "Max"),     # magika's softmax form (keepdims=0, then Max with -inf): pnnx crashed
    ([2, 3, 1, 0], [0, 1], 0, "Relu"),    # the kept axes would come out in another order (C, N)
    ([0, 2, 3, 1], [1, 3], 0, "Relu"),    # reduces C and W: not trailing in the input either
])
def test_other_transposed_maxes_are_left_alone(perm, axes, keepdims, reader):
    model = _transposed(perm, axes, keepdims, reader)
    assert reduce_max_as_global_pool(model) == 0
