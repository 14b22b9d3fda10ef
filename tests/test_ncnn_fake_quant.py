"""Static int8's fake quantisation folded into one Clip pass gives onnxruntime's bits on every x86 CPU
(edgepack/backends/ncnn/fake_quant_patch.py).

The model quantises and dequantises as quantized_qdq.py's lowering writes it (Div by the scale,
Round half to even, Clip to the integer range, Mul by the scale), with and without the Mul, on a
tensor of 3 channels (no packing: every vector width's tail and the scalar loop run) and one of 16
(packed 16 or 8 rows an element), and once where the rounded value is also an output (not folded:
the intermediate must stay). The folded artifact must match onnxruntime element for element under
every x86 CPU model the artifact may meet: AVX-512 natively, the AVX path (an isa=avx2 cap), qemu
Haswell, and qemu Nehalem, where ncnn's base SSE2 build rounds through int32."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from clirun import run_artifact_on, run_edgepack

X, Y = (1, 3, 5, 7), (1, 16, 5, 7)
OUTPUTS = {"fq": X, "q": Y, "r": X, "rc": X}


@pytest.fixture(scope="module")
def fq_model(tmp_path_factory):
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Div", ["x", "s1"], ["x_s"]), helper.make_node("Round", ["x_s"], ["x_r"]),
             helper.make_node("Clip", ["x_r", "lo1", "hi1"], ["x_c"]), helper.make_node("Mul", ["x_c", "s1"], ["fq"]),
             helper.make_node("Div", ["y", "s2"], ["y_s"]), helper.make_node("Round", ["y_s"], ["y_r"]),
             helper.make_node("Clip", ["y_r", "lo2", "hi2"], ["q"]),
             # the rounded value is read twice (an output too): this chain must stay four layers
             helper.make_node("Div", ["x", "s3"], ["x_s3"]), helper.make_node("Round", ["x_s3"], ["r"]),
             helper.make_node("Clip", ["r", "lo3", "hi3"], ["rc"])]
    consts = {"s1": 0.1, "lo1": -128.0, "hi1": 127.0, "s2": 0.0441063, "lo2": -20.0, "hi2": 20.0,
              "s3": 0.3, "lo3": 0.0, "hi3": 255.0}
    inits = [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in consts.items()]
    graph = helper.make_graph(nodes, "fake_quant",
                              [helper.make_tensor_value_info("x", f, list(X)), helper.make_tensor_value_info("y", f, list(Y))],
                              [helper.make_tensor_value_info(o, f, list(s)) for o, s in OUTPUTS.items()], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = tmp_path_factory.mktemp("fq") / "fq.onnx"
    onnx.save(model, path)
    return path


def _near_ties(scale: float) -> np.ndarray:
    """Values whose quotient by ``scale`` lands on or next to a half, where a multiplication by the
    reciprocal rounds the other way from the division."""
    s = np.float32(scale)
    out = []
    for k in range(-150, 150):
        tie = np.float32((k + 0.5) * float(s))
        for x in (np.nextafter(tie, np.float32(-np.inf)), tie, np.nextafter(tie, np.float32(np.inf))):
            if np.round(x * (np.float32(1) / s)) != np.round(x / s):
                out.append(x)
    return np.array(out, np.float32)


def _inputs():
    rng = np.random.default_rng(7)
    x = rng.uniform(-16.0, 16.0, X).astype(np.float32)
    ties = np.concatenate([_near_ties(0.1)[:40], _near_ties(0.3)[:40]])
    x.flat[:ties.size] = ties
    x.flat[ties.size:ties.size + 4] = [100.0, -100.0, 0.05, -0.05]   # past the clip; ties at zero
    y = rng.uniform(-1.2, 1.2, Y).astype(np.float32)
    return {"x": x, "y": y}


def test_the_check_can_fail_on_these_inputs():
    # a reciprocal instead of the division changes quantised values of both chains of x
    x = _inputs()["x"]
    for s in (0.1, 0.3):
        s = np.float32(s)
        assert np.count_nonzero(np.round(x * (np.float32(1) / s)) != np.round(x / s)) >= 20


def test_folded_chains_match_onnxruntime_bit_for_bit_on_every_x86_cpu(fq_model, tmp_path):
    feeds = _inputs()
    want = dict(zip(OUTPUTS, ort.InferenceSession(str(fq_model), providers=["CPUExecutionProvider"]).run(
        list(OUTPUTS), feeds)))
    proc = run_edgepack("build", fq_model, "--target", "x86_64", "--backend", "ncnn", "--fp32", "--out", tmp_path / "out",
                        "--json")
    report = json.loads(proc.stdout) if proc.stdout.strip() else {}
    assert proc.returncode == 0 and report.get("ok"), proc.stderr[-3000:]
    art = tmp_path / "out" / "fq-x86_64"
    manifest = json.loads((tmp_path / "out" / "fq-x86_64.json").read_text())
    assert manifest["backend"]["fake_quant_folds"] == 2, manifest["backend"]
    paths = {}
    for name, a in feeds.items():
        np.save(tmp_path / f"{name}.npy", a)
        paths[name] = tmp_path / f"{name}.npy"
    for cpu in ("native", "native isa=avx2", "Haswell-noTSX", "Nehalem"):
        for threads in (1, 2):
            got, _ = run_artifact_on(art, cpu, paths, tmp_path / f"o-{cpu}-{threads}".replace(" ", "_"), list(OUTPUTS),
                                     threads=threads)
            for name, shape in OUTPUTS.items():
                a = got[name].reshape(shape)
                bad = np.count_nonzero(a != want[name])
                assert bad == 0, f"{cpu}, {threads} threads: {name}: {bad} of {a.size} differ from onnxruntime's"
