"""A model with a data-dependent If (openWakeWord's score-then-verify form) builds, and the artifact
answers as onnxruntime's If does on inputs that take each branch (edgepack/control_flow.py)."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from clirun import run_edgepack

N = 16


def _score_then_verify() -> onnx.ModelProto:
    """p1 = Sigmoid(x @ W1); if p1 >= 0.5: y = Sigmoid(Relu(x @ W2) @ W3) (the verifier) else y = p1."""
    rng = np.random.default_rng(4)
    w = {k: (rng.standard_normal(s) * 0.5).astype(np.float32)
         for k, s in (("w1", (N, 1)), ("w2", (N, N)), ("w3", (N, 1)))}
    verifier = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w2"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "w3"], ["v"]), helper.make_node("Sigmoid", ["v"], ["p2"])],
        "then", [], [helper.make_tensor_value_info("p2", TensorProto.FLOAT, [1, 1])])
    keep = helper.make_graph([helper.make_node("Identity", ["p1"], ["p1_out"])], "else", [],
                             [helper.make_tensor_value_info("p1_out", TensorProto.FLOAT, [1, 1])])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["s"]), helper.make_node("Sigmoid", ["s"], ["p1"]),
         helper.make_node("GreaterOrEqual", ["p1", "half"], ["c"]),
         helper.make_node("Squeeze", ["c"], ["cond"]),
         helper.make_node("If", ["cond"], ["y"], then_branch=verifier, else_branch=keep)],
        "score_then_verify", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, N])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1])],
        [numpy_helper.from_array(v, k) for k, v in w.items()] + [numpy_helper.from_array(np.float32(0.5), "half")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def test_if_model_builds_and_answers_both_branches_as_onnxruntime(tmp_path):
    m = _score_then_verify()
    onnx.save(m, tmp_path / "wake.onnx")
    proc = run_edgepack("build", tmp_path / "wake.onnx", "--target", "x86_64", "--verify-on", "native",
                        "--out", tmp_path / "dist", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "If as Where: 1 If node(s)" in proc.stderr + proc.stdout
    artifact = tmp_path / "dist" / "wake-x86_64"
    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    w1 = numpy_helper.to_array(next(i for i in m.graph.initializer if i.name == "w1")).ravel()
    taken = set()
    for k, sign in enumerate((1.0, -1.0, 1.0, -1.0)):
        x = (np.sign(w1) * sign * (1 + k)).astype(np.float32).reshape(1, N)  # drives p1 to ~1 or ~0
        np.save(tmp_path / f"x{k}.npy", x)
        run = run_edgepack("run", str(artifact), "--input", f"x={tmp_path / f'x{k}.npy'}", "--output", tmp_path / f"o{k}")
        assert run.returncode == 0, run.stderr
        got = np.load(tmp_path / f"o{k}" / "y.npy")
        want = session.run(None, {"x": x})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        p1 = 1 / (1 + np.exp(-(x @ w1)))
        taken.add(bool(p1[0] >= 0.5))
        if p1[0] < 0.5:
            np.testing.assert_allclose(got.ravel(), p1, rtol=1e-5)  # the else branch's answer
    assert taken == {True, False}
    manifest = json.loads((tmp_path / "dist" / "wake-x86_64.json").read_text())
    assert any(n.startswith("If as Where: 1 If node(s)") for n in manifest["model"]["notes"])
