"""edgepack/backends/ncnn/fuse.py: shared-weight Gemm/MatMul batching, checked against onnxruntime
in-process on an unrolled-LSTM-like graph (input projections batch, the recurrence does not)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from edgepack.backends.ncnn.fuse import batch_shared_products

T, K, H = 5, 16, 8


def unrolled(opset: int = 17, matmul: bool = False) -> onnx.ModelProto:
    """x [T, K] -> per step: g_t = x_t W^T + b (shared W, independent of the recurrence),
    h_t = tanh(g_t + h_{t-1} U^T) (shared U, a recurrence); output: concat of h_t."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((H, K)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(H).astype(np.float32), "b"),
             numpy_helper.from_array(rng.standard_normal((H, H)).astype(np.float32) * 0.3, "U"),
             numpy_helper.from_array(np.zeros((1, H), np.float32), "h_init"),
             numpy_helper.from_array(rng.standard_normal((K, H)).astype(np.float32), "Wt")]
    nodes, prev, hs = [], "h_init", []
    for t in range(T):
        inits.append(numpy_helper.from_array(np.array([t], np.int64), f"i{t}"))
        nodes.append(helper.make_node("Gather", ["x", f"i{t}"], [f"x{t}"], axis=0))  # [1, K]
        if matmul:
            nodes.append(helper.make_node("MatMul", [f"x{t}", "Wt"], [f"g{t}"]))
        else:
            nodes.append(helper.make_node("Gemm", [f"x{t}", "W", "b"], [f"g{t}"], transB=1))
        nodes.append(helper.make_node("Gemm", [prev, "U"], [f"r{t}"], transB=1))
        nodes.append(helper.make_node("Add", [f"g{t}", f"r{t}"], [f"s{t}"]))
        nodes.append(helper.make_node("Tanh", [f"s{t}"], [f"h{t}"]))
        prev = f"h{t}"
        hs.append(prev)
    nodes.append(helper.make_node("Concat", hs, ["y"], axis=0))
    graph = helper.make_graph(nodes, "unrolled", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [T, H])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def test_independent_products_batch_and_the_recurrence_stays():
    model = unrolled()
    batched, removed = batch_shared_products(model)
    assert removed == T - 1  # the T input projections become one; the T recurrent ones stay
    onnx.checker.check_model(batched)
    ops = [n.op_type for n in batched.graph.node]
    assert ops.count("Gemm") == 1 + T and ops.count("Split") == 1 and ops.count("Concat") == 2
    assert len(model.graph.node) == 5 * T + 1  # the input model is not modified
    x = np.random.default_rng(1).standard_normal((T, K)).astype(np.float32)
    np.testing.assert_allclose(run(batched, x), run(model, x), rtol=1e-6, atol=1e-6)


def test_matmul_and_old_opsets_batch_too():
    for model in (unrolled(matmul=True), unrolled(opset=11)):
        batched, removed = batch_shared_products(model)
        assert removed == T - 1
        onnx.checker.check_model(batched)
        x = np.random.default_rng(2).standard_normal((T, K)).astype(np.float32)
        np.testing.assert_allclose(run(batched, x), run(model, x), rtol=1e-6, atol=1e-6)


def test_nothing_to_batch_returns_the_model_itself():
    model = unrolled()
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "k"  # a dim unknown: left alone
    assert batch_shared_products(model) == (model, 0)
    single = helper.make_model(helper.make_graph(
        [helper.make_node("Gemm", ["x", "W"], ["y"], transB=1)], "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, H])],
        [numpy_helper.from_array(np.ones((H, K), np.float32), "W")]))
    assert batch_shared_products(single) == (single, 0)
