"""Convolutions in NHWC before TVM fuses them (edgepack/backends/tvm/layout.py), and the pixel-row
tiles the default schedules give them (schedules.py).

In-process TVM, as test_tvm_schedules.py: relax modules built for the host and run in the VM,
answers against numpy."""
from __future__ import annotations

import numpy as np
import pytest

import tvm  # noqa: E402  (installed in CI: a missing one fails, never skips)
from tvm import relax  # noqa: E402

from tvm_modules import host_target as _target, relax_module as _module  # noqa: E402
from edgepack.backends.tvm.compile import conv_layout, fuse, lower_pipeline  # noqa: E402
from edgepack.backends.tvm.layout import clips_as_min_max, has_conv2d  # noqa: E402
from edgepack.backends.tvm.schedules import apply_default_schedules, schedule_func  # noqa: E402

RNG = np.random.default_rng(3)


def _build_run(mod, inputs: dict, target, scheduled=True):
    if scheduled:
        mod, _used = apply_default_schedules(mod, target)
    with tvm.transform.PassContext(opt_level=3):
        ex = relax.build(mod, target=target, relax_pipeline=lower_pipeline(target))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in inputs.values()]).numpy()


def _kernels(mod) -> dict:
    return {gv.name_hint: f for gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)}


def _conv_hardswish(w, b):
    """conv2d + bias + HardSwish as relax's ONNX importer writes it: add 3, clip(0, 6), /6, times x."""
    def body(bb, v):
        y = relax.op.add(relax.op.nn.conv2d(v, relax.const(w)), relax.const(b.reshape(1, -1, 1, 1)))
        gate = relax.op.divide(relax.op.clip(relax.op.add(y, relax.const(np.float32(3))), 0, 6),
                               relax.const(np.float32(6)))
        return relax.op.multiply(y, gate)
    return body


def _ref_conv1x1_hardswish(x, w, b):
    y = np.einsum("nchw,oc->nohw", x.astype(np.float64), w[:, :, 0, 0].astype(np.float64)) + b.reshape(1, -1, 1, 1)
    return y * np.clip(y + 3, 0, 6) / 6


def test_conv_and_hardswish_fuse_into_one_nhwc_kernel(monkeypatch):
    """The clip inside HardSwish has no layout rule in relax: without the rewrite it sat between
    two transposes and split the kernel; rewritten, conv + bias + HardSwish are one NHWC kernel and
    the only other kernels are the transposes at the module's edges."""
    x = RNG.standard_normal((1, 24, 14, 14)).astype("float32")
    w, b = RNG.standard_normal((32, 24, 1, 1)).astype("float32") * 0.2, RNG.standard_normal(32).astype("float32")
    mod = _module({"x": x}, _conv_hardswish(w, b))
    fused = fuse(mod, _target())
    assert conv_layout(fused) == "NHWC"
    names = sorted(_kernels(fused))
    convs = [n for n in names if "conv2d" in n]
    assert len(convs) == 1 and "minimum" in convs[0] and "maximum" in convs[0], names
    assert "transpose" not in convs[0], names
    assert all(n == convs[0] or n.startswith("transpose") for n in names), names
    got = _build_run(fused, {"x": x}, _target())
    np.testing.assert_allclose(got, _ref_conv1x1_hardswish(x, w, b), rtol=1e-4, atol=1e-4)

    monkeypatch.setenv("EDGEPACK_TVM_LAYOUT", "nchw")
    kept = fuse(mod, _target())
    assert conv_layout(kept).startswith("NCHW")
    assert not any("transpose" in n for n in _kernels(kept)), sorted(_kernels(kept))
    np.testing.assert_allclose(_build_run(kept, {"x": x}, _target()), got, rtol=1e-5, atol=1e-5)


def test_clip_rewrite_gives_the_same_bits_as_clip_nan_and_infinities_included():
    x = np.array([[np.nan, -np.inf, np.inf, -7.5, -0.0, 0.0, 2.5, 6.0, 6.5, 1e30, -1e-40, 3.0]], "float32")
    mod = _module({"x": x}, lambda bb, v: relax.op.clip(v, -1, 6))
    rewritten = clips_as_min_max(mod)
    assert "clip" not in rewritten.script() and "clip" in mod.script()
    a = _build_run(fuse(mod, _target()), {"x": x}, _target())
    b = _build_run(fuse(rewritten, _target()), {"x": x}, _target())
    assert a.tobytes() == b.tobytes(), (a, b)
    np.testing.assert_array_equal(b[0, 1:], np.clip(x[0, 1:], -1, 6))


def test_models_without_convolutions_keep_their_layout():
    x = RNG.standard_normal((4, 16)).astype("float32")
    mod = _module({"x": x}, lambda bb, v: relax.op.clip(relax.op.matmul(v, relax.const(np.eye(16, dtype="float32"))), 0, 1))
    assert not has_conv2d(mod)
    fused = fuse(mod, _target())
    assert conv_layout(fused) == "no conv2d"
    assert not any("transpose" in n for n in _kernels(fused))


@pytest.mark.parametrize("groups,k,stride", [(1, 3, 1), (1, 3, 2), (24, 5, 1), (24, 3, 2)],
                         ids=["conv3x3", "conv3x3-s2", "depthwise5x5", "depthwise3x3-s2"])
def test_nhwc_convolutions_compute_what_nchw_ones_do(groups, k, stride):
    x = RNG.standard_normal((1, 24, 17, 15)).astype("float32")
    w = RNG.standard_normal((24, 24 // groups, k, k)).astype("float32")

    def body(bb, v):
        y = relax.op.nn.conv2d(v, relax.const(w), strides=stride, padding=k // 2, groups=groups)
        return relax.op.nn.relu(y)
    mod = _module({"x": x}, body)
    fused = fuse(mod, _target(mcpu="x86-64-v3"))
    assert conv_layout(fused) == "NHWC"
    got = _build_run(fused, {"x": x}, _target(mcpu="x86-64-v3"))
    want = _build_run(relax.transform.LegalizeOps()(mod), {"x": x}, _target(), scheduled=False)  # naive NCHW
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("side,rows", [(14, 7), (7, 7)])
def test_pixels_of_a_short_nhwc_row_are_tiled_across_rows(side, rows):
    """1x1 conv in NHWC (PP-LCNet's 256-channel stage is 14 x 14): output channels are the vector,
    pixels of an image row the rows a weight vector is reused over, one FMA per row and loaded
    vector. Without 7 among the row tiles, a 14-pixel row tiled by 2 and a 7-pixel one by 1."""
    x = RNG.standard_normal((1, 64, side, side)).astype("float32")
    w, b = RNG.standard_normal((64, 64, 1, 1)).astype("float32") * 0.1, RNG.standard_normal(64).astype("float32")
    target = _target(mcpu="x86-64-v4")
    fused = fuse(_module({"x": x}, _conv_hardswish(w, b)), target)
    conv = next(f for n, f in _kernels(fused).items() if "conv2d" in n)
    rule, sched = schedule_func(conv, target)
    text = sched.script()
    assert rule == "tile"
    assert f"T.unroll(T.int64({rows}))" in text and "T.vectorized(T.int64(16))" in text, text[-2500:]
    assert "T.unroll(T.int64(2))" not in text, text[-2500:]
    if "avx512f" in open("/proc/cpuinfo").read():  # the v4 kernel runs here only on AVX-512 hosts
        got = _build_run(fused, {"x": x}, target)
        np.testing.assert_allclose(got, _ref_conv1x1_hardswish(x, w, b), rtol=1e-4, atol=1e-4)
    got = _build_run(fuse(_module({"x": x}, _conv_hardswish(w, b)), _target()), {"x": x}, _target())
    np.testing.assert_allclose(got, _ref_conv1x1_hardswish(x, w, b), rtol=1e-4, atol=1e-4)


def _onnx_conv_relu6_as_max_min(path):
    """Conv, then ReLU6 written as ONNX Max(x, 0) and Min(x, 6) (tf2onnx and hand-written graphs do),
    an opset-11 Clip with its bounds as inputs (PP-OCR's HardSwish is written so), a 1x1 Conv, then
    a three-input Sum of the result, the input's mean over channels and a constant."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    w = numpy_helper.from_array(RNG.standard_normal((16, 8, 3, 3)).astype("float32") * 0.3, "w")
    zero = numpy_helper.from_array(np.zeros(1, "float32"), "zero")
    six = numpy_helper.from_array(np.full(1, 6, "float32"), "six")
    bias = numpy_helper.from_array(RNG.standard_normal((1, 16, 1, 1)).astype("float32"), "bias")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Max", ["c", "zero"], ["lo"]),
             helper.make_node("Min", ["lo", "six"], ["r6"]),
             helper.make_node("Clip", ["r6", "clip_lo", "clip_hi"], ["cl"]),
             helper.make_node("Conv", ["cl", "w2"], ["c2"]),
             helper.make_node("ReduceMean", ["x"], ["m"], axes=[1], keepdims=1),
             helper.make_node("Sum", ["c2", "m", "bias"], ["y"])]
    graph = helper.make_graph(nodes, "relu6", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 12, 12])],
                              [w, zero, six, bias, numpy_helper.from_array(
                                  RNG.standard_normal((16, 16, 1, 1)).astype("float32") * 0.3, "w2"),
                               numpy_helper.from_array(np.array(-1.5, "float32"), "clip_lo"),
                               numpy_helper.from_array(np.array(5.0, "float32"), "clip_hi")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), path)


def test_onnx_max_min_sum_import_pairwise_and_keep_the_model_nhwc(tmp_path):
    """relax's importer wrote ONNX Max/Min/Sum as broadcast_to + stack + a reduction (a copy of the
    data, and a 5-D stack ConvertLayout has no rule for: the whole model fell back to NCHW) and Clip
    as TE calls (opaque to ConvertLayout: two transposes around each). Imported as relax maximum /
    minimum, the conv and everything after it are one NHWC kernel, and the answer is onnxruntime's."""
    import onnxruntime as ort
    from pathlib import Path
    from edgepack.backends.tvm.compile import import_onnx
    from edgepack.model import load_model
    path = tmp_path / "relu6.onnx"
    _onnx_conv_relu6_as_max_min(path)
    mod = import_onnx(load_model(Path(path)))
    text = mod.script(show_meta=False)
    assert "R.stack" not in text and "R.maximum" in text and "R.minimum" in text, text[-2000:]
    fused = fuse(mod, _target())
    assert conv_layout(fused) == "NHWC"
    names = sorted(_kernels(fused))
    first = [n for n in names if "conv2d" in n and "add" not in n]  # the first conv: the clips after it fused in
    assert len(first) == 1 and first[0].count("maximum") == 2 and first[0].count("minimum") == 2, names
    assert not any("transpose" in n and ("maximum" in n or "minimum" in n) for n in names), names
    x = RNG.standard_normal((1, 8, 12, 12)).astype("float32") * 4
    got = _build_run(fused, {"x": x}, _target())
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("channels,lanes", [(88, 8), (200, 8), (96, 16)])
def test_vectors_over_channels_are_a_power_of_two_wide(channels, lanes):
    """An NHWC depthwise conv over 88 or 200 channels (PP-OCR's classifier) took 11- and 10-lane
    vectors, the largest divisors within 16, which LLVM splits badly; a power of two that divides
    the channels comes first (96: whole 16-lane vectors)."""
    x = RNG.standard_normal((1, channels, 6, 20)).astype("float32")
    w = RNG.standard_normal((channels, 1, 5, 5)).astype("float32")
    target = _target(mcpu="x86-64-v4")
    fused = fuse(_module({"x": x}, lambda bb, v: relax.op.nn.conv2d(v, relax.const(w), padding=2, groups=channels)),
                 target)
    conv = next(f for n, f in _kernels(fused).items() if "conv2d" in n)
    rule, sched = schedule_func(conv, target)
    assert rule == "tile"
    text = sched.script()
    assert f"T.vectorized(T.int64({lanes}))" in text and "T.vectorized(T.int64(11))" not in text, text[-2000:]
    got = _build_run(fuse(_module({"x": x}, lambda bb, v: relax.op.nn.conv2d(v, relax.const(w), padding=2,
                                                                             groups=channels)), _target()),
                     {"x": x}, _target())
    want = _build_run(relax.transform.LegalizeOps()(_module(
        {"x": x}, lambda bb, v: relax.op.nn.conv2d(v, relax.const(w), padding=2, groups=channels))),
        {"x": x}, _target(), scheduled=False)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mcpu,lanes", [("x86-64-v3", 8), ("x86-64-v4", 16)])
def test_nhwc_depthwise_reuses_each_weight_vector_over_a_row_of_pixels(mcpu, lanes):
    """An NHWC depthwise conv reads input and weight along the channels; only the weight leaves the
    pixel axes free. The schedule looked at the input alone, found no axis to reuse a vector over and
    took the GEMV tile on AVX2: all 200 channels as one 25-vector tile (spilled), PP-OCR's 5x5
    depthwise conv at 2 x 96 5x slower than in NCHW. Now: 8-lane vectors, 8 pixels per weight vector."""
    channels = 200
    x = RNG.standard_normal((1, channels, 2, 96)).astype("float32")
    w = RNG.standard_normal((channels, 1, 5, 5)).astype("float32")

    def body(bb, v):
        return relax.op.nn.conv2d(v, relax.const(w), padding=2, groups=channels)
    target = _target(mcpu=mcpu)
    fused = fuse(_module({"x": x}, body), target)
    conv = next(f for n, f in _kernels(fused).items() if "conv2d" in n)
    rule, sched = schedule_func(conv, target)
    text = sched.script()
    assert rule == "tile"
    assert "T.vectorized(T.int64(8))" in text and f"T.vectorized(T.int64({channels}))" not in text, text[-2500:]
    assert "T.unroll(T.int64(8))" in text, text[-2500:]  # the row tile: 96 pixels in 8-pixel tiles
    want = _build_run(relax.transform.LegalizeOps()(_module({"x": x}, body)), {"x": x}, _target(), scheduled=False)
    if mcpu == "x86-64-v3" or "avx512f" in open("/proc/cpuinfo").read():  # v4 code runs only on AVX-512 hosts
        np.testing.assert_allclose(_build_run(fused, {"x": x}, target), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("out_channels,computed", [(150, 152), (100, 104), (152, 152), (6, 6)])
def test_nhwc_output_channels_are_computed_in_multiples_of_eight(out_channels, computed):
    """deepcut's 1 x 10 text convs have 150 and 100 output channels: no power of two of at least half a
    vector divides them, so the tile rule took 6- and 4-lane vectors. The conv now computes a multiple
    of 8 channels (zero weights) and slices them back: the same answer, whole vectors."""
    x = RNG.standard_normal((4, 32, 1, 21)).astype("float32")
    w = RNG.standard_normal((out_channels, 32, 1, 10)).astype("float32")

    def body(bb, v):
        return relax.op.nn.relu(relax.op.nn.conv2d(v, relax.const(w)))
    target = _target(mcpu="x86-64-v3")
    fused = fuse(_module({"x": x}, body), target)
    conv = next(f for n, f in _kernels(fused).items() if "conv2d" in n)
    assert f"T.int64({computed})" in conv.script() and ("strided_slice" in str(fused)) == (computed != out_channels)
    got = _build_run(fused, {"x": x}, target)
    want = _build_run(relax.transform.LegalizeOps()(_module({"x": x}, body)), {"x": x}, _target(), scheduled=False)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
