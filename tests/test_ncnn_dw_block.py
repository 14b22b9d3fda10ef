"""Depthwise convolutions that ncnn has no dedicated x86 kernel for (7x7, dilated 3x3) sum eight, then
four output pixels at a time (edgepack/backends/ncnn/dw_block_patch.py) and give onnxruntime's answer,
each pixel summed in ncnn's own order.

One 48-channel input feeds three depthwise layers: 7x7 without padding (29 output columns: three
blocks of eight, one of four, one pixel for ncnn's loop), 7x7 at stride 2 with padding, bias and a
fused ReLU (the 4-lane loop applies it inline), and 3x3 at dilation 2. 48 channels run packed 16 on
AVX-512 CPUs, 8 on AVX2 ones (natively or capped with EDGEPACK_NCNN_OPTIONS=isa=avx2, qemu's Haswell)
and 4 on SSE ones (isa=sse, qemu's Nehalem), so each run takes one of the three patched loops.

The same order for every pixel is checked bit for bit: fed an input whose columns are all alike, every
output of the unpadded layer sees the same 49 products in the same order, so a row's 29 outputs (in a
block of eight, of four, or ncnn's loop) must be the same bits."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from clirun import run_artifact_on, run_edgepack
from test_ncnn_thread_split import build_fp32_ncnn

C, H, W = 48, 20, 35
OUTPUTS = ("a", "b", "c")


@pytest.fixture(scope="module")
def dw_model(tmp_path_factory) -> Path:
    rng = np.random.default_rng(5)
    tmp = tmp_path_factory.mktemp("dwblock")

    def weights(name: str, k: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal((C, 1, k, k)) / k).astype(np.float32), name)

    nodes = [helper.make_node("Conv", ["x", "wa", "ba"], ["a"], group=C, kernel_shape=[7, 7]),
             helper.make_node("Conv", ["x", "wb", "bb"], ["pb"], group=C, kernel_shape=[7, 7], strides=[2, 2],
                              pads=[3, 3, 3, 3]),
             helper.make_node("Relu", ["pb"], ["b"]),
             helper.make_node("Conv", ["x", "wc"], ["c"], group=C, kernel_shape=[3, 3], dilations=[2, 2],
                              pads=[2, 2, 2, 2])]
    inits = [weights("wa", 7), weights("wb", 7), weights("wc", 3),
             numpy_helper.from_array(rng.standard_normal(C).astype(np.float32), "ba"),
             numpy_helper.from_array(rng.standard_normal(C).astype(np.float32), "bb")]
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "dwblock", [helper.make_tensor_value_info("x", f, [1, C, H, W])],
                              [helper.make_tensor_value_info("a", f, [1, C, H - 6, W - 6]),
                               helper.make_tensor_value_info("b", f, [1, C, (H + 1) // 2, (W + 1) // 2]),
                               helper.make_tensor_value_info("c", f, [1, C, H, W])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = tmp / "dwblock.onnx"
    onnx.save(model, path)
    return path


def _run(art: Path, cpu: str, x_path: Path, out: Path, threads: int = 1) -> dict:
    return run_artifact_on(art, cpu, {"x": x_path}, out, OUTPUTS, threads)[0]


def _inputs(model: Path, tmp_path: Path) -> dict:
    """x.npy (random) and alike.npy (every column the same) in tmp_path; onnxruntime's outputs for x."""
    rng = np.random.default_rng(9)
    x = rng.standard_normal((1, C, H, W)).astype(np.float32)
    alike = np.repeat(rng.standard_normal((1, C, H, 1)).astype(np.float32), W, axis=3)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "alike.npy", alike)
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    want = dict(zip(OUTPUTS, session.run(list(OUTPUTS), {"x": x})))
    assert want["a"].shape == (1, C, H - 6, W - 6) and want["b"].shape == (1, C, 10, 18)
    return want


def _check(art: Path, cpu: str, bound: float, want: dict, tmp_path: Path, tag: str) -> dict:
    """The artifact's outputs on `cpu`: each within bound x its scale of onnxruntime's, and the unpadded
    layer's rows, fed columns all alike, the same bits across a row. Returns the outputs for x."""
    got = _run(art, cpu, tmp_path / "x.npy", tmp_path / tag)
    for name in OUTPUTS:
        scale = float(np.abs(want[name]).max())
        err = float(np.abs(got[name].reshape(want[name].shape) - want[name]).max())
        assert scale > 1 and err <= bound * scale, (tag, name, err, scale)
    rows = _run(art, cpu, tmp_path / "alike.npy", tmp_path / f"alike-{tag}")["a"].reshape(want["a"].shape)
    assert float(np.abs(rows).max()) > 1
    np.testing.assert_array_equal(rows, np.repeat(rows[..., :1], W - 6, axis=3), err_msg=tag)
    return got


def test_generic_depthwise_in_blocks_matches_onnxruntime_on_every_packing(dw_model, tmp_path):
    art = build_fp32_ncnn(dw_model, tmp_path / "dist")
    want = _inputs(dw_model, tmp_path)
    for cpu in ("native", "native isa=avx2", "native isa=sse", "Haswell-noTSX", "Nehalem"):
        _check(art, cpu, 2e-6, want, tmp_path, cpu.replace(" ", "-"))

    one = _run(art, "native", tmp_path / "x.npy", tmp_path / "one")
    two = _run(art, "native", tmp_path / "x.npy", tmp_path / "two", threads=2)
    for name in OUTPUTS:
        np.testing.assert_array_equal(two[name], one[name], err_msg=name)


def _build_arm(model: Path, dist: Path, precision: str) -> Path:
    proc = run_edgepack("build", str(model), "--target", "arm64", "--backend", "ncnn", precision,
                        "--verify-on", "max", "--out", str(dist), "--json")
    report = json.loads(proc.stdout) if proc.stdout.strip() else {}
    assert proc.returncode == 0 and report.get("ok"), proc.stderr[-3000:]
    return dist / "dwblock-arm64"


def test_generic_depthwise_in_blocks_on_arm(dw_model, tmp_path):
    # an fp32 build on cortex-a53 and qemu's "max" (4 lanes of fp32); an fp16 build on "max", which
    # has fp16 arithmetic: as built (fp16 arithmetic, 8 lanes) and with it switched off (fp16 storage
    # summed in fp32, 4 lanes)
    fp32 = _build_arm(dw_model, tmp_path / "fp32", "--fp32")
    fp16 = _build_arm(dw_model, tmp_path / "fp16", "--fp16")
    assert json.loads(fp16.with_name("dwblock-arm64.json").read_text())["precision_rung"] == "fp16-arith"
    want = _inputs(dw_model, tmp_path)
    runs = ((fp32, "cortex-a53", 2e-6), (fp32, "max", 2e-6), (fp16, "max", 1e-2), (fp16, "max fp16a=0", 1e-2))
    outs = {}
    for art, cpu, bound in runs:
        tag = f"{art.parent.name}-{cpu.replace(' ', '-')}"
        outs[tag] = _check(art, cpu, bound, want, tmp_path, tag)
    # the fp16 build ran two different loops: fp16 sums and fp32 sums of fp16 values
    assert not np.array_equal(outs["fp16-max"]["a"], outs["fp16-max-fp16a=0"]["a"])
    np.testing.assert_array_equal(outs["fp32-max"]["a"], outs["fp32-cortex-a53"]["a"])
