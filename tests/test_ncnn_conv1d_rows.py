"""A Whisper-style encoder front (two many-channel Conv1Ds, kernel 3, the second with stride 2) runs in
ncnn as 2-D Convolutions of one row (strided_conv.wide_convs_as_rows: im2col + ncnn's packed GEMM
instead of Convolution1D's direct kernel): built for real, the rewrite recorded in the manifest, checked
against onnxruntime on every x86 CPU model the artifact may meet."""
from __future__ import annotations

import json

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from models import saved_graph
from test_ncnn_thread_split import assert_matches_onnxruntime_on_every_cpu, build_fp32_ncnn

MELS, FRAMES, WIDTH = 40, 101, 48


def encoder_front(path):
    """x [1, 40, 101] -> Conv1D 40->48 (k3, pad 1) -> Relu -> Conv1D 48->48 (k3, stride 2, pad 1) -> y [1, 48, 51]."""
    rng = np.random.default_rng(8)
    w1 = (rng.standard_normal((WIDTH, MELS, 3)) / np.sqrt(3 * MELS)).astype(np.float32)
    w2 = (rng.standard_normal((WIDTH, WIDTH, 3)) / np.sqrt(3 * WIDTH)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[3], pads=[1, 1]),
             helper.make_node("Relu", ["c1"], ["a1"]),
             helper.make_node("Conv", ["a1", "w2", "b2"], ["y"], kernel_shape=[3], pads=[1, 1], strides=[2])]
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"),
             numpy_helper.from_array(rng.standard_normal(WIDTH).astype(np.float32) / 4, "b1"),
             numpy_helper.from_array(rng.standard_normal(WIDTH).astype(np.float32) / 4, "b2")]
    graph = helper.make_graph(nodes, "front", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, MELS, FRAMES])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, WIDTH, (FRAMES + 1) // 2])],
                              inits)
    return saved_graph(graph, path, opset=13)


def test_many_channel_conv1ds_run_as_rows_and_match_onnxruntime(tmp_path):
    model = encoder_front(tmp_path / "front.onnx")
    art = build_fp32_ncnn(model, tmp_path / "out")
    backend = json.loads((tmp_path / "out" / "front-x86_64.json").read_text())["backend"]
    assert "wide_convs_as_rows x2" in backend["onnx_rewrites"], backend["onnx_rewrites"]
    assert "Convolution" in backend["layers"] and "Convolution1D" not in backend["layers"], backend["layers"]
    x = np.random.default_rng(2).standard_normal((1, MELS, FRAMES)).astype(np.float32)
    assert_matches_onnxruntime_on_every_cpu(model, art, x, tmp_path)
