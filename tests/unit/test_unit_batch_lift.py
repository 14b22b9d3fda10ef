"""lift_unit_batch (edgepack/backends/ncnn/unit_batch.py) on small onnx.helper graphs, checked with
in-process onnxruntime: a sequence-first attention layer ([T, 1, C], PyTorch's default layout)
computes the same values with a leading unit axis on every tensor, and graphs it cannot lift (or
need not) are left alone."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgepack.backends.ncnn.unit_batch import lift_unit_batch

T, C, H = 5, 8, 2


def _model(nodes, inits, inputs, outputs, opset=13) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def attention_layer(reshape_back=(T, 1, C)) -> onnx.ModelProto:
    """x [T, 1, C], mask [H, 1, T] -> fused QKV Gemm (transB, alpha) -> heads -> softmax(q kᵀ + mask) v ->
    residual -> LayerNorm spelled out -> Squeeze/Unsqueeze round trip -> output [T, 1, C]."""
    rng = np.random.default_rng(0)
    inits = {"flat": np.array([-1, C], np.int64), "seq3": np.array([T, 1, 3 * C], np.int64),
             "heads": np.array([T, H, C // H], np.int64), "back": np.array(reshape_back, np.int64),
             "w": rng.standard_normal((3 * C, C)).astype(np.float32), "b": rng.standard_normal(3 * C).astype(np.float32),
             "two": np.array(2.0, np.float32), "eps": np.array(1e-5, np.float32), "ax1": np.array([1], np.int64)}
    for j in range(4):
        inits[f"at{j}"] = np.array([j * C], np.int64)
    inits["last"] = np.array([2], np.int64)   # counted from the front: the lift must move it
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["f"]),
             helper.make_node("Gemm", ["f", "w", "b"], ["m"], transB=1, alpha=0.5),
             helper.make_node("Reshape", ["m", "seq3"], ["m3"])]
    for j, part in enumerate("qkv"):
        nodes += [helper.make_node("Slice", ["m3", f"at{j}", f"at{j + 1}", "last"], [part + "s"]),
                  helper.make_node("Reshape", [part + "s", "heads"], [part + "h"]),
                  helper.make_node("Transpose", [part + "h"], [part], perm=[1, 0, 2])]
    nodes += [helper.make_node("Transpose", ["kh"], ["kt"], perm=[1, 2, 0]),
              helper.make_node("MatMul", ["q", "kt"], ["s0"]),
              helper.make_node("Add", ["s0", "mask"], ["s"]),
              helper.make_node("Softmax", ["s"], ["p"], axis=2),
              helper.make_node("MatMul", ["p", "v"], ["o"]),
              helper.make_node("Transpose", ["o"], ["ot"], perm=[1, 0, 2]),
              helper.make_node("Reshape", ["ot", "back"], ["r"]),
              helper.make_node("Add", ["x", "r"], ["res"]),
              helper.make_node("ReduceMean", ["res"], ["mu"], axes=[2]),
              helper.make_node("Sub", ["res", "mu"], ["d"]),
              helper.make_node("Pow", ["d", "two"], ["d2"]),
              helper.make_node("ReduceMean", ["d2"], ["var"], axes=[-1]),
              helper.make_node("Add", ["var", "eps"], ["ve"]),
              helper.make_node("Sqrt", ["ve"], ["sd"]),
              helper.make_node("Div", ["d", "sd"], ["n"]),
              helper.make_node("Squeeze", ["n", "ax1"], ["sq"]),
              helper.make_node("Unsqueeze", ["sq", "ax1"], ["y"])]
    return _model(nodes, inits, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, 1, C]),
                                 helper.make_tensor_value_info("mask", TensorProto.FLOAT, [H, 1, T])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [T, 1, C]),
                   helper.make_tensor_value_info("p", TensorProto.FLOAT, [H, T, T])])


def _run(m: onnx.ModelProto, feeds: dict) -> list:
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def test_a_sequence_first_attention_layer_computes_the_same_with_every_tensor_one_rank_higher():
    m = attention_layer()
    lifted = lift_unit_batch(m)
    assert lifted is not None
    onnx.checker.check_model(lifted)
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((T, 1, C)).astype(np.float32),
             "mask": (rng.standard_normal((H, 1, T)) * 3).astype(np.float32)}
    want, got = _run(m, feeds), _run(lifted, feeds)
    for w, g in zip(want, got):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    # every op now works one rank higher: the inputs are reshaped to [1, ...] first, no Gemm is left
    inferred = onnx.shape_inference.infer_shapes(lifted).graph
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in inferred.value_info}
    ops = [n.op_type for n in lifted.graph.node]
    assert "Gemm" not in ops and ops[:2] == ["Reshape", "Reshape"]
    assert ranks[lifted.graph.node[0].output[0]] == 4
    softmax = next(n for n in lifted.graph.node if n.op_type == "Softmax")
    assert helper.get_attribute_value(softmax.attribute[0]) == 3 and ranks[softmax.output[0]] == 4
    # the original graph is untouched (a copy is lifted)
    assert [n.op_type for n in m.graph.node][0] == "Reshape" and "Gemm" in [n.op_type for n in m.graph.node]


def test_a_copied_dimension_a_convolution_or_a_batch_first_graph_is_left_alone():
    assert lift_unit_batch(attention_layer(reshape_back=(0, 1, C))) is None   # 0 would copy the wrong axis
    conv = _model([helper.make_node("Conv", ["x", "w"], ["y"])], {"w": np.ones((2, 3, 1, 1), np.float32)},
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 4])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2, 4, 4])])
    assert lift_unit_batch(conv) is None
    batch_first = _model([helper.make_node("Relu", ["x"], ["y"])], {},
                         [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, T, C])],
                         [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, T, C])])
    assert lift_unit_batch(batch_first) is None   # pnnx's batch guess is already a unit axis


@pytest.mark.parametrize("lifted_operand", ["ids", "table"])
def test_gather_lifts_an_embedding_lookup_and_a_constant_index_pick(lifted_operand):
    table = np.arange(40, dtype=np.float32).reshape(10, 4)
    if lifted_operand == "ids":   # data constant, ids at run time: the ids' leading 1 leads the result
        m = _model([helper.make_node("Cast", ["x"], ["i"], to=TensorProto.INT64),
                    helper.make_node("Gather", ["table", "i"], ["y"])], {"table": table},
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, 1])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [T, 1, 4])])
        feeds = {"x": np.array([[1], [3], [0], [9], [2]], np.float32)}
    else:                          # data at run time, constant index on axis 1
        m = _model([helper.make_node("Gather", ["x", "pick"], ["y"], axis=1)], {"pick": np.array([2, 0], np.int64)},
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, 3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [T, 2])])
        feeds = {"x": np.arange(T * 3, dtype=np.float32).reshape(T, 3)}
    lifted = lift_unit_batch(m)
    assert lifted is not None
    np.testing.assert_array_equal(_run(lifted, feeds)[0], _run(m, feeds)[0])
