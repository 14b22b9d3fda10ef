"""Kernels held in fp16 in the default `fast` mode on x86 CPUs with F16C, at the fp16 rung, with the values the fp32
kernels held, so the same bits: im2col + GEMM convolutions (edgepack/backends/ncnn/gemm_conv_fp16_patch.py) and the
direct kernel's large layers (direct_conv_patch.py, version 8).

Three convolutions that ncnn runs as im2col + GEMM (not Winograd, not the direct kernel) walk every part of the
widening: a 1x1 64 -> 36 (output channels not a multiple of 8: 32- or 16-row runs and a 4-row tail), a 3x3
stride-2 36 -> 2052 (many M tiles, the last partial) and a 3x3 stride-2 2052 -> 40 (K = 18468: more than one K
tile on AVX-512, so partial sums are kept between K tiles). `EDGEPACK_NCNN_OPTIONS=fp16=0` keeps their kernels
fp32: the outputs must be the same bits either way, on every CPU with F16C (this host, qemu's Haswell and
IvyBridge); a wrong row, tile or offset in the widening, or a kernel rounded, would differ.

A stack of 256 -> 256 1x1 convolutions (64K weights each, run by the direct kernel) shows the direct kernel's
fp16 weights: the same bits as with `direct=3` (fp32 weights), on the 16- and the 8-lane kernel, and about half
the bytes held. A stack of 1024 -> 1024 1x1 convolutions (more input channels than the direct kernel takes)
does the same for im2col + GEMM against the fp32 build."""
from __future__ import annotations


import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from clirun import host_cpu_flags, run_artifact_on
from test_memory import conv_relu_stack, resident_after_run
from test_ncnn_winograd_fp16 import build_x86_ncnn, f16c_cpus, fp16_rung_reference, runs_with_and_without_fp16

H, W = 24, 20
LAYERS = [(64, 36, 1, 1), (36, 2052, 3, 2), (2052, 40, 3, 2)]  # (in, out, kernel, stride)


def _model(path):
    rng = np.random.default_rng(23)
    nodes, inits, x = [], [], "x"
    for i, (cin, cout, k, s) in enumerate(LAYERS):
        w = (rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float16).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"),
                  numpy_helper.from_array((rng.standard_normal(cout) * 0.1).astype(np.float32), f"b{i}")]
        last = i == len(LAYERS) - 1
        nodes.append(helper.make_node("Conv", [x, f"w{i}", f"b{i}"], ["y" if last else f"c{i}"], pads=[k // 2] * 4,
                                      strides=[s, s]))
        if not last:
            nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"]))
            x = f"r{i}"
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "gcf16", [helper.make_tensor_value_info("x", f, [1, LAYERS[0][0], H, W])],
                              [helper.make_tensor_value_info("y", f, [1, LAYERS[-1][1], H // 4, W // 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_fp16_gemm_conv_kernels_give_the_fp32_kernels_bits_on_every_x86_cpu(tmp_path):
    model = _model(tmp_path / "gcf16.onnx")
    res, want, scale = fp16_rung_reference(model, tmp_path, 5, (1, LAYERS[0][0], H, W))
    every = sorted((str(i), str(o), str(k)) for i, o, k, _ in LAYERS)
    for cpu, fp16 in f16c_cpus().items():
        got = runs_with_and_without_fp16(res["file"], cpu, tmp_path, want.shape,
                                         r"edgepack gemm conv: (\d+) -> (\d+) (\d)x\d, kernel in fp16",
                                         every if fp16 else [])
        for key, out in got.items():
            np.testing.assert_array_equal(out, got["fp16=0", 1], err_msg=f"{cpu} {key}")
        # and onnxruntime's answer, but for the order of 18468-term sums
        assert float(np.abs(got["", 1] - want).max()) <= 2e-3 * scale, cpu


def test_fp16_gemm_conv_kernels_take_half_the_memory(tmp_path):
    """Weights fp16 does not hold exactly: the fp16 rung stores them rounded (and its kernels narrow), the fp32
    rung stores them as they are (and its kernels stay fp32)."""
    layers, ch = 3, 1024
    model = conv_relu_stack(tmp_path / "convs.onnx", layers, ch, 8, 1, seed=5)
    held = {}
    for rung, extra in (("fp16", ()), ("fp32", ("--fp32",))):
        res = build_x86_ncnn(model, tmp_path / rung, *extra)
        assert res["precision"] == ("fp32" if extra else "fp16-storage"), res
        held[rung] = resident_after_run(res["file"])
    kernels = layers * ch * ch * 4  # fp32
    if "f16c" not in host_cpu_flags():
        assert abs(held["fp16"] - held["fp32"]) < 0.25 * kernels / 2
        return
    assert held["fp16"] < held["fp32"] - 0.75 * kernels / 2, {k: v / 2**20 for k, v in held.items()}


def test_the_direct_kernel_keeps_large_layers_weights_in_fp16(tmp_path):
    layers, ch, hw = 6, 256, 12  # 64K weights a layer: the smallest the fp16 rung narrows
    model = conv_relu_stack(tmp_path / "direct.onnx", layers, ch, hw, 1, seed=9)
    res = build_x86_ncnn(model, tmp_path / "out")
    assert res["precision"] == "fp16-storage", res
    np.save(tmp_path / "x.npy", np.random.default_rng(2).standard_normal((1, ch, hw, hw)).astype(np.float32))
    fp16, fp32 = resident_after_run(res["file"]), resident_after_run(res["file"], "direct=3")
    weights = layers * ch * ch * 4
    if not {"f16c", "fma"} <= host_cpu_flags():  # ncnn's own kernels, fp32 weights either way
        assert abs(fp16 - fp32) < 0.25 * weights / 2, (fp16 / 2**20, fp32 / 2**20)
        return
    kernels = ["native"] + (["native isa=avx2"] if "avx512f" in host_cpu_flags() else [])
    for cpu in kernels:
        got = {}
        for switch in ("direct=1", "direct=3"):  # fp16 weights on these layers, fp32
            for threads in (1, 2):
                run_on = cpu + ("," if " " in cpu else " ") + switch
                got[switch, threads] = run_artifact_on(res["file"], run_on, {"x": tmp_path / "x.npy"},
                                                       tmp_path / f"{run_on}-{threads}", ("r5",), threads)[0]["r5"]
        for key, out in got.items():
            np.testing.assert_array_equal(out, got["direct=3", 1], err_msg=f"{cpu} {key}")
    assert fp16 < fp32 - 0.75 * weights / 2, (fp16 / 2**20, fp32 / 2**20)


def test_the_x86_library_carries_the_fp16_gemm_conv_kernels_and_only_x86_keys_them(monkeypatch):
    from edgepack.backends.ncnn import library
    from edgepack.targets import TargetMatrix
    from edgepack.toolchains import Toolchain
    matrix, tc = TargetMatrix.load(), Toolchain.load()
    lib = library.build_library(matrix.get("x86_64"), tc)
    x86 = lib.root / "src" / "src" / "layer" / "x86"
    im2col = (x86 / "convolution_im2col_gemm.h").read_text()
    assert im2col.count("ep_im2col_gemm_tile(AT_tile, BT_tile, bias") == 1
    assert im2col.count("#define EP_WF16_HELPERS_DEFINED") == 1  # the shared F16C block, once in each header
    assert (x86 / "convolution_3x3_winograd.h").read_text().count("#define EP_WF16_HELPERS_DEFINED") == 1
    assert (x86 / "convolution_x86.cpp").read_text().count("ep_im2col_kernel_fp16(weight_sgemm_data") == 1
    arm_key, _ = library.library_key(matrix.get("arm64"), tc)
    monkeypatch.setattr(library, "GEMM_CONV_FP16_PATCH_KEY", library.GEMM_CONV_FP16_PATCH_KEY + "-changed")
    assert library.library_key(matrix.get("arm64"), tc)[0] == arm_key
    assert library.library_key(matrix.get("x86_64"), tc)[0] != lib.key
