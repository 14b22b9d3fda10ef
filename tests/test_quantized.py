"""onnxruntime int8 models built for x86_64 with the default backend and checked with `run` on fresh
inputs against onnxruntime running the original quantised model: dynamic (quantize_dynamic:
DynamicQuantizeLinear, ConvInteger, MatMulInteger), static in the QDQ format (quantize_static:
QuantizeLinear, DequantizeLinear) and in the QOperator format (QLinearConv, QLinearMatMul). Before
edgepack/quantized.py no backend took these ops (exit 5)."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from clirun import run_edgepack
from edgepack.runner import run_artifact


def float_cnn(tmp: Path) -> Path:
    """Conv -> SiLU -> grouped 1x1 Conv + residual -> MatMul head, float."""
    rng = np.random.default_rng(5)

    def f32(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)

    nodes = [helper.make_node("Conv", ["x", "cw", "cb"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Sigmoid", ["c"], ["sg"]), helper.make_node("Mul", ["c", "sg"], ["a"]),
             helper.make_node("Conv", ["a", "cw2", "cb2"], ["c2"], group=2),
             helper.make_node("Add", ["c2", "a"], ["r"]),
             helper.make_node("Reshape", ["r", "shape"], ["f"]),
             helper.make_node("MatMul", ["f", "mw"], ["m"]), helper.make_node("Add", ["m", "mb"], ["y"])]
    inits = [f32("cw", 8, 3, 3, 3), f32("cb", 8), f32("cw2", 8, 4, 1, 1), f32("cb2", 8),
             numpy_helper.from_array(np.array([1, 8 * 8 * 8], np.int64), "shape"), f32("mw", 512, 10), f32("mb", 10)]
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "qcnn", [helper.make_tensor_value_info("x", f, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", f, [1, 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    src = tmp / "qcnn-float.onnx"
    onnx.save(model, src)
    return src


def quantised_cnn(tmp: Path) -> Path:
    """float_cnn through quantize_dynamic (uint8 weights: onnxruntime's AVX2 u8s8 GEMM may saturate
    int16 pair sums, u8u8 is exact)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic
    src, dst = float_cnn(tmp), tmp / "qcnn.onnx"
    logging.getLogger().setLevel(logging.ERROR)
    quantize_dynamic(src, dst, weight_type=QuantType.QUInt8)
    ops = {n.op_type for n in onnx.load(dst).graph.node}
    assert {"DynamicQuantizeLinear", "ConvInteger", "MatMulInteger"} <= ops, ops
    return dst


def test_quantize_dynamic_model_builds_and_runs_like_onnxruntime(tmp_path):
    model = quantised_cnn(tmp_path)
    t0 = time.monotonic()
    dist = tmp_path / "dist"
    proc = run_edgepack("build", model, "--target", "x86_64", "--out", dist, "--json", timeout=600)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"no JSON report (exit {proc.returncode}): {proc.stderr[-3000:]}")
    assert proc.returncode == 0 and report["ok"], proc.stderr[-4000:]
    art = dist / "qcnn-x86_64"
    manifest = json.loads(art.with_name(art.name + ".json").read_text())
    notes = " ".join(manifest["model"]["notes"])
    assert "quantised ops lowered to float: 3 DynamicQuantizeLinear, 2 ConvInteger, 1 MatMulInteger" in notes, notes
    if manifest["backend"]["name"] == "ncnn":  # integer convolutions summed exactly: no Winograd
        assert manifest["backend"]["exact_integer_convolutions"] is True
    tol = manifest["tolerance"]
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    worst = 0.0
    for seed in (31, 32, 33):
        x = np.random.default_rng(seed).standard_normal((1, 3, 16, 16)).astype(np.float32)
        want = sess.run(None, {"x": x})[0]
        np.save(tmp_path / "x.npy", x)
        out = tmp_path / f"out{seed}"
        proc = run_artifact(art, ["run", "--threads", "1", "--input", f"x={tmp_path / 'x.npy'}", "--output", str(out)])
        assert proc.returncode == 0, proc.stderr
        got = np.load(json.loads(proc.stdout)["outputs"]["y"]["file"]).reshape(want.shape)
        err = float(np.max(np.abs(got - want)))
        assert err <= tol["atol"] + tol["rtol"] * float(np.max(np.abs(want))), (seed, err)
        worst = max(worst, err)
    print(f"quantize_dynamic CNN: {report['results'][0]['backend']}, built and checked in "
          f"{time.monotonic() - t0:.0f} s, max error {worst:.2e}")


def quantised_static(src: Path, dst: Path, qdq: bool, per_channel: bool, weights: str) -> Path:
    """`src` through quantize_static (uint8 activations), calibrated on 8 seeded [1, 3, 16, 16] inputs."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.feeds = iter([{"x": np.random.default_rng(50 + i).standard_normal((1, 3, 16, 16)).astype(np.float32)}
                               for i in range(8)])

        def get_next(self):
            return next(self.feeds, None)

    logging.getLogger().setLevel(logging.ERROR)
    quantize_static(src, dst, Reader(), quant_format=QuantFormat.QDQ if qdq else QuantFormat.QOperator,
                    per_channel=per_channel, activation_type=QuantType.QUInt8, weight_type=getattr(QuantType, weights))
    return dst


def built_x86_64(model: Path, dist: Path) -> tuple[Path, dict]:
    """The x86_64 artifact of `model` (default backend) and its manifest."""
    proc = run_edgepack("build", model, "--target", "x86_64", "--out", dist, "--json", timeout=600)
    report = json.loads(proc.stdout or "{}")
    assert proc.returncode == 0 and report.get("ok"), proc.stderr[-4000:]
    art = dist / f"{model.stem}-x86_64"
    return art, json.loads(art.with_name(art.name + ".json").read_text())


def assert_runs_like(sess, art: Path, manifest: dict, seeds, tmp: Path) -> None:
    """`run` on fresh seeded inputs within the build's own bound of the session's answer."""
    tol = manifest["tolerance"]
    for seed in seeds:
        x = np.random.default_rng(seed).standard_normal((1, 3, 16, 16)).astype(np.float32)
        want = sess.run(None, {"x": x})[0]
        np.save(tmp / "x.npy", x)
        proc = run_artifact(art, ["run", "--threads", "1", "--input", f"x={tmp / 'x.npy'}", "--output", str(tmp / f"o{seed}")])
        assert proc.returncode == 0, proc.stderr
        got = np.load(json.loads(proc.stdout)["outputs"]["y"]["file"]).reshape(want.shape)
        assert float(np.max(np.abs(got - want))) <= tol["atol"] + tol["rtol"] * float(np.max(np.abs(want))), seed


def test_quantize_static_qdq_model_builds_and_runs_like_onnxruntime(tmp_path):
    # int8 weights per channel
    model = quantised_static(float_cnn(tmp_path), tmp_path / "qdq.onnx", qdq=True, per_channel=True, weights="QInt8")
    art, manifest = built_x86_64(model, tmp_path / "dist")
    notes = " ".join(manifest["model"]["notes"])
    assert "QuantizeLinear" in notes and "DequantizeLinear" in notes, notes
    assert manifest["backend"]["name"] == "ncnn", manifest["backend"]
    # float convolutions, as the reference's: Winograd is not masked (only dynamic int8 sums integers)
    assert manifest["backend"]["exact_integer_convolutions"] is False
    # the QDQ ops as written (the build's reference, edgepack/reference.py): onnxruntime's fused u8s8
    # kernels saturate on AVX2 CPUs without VNNI
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.disable_quant_qdq", "1")
    sess = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
    assert_runs_like(sess, art, manifest, (41, 42, 43), tmp_path)


def qoperator_cnn(tmp: Path) -> Path:
    """Conv -> Relu -> MaxPool -> Flatten -> MatMul through quantize_static in the QOperator format
    (QLinearConv, QLinearMatMul; uint8 weights per tensor, which onnxruntime sums exactly)."""
    rng = np.random.default_rng(9)
    weights = {"w": (8, 3, 3, 3), "b": (8,), "m": (8 * 8 * 8, 6)}
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n) for n, s in weights.items()]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Flatten", ["p"], ["f"]), helper.make_node("MatMul", ["f", "m"], ["y"])]
    graph = helper.make_graph(nodes, "qop", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    src = tmp / "qop-float.onnx"
    onnx.save(model, src)
    return quantised_static(src, tmp / "qop.onnx", qdq=False, per_channel=False, weights="QUInt8")


def test_qoperator_model_builds_on_ncnn_and_runs_like_onnxruntime(tmp_path):
    model = qoperator_cnn(tmp_path)
    assert {"QLinearConv", "QLinearMatMul"} <= {n.op_type for n in onnx.load(model).graph.node}
    art, manifest = built_x86_64(model, tmp_path / "dist")
    assert manifest["backend"]["name"] == "ncnn", manifest["backend"]
    assert "1 QLinearConv, 1 QLinearMatMul" in " ".join(manifest["model"]["notes"])
    assert manifest["backend"]["exact_integer_convolutions"] is True   # integer sums, as QLinearConv's
    assert_runs_like(ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]), art, manifest, (51, 52), tmp_path)
