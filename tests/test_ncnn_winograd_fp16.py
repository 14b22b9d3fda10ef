"""Winograd kernels held in fp16 on x86 CPUs with F16C (edgepack/backends/ncnn/winograd_fp16_patch.py).

Three 3x3 convolutions chosen to walk every part of the widening: 160 -> 36 channels (F(4,3), 160 input
channels: more than one K tile on any L2 up to 2 MiB; 36 output rows: 16- or 32-row runs and a 4-row tail,
in an M tile of 40 rows whose last 4 hold no kernel), 36 -> 24 (F(4,3)) and 24 -> 24 (F(6,3), which keeps
its fp32 kernel). The weights are values fp16 holds exactly, so an artifact built at
the fp16 rung and run where the kernels stay fp32 (an SSE CPU: qemu's Nehalem, or this host capped with
isa=sse) differs from onnxruntime only by the order of additions; where they are fp16 (F16C: this host,
qemu's Haswell and IvyBridge) it differs by the transformed kernel's rounding too — a little, and measurably. Both at
1 and 2 threads with the same bits.

A stack of 128 -> 128 3x3 convolutions shows the memory: after a run, the fp16 build holds about half
the F(4,3) kernels the fp32 build holds."""
from __future__ import annotations

import json
import re

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from clirun import host_cpu_flags, run_artifact_on
from conftest import run_edgepack
from test_memory import CH, CONVS, HW, conv_relu_stack, resident_after_run

H, W = 30, 26
LAYERS = [(160, 36), (36, 24), (24, 24)]  # (in, out) channels, 3x3, stride 1, zero border 1


def _model(path):
    rng = np.random.default_rng(17)
    nodes, inits, x = [], [], "x"
    for i, (cin, cout) in enumerate(LAYERS):
        w = (rng.standard_normal((cout, cin, 3, 3)) / np.sqrt(cin * 9)).astype(np.float16).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"),
                  numpy_helper.from_array((rng.standard_normal(cout) * 0.1).astype(np.float32), f"b{i}")]
        y = "y" if i == len(LAYERS) - 1 else f"r{i}"
        nodes.append(helper.make_node("Conv", [x, f"w{i}", f"b{i}"], [f"c{i}" if y != "y" else "y"], pads=[1] * 4))
        if y != "y":
            nodes.append(helper.make_node("Relu", [f"c{i}"], [y]))
        x = y
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "wf16", [helper.make_tensor_value_info("x", f, [1, LAYERS[0][0], H, W])],
                              [helper.make_tensor_value_info("y", f, [1, LAYERS[-1][1], H, W])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def build_x86_ncnn(model, out, *extra):
    proc = run_edgepack("build", str(model), "--target", "x86_64", "--backend", "ncnn", *extra, "--out", str(out),
                        "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)["results"][0]
    assert res["ok"], res
    return res


def f16c_cpus() -> dict[str, bool]:
    """The CPUs an x86 artifact is checked on, each with whether it has F16C (and so fp16 kernels).
    IvyBridge: AVX and F16C without FMA (ncnn's AVX tile kernel, not the FMA one)."""
    return {"native isa=sse": False, "Nehalem": False, "Haswell-noTSX": True, "IvyBridge": True,
            "native": "f16c" in host_cpu_flags()}


def fp16_rung_reference(model, tmp_path, seed: int, shape: tuple) -> tuple[dict, np.ndarray, float]:
    """The model built at the fp16 rung, its input saved as tmp_path/x.npy, onnxruntime's output and its scale."""
    res = build_x86_ncnn(model, tmp_path / "out")
    assert res["precision"] == "fp16-storage", res  # the rung that keeps kernels in fp16
    x = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    scale = float(np.abs(want).max())
    assert scale > 0.1
    return res, want, scale


def test_fp16_winograd_kernels_match_onnxruntime_on_every_x86_cpu(tmp_path):
    model = _model(tmp_path / "wf16.onnx")
    res, want, scale = fp16_rung_reference(model, tmp_path, 4, (1, LAYERS[0][0], H, W))
    for cpu, fp16 in f16c_cpus().items():
        got = {}
        for threads in (1, 2):
            outs, log = run_artifact_on(res["file"], cpu, {"x": tmp_path / "x.npy"}, tmp_path / f"{cpu}-{threads}",
                                        ("y",), threads, env={"EDGEPACK_NCNN_TRACE": "1"})
            got[threads] = outs["y"].reshape(want.shape)
            traced = re.findall(r"edgepack winograd: (\d+) -> (\d+) 3x3, F\((\d),3\) kernel in fp16", log)
            # every F(4,3) layer says so where the kernels are fp16, none where they are not
            assert sorted(traced) == (sorted([(str(i), str(o), "4") for i, o in LAYERS if max(i, o) > 32])
                                      if fp16 else []), (cpu, traced, log[-1500:])
        np.testing.assert_array_equal(got[1], got[2], err_msg=cpu)
        err = float(np.abs(got[1] - want).max())
        if fp16:  # the kernels' rounding shows, within the verification's bound
            assert 1e-5 * scale < err <= 2e-3 * scale, (cpu, err / scale)
        else:     # fp32 kernels of fp16-exact weights: only the order of additions differs
            assert err <= 1e-4 * scale, (cpu, err / scale)


def test_fp16_winograd_kernels_take_half_the_memory(tmp_path):
    """After a run the net holds its Winograd kernels and little else (ncnn releases a Winograd layer's
    plain weights, the engine the embedded copy): at the fp16 rung about half what the fp32 build holds."""
    model = conv_relu_stack(tmp_path / "convs.onnx", CONVS, CH, HW, 3, seed=7, fp16_exact=True)
    held = {}
    for rung, extra in (("fp16", ()), ("fp32", ("--fp32",))):
        res = build_x86_ncnn(model, tmp_path / rung, *extra)
        assert res["precision"] == ("fp32" if extra else "fp16-storage"), res
        held[rung] = resident_after_run(res["file"])
    kernels = CONVS * CH * CH * 36 * 4  # F(4,3), fp32
    if "f16c" not in host_cpu_flags():
        assert abs(held["fp16"] - held["fp32"]) < 0.25 * kernels / 2
        return
    assert held["fp16"] < held["fp32"] - 0.75 * kernels / 2, {k: v / 2**20 for k, v in held.items()}


def test_the_x86_library_carries_the_fp16_kernels_and_only_x86_keys_them(monkeypatch):
    from edgepack.backends.ncnn import library
    from edgepack.targets import TargetMatrix
    from edgepack.toolchains import Toolchain
    matrix, tc = TargetMatrix.load(), Toolchain.load()
    lib = library.build_library(matrix.get("x86_64"), tc)
    x86 = lib.root / "src" / "src" / "layer" / "x86"
    assert (x86 / "convolution_3x3_winograd.h").read_text().count("ep_winograd_gemm(AT_tile, BT_tile") == 3
    assert (x86 / "convolution_x86.cpp").read_text().count("ep_winograd_kernel_fp16(weight_winograd43_data") == 1
    arm_key, _ = library.library_key(matrix.get("arm64"), tc)
    monkeypatch.setattr(library, "WINOGRAD_FP16_PATCH_KEY", library.WINOGRAD_FP16_PATCH_KEY + "-changed")
    assert library.library_key(matrix.get("arm64"), tc)[0] == arm_key
    assert library.library_key(matrix.get("x86_64"), tc)[0] != lib.key
