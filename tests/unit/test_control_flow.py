"""If nodes as Where (edgepack/control_flow.py): the same outputs as onnxruntime's If on inputs that
take each branch, and Ifs whose untaken branch could fail or whose branches disagree in shape kept."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from edgepack.control_flow import lower_if
from edgepack.model import LoadedModel, load_model

RNG = np.random.default_rng(11)


def _branch(name, nodes, out, shape, inits=()):
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(out, TensorProto.FLOAT, shape)],
                             [numpy_helper.from_array(np.asarray(v), k) for k, v in inits])


def _verifier(tag: str, n: int = 8) -> tuple[list, list]:
    """A second small MLP on the outer input x [1, n] (openWakeWord's verifier in small)."""
    w = RNG.standard_normal((n, n)).astype(np.float32)
    return ([helper.make_node("MatMul", ["x", f"{tag}_w"], [f"{tag}_h"]),
             helper.make_node("Relu", [f"{tag}_h"], [f"{tag}_r"]),
             helper.make_node("Sigmoid", [f"{tag}_r"], [f"{tag}_out"])], [(f"{tag}_w", w)])


def _model(then_g, else_g, extra_nodes=(), n: int = 8) -> onnx.ModelProto:
    """score = Sigmoid(sum(x)); if score >= 0.5: then_g else else_g."""
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], keepdims=1),
             helper.make_node("Sigmoid", ["s"], ["score"]),
             helper.make_node("GreaterOrEqual", ["score", "half"], ["cond"]),
             *extra_nodes,
             helper.make_node("If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
                              [numpy_helper.from_array(np.array([[0.5]], np.float32), "half")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def _loaded(m: onnx.ModelProto, tmp: Path) -> LoadedModel:
    onnx.save(m, tmp / "m.onnx")
    return load_model(tmp / "m.onnx")


def _run(m: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _score_branch():
    nodes, inits = _verifier("v")
    return _branch("then", nodes, "v_out", [1, 8], inits)


def _identity_branch():
    return _branch("else", [helper.make_node("Sigmoid", ["x"], ["e_out"])], "e_out", [1, 8])


def test_both_branches_give_onnxruntimes_if_outputs(tmp_path):
    original = _model(_score_branch(), _identity_branch())
    lowered = lower_if(_loaded(original, tmp_path))
    assert "If" not in lowered.ops() and "Where" in lowered.ops()
    assert lowered.notes[-1].startswith("If as Where: 1 If node(s), both branches computed")
    for sign in (1.0, -1.0):  # sum(x) > 0 takes then (the verifier), < 0 else (Sigmoid(x))
        x = (np.abs(RNG.standard_normal((1, 8))) * sign).astype(np.float32)
        expected = _run(original, x)
        np.testing.assert_array_equal(_run(lowered.proto, x), expected)
        took_else = np.allclose(expected, 1 / (1 + np.exp(-x)), rtol=1e-6)
        assert took_else == (sign < 0)


def test_a_nested_if_is_lowered_inside_out(tmp_path):
    inner_nodes = [helper.make_node("ReduceMax", ["x"], ["m"], keepdims=1),
                   helper.make_node("Greater", ["m", "zero"], ["c2"]),
                   helper.make_node("If", ["c2"], ["inner"], then_branch=_score_branch(),
                                    else_branch=_branch("e2", [helper.make_node("Neg", ["x"], ["n_out"])], "n_out", [1, 8]))]
    outer_then = _branch("then", inner_nodes, "inner", [1, 8], [("zero", np.array(0.2, np.float32))])
    original = _model(outer_then, _identity_branch())
    lowered = lower_if(_loaded(original, tmp_path))
    assert "If" not in lowered.ops()
    assert lowered.notes[-1].startswith("If as Where: 2 If node(s)")
    for x in (np.full((1, 8), 0.5, np.float32), np.full((1, 8), 0.1, np.float32), -np.ones((1, 8), np.float32),
              RNG.standard_normal((1, 8)).astype(np.float32)):
        np.testing.assert_array_equal(_run(lowered.proto, x), _run(original, x))


def test_a_branch_with_a_computed_index_is_kept(tmp_path):
    """Gather with an index computed from data: out of range exactly when the branch is not taken."""
    idx_nodes = [helper.make_node("ArgMax", ["x"], ["i"], axis=1, keepdims=0),
                 helper.make_node("Gather", ["x", "i"], ["g"], axis=1),
                 helper.make_node("Expand", ["g", "shape"], ["g_out"])]
    then_g = _branch("then", idx_nodes, "g_out", [1, 8], [("shape", np.array([1, 8], np.int64))])
    loaded = _loaded(_model(then_g, _identity_branch()), tmp_path)
    assert lower_if(loaded) is loaded


def test_branches_of_different_shapes_are_kept(tmp_path):
    then_g = _branch("then", [helper.make_node("ReduceSum", ["x"], ["t_out"], keepdims=1)], "t_out", [1, 1])
    graph_out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "d"])
    m = _model(then_g, _identity_branch())
    m.graph.output[0].CopyFrom(graph_out)
    loaded = _loaded(m, tmp_path)
    assert lower_if(loaded) is loaded


def test_a_model_without_if_is_returned_as_is(tmp_path):
    nodes, inits = _verifier("v")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
                              [helper.make_tensor_value_info("v_out", TensorProto.FLOAT, [1, 8])],
                              [numpy_helper.from_array(v, k) for k, v in inits])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    loaded = _loaded(m, tmp_path)
    assert lower_if(loaded) is loaded
