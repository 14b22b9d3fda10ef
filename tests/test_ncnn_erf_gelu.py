"""PP-OCRv6's erf GELUs, as Paddle's exporter writes them (Div by sqrt 2, Erf, Add 1, Mul x, Mul 0.5),
each read by a Conv: the build's onnxsim folds the 0.5 into that Conv, and erf_gelu.py gives pnnx the
GELU back, so ncnn runs one GELU layer instead of four. Built for real, checked against onnxruntime on
every x86 CPU model the artifact may meet."""
from __future__ import annotations

import json
import math

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from clirun import run_artifact_on
from models import saved_graph
from test_ncnn_thread_split import assert_matches_onnxruntime_on_every_cpu, build_fp32_ncnn


def conv_gelu_stack(path, blocks: int = 3, c: int = 32):
    """x [1, 3, 40, 40] -> Conv 3x3 -> `blocks` x (GELU -> Conv 1x1) -> y."""
    rng = np.random.default_rng(11)
    inits = [numpy_helper.from_array(np.array(v, dtype=np.float32), n)
             for n, v in (("sqrt2", math.sqrt(2.0)), ("one", 1.0), ("half", 0.5))]
    inits.append(numpy_helper.from_array((rng.standard_normal((c, 3, 3, 3)) * 0.3).astype(np.float32), "w0"))
    nodes = [helper.make_node("Conv", ["x", "w0"], ["h0"], kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
    for i in range(blocks):
        h = f"h{i}"
        inits.append(numpy_helper.from_array((rng.standard_normal((c, c, 1, 1)) / math.sqrt(c)).astype(np.float32), f"w{i + 1}"))
        inits.append(numpy_helper.from_array(rng.standard_normal(c).astype(np.float32) * 0.1, f"b{i + 1}"))
        nodes += [helper.make_node("Div", [h, "sqrt2"], [f"d{i}"]), helper.make_node("Erf", [f"d{i}"], [f"e{i}"]),
                  helper.make_node("Add", [f"e{i}", "one"], [f"a{i}"]), helper.make_node("Mul", [h, f"a{i}"], [f"m{i}"]),
                  helper.make_node("Mul", [f"m{i}", "half"], [f"g{i}"]),
                  helper.make_node("Conv", [f"g{i}", f"w{i + 1}", f"b{i + 1}"], ["y" if i == blocks - 1 else f"h{i + 1}"],
                                   kernel_shape=[1, 1])]
    graph = helper.make_graph(nodes, "gelus", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 40, 40])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, 40, 40])], inits)
    return saved_graph(graph, path, opset=13)


def test_erf_gelus_run_as_ncnn_gelu_and_match_onnxruntime(tmp_path):
    model = conv_gelu_stack(tmp_path / "gelus.onnx")
    art = build_fp32_ncnn(model, tmp_path / "out")
    backend = json.loads((tmp_path / "out" / "gelus-x86_64.json").read_text())["backend"]
    assert "erf_gelus_as_gelu x3" in backend["onnx_rewrites"], backend["onnx_rewrites"]
    assert "GELU" in backend["layers"] and "Erf" not in backend["layers"], backend["layers"]
    assert "BinaryOp" not in backend["layers"], backend["layers"]  # the factor 2 went into the Convs' weights
    x = np.random.default_rng(2).standard_normal((1, 3, 40, 40)).astype(np.float32)
    assert_matches_onnxruntime_on_every_cpu(model, art, x, tmp_path)


def test_gelu_holds_exact_erf_on_every_cpu(tmp_path):
    # ncnn's x86 GELU with edgepack's rational erf (gelu_erf_patch.py): values across [-9, 9] (past the
    # erf clamp at 4 sqrt 2), 16 channels packed 16, 8 or 4 by CPU, checked against 0.5 x (1 + erf(x / sqrt 2))
    # in float64 and against onnxruntime
    shape = (1, 16, 30, 35)
    f = TensorProto.FLOAT
    inits = [numpy_helper.from_array(np.array(v, dtype=np.float32), n)
             for n, v in (("sqrt2", math.sqrt(2.0)), ("one", 1.0), ("half", 0.5))]
    nodes = [helper.make_node("Div", ["x", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["a"]), helper.make_node("Mul", ["x", "a"], ["m"]),
             helper.make_node("Mul", ["m", "half"], ["y"])]
    graph = helper.make_graph(nodes, "gelu", [helper.make_tensor_value_info("x", f, list(shape))],
                              [helper.make_tensor_value_info("y", f, list(shape))], inits)
    art = build_fp32_ncnn(saved_graph(graph, tmp_path / "gelu.onnx", opset=13), tmp_path / "out")
    assert json.loads((tmp_path / "out" / "gelu-x86_64.json").read_text())["backend"]["layers"] == ["GELU", "Input"]

    x = np.linspace(-9, 9, math.prod(shape)).astype(np.float32)
    x = x[np.random.default_rng(4).permutation(x.size)].reshape(shape)
    np.save(tmp_path / "x.npy", x)
    exact = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.reshape(-1).tolist()]).reshape(shape)
    want = ort.InferenceSession(str(tmp_path / "gelu.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert float(np.abs(want - exact).max()) < 2e-6
    for cpu in ("native", "native isa=avx2", "native isa=sse", "Haswell-noTSX", "Nehalem"):
        got = run_artifact_on(art, cpu, {"x": tmp_path / "x.npy"}, tmp_path / cpu.replace(" ", "-"), ("y",))[0]["y"]
        got = got.reshape(shape).astype(np.float64)
        assert float(np.abs(got - exact).max()) < 2e-6, cpu    # 9 x 2e-7: a few units in the last place
        assert float(np.abs(got - want).max()) < 3e-6, cpu
