"""Transposed convolutions whose GEMM columns would be large run over strips of input rows
(edgepack/backends/ncnn/deconv_strips_patch.py) and still match onnxruntime.

x (1 x 16 x 96 x 64) -> ConvTranspose 2x2 stride 2 (16 -> 64, the usual upsampler: each output from one
input pixel) -> Relu -> ConvTranspose 3x3 stride 2, pads 1, output_padding 1 (64 -> 6: outputs reached
from two input rows, so from two strips) -> y (1 x 6 x 384 x 256). Both layers' whole-map columns and
packed inputs (6.7 and 13.4 MB) exceed two 2 MiB strips. x86 runs the first layer through ncnn's
stride = kernel scatter (pack 8 and 4: Haswell, Nehalem) and col2im (pack 16 on AVX-512), the second through
col2im at pack 1. Arm runs both through col2im, fp32 and fp16 arithmetic. On every CPU model at 1 and 2
threads: within 1e-4 of onnxruntime's scale in fp32 (the same bits on 1 and 2 threads on x86), within
the build's bound in fp16; and the arena's held-peak far below what the whole-map columns held."""
from __future__ import annotations

import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from edgepack.backends.ncnn.winograd_strips_patch import STRIP_BYTES
from test_memory import held_peak
from test_ncnn_thread_split import assert_matches_onnxruntime_on_every_cpu, build_fp32_ncnn
from test_ncnn_winograd_strips import assert_arm64_builds_match_and_bound_the_tensors

H, W = 96, 64
# the arena's held-peak allowed, at 1 and 2 threads: halfway between this patch (x86, on AVX-512 natively and
# qemu Haswell, and Arm's fp32 path: 11.0 MB; Arm's fp16 arithmetic path: 5.5 MB) and the whole-map columns
# (20.3 and 10.1 MB: the second layer's input, columns, packed input and output at once)
X86_BOUND = 15.6e6
ARM_HELD_PEAK = {"fp32": 15.6e6, "fp16sa": 7.8e6}


def _model(path):
    rng = np.random.default_rng(21)
    w1 = (rng.standard_normal((16, 64, 2, 2)) * 0.2).astype(np.float32)  # ConvTranspose weights: in, out, kh, kw
    w2 = (rng.standard_normal((64, 6, 3, 3)) * 0.05).astype(np.float32)
    nodes = [helper.make_node("ConvTranspose", ["x", "w1", "b1"], ["d1"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("Relu", ["d1"], ["r1"]),
             helper.make_node("ConvTranspose", ["r1", "w2", "b2"], ["y"], kernel_shape=[3, 3], strides=[2, 2],
                              pads=[1, 1, 1, 1], output_padding=[1, 1])]
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(rng.standard_normal(64).astype(np.float32) * 0.1, "b1"),
             numpy_helper.from_array(w2, "w2"), numpy_helper.from_array(rng.standard_normal(6).astype(np.float32) * 0.1, "b2")]
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "deconv_strips", [helper.make_tensor_value_info("x", f, [1, 16, H, W])],
                              [helper.make_tensor_value_info("y", f, [1, 6, 4 * H, 4 * W])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _columns_bytes(kernel: int, cout: int, cin: int, pixels: int) -> int:
    """A Deconvolution GEMM's columns plus its packed input over `pixels` input pixels."""
    return (kernel * kernel * cout + cin) * pixels * 4


def test_the_shapes_take_strips():
    assert _columns_bytes(2, 64, 16, H * W) > 2 * STRIP_BYTES        # 6.7 MB
    assert _columns_bytes(3, 6, 64, 4 * H * W) > 4 * STRIP_BYTES     # 13.4 MB


def test_deconv_strips_match_onnxruntime_and_bound_the_tensors(tmp_path):
    model = _model(tmp_path / "deconv.onnx")
    art = build_fp32_ncnn(model, tmp_path / "out")
    assert "Deconvolution" in json.loads((tmp_path / "out" / "deconv-x86_64.json").read_text())["backend"]["layers"]
    x = np.random.default_rng(22).standard_normal((1, 16, H, W)).astype(np.float32)
    assert_matches_onnxruntime_on_every_cpu(model, art, x, tmp_path, cpus=(
        "native", "native isa=avx2", "Haswell-noTSX", "Nehalem"))
    peak = held_peak(art)
    assert 2 << 20 < peak < X86_BOUND, peak


def test_arm64_deconv_strips_match_onnxruntime_and_bound_the_tensors(tmp_path):
    x = np.random.default_rng(23).standard_normal((1, 16, H, W)).astype(np.float32)
    assert_arm64_builds_match_and_bound_the_tensors(_model(tmp_path / "deconv.onnx"), x, tmp_path, ARM_HELD_PEAK)
