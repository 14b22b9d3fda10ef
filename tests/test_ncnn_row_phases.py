"""3x3 convolutions dilated along the height (PLCMOS v2's form) run in ncnn as undilated ones over the
row phases side by side (edgepack/backends/ncnn/dilated_conv.py; the MaxPool after the first moves
before its crop), so ncnn's Winograd takes them: built for real, the rewrite recorded in the manifest,
checked against onnxruntime on every x86 CPU model the artifact may meet."""
from __future__ import annotations

import json

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from models import saved_graph
from test_ncnn_thread_split import assert_matches_onnxruntime_on_every_cpu, build_fp32_ncnn

H, W = 61, 33


def spectrogram_cnn(path):
    """x [1, 1, 61, 33] -> Conv 1->16 (3x3, dilation (2, 1), pads 1) -> LeakyRelu -> MaxPool (1, 2) ->
    Conv 16->32 (the same) -> LeakyRelu -> y [1, 32, 53, 16]."""
    rng = np.random.default_rng(11)
    w1 = (rng.standard_normal((16, 1, 3, 3)) / 3).astype(np.float32)
    w2 = (rng.standard_normal((32, 16, 3, 3)) / 12).astype(np.float32)
    conv = dict(kernel_shape=[3, 3], dilations=[2, 1], pads=[1, 1, 1, 1])
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], **conv),
             helper.make_node("LeakyRelu", ["c1"], ["a1"], alpha=0.1),
             helper.make_node("MaxPool", ["a1"], ["p1"], kernel_shape=[1, 2], strides=[1, 2]),
             helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], **conv),
             helper.make_node("LeakyRelu", ["c2"], ["y"], alpha=0.1)]
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2"),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32) / 4, "b1"),
             numpy_helper.from_array(rng.standard_normal(32).astype(np.float32) / 4, "b2")]
    graph = helper.make_graph(nodes, "dilated", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, H, W])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32, H - 6, W // 2])], inits)
    return saved_graph(graph, path, opset=13)


def test_height_dilated_convs_run_undilated_and_match_onnxruntime(tmp_path):
    model = spectrogram_cnn(tmp_path / "dilated.onnx")
    art = build_fp32_ncnn(model, tmp_path / "out")
    backend = json.loads((tmp_path / "out" / "dilated-x86_64.json").read_text())["backend"]
    assert "dilated_convs_as_phases x2" in backend["onnx_rewrites"], backend["onnx_rewrites"]
    assert {"Convolution", "Reshape", "Crop"} <= set(backend["layers"]), backend["layers"]
    x = np.random.default_rng(3).standard_normal((1, 1, H, W)).astype(np.float32)
    assert_matches_onnxruntime_on_every_cpu(model, art, x, tmp_path)
