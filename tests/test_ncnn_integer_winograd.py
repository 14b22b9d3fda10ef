"""A dynamically quantised 3x3 convolution (ConvInteger) with 24 input channels: on x86 it is allowed
Winograd F(2,3) (integer_winograd_patch.py; the library says so under EDGEPACK_NCNN_TRACE=1), whose
transforms keep its integer sums exact, so it gives bit for bit what the direct kernel gives
(`EDGEPACK_NCNN_OPTIONS=direct=2` hands that kernel every 3x3 layer), on AVX2 (natively and under
qemu's Haswell) and SSE (Nehalem), and onnxruntime's integer convolution to one rounding of the scale; at the
fp16 rung too, where F16C CPUs transform its fp16 weights as the convolution goes.
(ncnn's own pick, F(4,3), moved ddddocr_old_int8's output 1.3%.)"""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from clirun import run_artifact_on
from models import quantised_graph
from test_ncnn_thread_split import build_fp32_ncnn
from test_ncnn_winograd_fp16 import build_x86_ncnn, f16c_cpus

C, O, H, W = 24, 32, 20, 20


def conv_integer(tmp):
    from onnxruntime.quantization import QuantType
    rng = np.random.default_rng(9)
    w = (rng.standard_normal((O, C, 3, 3)) * 0.2 + 0.03).astype(np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
    graph = helper.make_graph([node], "convint", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, H, W])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, O, H, W])],
                              [numpy_helper.from_array(w, "w")])
    dst = quantised_graph(graph, tmp, "convint", weight_type=QuantType.QUInt8)
    assert "ConvInteger" in {n.op_type for n in onnx.load(dst).graph.node}
    return dst


def test_integer_convolution_takes_f23_and_stays_exact(tmp_path):
    model = conv_integer(tmp_path)
    art = build_fp32_ncnn(model, tmp_path / "out")
    backend = json.loads((tmp_path / "out" / "convint-x86_64.json").read_text())["backend"]
    assert backend["name"] == "ncnn" and backend["exact_integer_convolutions"] is True
    x = np.random.default_rng(4).standard_normal((1, C, H, W)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    scale = float(np.abs(want).max())
    runs = {}
    for cpu in ("native", "native direct=2", "Haswell-noTSX", "Haswell-noTSX direct=2", "Nehalem"):
        got, log = run_artifact_on(art, cpu, {"x": tmp_path / "x.npy"}, tmp_path / cpu.replace(" ", "-"), ("y",),
                                   env={"EDGEPACK_NCNN_TRACE": "1"})
        assert f"edgepack integer convolution: {C} -> {O} 3x3, Winograd F(2,3) allowed" in log, (cpu, log[-2000:])
        runs[cpu] = got["y"].reshape(want.shape)
        assert float(np.abs(runs[cpu] - want).max()) <= 1e-6 * scale, cpu  # integer sums, one scale product
    for cpu in ("native direct=2", "Haswell-noTSX", "Haswell-noTSX direct=2", "Nehalem"):
        np.testing.assert_array_equal(runs[cpu], runs["native"], err_msg=cpu)
    # at the fp16 rung, F16C CPUs keep the layer's weights (small integers) in fp16 and transform them as they
    # go (winograd_fp16_patch.py): halves of small integers, exact in any order, so the same bits
    res = build_x86_ncnn(model, tmp_path / "fp16")
    assert res["precision"] == "fp16-storage", res
    for cpu, fp16 in f16c_cpus().items():
        got, log = run_artifact_on(res["file"], cpu, {"x": tmp_path / "x.npy"}, tmp_path / f"fp16-{cpu}", ("y",),
                                   env={"EDGEPACK_NCNN_TRACE": "1"})
        assert (f"edgepack winograd: {C} -> {O} 3x3, F(2,3) kernel as fp16 3x3 weights" in log) == fp16, (cpu, log[-2000:])
        np.testing.assert_array_equal(got["y"].reshape(want.shape), runs["native"], err_msg=f"fp16 rung, {cpu}")
