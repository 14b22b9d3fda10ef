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


def _recurrent_matmuls() -> onnx.ModelProto:
    """unrolled(), with the recurrent products written as MatMul(h, U^T) (one row each, one shared
    weight) and one two-row MatMul on the same weight that must stay a MatMul."""
    model = unrolled()
    ut = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "U")).T.copy()
    model.graph.initializer.append(numpy_helper.from_array(ut, "Ut"))
    for i, n in enumerate(model.graph.node):
        if n.op_type == "Gemm" and n.input[1] == "U":
            model.graph.node[i].CopyFrom(helper.make_node("MatMul", [n.input[0], "Ut"], list(n.output)))
    model.graph.node.append(helper.make_node("MatMul", ["y2", "Ut"], ["z"]))
    model.graph.node.insert(len(model.graph.node) - 1, helper.make_node("Slice", ["y", "slice_lo", "slice_hi"], ["y2"]))
    model.graph.initializer.extend([numpy_helper.from_array(np.array([0], np.int64), "slice_lo"),
                                    numpy_helper.from_array(np.array([2], np.int64), "slice_hi")])
    model.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [2, H]))
    return model


def test_one_row_products_become_gemm_with_one_transposed_weight():
    from edgepack.backends.ncnn.fuse import gemv_as_gemm
    model = _recurrent_matmuls()
    onnx.checker.check_model(model)
    rewritten, count = gemv_as_gemm(model)
    onnx.checker.check_model(rewritten)
    # the recurrent steps after the first (whose h is a constant, for onnxsim to fold); the
    # two-row product stays a MatMul
    assert count == T - 1
    ops = [n.op_type for n in rewritten.graph.node]
    assert ops.count("MatMul") == 2 and ops.count("Gemm") == 2 * T - 1
    added = [t.name for t in rewritten.graph.initializer if t.name.endswith("_edgepack_transposed")]
    assert added == ["Ut_edgepack_transposed"]
    x = np.random.default_rng(3).standard_normal((T, K)).astype(np.float32)
    for want, got in zip(*(ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
                           for m in (model, rewritten))):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    plain = unrolled()  # Gemm only: nothing to rewrite, the model itself comes back
    assert gemv_as_gemm(plain) == (plain, 0)
