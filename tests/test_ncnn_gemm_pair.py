"""ncnn's im2col and Winograd convolution GEMMs summing two 8-row panels at once on AVX and AVX2
(edgepack/backends/ncnn/gemm_pair_patch.py), checked against onnxruntime on every x86 CPU model the
artifact may meet, AVX without FMA (SandyBridge) included, and for the same bits on 1 and 2 threads.

The convolutions are 5 x 1 and 1 x 5 (not Winograd's 3 x 3, not the direct kernel's 1 x 1), so they
take the im2col GEMM; their output channels give every output packing (40: 8, 36: 4, 26: 1) and odd
panel counts (5, 4 + a half, 3 + a quarter), their pixels a part block of columns (17 x 20 = 340 =
28 x 12 + 4), and 64 x 5 = 320 sums per output, more than one k tile (partial sums kept in topT).
The last, 3 x 3 stride 1 from 64 channels, runs as Winograd, whose batched GEMM pairs panels too."""
from __future__ import annotations

import json

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from models import saved_graph
from test_ncnn_thread_split import CPUS, assert_matches_onnxruntime_on_every_cpu, build_fp32_ncnn

LAYERS = [(64, 40, (5, 1), True), (40, 36, (1, 5), False), (36, 26, (5, 1), True), (26, 64, (1, 5), True),
          (64, 40, (3, 3), True)]


def conv_graph(path, layers, hw, seed):
    """A chain of Convs (cin, cout, kernel, bias) on a 1 x cin x h x w input "x": up to 5 wide padded to
    keep the size, wider ones unpadded; random weights from `seed`."""
    rng = np.random.default_rng(seed)
    nodes, inits, x = [], [], "x"
    h, w_out = hw
    for i, (cin, cout, (kh, kw), bias) in enumerate(layers):
        w = (rng.standard_normal((cout, cin, kh, kw)) / np.sqrt(cin * kh * kw)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        ins = [x, f"w{i}"]
        if bias:
            inits.append(numpy_helper.from_array(rng.standard_normal(cout).astype(np.float32), f"b{i}"))
            ins.append(f"b{i}")
        out = "y" if i == len(layers) - 1 else f"c{i}"
        pads = [kh // 2, kw // 2, kh // 2, kw // 2] if max(kh, kw) <= 5 else [0, 0, 0, 0]
        w_out = w_out if max(kh, kw) <= 5 else w_out - kw + 1
        nodes.append(helper.make_node("Conv", ins, [out], kernel_shape=[kh, kw], pads=pads))
        x = out
    graph = helper.make_graph(nodes, path.stem,
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, layers[0][0], *hw])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, layers[-1][1], h, w_out])],
                              inits)
    return saved_graph(graph, path, opset=13)


def test_paired_panels_match_onnxruntime_on_every_cpu(tmp_path):
    model = conv_graph(tmp_path / "pairs.onnx", LAYERS, (17, 20), 11)
    art = build_fp32_ncnn(model, tmp_path / "out")
    layers = json.loads((tmp_path / "out" / "pairs-x86_64.json").read_text())["backend"]["layers"]
    assert "Convolution" in layers
    x = np.random.default_rng(12).standard_normal((1, 64, 17, 20)).astype(np.float32)
    # AVX without FMA runs the kernel's other copy (mul + add)
    assert_matches_onnxruntime_on_every_cpu(model, art, x, tmp_path, cpus=(*CPUS, "SandyBridge"))
