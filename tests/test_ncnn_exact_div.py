"""NCNN artifacts divide as onnxruntime does, bit for bit (edgepack/backends/ncnn/exact_div_patch.py).

ncnn is built with -ffast-math: a tensor divided by a per-tensor scale (or by a constant) became a
multiplication by the reciprocal, one ulp off on many elements. Lowered dynamic int8 rounds such
quotients, and a tie that comes out one ulp low rounds the other way (ddddocr_old_int8 moved 3.7%).
The model divides by a scale computed at run time (broadcast), by a constant (ncnn's scalar path)
and divides a constant by the tensor (RDIV), on every CPU model the artifact may meet; and Round
rounds ties to even on NCNN and TVM, as the lowering (quantized.py) needs."""
from __future__ import annotations

import json
import subprocess

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import run_edgepack
from edgepack.runner import command_for, command_for_cpu

SHAPE = (1, 4, 16, 32)
OUTPUTS = ("by_scale", "by_const", "const_by", "rounded")


@pytest.fixture(scope="module")
def div_model(tmp_path_factory):
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Reshape", ["x", "flat_shape"], ["flat"]),
             helper.make_node("GlobalMaxPool", ["flat"], ["peak4"]),
             helper.make_node("Reshape", ["peak4", "one"], ["peak"]),
             helper.make_node("Div", ["peak", "q255"], ["scale"]),          # as DynamicQuantizeLinear's scale
             helper.make_node("Div", ["x", "scale"], ["by_scale"]),
             helper.make_node("Div", ["x", "c"], ["by_const"]),
             helper.make_node("Div", ["seven", "x"], ["const_by"]),
             # lowered dynamic int8 rounds with ONNX Round: half to even, as onnxruntime's quantiser
             helper.make_node("Mul", ["x", "two"], ["doubled"]), helper.make_node("Round", ["doubled"], ["rounded"])]
    inits = [numpy_helper.from_array(np.array([1, 1, 1, -1], np.int64), "flat_shape"),
             numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array([127.5], np.float32), "q255"),
             numpy_helper.from_array(np.array(0.3, np.float32), "c"),
             numpy_helper.from_array(np.array(7.0, np.float32), "seven"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    graph = helper.make_graph(nodes, "divs", [helper.make_tensor_value_info("x", f, list(SHAPE))],
                              [helper.make_tensor_value_info(o, f, list(SHAPE)) for o in OUTPUTS], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = tmp_path_factory.mktemp("divs") / "divs.onnx"
    onnx.save(model, path)
    return path


def _input():
    x = np.random.default_rng(3).uniform(0.5, 3.0, SHAPE).astype(np.float32)
    x[0, 0, 0, :8] = [3.0, -3.0, 1.5, -1.5, 0.75, 2.25, -0.375, 1.125]
    x[0, 0, 1, :8] = [1.25, 1.75, -1.25, -0.25, 0.25, 2.25, -2.75, 0.75]  # ties of Round(2x)
    return x


def _build(model, target, backend, out):
    proc = run_edgepack("build", str(model), "--target", target, "--backend", backend, "--fp32", "--out", str(out), "--json")
    report = json.loads(proc.stdout) if proc.stdout.strip() else {}
    assert proc.returncode == 0 and report.get("ok"), proc.stderr[-3000:]
    return out / f"{model.stem}-{target}"


def _outputs(argv, x_path, out):
    run = subprocess.run(argv + ["run", "--input", f"x={x_path}", "--output", str(out), "--threads", "1"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    files = json.loads(run.stdout)["outputs"]
    return {o: np.load(files[o]["file"]).reshape(SHAPE) for o in OUTPUTS}


def test_a_reciprocal_or_a_rounding_half_up_would_be_caught():
    # the check below can fail: on this input a multiplication by the reciprocal differs from division
    x = _input()
    scale = np.float32(np.float32(x.max()) / np.float32(127.5))
    assert np.count_nonzero(x * (np.float32(1) / scale) != x / scale) > 20
    assert np.count_nonzero(x * (np.float32(1) / np.float32(0.3)) != x / np.float32(0.3)) > 20
    assert np.count_nonzero(np.floor(2 * x + 0.5) != np.round(2 * x)) >= 4


@pytest.mark.parametrize("target, backend, cpus", [
    ("x86_64", "ncnn", ["native", "native isa=avx2", "Haswell-noTSX", "Nehalem"]),
    ("arm64", "ncnn", [None]),
    ("x86_64", "tvm", ["native"])])
def test_division_and_rounding_match_onnxruntime_bit_for_bit(div_model, tmp_path, target, backend, cpus):
    x = _input()
    np.save(tmp_path / "x.npy", x)
    want = dict(zip(OUTPUTS, ort.InferenceSession(str(div_model), providers=["CPUExecutionProvider"]).run(None, {"x": x})))
    art = _build(div_model, target, backend, tmp_path / "out")
    for cpu in cpus:
        if cpu is None:
            argv, env_isa = command_for(art, None), ""
        else:
            cpu, _, env_isa = cpu.partition(" ")
            argv = command_for_cpu(art, cpu)
        if env_isa:
            argv = ["env", f"EDGEPACK_NCNN_OPTIONS={env_isa}"] + argv
        got = _outputs(argv, tmp_path / "x.npy", tmp_path / f"o-{cpu}-{env_isa}")
        for name in OUTPUTS:
            bad = np.count_nonzero(got[name] != want[name])
            assert bad == 0, f"{target} {backend} {cpu} {env_isa}: {name}: {bad} of {x.size} differ from onnxruntime's"
