"""Pure helpers of the corpus report and of the leftover probe (no pnnx, no builds)."""
from __future__ import annotations

import sys
from pathlib import Path

from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import corpus  # noqa: E402

from edgepack.partition_probe import _candidates  # noqa: E402


def _row(model, target, ok=True):
    return {"model": model, "kind": "k", "target": target, "ok": ok, "ratio": None}


def test_update_replaces_only_the_rerun_model_target_rows():
    old = [_row("a", "x86_64"), _row("a", "arm64"), _row("b", "x86_64"), _row("c", "-", ok=False)]
    kept = corpus.kept_rows(old, {"a", "c"}, {"arm64"})
    assert [(r.model, r.target) for r in kept] == [("a", "x86_64"), ("b", "x86_64")]


def _graph(*ops):
    nodes = [helper.make_node(op, ["x"], [f"y{i}"], name=f"n{i}") for i, op in enumerate(ops)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1]) for i in range(len(ops))])
    return helper.make_model(g)


def test_probe_suspects_follow_the_leftover_layer_types():
    m = _graph("Cast", "Conv", "Reshape", "Pad", "Gather", "Relu")
    names = lambda ns: sorted(n.name for n in ns)  # noqa: E731
    assert names(_candidates(m, ["Tensor.to"])) == ["n0"]
    assert names(_candidates(m, ["Tensor.reshape", "Pad"])) == ["n2", "n3"]
    assert names(_candidates(m, ["Gather"])) == ["n4"]
    # a layer that names no ONNX op: every node is a suspect
    assert len(_candidates(m, ["torch.something_else"])) == 6
