"""ncnn's im2col convolution GEMM summing two 16-row panels at once on AVX-512
(edgepack/backends/ncnn/gemm_pair16_patch.py), checked against onnxruntime and for the same bits on 1
and 2 threads (2 threads split the rows otherwise: another mix of paired and single panels).

The AVX-512 kernel runs natively on an AVX-512 host (qemu has no AVX-512); the other CPU models check
that the edits leave the AVX2, AVX and SSE kernels alone.

First model: 5 x 1 and 1 x 5 convolutions (the im2col GEMM) whose output channels give every output
packing with a pair and a lone panel or rows left over (48: 16-packed, 40: 8, 36: 4, 50: 1, 64: two
pairs); 18 x 20 = 360 pixels are seven spans of 48 columns (four 12-column groups at offsets 0, 12,
8, 4), one 16-column block as two 8-column halves, and a tail block of 8 that ncnn's loop keeps.
Second model: one convolution with 256 x 257 = 65,792 sums per output, more than a k tile holds
(TILE_K follows the L2 cache: 32,752 at 2 MiB), so partial sums go through topT between k tiles.
Third: a 3 x 3 convolution, 64 -> 64 channels (two pairs) on a 48 x 64 map, which ncnn runs as Winograd:
its batched GEMM pairs panels over the map's 88 to 768 tiles (F(6,3) to F(2,3)). Last: the Gemm layer's
tile kernel (gemm_fp32.h), with constant and per-run B."""
from __future__ import annotations

import json

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from models import saved_graph
from test_ncnn_gemm_pair import conv_graph
from test_ncnn_thread_split import CPUS, assert_matches_onnxruntime_on_every_cpu, build_fp32_ncnn

CHAIN = [(64, 48, (5, 1), True), (48, 40, (1, 5), False), (40, 36, (5, 1), True), (36, 50, (1, 5), True),
         (50, 64, (1, 5), True)]
LONG_K = [(256, 32, (1, 257), True)]
WINOGRAD = [(64, 64, (3, 3), True)]


def _check(tmp_path, name, layers, hw, seed):
    model = conv_graph(tmp_path / f"{name}.onnx", layers, hw, seed)
    art = build_fp32_ncnn(model, tmp_path / "out")
    x = np.random.default_rng(seed + 1).standard_normal((1, layers[0][0], *hw)).astype(np.float32)
    assert_matches_onnxruntime_on_every_cpu(model, art, x, tmp_path, cpus=CPUS)


def test_paired_16_row_panels_match_onnxruntime(tmp_path):
    _check(tmp_path, "pairs16", CHAIN, (18, 20), 21)


def test_paired_panels_keep_partial_sums_between_k_tiles(tmp_path):
    _check(tmp_path, "longk", LONG_K, (1, 112 + 256), 31)


def test_paired_panels_in_winograds_batched_gemm(tmp_path):
    _check(tmp_path, "wino16", WINOGRAD, (48, 64), 41)


def gemm_graph(path):
    """x [48, 300] times constant weights with a bias per column (pnnx: a Gemm with a per-column C), then
    without one, then the result times its own transpose (MatMul: B packed each run). 48 rows are a pair
    and a lone panel; 360 and 200 columns spans, a half-block remainder and tails; 48 columns one span."""
    rng = np.random.default_rng(51)

    def const(name, *shape, scale=1.0):
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    inits = [const("w1", 300, 360, scale=300 ** -0.5), const("c1", 360), const("w2", 360, 200, scale=360 ** -0.5)]
    nodes = [helper.make_node("Gemm", ["x", "w1", "c1"], ["h1"]),
             helper.make_node("MatMul", ["h1", "w2"], ["h2"]),
             helper.make_node("Transpose", ["h2"], ["h2t"], perm=[1, 0]),
             helper.make_node("MatMul", ["h2", "h2t"], ["y"])]
    graph = helper.make_graph(nodes, path.stem, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [48, 300])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [48, 48])], inits)
    return saved_graph(graph, path, opset=13)


def test_paired_panels_in_the_gemm_layer(tmp_path):
    model = gemm_graph(tmp_path / "gemm16.onnx")
    art = build_fp32_ncnn(model, tmp_path / "out")
    layers = json.loads((tmp_path / "out" / "gemm16-x86_64.json").read_text())["backend"]["layers"]
    assert {"Gemm", "MatMul"} <= set(layers), layers
    x = np.random.default_rng(52).standard_normal((48, 300)).astype(np.float32)
    assert_matches_onnxruntime_on_every_cpu(model, art, x, tmp_path, cpus=CPUS)
