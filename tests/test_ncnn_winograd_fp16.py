"""Winograd kernels held as fp16 3x3 weights on x86 CPUs with F16C and transformed as the convolution goes
(edgepack/backends/ncnn/winograd_fp16_patch.py, version 4).

Three 3x3 convolutions chosen to walk every part of the transform: 1040 -> 39 channels (F(4,3), 1040 input
channels: more than one K tile on any L2 up to 4 MiB; 39 output rows: a run of 32 (16 without AVX-512) and a tail
of 4-, 2- and 1-row panels), 39 -> 24 (F(4,3)) and 24 -> 24 (F(6,3)). The weights
are values fp16 holds exactly, so at the fp16 rung the convolution transforms the values the fp32 kernel was
transformed from, with the same arithmetic. ncnn builds with -ffast-math, so the compiler may order the two copies
of that arithmetic differently: the outputs agree with `EDGEPACK_NCNN_OPTIONS=fp16=0` (fp32 kernels) to within
2e-5 of their scale (measured: 4-5e-6, as much as 1 and 2 threads differ on an SSE CPU), at 1 and 2 threads, on
every CPU with F16C (this host, qemu's Haswell and IvyBridge) and on those without (qemu's Nehalem, this host
capped with isa=sse), where every kernel stays fp32. (F(2,3), which integer-sum layers take, must stay exact:
tests/test_ncnn_integer_winograd.py.) A wrong panel, row, offset or tap would be off by about
1e-2 of scale.

A stack of 128 -> 128 3x3 convolutions shows the memory: after a run, the fp16 build holds about 1/8 of the
F(4,3) kernel bytes the fp32 build holds, and its load never holds an fp32 kernel."""
from __future__ import annotations

import json
import re

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from clirun import host_cpu_flags, run_artifact_on
from conftest import run_edgepack
from test_memory import CH, CONVS, HW, conv_relu_stack, memory_trace

H, W = 30, 26
LAYERS = [(1040, 39), (39, 24), (24, 24)]  # (in, out) channels, 3x3, stride 1, zero border 1


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


def runs_with_and_without_fp16(artifact, cpu: str, tmp_path, shape, trace: str, expect: list) -> dict:
    """The artifact's output y (reshaped to `shape`) on `cpu` at 1 and 2 threads, as built ("") and with
    `EDGEPACK_NCNN_OPTIONS=fp16=0` (fp32 kernels), keyed (switch, threads). As built, the EDGEPACK_NCNN_TRACE
    lines matching `trace` must be `expect` (sorted tuples of its groups: every layer that says so where the
    kernels are fp16); under fp16=0 there must be none."""
    got = {}
    for switch in ("", "fp16=0"):
        for threads in (1, 2):
            run_on = cpu + ("," if " " in cpu else " ") + switch if switch else cpu
            outs, log = run_artifact_on(artifact, run_on, {"x": tmp_path / "x.npy"},
                                        tmp_path / f"{cpu}-{switch}-{threads}", ("y",), threads,
                                        env={"EDGEPACK_NCNN_TRACE": "1"})
            got[switch, threads] = outs["y"].reshape(shape)
            traced = sorted(re.findall(trace, log))
            assert traced == (expect if not switch else []), (run_on, traced, log[-1500:])
    return got


def test_fp16_winograd_kernels_give_the_fp32_kernels_results_on_every_x86_cpu(tmp_path):
    model = _model(tmp_path / "wf16.onnx")
    res, want, scale = fp16_rung_reference(model, tmp_path, 4, (1, LAYERS[0][0], H, W))
    every = sorted((str(i), str(o), "4" if max(i, o) > 32 else "6") for i, o in LAYERS)
    for cpu, fp16 in f16c_cpus().items():
        got = runs_with_and_without_fp16(res["file"], cpu, tmp_path, want.shape,
                                         r"edgepack winograd: (\d+) -> (\d+) 3x3, F\((\d),3\) kernel as fp16 3x3 weights",
                                         every if fp16 else [])
        for key, out in got.items():
            assert float(np.abs(out - got["fp16=0", 1]).max()) <= 2e-5 * scale, (cpu, key)
        # and onnxruntime's answer but for Winograd's rounding in 9360-term sums (measured: 2.3e-4 of scale)
        assert float(np.abs(got["", 1] - want).max()) <= 1e-3 * scale, cpu


def test_fp16_winograd_kernels_take_an_eighth_of_the_memory(tmp_path):
    """After a run the net holds its Winograd kernels and little else (ncnn releases a Winograd layer's
    plain weights, the engine the embedded copy): at the fp16 rung 9 fp16 values a channel pair where the fp32
    build holds 36 fp32 ones. Loading never makes the fp32 kernels there (version 4; version 3 made each and
    then replaced it, and VmHWM at load stood 5.1 MB, two layers' fp32 kernels, over what stayed: 0.5 MB now)."""
    model = conv_relu_stack(tmp_path / "convs.onnx", CONVS, CH, HW, 3, seed=7, fp16_exact=True)
    trace = {}
    for rung, extra in (("fp16", ()), ("fp32", ("--fp32",))):
        res = build_x86_ncnn(model, tmp_path / rung, *extra)
        assert res["precision"] == ("fp32" if extra else "fp16-storage"), res
        trace[rung] = memory_trace(res["file"])
    held = {rung: t["ran"][0] for rung, t in trace.items()}
    kernels = CONVS * CH * CH * 36 * 4  # F(4,3), fp32
    if "f16c" not in host_cpu_flags():
        assert abs(held["fp16"] - held["fp32"]) < 0.25 * kernels / 2
        return
    assert held["fp16"] < held["fp32"] - 0.9 * kernels * 7 / 8, {k: v / 2**20 for k, v in held.items()}
    rss, hwm = trace["fp16"]["loaded"]
    assert hwm - rss < 0.5 * kernels / CONVS, (rss, hwm)


def test_the_x86_library_carries_the_fp16_kernels_and_only_x86_keys_them(monkeypatch):
    from edgepack.backends.ncnn import library
    from edgepack.targets import TargetMatrix
    from edgepack.toolchains import Toolchain
    matrix, tc = TargetMatrix.load(), Toolchain.load()
    lib = library.build_library(matrix.get("x86_64"), tc)
    x86 = lib.root / "src" / "src" / "layer" / "x86"
    assert (x86 / "convolution_3x3_winograd.h").read_text().count("ep_winograd_gemm(AT_tile, BT_tile") == 3
    assert (x86 / "convolution_3x3_winograd.h").read_text().count("if (ep_winograd_kernel_fp16(kernel, AT, inch, outch, opt))") == 3
    arm_key, _ = library.library_key(matrix.get("arm64"), tc)
    monkeypatch.setattr(library, "WINOGRAD_FP16_PATCH_KEY", library.WINOGRAD_FP16_PATCH_KEY + "-changed")
    assert library.library_key(matrix.get("arm64"), tc)[0] == arm_key
    assert library.library_key(matrix.get("x86_64"), tc)[0] != lib.key
