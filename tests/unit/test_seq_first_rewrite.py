"""lift_sequence_tail (edgepack/backends/ncnn/seq_first.py) on tiny onnx.helper graphs, checked with
in-process onnxruntime: a time-major (layout 0) LSTM whose [T, 1, C] output is flattened to [T, C],
scaled by a per-tensor maximum (the GlobalMaxPool pattern of dynamic quantisation that makes pnnx
take T for the batch) and classified by a MatMul, then reshaped back to [T, 1, K]."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from edgepack.backends.ncnn.rewrite import remove_dead_nodes, rewrite_for_ncnn
from edgepack.backends.ncnn.seq_first import lift_sequence_tail

T, I, H, K = 6, 5, 4, 7


def _c(name: str, arr) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(arr), name)


def seq_first_model(tail: str = "plain", range_of: str = "seq") -> onnx.ModelProto:
    """x [T, 1, I] -> bidirectional LSTM -> [T, 1, 2H] -> [T, 2H] -> / max|.| -> MatMul -> [T, 1, K].

    tail="transpose" puts a Transpose in the chain (not liftable); "dynamic_rhs" multiplies by a
    tensor computed from the input (not a constant) instead of the classifier weights; "gemm" is the
    classifier as one Gemm (transB, bias: torch's Linear, or onnxsim's fusion); "constant" divides by
    a constant, not the run-time range (nothing for pnnx to mis-tag: left alone). range_of="yt"
    takes the range from the LSTM's transposed output, a second reader of it (as onnxsim leaves it)."""
    rng = np.random.default_rng(3)
    inits = [_c("W", rng.standard_normal((2, 4 * H, I)).astype(np.float32) * 0.5),
             _c("R", rng.standard_normal((2, 4 * H, H)).astype(np.float32) * 0.5),
             _c("B", rng.standard_normal((2, 8 * H)).astype(np.float32) * 0.1),
             _c("flat", np.array([T, 2 * H], np.int64)), _c("all4", np.array([1, 1, 1, T * 2 * H], np.int64)),
             _c("one", np.array([1], np.int64)), _c("eps", np.array(1e-3, np.float32)),
             _c("Wc", rng.standard_normal((2 * H, K)).astype(np.float32)),
             _c("bc", rng.standard_normal(K).astype(np.float32)), _c("back", np.array([T, 1, K], np.int64))]
    nodes = [helper.make_node("LSTM", ["x", "W", "R", "B"], ["y"], hidden_size=H, direction="bidirectional"),
             helper.make_node("Transpose", ["y"], ["yt"], perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["yt", "flat"], ["seq"]),
             # the per-tensor range, as DynamicQuantizeLinear's lowering computes it
             helper.make_node("Reshape", [range_of, "all4"], ["y4"]),
             helper.make_node("GlobalMaxPool", ["y4"], ["m4"]),
             helper.make_node("Reshape", ["m4", "one"], ["m"]),
             helper.make_node("Add", ["m", "eps"], ["scale"]),
             helper.make_node("Div", ["seq", "eps" if tail == "constant" else "scale"], ["norm"]),
             helper.make_node("Floor", ["norm"], ["q"]),
             helper.make_node("Relu", ["q"], ["act"])]
    if tail == "transpose":
        nodes += [helper.make_node("Transpose", ["act"], ["actt"], perm=[1, 0]),
                  helper.make_node("Transpose", ["actt"], ["act2"], perm=[1, 0])]
    else:
        nodes += [helper.make_node("Identity", ["act"], ["act2"])]
    rhs = "Wc"
    if tail == "dynamic_rhs":
        nodes += [helper.make_node("Mul", ["Wc", "scale"], ["Wd"])]
        rhs = "Wd"
    if tail == "gemm":
        inits.append(_c("WcT", np.ascontiguousarray(numpy_helper.to_array(inits[7]).T)))
        nodes += [helper.make_node("Gemm", ["act2", "WcT", "bc"], ["biased"], transB=1)]
    else:
        nodes += [helper.make_node("MatMul", ["act2", rhs], ["logits"]),
                  helper.make_node("Add", ["logits", "bc"], ["biased"])]
    nodes += [helper.make_node("Reshape", ["biased", "back"], ["out"])]
    graph = helper.make_graph(nodes, "seq_first", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, 1, I])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [T, 1, K])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def _run(m: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _x(seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((T, 1, I)) * 2).astype(np.float32)


def _shapes(m: onnx.ModelProto) -> dict:
    g = onnx.shape_inference.infer_shapes(m, strict_mode=True).graph
    return {v.name: tuple(d.dim_value for d in v.type.tensor_type.shape.dim) for v in [*g.value_info, *g.output]}


def test_lifts_the_tail_to_a_unit_batch_first_axis_with_the_same_outputs():
    m = seq_first_model()
    new = onnx.ModelProto()
    new.CopyFrom(m)
    assert lift_sequence_tail(new) == 1
    remove_dead_nodes(new)
    onnx.checker.check_model(new)
    shapes = _shapes(new)
    assert shapes["seq"] == (1, T, 2 * H) and shapes["norm"] == (1, T, 2 * H)   # axis 0 is the unit one now
    assert [o.name for o in new.graph.output] == ["out"] and shapes["out"] == (T, 1, K)
    for seed in (1, 2, 3):
        before, after = _run(m, _x(seed)), _run(new, _x(seed))
        assert before.shape == after.shape == (T, 1, K)
        np.testing.assert_array_equal(before, after)
        assert np.abs(before).max() > 0.1   # the check compares real values, not zeros


def test_a_lifted_graph_output_is_reshaped_back_to_its_onnx_shape():
    m = seq_first_model()
    m.graph.node.pop()   # the tail ends at the MatMul+Add: the [T, K] result is the graph output itself
    del m.graph.output[:]
    m.graph.output.append(helper.make_tensor_value_info("biased", TensorProto.FLOAT, [T, K]))
    new = onnx.ModelProto()
    new.CopyFrom(m)
    assert lift_sequence_tail(new) == 1
    assert new.graph.node[-1].op_type == "Reshape" and new.graph.node[-1].output[0] == "biased"
    assert _shapes(new)["biased"] == (T, K)
    np.testing.assert_array_equal(_run(m, _x(4)), _run(new, _x(4)))


def test_a_gemm_classifier_becomes_matmul_and_add_on_the_lifted_rows():
    m = seq_first_model("gemm")
    new = onnx.ModelProto()
    new.CopyFrom(m)
    assert lift_sequence_tail(new) == 1
    remove_dead_nodes(new)
    onnx.checker.check_model(new)
    assert "Gemm" not in {n.op_type for n in new.graph.node}
    assert _shapes(new)["out"] == (T, 1, K)
    for seed in (1, 2):   # Gemm adds its bias in another order than MatMul + Add: equal to rounding
        np.testing.assert_allclose(_run(new, _x(seed)), _run(m, _x(seed)), rtol=1e-5, atol=1e-5)


def test_leaves_a_chain_it_cannot_lift_whole_or_that_reads_only_constants():
    for tail in ("transpose", "dynamic_rhs", "constant"):
        m = seq_first_model(tail)
        new = onnx.ModelProto()
        new.CopyFrom(m)
        assert lift_sequence_tail(new) == 0, tail
        assert new.SerializeToString() == m.SerializeToString(), tail


def test_rewrite_for_ncnn_includes_it_and_keeps_onnxruntimes_answer():
    for range_of in ("seq", "yt"):
        m = seq_first_model(range_of=range_of)
        new, applied = rewrite_for_ncnn(m)
        assert applied.get("lift_sequence_tail") == 1, (range_of, applied)
        # the LSTM in torch's export form for pnnx, also when its output has two Reshape readers
        assert applied.get("lstm_outputs_as_pnnx_expects"), (range_of, applied)
        np.testing.assert_allclose(_run(new, _x(5)), _run(m, _x(5)), rtol=1e-6, atol=1e-6)
