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
its batched GEMM pairs panels over the map's 88 to 768 tiles (F(6,3) to F(2,3))."""
from __future__ import annotations

import numpy as np

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
