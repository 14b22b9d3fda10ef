"""ncnn's x86 1x1 and 2x2 convolutions and 3x3 ones with few input channels run edgepack's direct kernel
(edgepack/backends/ncnn/direct_conv_patch.py: 16 lanes on AVX-512, 8 on CPUs with FMA and F16C, such as
Haswell) and give onnxruntime's answer, on 1 and 2 threads; SSE CPUs (Nehalem) keep ncnn's kernels and
must agree too. The layers reach every variant of the kernel: input packed 1, 4, 8 and 16 channels
per pixel; output packed 8 and 16; one or two registers of output channels, with an 8-channel
half-block; 3x3 at stride 1 and 2, without padding and with a border the kernel adds row by row
(even, and bottom-right only as TensorFlow exports "SAME"); 1x1 unpadded (runs of pixels) and padded
(rows); 2x2 at stride 1, padded right and bottom as PP-HGNet's stem is, and unpadded; rows of 12-, 4- and 1-pixel blocks (6-, 2- and 1-pixel with 8 lanes); a fused activation; and, next to them, layers just past the break-even (16 channels
at stride 1, 128 at stride 2) and a 1x1 to 12 channels, which keep ncnn's Winograd and GEMM."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from clirun import host_cpu_flags
from test_ncnn_thread_split import _run, assert_matches_onnxruntime_on_every_cpu, build_fp32_ncnn

# (out channels, kernel, stride, pad: all sides or (top, left, bottom, right), relu): input 3 x 50 x 57
LAYERS = [(16, 3, 2, 1, False),   # 3 -> 16: packed 1 in, 16 out, one register; 25 x 29: 12 + 12 + 4 + 1 (6 x 4 + 2 x 2 + 1)
          (12, 1, 1, 0, False),   # to 12 channels (packed 4): ncnn's GEMM
          (24, 3, 1, 1, True),    # 12 -> 24 stride 1: packed 4 in, 8 out, a half-filled second register; Relu fused
          (16, 3, 1, 1, False),   # 24 -> 16 stride 1: ncnn's Winograd (past the break-even)
          (40, 3, 2, 0, False),   # 16 -> 40 stride 2, no padding: packed 16 in, 8 out, 32 + 8 channels; 12 x 14
          (48, 1, 1, 0, False),   # 1x1 40 -> 48 unpadded: packed 8 in, 16 out, 168 pixels in runs of 96 and 72
          (24, 1, 1, 1, True),    # 1x1 48 -> 24 padded: by rows, 14 x 16 pixels
          (48, 1, 1, 0, False),
          (96, 3, 2, (0, 0, 1, 1), True),  # 48 -> 96: packed 16 in and out, three blocks of 32; 7 x 8
          (32, 3, 2, 1, False),   # 96 -> 32: the largest input the kernel takes at stride 2
          (128, 1, 1, 0, False),
          (64, 3, 2, 1, False),   # 128 -> 64: ncnn's GEMM (past the break-even)
          (32, 2, 1, (0, 0, 1, 1), True),  # 2x2 64 -> 32 padded right and bottom (PP-HGNet's stem): packed 16 in and out
          (24, 2, 1, 0, False)]   # 2x2 32 -> 24 unpadded: 16 + 8 channels
H, W = 50, 57


@pytest.fixture(scope="module")
def direct_model(tmp_path_factory):
    rng = np.random.default_rng(3)
    nodes, inits, cin, name, hh, ww = [], [], 3, "x", H, W
    for i, (cout, k, s, pad, relu) in enumerate(LAYERS):
        pads = list(pad) if isinstance(pad, tuple) else [pad] * 4
        hh, ww = (hh + pads[0] + pads[2] - k) // s + 1, (ww + pads[1] + pads[3] - k) // s + 1
        w = (rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
        b = rng.standard_normal(cout).astype(np.float32) * 0.1
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        out = "y" if i == len(LAYERS) - 1 else f"c{i}"
        nodes.append(helper.make_node("Conv", [name, f"w{i}", f"b{i}"], [out], kernel_shape=[k, k], strides=[s, s],
                                      pads=pads))
        if relu:
            nodes.append(helper.make_node("Relu", [out], [f"r{i}"]))
            out = f"r{i}"
        cin, name = cout, out
    graph = helper.make_graph(nodes, "direct", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, H, W])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, cin, hh, ww])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = tmp_path_factory.mktemp("direct") / "direct.onnx"
    onnx.save(model, path)
    return path


def test_direct_kernel_layers_match_onnxruntime_on_every_x86_cpu(direct_model, tmp_path):
    art = build_fp32_ncnn(direct_model, tmp_path / "out")
    x = np.random.default_rng(8).standard_normal((1, 3, H, W)).astype(np.float32)
    assert_matches_onnxruntime_on_every_cpu(direct_model, art, x, tmp_path)


def _fma_order(x, w, b, pad=None):
    """The kernel's arithmetic for a stride-1 layer (padded to keep its size unless `pad` says): per
    output, the bias, then one fused multiply-add per (ic, ky, kx) in that order, rounded to fp32 each
    time (the fp64 product of two fp32 values is exact)."""
    cout, cin, k = w.shape[:3]
    pad = k // 2 if pad is None else pad
    xp = np.pad(x[0].astype(np.float64), ((0, 0), (pad, pad), (pad, pad)))
    hh, ww = x.shape[2] + 2 * pad - k + 1, x.shape[3] + 2 * pad - k + 1
    acc = np.broadcast_to(b[:, None, None], (cout, hh, ww)).astype(np.float32)
    for ic in range(cin):
        for ky in range(k):
            for kx in range(k):
                prod = w[:, ic, ky, kx].astype(np.float64)[:, None, None] * xp[ic, ky:ky + hh, kx:kx + ww][None]
                acc = (acc.astype(np.float64) + prod).astype(np.float32)
    return acc[None]


def test_avx512_and_avx2_cpus_run_the_direct_kernel(tmp_path):
    """A 12 -> 24 3x3 stride-1 layer, a 24 -> 32 1x1, then a 32 -> 16 2x2: where the kernel runs, the output is bit for
    bit its order of fused multiply-adds. It runs on AVX-512 (16 lanes) and on CPUs with FMA and F16C
    (8 lanes, AVX2 class: qemu's Haswell, and this machine capped with isa=avx2). An SSE CPU (Nehalem)
    runs ncnn's kernels, the first layer as Winograd, which is not that order; this machine capped
    with isa=sse runs the same code and gets the same bits."""
    rng = np.random.default_rng(4)
    w = (rng.standard_normal((24, 12, 3, 3)) / 6).astype(np.float32)
    b = (rng.standard_normal(24) * 0.1).astype(np.float32)
    w1 = (rng.standard_normal((32, 24, 1, 1)) / 5).astype(np.float32)
    b1 = (rng.standard_normal(32) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((16, 32, 2, 2)) / 11).astype(np.float32)
    b2 = (rng.standard_normal(16) * 0.1).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["h"], kernel_shape=[3, 3], pads=[1] * 4),
         helper.make_node("Conv", ["h", "w1", "b1"], ["h1"], kernel_shape=[1, 1]),
         helper.make_node("Conv", ["h1", "w2", "b2"], ["y"], kernel_shape=[2, 2])], "two",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 12, 20, 29])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 19, 28])],
        [numpy_helper.from_array(a, n) for a, n in ((w, "w"), (b, "b"), (w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "two.onnx")
    art = build_fp32_ncnn(tmp_path / "two.onnx", tmp_path / "out", "--no-simplify")
    x = rng.standard_normal((1, 12, 20, 29)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    exact = _fma_order(_fma_order(_fma_order(x, w, b), w1, b1), w2, b2, pad=0)
    cpus = ("native", "native isa=avx2", "Haswell-noTSX", "Nehalem", "native isa=sse", "native isa=avx2,direct=0",
            "native isa=avx2,direct=2")
    got = {cpu: _run(art, cpu, 1, tmp_path / "x.npy", tmp_path / cpu.replace(" ", "-").replace(",", "-")).reshape(exact.shape)
           for cpu in cpus}
    for cpu in ("native isa=avx2", "Haswell-noTSX", "native isa=avx2,direct=2"):
        np.testing.assert_array_equal(got[cpu], exact, err_msg=cpu)
    # direct=0 (the measuring switch): ncnn's Winograd and GEMM instead, another order, the same answer
    off = got["native isa=avx2,direct=0"]
    assert not np.array_equal(off, exact) and float(np.abs(off - exact).max()) <= 1e-5 * float(np.abs(exact).max())
    assert not np.array_equal(got["Nehalem"], exact)
    np.testing.assert_array_equal(got["native isa=sse"], got["Nehalem"])
    if "avx512f" in host_cpu_flags():
        np.testing.assert_array_equal(got["native"], exact)
    else:  # (the AMD EPYC of earlier sessions: AVX2, so the 8-lane kernel)
        np.testing.assert_array_equal(got["native"], got["Haswell-noTSX"])


def test_wide_1x1_layers_give_the_same_bits_by_either_kernel(tmp_path):
    """A 1x1 from 768 to 576 channels: on AVX2 CPUs the 8-lane kernel now takes it (measured ahead of
    ncnn's GEMM up to 768 -> 1536 there, bench/bench_direct_conv.py), on AVX-512 ones ncnn's GEMM keeps
    it (the 16-lane break-even stops at 512 outputs). Either sums each output as bias, then one fused
    multiply-add per input channel in order, so moving the break-even changes no answer: every CPU and
    direct=0 / direct=2 give that order's bits."""
    rng = np.random.default_rng(6)
    w = (rng.standard_normal((576, 768, 1, 1)) / 28).astype(np.float32)
    b = (rng.standard_normal(576) * 0.1).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[1, 1])], "wide",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 768, 9, 14])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 576, 9, 14])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "wide.onnx")
    art = build_fp32_ncnn(tmp_path / "wide.onnx", tmp_path / "out")
    x = rng.standard_normal((1, 768, 9, 14)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    exact = _fma_order(x, w, b)
    for cpu in ("native", "native isa=avx2", "Haswell-noTSX", "native isa=avx2,direct=0", "native direct=0",
                "native direct=2"):
        got = _run(art, cpu, 1, tmp_path / "x.npy", tmp_path / cpu.replace(" ", "-").replace(",", "-"))
        np.testing.assert_array_equal(got.reshape(exact.shape), exact, err_msg=cpu)


def test_the_x86_library_carries_the_direct_kernel_and_only_x86_keys_it(monkeypatch):
    from edgepack.backends.ncnn import library
    from edgepack.backends.ncnn.direct_conv_patch import CONV_FILE, FMA_FILE
    from edgepack.targets import TargetMatrix
    from edgepack.toolchains import Toolchain
    matrix, tc = TargetMatrix.load(), Toolchain.load()
    lib = library.build_library(matrix.get("x86_64"), tc)
    text = (lib.root / "src" / CONV_FILE).read_text()
    assert text.count("&& ep_c3_wanted(") == 1 and text.count("if (!weight_ep_c3.empty())") == 1
    assert (lib.root / "src" / FMA_FILE).read_text().count("\nint ep_c3_run_fma(") == 1  # the 8-lane kernel
    arm_key, _ = library.library_key(matrix.get("arm64"), tc)
    monkeypatch.setattr(library, "DIRECT_CONV_PATCH_KEY", library.DIRECT_CONV_PATCH_KEY + "-changed")
    assert library.library_key(matrix.get("arm64"), tc)[0] == arm_key
    assert library.library_key(matrix.get("x86_64"), tc)[0] != lib.key
