"""ncnn's x86 convolutions shared between threads by output pixels (edgepack/backends/ncnn/
thread_split_patch.py) give onnxruntime's answer on every x86 CPU model the artifact may meet, on 1
and 2 threads: AVX-512 (native here, N tiles of 16), AVX2 (Haswell, and this machine capped to AVX2;
12) and SSE2 only (Nehalem, 4) each run a different copy of the patched loops. The layers reach each path: a 3-channel first layer
into 16 channels (ncnn's direct kernel, one block of 16 cut into row runs), 1x1 and strided 3x3
products with few output channels and many pixels (split by N; 24, 48 and 112 channels are uneven
M tiles; on AVX-512 ncnn's direct kernel and most of these products give way to
direct_conv_patch.py's kernel, and the 160 -> 112 stride-2 layer is the product split by N there),
3x3 stride-1 layers that ncnn runs as Winograd (split, and not split where the tiles are
fewer than the channels), a 1x1 with more channels than pixels (ncnn's own loop), and pixel counts
that are not a multiple of any tile; after each, an activation layer that the patch also splits; and
channel Slices and Concats, a same-shape Add and an in-place scalar Mul, which the patch shares by
pixels or, where channels outnumber pixels, by channels."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from clirun import run_artifact_on, run_edgepack

# "native isa=avx2": this machine running the kernels an AVX2 CPU gets (EDGEPACK_NCNN_OPTIONS,
# isa_cap_patch.py), at native speed and with real threads
CPUS = ["native", "native isa=avx2", "Haswell-noTSX", "Nehalem"]
# (out channels, kernel, stride): input 3 x 116 x 100
# each followed by one of these (ncnn's activation layers, split by pixels as the convolutions are)
ACTIVATIONS = ["Swish", "HardSwish", "Sigmoid", "Relu", "Tanh"]
# (on AVX-512 the first layer, the stride-2 48-channel one and the stride-1 1x1s take direct_conv_patch.py's
# kernel instead; 160 -> 112 at stride 2 keeps im2col-gemm there, split by N)
LAYERS = [(16, 3, 2), (32, 1, 1), (24, 3, 1), (48, 3, 2), (160, 1, 1), (112, 3, 2), (64, 3, 1), (256, 1, 2), (40, 3, 1)]


def _split_add_concat(nodes, inits, name, cin):
    """Slice into halves, add them, scale by a constant in place, Concat after the input: 58 x 50 pixels
    by 32 channels, where ncnn's copies, same-shape Add and scalar Mul are shared by pixels."""
    half = cin // 2
    inits += [numpy_helper.from_array(np.array([half, half], np.int64), "halves"),
              numpy_helper.from_array(np.array(0.5, np.float32), "half_scale")]
    nodes += [helper.make_node("Split", [name, "halves"], ["h0", "h1"], axis=1),
              helper.make_node("Add", ["h0", "h1"], ["h_sum"]),
              helper.make_node("Mul", ["h_sum", "half_scale"], ["h_scaled"]),
              helper.make_node("Concat", [name, "h_scaled"], ["h_cat"], axis=1)]
    return cin + half, "h_cat"


def _swap_halves(nodes, inits, name, cin):
    """The channel halves swapped (Slice, Concat) at 8 x 7 pixels by 256 channels: shared by channels."""
    inits.append(numpy_helper.from_array(np.array([cin // 2, cin // 2], np.int64), "swap_halves"))
    nodes += [helper.make_node("Split", [name, "swap_halves"], ["g0", "g1"], axis=1),
              helper.make_node("Concat", ["g1", "g0"], ["g_cat"], axis=1)]
    return cin, "g_cat"


# after these layers: copies, binary ops (split by pixels or by channels as the tensor's shape says)
SHUFFLES = {1: _split_add_concat, 7: _swap_halves}


@pytest.fixture(scope="module")
def conv_model(tmp_path_factory):
    rng = np.random.default_rng(11)
    nodes, inits, cin, name, hh, ww = [], [], 3, "x", 116, 100
    for i, (cout, k, s) in enumerate(LAYERS):
        hh, ww = (hh - 1) // s + 1, (ww - 1) // s + 1
        w = (rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
        b = rng.standard_normal(cout).astype(np.float32) * 0.1
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        last = i == len(LAYERS) - 1  # ends on a convolution: a squashing activation would hide errors
        out, act = f"r{i}", ACTIVATIONS[i % len(ACTIVATIONS)]
        nodes.append(helper.make_node("Conv", [name, f"w{i}", f"b{i}"], ["y" if last else f"c{i}"],
                                      kernel_shape=[k, k], strides=[s, s], pads=[k // 2] * 4))
        if not last and act == "Swish":  # as exporters write SiLU; pnnx makes it ncnn's Swish
            nodes += [helper.make_node("Sigmoid", [f"c{i}"], [f"s{i}"]), helper.make_node("Mul", [f"c{i}", f"s{i}"], [out])]
        elif not last:
            nodes.append(helper.make_node(act, [f"c{i}"], [out]))
        cin, name = cout, f"r{i}"
        if i in SHUFFLES:
            cin, name = SHUFFLES[i](nodes, inits, name, cin)
    graph = helper.make_graph(nodes, "convs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 116, 100])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, cin, hh, ww])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])  # 14: HardSwish
    model.ir_version = 8
    path = tmp_path_factory.mktemp("convs") / "convs.onnx"
    onnx.save(model, path)
    return path


def _run(art, cpu, threads, x_path, out):
    """Run the artifact on a qemu CPU model, or natively ("native", or "native isa=..." for a cap)."""
    return run_artifact_on(art, cpu, {"x": x_path}, out, ("y",), threads)[0]["y"]


def build_fp32_ncnn(model, out, *extra):
    """The x86_64 NCNN artifact of `model`, fp32 (so only the kernels' order of additions can differ)."""
    proc = run_edgepack("build", str(model), "--target", "x86_64", "--backend", "ncnn", "--fp32", *extra,
                        "--out", str(out), "--json")
    report = json.loads(proc.stdout) if proc.stdout.strip() else {}
    assert proc.returncode == 0 and report.get("ok"), proc.stderr[-3000:]
    return out / f"{model.stem}-x86_64"


def test_layers_split_by_pixels_match_onnxruntime_on_every_x86_cpu(conv_model, tmp_path):
    art = build_fp32_ncnn(conv_model, tmp_path / "out")
    layers = set(json.loads((tmp_path / "out" / "convs-x86_64.json").read_text())["backend"]["layers"])
    # (pnnx fuses Relu and Sigmoid into the convolution, which runs them as an in-place layer pass)
    assert {"Swish", "HardSwish", "TanH", "Slice", "Concat", "BinaryOp"} <= layers, layers
    x = np.random.default_rng(5).standard_normal((1, 3, 116, 100)).astype(np.float32)
    assert_matches_onnxruntime_on_every_cpu(conv_model, art, x, tmp_path)


def assert_matches_onnxruntime_on_every_cpu(model, art, x, tmp_path, cpus=tuple(CPUS)):
    """The fp32 artifact's output `y` for input `x` on every CPU model at 1 and 2 threads: within
    1e-4 of onnxruntime's scale, and the same bits on 1 and 2 threads (every output element is summed
    in the same order whichever thread computes it)."""
    np.save(tmp_path / "x.npy", x)
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    scale = float(np.abs(want).max())
    assert scale > 0.1 and float(np.abs(want - np.median(want)).mean()) > 1e-3 * scale  # a live signal
    for cpu in cpus:
        one = _run(art, cpu, 1, tmp_path / "x.npy", tmp_path / f"{cpu}-1")
        two = _run(art, cpu, 2, tmp_path / "x.npy", tmp_path / f"{cpu}-2")
        for threads, got in ((1, one), (2, two)):
            err = float(np.abs(got.reshape(want.shape) - want).max())
            assert err <= 1e-4 * scale, (cpu, threads, err)  # fp32: only the order of additions differs
        np.testing.assert_array_equal(one, two, err_msg=cpu)


def test_the_x86_library_carries_the_split_and_only_x86_keys_it(monkeypatch):
    from edgepack.backends.ncnn import library
    from edgepack.backends.ncnn.thread_split_patch import IM2COL_FILE, WINOGRAD_FILE
    from edgepack.targets import TargetMatrix
    from edgepack.toolchains import Toolchain
    matrix, tc = TargetMatrix.load(), Toolchain.load()
    lib = library.build_library(matrix.get("x86_64"), tc)
    assert (lib.root / "src" / IM2COL_FILE).read_text().count("ep_split_n(M, N, nT, TILE_N)") == 1
    assert (lib.root / "src" / WINOGRAD_FILE).read_text().count("ep_split_n(M, N, nT, TILE_N)") == 3
    arm_key, _ = library.library_key(matrix.get("arm64"), tc)
    monkeypatch.setattr(library, "THREAD_SPLIT_PATCH_KEY", library.THREAD_SPLIT_PATCH_KEY + "-changed")
    assert library.library_key(matrix.get("arm64"), tc)[0] == arm_key
    assert library.library_key(matrix.get("x86_64"), tc)[0] != lib.key
