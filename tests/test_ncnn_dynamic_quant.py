"""Dynamic quantisation as one engine layer (runtimes/ncnn/ep_ncnn_layers.cc, EpDynQuant; the .param
fold: edgepack/backends/ncnn/dynamic_quant_fold.py). A quantize_dynamic convolution stack
(ConvInteger: every convolution's input quantised at run time) with inputs of 3, 48, 40, 36 and 2
channels (ncnn packs them 1, 16, 8, 4 and 1 wide on AVX-512) is built for x86_64 and arm64: each
DynamicQuantizeLinear runs as one layer, and the outputs match onnxruntime's on every x86 CPU model
(native AVX-512, an AVX2 cap, qemu Haswell and Nehalem), at 1 and 2 threads, and under qemu's Arm, for
random inputs, an all-zero input (onnxruntime's scale of 1 for an empty range) and an input whose
quotients fall on halves (rounding half to even). The layer runs 16 lanes wide on AVX-512 and 4 on the
others, and splits tensors of 32k floats and more between threads: the bits stay the same."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from clirun import run_artifact_on, run_edgepack
from models import quantised_graph
from edgepack.runner import command_for
from test_ncnn_thread_split import CPUS, build_fp32_ncnn

CHANNELS = (3, 48, 40, 36, 2)
H, W = 40, 48  # 48 x 1920 floats: past EpDynQuant's 32k, split between threads at 2; 3 x 1920 not


@pytest.fixture(scope="module")
def quantised_convs(tmp_path_factory) -> Path:
    from onnxruntime.quantization import QuantType
    rng = np.random.default_rng(3)
    tmp = tmp_path_factory.mktemp("dynquant")
    nodes, inits, x = [], [], "x"
    for i, (cin, cout) in enumerate(zip(CHANNELS, CHANNELS[1:])):
        w = (rng.standard_normal((cout, cin, 3, 3)) * 0.3).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"),
                  numpy_helper.from_array((rng.standard_normal(cout) * 0.1).astype(np.float32), f"b{i}")]
        nodes.append(helper.make_node("Conv", [x, f"w{i}", f"b{i}"], [f"c{i}"], pads=[1, 1, 1, 1], name=f"conv{i}"))
        last = i == len(CHANNELS) - 2
        if not last:
            nodes.append(helper.make_node("Relu", [f"c{i}"], [f"r{i}"]))
        x = f"c{i}" if last else f"r{i}"
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "dynquant", [helper.make_tensor_value_info("x", f, [1, 3, H, W])],
                              [helper.make_tensor_value_info(x, f, [1, CHANNELS[-1], H, W])], inits)
    dst = quantised_graph(graph, tmp, "dynquant", weight_type=QuantType.QUInt8, op_types_to_quantize=["Conv"])
    ops = [n.op_type for n in onnx.load(dst).graph.node]
    assert ops.count("ConvInteger") == 4 and ops.count("DynamicQuantizeLinear") == 4, ops
    return dst


def _inputs(tmp_path: Path) -> dict[str, Path]:
    rng = np.random.default_rng(9)
    # quotients on halves: x in [0, 127.5] gives scale 0.5, and multiples of 0.25 fall on k / 2
    halves = rng.integers(0, 511, (1, 3, H, W)).astype(np.float32) * 0.25
    halves.flat[0] = 127.5
    cases = {"random": (rng.standard_normal((1, 3, H, W)) * 3 + 1).astype(np.float32),
             "zeros": np.zeros((1, 3, H, W), np.float32), "halves": halves}
    paths = {}
    for name, x in cases.items():
        paths[name] = tmp_path / f"{name}.npy"
        np.save(paths[name], x)
    return paths


def _assert_close(model: Path, x_path: Path, got: np.ndarray, what: str) -> None:
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": np.load(x_path)})[0]
    scale = max(float(np.abs(want).max()), 1e-3)
    err = float(np.abs(got.reshape(want.shape) - want).max())
    # integer sums: exact; only the float scaling after them may differ by an ulp or so
    assert err <= 1e-5 * scale, (what, err, scale)


def test_each_dynamic_quantisation_is_one_layer_on_every_x86_cpu(quantised_convs, tmp_path):
    art = build_fp32_ncnn(quantised_convs, tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "dynquant-x86_64.json").read_text())
    assert manifest["backend"]["dynamic_quant_folds"] == 4, manifest["backend"]
    for name, x_path in _inputs(tmp_path).items():
        runs = {}
        for cpu in CPUS:
            for threads in (1, 2):
                got, _ = run_artifact_on(art, cpu, {"x": x_path}, tmp_path / f"{name}-{cpu}-{threads}".replace(" ", "_"),
                                         ("c3",), threads)
                _assert_close(quantised_convs, x_path, got["c3"], (name, cpu, threads))
                runs[(cpu, threads)] = got["c3"]
        first = runs[("native", 1)]
        for key, got in runs.items():   # integer sums and the same scalings: the same bits everywhere
            np.testing.assert_array_equal(got, first, err_msg=f"{name} {key}")


def test_arm64_runs_the_same_layer(quantised_convs, tmp_path):
    proc = run_edgepack("build", str(quantised_convs), "--target", "arm64", "--backend", "ncnn", "--fp32",
                        "--out", str(tmp_path / "out"), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((tmp_path / "out" / "dynquant-arm64.json").read_text())
    assert manifest["backend"]["dynamic_quant_folds"] == 4, manifest["backend"]
    art = tmp_path / "out" / "dynquant-arm64"
    for name, x_path in _inputs(tmp_path).items():
        run = subprocess.run(command_for(art, None) + ["run", "--input", f"x={x_path}", "--output", str(tmp_path / name)],
                             capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        _assert_close(quantised_convs, x_path, np.load(json.loads(run.stdout)["outputs"]["c3"]["file"]), name)
