"""Winograd convolutions on maps too large for their transformed input to stay in cache run over strips of
rows (edgepack/backends/ncnn/winograd_strips_patch.py) and still match onnxruntime.

Two 3x3 convolutions on a 216 x 96 map: 32 -> 32 channels (ncnn's F(6,3)) and 32 -> 64 (F(4,3)), whose
whole-map transformed inputs (4.7 and 6.0 MB) exceed two 2 MiB strips, so each runs as strips of tile rows,
the last one partial (216 rows are 36 F(6,3) tiles, 54 F(4,3) tiles). On every x86 CPU model at 1 and 2
threads: within 1e-4 of onnxruntime's scale, and the same bits on 1 and 2 threads. The strip arithmetic
is checked against the same shapes.

im2col + GEMM (version 2): a 3x3 stride-2 layer (32 -> 64 from the same map, 6.0 MB of im2col) and a 5x5
layer (64 -> 32 on its 108 x 48 output, 33 MB), with the direct kernel switched off so ncnn's im2col path
runs them. The same checks, plus the arena's held-peak (EDGEPACK_NCNN_TRACE): the tensors alive at once
must stay far below the 5x5 layer's whole-map im2col, which the unpatched library allocated at once, and
below what it was while the whole input was bordered before the strips (version 3 borders each strip).

Arm (aarch64 builds): the Winograd model and a stride-2 + dilated 3x3 pair that Arm runs as im2col + GEMM
(its 5x5 takes a direct kernel there), built fp32 and fp16, run under qemu's cortex-a53 (no fp16
arithmetic: Convolution_arm's fp32 path) and max (the fp16 arithmetic path): within 1e-4 of onnxruntime's
scale in fp32, within the build's own bound in fp16, and the arena's held-peak far below the dilated
layer's whole-map im2col."""
from __future__ import annotations

import json
import re

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from clirun import run_artifact_on, run_edgepack
from edgepack.backends.ncnn.winograd_strips_patch import STRIP_BYTES
from models import saved_graph
from test_memory import held_peak
from test_ncnn_thread_split import assert_matches_onnxruntime_on_every_cpu, build_fp32_ncnn

H, W = 216, 96


def _two_convs(path, name, seed, convs, out_shape):
    """x (1 x 32 x H x W) -> Conv -> Relu -> Conv -> y, each conv given as (weight shape, weight scale, its
    Conv attributes); weights drawn first, then biases, from one seeded generator."""
    rng = np.random.default_rng(seed)
    w1, w2 = ((rng.standard_normal(shape) * scale).astype(np.float32) for shape, scale, _ in convs)
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], **convs[0][2]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["y"], **convs[1][2])]
    inits = [numpy_helper.from_array(w1, "w1"),
             numpy_helper.from_array(rng.standard_normal(w1.shape[0]).astype(np.float32) * 0.1, "b1"),
             numpy_helper.from_array(w2, "w2"),
             numpy_helper.from_array(rng.standard_normal(w2.shape[0]).astype(np.float32) * 0.1, "b2")]
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", f, [1, 32, H, W])],
                              [helper.make_tensor_value_info("y", f, out_shape)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _model(path):
    return _two_convs(path, "strips", 3, [((32, 32, 3, 3), 0.08, {"pads": [1, 1, 1, 1]}),
                                          ((64, 32, 3, 3), 0.08, {"pads": [1, 1, 1, 1]})], [1, 64, H, W])


def _transformed_bytes(m: int, cin: int) -> int:
    """The whole map's transformed input for F(m,3): (m + 2)^2 values per tile and input channel."""
    return (m + 2) ** 2 * cin * ((W + m - 1) // m) * ((H + m - 1) // m) * 4


def test_the_shapes_take_strips():
    # both layers' buffers exceed two strips (else the layer runs whole and this test checks nothing new)
    assert _transformed_bytes(6, 32) > 2 * STRIP_BYTES and _transformed_bytes(4, 32) > 2 * STRIP_BYTES


def test_winograd_strips_match_onnxruntime_on_every_x86_cpu(tmp_path):
    model = _model(tmp_path / "strips.onnx")
    art = build_fp32_ncnn(model, tmp_path / "out")
    x = np.random.default_rng(9).standard_normal((1, 32, H, W)).astype(np.float32)
    assert_matches_onnxruntime_on_every_cpu(model, art, x, tmp_path)


def _im2col_model(path):
    return _two_convs(path, "im2col_strips", 4,
                      [((64, 32, 3, 3), 0.08, {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
                       ((32, 64, 5, 5), 0.03, {"pads": [2, 2, 2, 2]})], [1, 32, H // 2, W // 2])


def _im2col_bytes(k_values: int, out_pixels: int) -> int:
    return k_values * out_pixels * 4


def test_the_im2col_shapes_take_strips():
    out_pixels = (H // 2) * (W // 2)
    assert _im2col_bytes(32 * 9, out_pixels) > 2 * STRIP_BYTES      # the stride-2 layer: 6.0 MB
    assert _im2col_bytes(64 * 25, out_pixels) > 8 * STRIP_BYTES     # the 5x5 layer: 33 MB


def _held_peak(stderr: str) -> int:
    peaks = [int(v) * 1024 for v in re.findall(r"held-peak=(\d+) kB", stderr)]
    assert peaks, stderr[-2000:]
    return peaks[-1]


def test_im2col_strips_match_onnxruntime_and_bound_the_tensors(tmp_path):
    model = _im2col_model(tmp_path / "im2col.onnx")
    art = build_fp32_ncnn(model, tmp_path / "out")
    x = np.random.default_rng(11).standard_normal((1, 32, H, W)).astype(np.float32)
    # direct=0: ncnn's own kernels, so both layers run as im2col + GEMM on every CPU
    assert_matches_onnxruntime_on_every_cpu(model, art, x, tmp_path, cpus=(
        "native direct=0", "native isa=avx2,direct=0", "Haswell-noTSX direct=0", "Nehalem", "native isa=sse"))
    peak = held_peak(art, "direct=0")
    # alive at once: the input (2.7 MB), the first layer's output (1.3 MB), a bordered strip and the GEMM's
    # tiles: 9.6 MB on an AVX-512 host, where the library that bordered the whole input first held 11.4 MB
    # (patch version 2). The 5x5 layer's whole im2col alone is 33 MB
    assert 2 << 20 < peak < 10.5e6, peak


def _uneven_border_model(path):
    # borders that differ per side, made strip by strip: ONNX SAME_UPPER on a stride-2 layer (no row above,
    # one below: im2col strips) and explicit pads of 2 above and right, none below and left (Winograd strips)
    return _two_convs(path, "uneven_border_strips", 6,
                      [((64, 32, 3, 3), 0.08, {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
                       ((32, 64, 3, 3), 0.05, {"pads": [2, 0, 0, 2]})], [1, 32, H // 2, W // 2])


def test_uneven_borders_match_onnxruntime_on_every_x86_cpu(tmp_path):
    model = _uneven_border_model(tmp_path / "uneven.onnx")
    art = build_fp32_ncnn(model, tmp_path / "out")
    x = np.random.default_rng(12).standard_normal((1, 32, H, W)).astype(np.float32)
    assert_matches_onnxruntime_on_every_cpu(model, art, x, tmp_path, cpus=(
        "native direct=0", "native", "Haswell-noTSX direct=0", "Nehalem"))


def _arm_im2col_model(path):
    # Arm's direct kernels take neither a pack-4 3x3 stride-2 layer with 32 outputs or more nor a dilated one
    return _two_convs(path, "arm_im2col_strips", 5,
                      [((64, 32, 3, 3), 0.08, {"pads": [1, 1, 1, 1], "strides": [2, 2]}),
                       ((64, 64, 3, 3), 0.05, {"pads": [2, 2, 2, 2], "dilations": [2, 2]})], [1, 64, H // 2, W // 2])


def test_the_arm_im2col_shapes_take_strips():
    assert _im2col_bytes(64 * 9, (H // 2) * (W // 2)) > 4 * STRIP_BYTES  # the dilated layer: 11.9 MB


# The arena's held-peak allowed per (model, Convolution_arm path), at 1 and 2 threads under qemu-user (ncnn
# reads the host's cache sizes there):
# fp32 path: halfway between the strips that border their own rows (Arm patch version 2: the Winograd model
# 13.4 MB, the im2col one 9.6) and the strips of a whole bordered copy (version 1: 14.9 and 11.4 MB; 20.1
# and 16.1 without strips)
# fp16 arithmetic path: halfway to the library without strips: 10.6 against 11.4 and 6.0 against 8.1 (its
# buffers are half the size; bordering by strips does not move these two peaks)
ARM_HELD_PEAK = {("_model", "fp32"): 14.1e6, ("_arm_im2col_model", "fp32"): 10.5e6,
                 ("_model", "fp16sa"): 11.0e6, ("_arm_im2col_model", "fp16sa"): 7.0e6}


def assert_arm64_builds_match_and_bound_the_tensors(model, x, tmp_path, held_peak):
    """`model` (input x, output y) built fp32 and fp16 for arm64, each verified by the build on cortex-a53 and max
    against onnxruntime within its bound for the precision, then run on both at 1 and 2 threads: fp32 within
    1e-4 of onnxruntime's scale, and the arena's held-peak under held_peak[path], the layers' path: "fp32", or
    "fp16sa" (fp16 arithmetic, the fp16 build on max; the A53 has none)."""
    np.save(tmp_path / "x.npy", x)
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    scale = float(np.abs(want).max())
    for precision in ("--fp32", "--fp16"):
        out = tmp_path / f"{model.stem}{precision}"
        proc = run_edgepack("build", str(model), "--target", "arm64", "--backend", "ncnn", precision,
                            "--out", str(out), "--json")
        report = json.loads(proc.stdout) if proc.stdout.strip() else {}
        assert proc.returncode == 0 and report.get("ok"), proc.stderr[-3000:]
        for cpu in ("cortex-a53", "max"):
            path = "fp16sa" if (precision, cpu) == ("--fp16", "max") else "fp32"
            for threads in (1, 2):
                got, err = run_artifact_on(out / f"{model.stem}-arm64", cpu, {"x": tmp_path / "x.npy"},
                                           tmp_path / f"o-{model.stem}{precision}-{cpu}-{threads}", ("y",), threads,
                                           env={"EDGEPACK_NCNN_TRACE": "1"})
                diff = float(np.abs(got["y"].reshape(want.shape) - want).max())
                if precision == "--fp32":  # (an fp16 build's weights are fp16 on every CPU)
                    assert diff <= 1e-4 * scale, (model.stem, precision, cpu, threads, diff)
                peak = _held_peak(err)
                assert peak < held_peak[path], (model.stem, precision, cpu, threads, peak)


def test_arm64_strips_match_onnxruntime_and_bound_the_tensors(tmp_path):
    x = np.random.default_rng(13).standard_normal((1, 32, H, W)).astype(np.float32)
    for make in (_model, _arm_im2col_model):
        assert_arm64_builds_match_and_bound_the_tensors(
            make(tmp_path / f"{make.__name__}.onnx"), x, tmp_path,
            {path: ARM_HELD_PEAK[make.__name__, path] for path in ("fp32", "fp16sa")})


# Version 4: one-row maps in pieces of columns. A Whisper-like STFT (1 -> 128 channels, 400 taps at stride
# 160 over 480,400 samples: 3001 frames) and, on its output, a dilated Conv1D (128 -> 32, kernel 3,
# dilation 2, pads 2 on each side), both written by the converter as 2-D Convolutions of one row
SAMPLES, TAPS, HOP, BANDS, FRAMES = 480_400, 400, 160, 128, 3001


def _row_model(path):
    rng = np.random.default_rng(14)
    t = np.arange(TAPS)
    window = 0.5 - 0.5 * np.cos(2 * np.pi * t / TAPS)
    stft = (np.cos(2 * np.pi * np.outer(np.arange(BANDS), t) / TAPS) * window)[:, None, :].astype(np.float32)
    w2 = (rng.standard_normal((32, BANDS, 3)) / np.sqrt(3 * BANDS)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "stft"], ["c1"], kernel_shape=[TAPS], strides=[HOP]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["y"], kernel_shape=[3], dilations=[2], pads=[2, 2])]
    inits = [numpy_helper.from_array(stft, "stft"), numpy_helper.from_array(w2, "w2"),
             numpy_helper.from_array(rng.standard_normal(32).astype(np.float32) * 0.1, "b2")]
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "row_pieces", [helper.make_tensor_value_info("x", f, [1, 1, SAMPLES])],
                              [helper.make_tensor_value_info("y", f, [1, 32, FRAMES])], inits)
    return saved_graph(graph, path, opset=13)


def test_the_row_shapes_take_pieces():
    # each layer's one-row im2col exceeds two strips (else it runs whole and this test checks nothing new)
    assert _im2col_bytes(TAPS, FRAMES) > 2 * STRIP_BYTES and _im2col_bytes(3 * BANDS, FRAMES) > 2 * STRIP_BYTES
    assert (SAMPLES - TAPS) // HOP + 1 == FRAMES


def test_one_row_maps_run_in_pieces_match_onnxruntime_and_bound_the_tensors(tmp_path):
    model = _row_model(tmp_path / "rows.onnx")
    art = build_fp32_ncnn(model, tmp_path / "out")
    rewrites = json.loads((tmp_path / "out" / "rows-x86_64.json").read_text())["backend"]["onnx_rewrites"]
    assert {"strided_convs_as_rows x1", "wide_convs_as_rows x1"} <= set(rewrites), rewrites
    t = np.arange(SAMPLES) / 16000
    noise = np.random.default_rng(15).standard_normal(SAMPLES)
    x = (np.sin(2 * np.pi * 440 * t) + 0.3 * noise).astype(np.float32).reshape(1, 1, SAMPLES)
    # (the pieces' seams: 640 and 672 frames a piece, the last ones partial)
    assert_matches_onnxruntime_on_every_cpu(model, art, x, tmp_path, cpus=(
        "native", "native isa=avx2", "Haswell-noTSX", "Nehalem"))
    peak = held_peak(art)
    # alive at once, run whole (patch version 3): the input (1.9 MB), the STFT's output (1.5 MB) and its
    # whole im2col (4.9 MB): 8.4 MB; in pieces, each im2col about a strip (2 MiB): 5.8 MB on an AVX-512 host
    assert peak < 7.0e6, peak
