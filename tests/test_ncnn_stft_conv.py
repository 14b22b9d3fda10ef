"""A short-time Fourier transform as a strided 1-channel Conv1D (openWakeWord's log-mel front end) runs
in ncnn as a 2-D Convolution of one row (edgepack/backends/ncnn/strided_conv.py), and its
mel filterbank product on frames-major power goes through the batch-aware Reshapes pnnx writes around an
F.linear, which ncnn copies in rows (batch_reshape_patch.py): built for real, checked against onnxruntime
on every x86 CPU model the artifact may meet."""
from __future__ import annotations

import json

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from models import saved_graph
from test_ncnn_thread_split import assert_matches_onnxruntime_on_every_cpu, build_fp32_ncnn

SAMPLES, WINDOW, HOP, BINS, MELS = 1760, 512, 160, 257, 32


def power_spectrum(path):
    """x [1, 1, 1760] -> real and imaginary DFT rows as two Convs (kernel 512, stride 160) -> |X|^2 ->
    frames-major [1, 1, 8, 257] -> times a [257, 32] filterbank."""
    t = np.arange(WINDOW)
    window = 0.5 - 0.5 * np.cos(2 * np.pi * t / WINDOW)
    angle = 2 * np.pi * np.outer(np.arange(BINS), t) / WINDOW
    real = (np.cos(angle) * window)[:, None, :].astype(np.float32)
    imag = (-np.sin(angle) * window)[:, None, :].astype(np.float32)
    frames = (SAMPLES - WINDOW) // HOP + 1
    nodes = [helper.make_node("Conv", ["x", "real"], ["re"], kernel_shape=[WINDOW], strides=[HOP]),
             helper.make_node("Conv", ["x", "imag"], ["im"], kernel_shape=[WINDOW], strides=[HOP]),
             helper.make_node("Mul", ["re", "re"], ["re2"]), helper.make_node("Mul", ["im", "im"], ["im2"]),
             helper.make_node("Add", ["re2", "im2"], ["power"]),
             # as openWakeWord's graph has it: a unit axis, then frames-major [1, 1, 8, 257]
             helper.make_node("Unsqueeze", ["power", "axis1"], ["power4"]),
             helper.make_node("Transpose", ["power4"], ["frames"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["frames", "mel"], ["y"])]
    # triangular-ish filters: each mel band a smooth bump over the bins
    centre = np.linspace(0, BINS - 1, MELS)
    mel = np.maximum(0, 1 - np.abs(np.arange(BINS)[:, None] - centre[None, :]) / 12).astype(np.float32)
    graph = helper.make_graph(nodes, "power", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, SAMPLES])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, frames, MELS])],
                              [numpy_helper.from_array(real, "real"), numpy_helper.from_array(imag, "imag"),
                               numpy_helper.from_array(mel, "mel"), numpy_helper.from_array(np.array([1]), "axis1")])
    return saved_graph(graph, path, opset=13)


def test_stft_conv_runs_as_one_row_and_matches_onnxruntime(tmp_path):
    model = power_spectrum(tmp_path / "power.onnx")
    art = build_fp32_ncnn(model, tmp_path / "out")
    backend = json.loads((tmp_path / "out" / "power-x86_64.json").read_text())["backend"]
    assert "strided_convs_as_rows x2" in backend["onnx_rewrites"], backend["onnx_rewrites"]
    assert {"Convolution", "Gemm", "Reshape"} <= set(backend["layers"]), backend["layers"]
    # a 440 Hz tone in noise: one strong bin and a live floor
    t = np.arange(SAMPLES) / 16000
    rng = np.random.default_rng(4)
    x = (np.sin(2 * np.pi * 440 * t) + 0.5 * rng.standard_normal(SAMPLES)).astype(np.float32)
    assert_matches_onnxruntime_on_every_cpu(model, art, x.reshape(1, 1, SAMPLES), tmp_path)
