"""edgepack.quantized_qdq: static (QDQ) quantisation lowered to float ops computes what onnxruntime's
QuantizeLinear/DequantizeLinear compute (onnxruntime itself, in-process, is the reference), and the
forms no backend can take are refused by name."""
from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from edgepack.errors import UnsupportedOpError
from edgepack.model import load_model
from edgepack.quantized import lower_quantized, rounds_quotients
from edgepack.reference import run_onnxruntime
from test_quantized_lowering import _lowered


def _session(proto: onnx.ModelProto, fused: bool = True) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if not fused:   # QuantizeLinear/DequantizeLinear as written, not fused into integer kernels
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _ops(proto) -> set[str]:
    return {n.op_type for n in proto.graph.node}


def _float_cnn() -> onnx.ModelProto:
    rng = np.random.default_rng(7)
    f32 = lambda name, *s: nh.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), name)  # noqa: E731
    nodes = [h.make_node("Conv", ["x", "cw", "cb"], ["c"], pads=[1, 1, 1, 1]),
             h.make_node("Relu", ["c"], ["a"]),
             h.make_node("Conv", ["a", "cw2", "cb2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
             h.make_node("Sigmoid", ["c2"], ["s"]), h.make_node("Mul", ["c2", "s"], ["a2"]),
             h.make_node("Reshape", ["a2", "shape"], ["f"]),
             h.make_node("MatMul", ["f", "mw"], ["m"]), h.make_node("Add", ["m", "mb"], ["y"])]
    inits = [f32("cw", 8, 3, 3, 3), f32("cb", 8), f32("cw2", 16, 8, 3, 3), f32("cb2", 16),
             nh.from_array(np.array([1, 16 * 4 * 4], np.int64), "shape"), f32("mw", 256, 10), f32("mb", 10)]
    graph = h.make_graph(nodes, "qdq", [h.make_tensor_value_info("x", T.FLOAT, [1, 3, 8, 8])],
                         [h.make_tensor_value_info("y", T.FLOAT, [1, 10])], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def quantize_static_qdq(tmp_path, float_model: onnx.ModelProto, name: str, per_channel: bool = True,
                        qoperator: bool = False, weights: str = "QInt8") -> onnx.ModelProto:
    """`float_model` through onnxruntime's quantize_static (uint8 activations with a zero point), in the
    QDQ format (or QOperator's), calibrated on 8 seeded inputs."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    src, dst = tmp_path / f"{name}-float.onnx", tmp_path / f"{name}.onnx"
    onnx.save(float_model, src)
    inp = float_model.graph.input[0]
    shape = [d.dim_value for d in inp.type.tensor_type.shape.dim]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter([{inp.name: np.random.default_rng(100 + i).standard_normal(shape).astype(np.float32)}
                               for i in range(8)])

        def get_next(self):
            return next(self.feeds, None)

    logging.getLogger().setLevel(logging.ERROR)
    quantize_static(src, dst, Reader(), quant_format=QuantFormat.QOperator if qoperator else QuantFormat.QDQ,
                    per_channel=per_channel, activation_type=QuantType.QUInt8, weight_type=getattr(QuantType, weights))
    return onnx.load(dst)


def test_quantize_static_qdq_cnn_computes_what_onnxruntime_computes(tmp_path):
    quant = quantize_static_qdq(tmp_path, _float_cnn(), "cnn")
    assert {"QuantizeLinear", "DequantizeLinear"} <= _ops(quant)
    model, low = _lowered(tmp_path, quant)
    assert not _ops(low.proto) & {"QuantizeLinear", "DequantizeLinear"}
    assert rounds_quotients(low.proto)   # x / scale is rounded next: NCNN divides exactly
    assert "QuantizeLinear" in low.notes[-1] and "DequantizeLinear" in low.notes[-1]
    # the head's MatMul (int8 weights per column) multiplies the integers and scales after
    assert "1 MatMul of int8 weights on integers" in low.notes[-1], low.notes[-1]
    fused, unfused, lowered = _session(model.proto), _session(model.proto, fused=False), _session(low.proto)
    saturated = 0.0
    for seed in range(6):
        feeds = {"x": np.random.default_rng(seed).standard_normal((1, 3, 8, 8)).astype(np.float32)}
        ref, got = unfused.run(None, feeds)[0], lowered.run(None, feeds)[0]
        scale = float(np.abs(ref).max())
        # the same float ops as onnxruntime's own QDQ kernels: equal but for the sums' order
        assert float(np.abs(ref - got).max()) <= 1e-5 * scale
        # the build's reference runs the QDQ ops unfused too
        np.testing.assert_array_equal(run_onnxruntime(model, feeds)["y"], ref)
        saturated = max(saturated, float(np.abs(fused.run(None, feeds)[0] - ref).max()) / scale)
    # why: onnxruntime's fused u8s8 kernels on this AVX2 host sum byte pairs in int16 and saturate
    print(f"onnxruntime fused u8s8 against the QDQ ops as written: {saturated:.2%} of scale")


def test_quantize_linear_read_as_integers_is_bit_exact(tmp_path):
    # a QuantizeLinear written out as uint8 / int8 (not a QDQ pair): ties round half to even, saturation
    nodes = [h.make_node("QuantizeLinear", ["x", "s", "zu"], ["qu"]),
             h.make_node("QuantizeLinear", ["x", "s", "zi"], ["qi"]),
             h.make_node("DequantizeLinear", ["qi", "s", "zi"], ["d"])]
    inits = [nh.from_array(np.array(0.5, np.float32), "s"), nh.from_array(np.array(7, np.uint8), "zu"),
             nh.from_array(np.array(-3, np.int8), "zi")]
    graph = h.make_graph(nodes, "q", [h.make_tensor_value_info("x", T.FLOAT, [12])],
                         [h.make_tensor_value_info("qu", T.UINT8, [12]), h.make_tensor_value_info("qi", T.INT8, [12]),
                          h.make_tensor_value_info("d", T.FLOAT, [12])], inits)
    model, low = _lowered(tmp_path, h.make_model(graph, opset_imports=[h.make_opsetid("", 13)]))
    assert [o.dtype for o in low.outputs] == ["uint8", "int8", "float32"]
    x = np.array([0.25, 0.75, 1.25, -0.25, -0.75, 3.0, 200.0, -200.0, 60.1, -63.6, 1e9, -1e9], np.float32)
    want, got = _session(model.proto).run(None, {"x": x}), _session(low.proto).run(None, {"x": x})
    for w, g in zip(want, got):
        assert w.dtype == g.dtype
        np.testing.assert_array_equal(w, g)


def test_dequantized_weights_are_onnxruntimes_floats(tmp_path):
    # per-axis int8 weights and an int32 bias: constants, folded to what DequantizeLinear returns
    rng = np.random.default_rng(3)
    w = rng.integers(-128, 128, (4, 6), dtype=np.int8)
    nodes = [h.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wf"], axis=0),
             h.make_node("DequantizeLinear", ["b", "bs"], ["bf"]),
             h.make_node("MatMul", ["x", "wf"], ["m"]), h.make_node("Add", ["m", "bf"], ["y"])]
    inits = [nh.from_array(w, "w"), nh.from_array(rng.random(4).astype(np.float32) * 0.1, "ws"),
             nh.from_array(rng.integers(-5, 5, 4, dtype=np.int8), "wz"),
             nh.from_array(rng.integers(-2 ** 30, 2 ** 30, 6, dtype=np.int32), "b"),
             nh.from_array(np.array(3.1e-7, np.float32), "bs")]
    graph = h.make_graph(nodes, "w", [h.make_tensor_value_info("x", T.FLOAT, [2, 4])],
                         [h.make_tensor_value_info("y", T.FLOAT, [2, 6])], inits)
    model, low = _lowered(tmp_path, h.make_model(graph, opset_imports=[h.make_opsetid("", 13)]))
    assert _ops(low.proto) == {"MatMul", "Add"}
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_array_equal(_session(model.proto, fused=False).run(None, {"x": x})[0],
                                  _session(low.proto).run(None, {"x": x})[0])


def _single(node, x_type, x_shape, inits, opset=21):
    graph = h.make_graph([node], "r", [h.make_tensor_value_info("x", x_type, x_shape)],
                         [h.make_tensor_value_info("y", T.FLOAT if node.op_type == "DequantizeLinear" else T.UINT8,
                                                   x_shape)], inits)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", opset)])


@pytest.mark.parametrize("form", ["blocked", "activation per axis", "run-time scale", "int4"])
def test_forms_no_backend_runs_are_refused_naming_the_node(tmp_path, form):
    s = nh.from_array(np.array(0.5, np.float32), "s")
    if form == "blocked":
        node = h.make_node("DequantizeLinear", ["x", "s2"], ["y"], name="dq_blocked", axis=1, block_size=2)
        proto = _single(node, T.INT8, [2, 4], [nh.from_array(np.ones((2, 2), np.float32), "s2")])
    elif form == "activation per axis":
        node = h.make_node("QuantizeLinear", ["x", "s3", "z3"], ["y"], name="q_axis", axis=1)
        proto = _single(node, T.FLOAT, [2, 3], [nh.from_array(np.ones(3, np.float32), "s3"),
                                                 nh.from_array(np.zeros(3, np.uint8), "z3")], opset=13)
    elif form == "run-time scale":
        node = h.make_node("QuantizeLinear", ["x", "x"], ["y"], name="q_dyn")
        proto = _single(node, T.FLOAT, [], [], opset=13)
    else:
        node = h.make_node("QuantizeLinear", ["x", "s", "z4"], ["y"], name="q_int4")
        proto = _single(node, T.FLOAT, [4], [s, h.make_tensor("z4", T.INT4, [], [0])])
    path = tmp_path / "r.onnx"
    onnx.save(proto, path)
    with pytest.raises(UnsupportedOpError) as err:
        lower_quantized(load_model(path))
    assert err.value.exit_code == 5
    assert node.name in err.value.message and "r.onnx" in err.value.message, err.value.message
    assert "quantize_static" in err.value.hint


def _float_convnet() -> onnx.ModelProto:
    """Conv -> Relu -> MaxPool -> Conv -> Reshape -> MatMul: what the QOperator format writes with ONNX's own
    QLinearConv / QLinearMatMul only (an Add or a Sigmoid would become a com.microsoft QLinear op)."""
    rng = np.random.default_rng(8)
    f32 = lambda name, *s: nh.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), name)  # noqa: E731
    nodes = [h.make_node("Conv", ["x", "cw", "cb"], ["c"], pads=[1, 1, 1, 1]), h.make_node("Relu", ["c"], ["r"]),
             h.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             h.make_node("Conv", ["p", "cw2", "cb2"], ["c2"], pads=[1, 1, 1, 1]),
             h.make_node("Reshape", ["c2", "shape"], ["f"]), h.make_node("MatMul", ["f", "mw"], ["y"])]
    inits = [f32("cw", 8, 3, 3, 3), f32("cb", 8), f32("cw2", 16, 8, 3, 3), f32("cb2", 16),
             nh.from_array(np.array([1, 16 * 4 * 4], np.int64), "shape"), f32("mw", 256, 10)]
    graph = h.make_graph(nodes, "qop", [h.make_tensor_value_info("x", T.FLOAT, [1, 3, 8, 8])],
                         [h.make_tensor_value_info("y", T.FLOAT, [1, 10])], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def test_qoperator_qlinearconv_and_qlinearmatmul_give_onnxruntimes_integers(tmp_path):
    # per tensor: onnxruntime keeps uint8 weights, which it sums exactly (per channel it writes int8
    # weights, and its u8s8 AVX2 kernels saturate: 90 of 255 steps off on a channel, measured)
    quant = quantize_static_qdq(tmp_path, _float_convnet(), "qop", per_channel=False, qoperator=True, weights="QUInt8")
    assert {"QLinearConv", "QLinearMatMul"} <= _ops(quant), _ops(quant)
    model, low = _lowered(tmp_path, quant, "qop-low.onnx")
    assert not {op for op in _ops(low.proto) if op.startswith("QLinear") or op.endswith("QuantizeLinear")}
    assert "2 QLinearConv, 1 QLinearMatMul" in low.notes[-1], low.notes[-1]
    ref, lowered = _session(model.proto), _session(low.proto)
    for seed in range(6):
        feeds = {"x": np.random.default_rng(seed).standard_normal((1, 3, 8, 8)).astype(np.float32) * 1.5}
        # integer sums, then onnxruntime's requantisation in the same float order: the same answer
        np.testing.assert_array_equal(ref.run(None, feeds)[0], lowered.run(None, feeds)[0])
