"""A byte classifier written the way jax2tf writes Magika (one_hot(bytes) @ W, a 1-D convolution, a
max pool, a dense head and softmax spelled out as max/sub/exp/sum/div), and again with ONNX's OneHot as
torch writes it, as real x86_64 artifacts: the one-hot product becomes a lookup in a small TVM segment,
everything after it runs in one NCNN segment (the written-out softmax as ncnn's Softmax), and the
artifact answers as onnxruntime does on the original graph, for bytes outside the table (a zero
one-hot row; OneHot's -D..-1 count from the end) too."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import run_edgepack
from edgepack.runner import run_artifact

L, D, C, K, OUT = 64, 257, 16, 5, 12


def byte_classifier(path: Path, form: str = "equal") -> Path:
    rng = np.random.default_rng(21)
    f = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)  # noqa: E731
    inits = {"col_shape": np.array([1, L, 1], np.int64), "range": np.arange(D, dtype=np.int32).reshape(1, 1, D),
             "emb": f(D, C), "cw": f(8, C, K), "cb": f(8), "flat": np.array([1, 8], np.int64),
             "hw": f(8, OUT), "hb": f(OUT), "ninf": np.array(-np.inf, np.float32), "one": np.array([1], np.int64),
             "kept": np.array([1, 1], np.int64), "depth": np.array(D, np.int64),
             "onoff": np.array([0.0, 1.0], np.float32)}
    if form == "equal":  # jax2tf's one_hot
        nodes = [helper.make_node("Reshape", ["bytes", "col_shape"], ["col"]),
                 helper.make_node("Equal", ["col", "range"], ["hot"]),
                 helper.make_node("Cast", ["hot"], ["hotf"], to=TensorProto.FLOAT)]
    else:  # torch's F.one_hot, tf2onnx's tf.one_hot
        nodes = [helper.make_node("OneHot", ["bytes", "depth", "onoff"], ["hotf"], axis=-1)]
    nodes += [helper.make_node("MatMul", ["hotf", "emb"], ["e"]),
             helper.make_node("Transpose", ["e"], ["et"], perm=[0, 2, 1]),
             helper.make_node("Conv", ["et", "cw", "cb"], ["c"]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("GlobalMaxPool", ["r"], ["p"]),
             helper.make_node("Reshape", ["p", "flat"], ["pf"]),
             helper.make_node("Gemm", ["pf", "hw", "hb"], ["logits"]),
             helper.make_node("ReduceMax", ["logits"], ["m"], axes=[1], keepdims=0),
             helper.make_node("Max", ["ninf", "m"], ["m2"]),
             helper.make_node("Reshape", ["m2", "kept"], ["mk"]),
             helper.make_node("Sub", ["logits", "mk"], ["d"]),
             helper.make_node("Exp", ["d"], ["ex"]),
             helper.make_node("ReduceSum", ["ex", "one"], ["s"], keepdims=0),
             helper.make_node("Reshape", ["s", "kept"], ["sk"]),
             helper.make_node("Div", ["ex", "sk"], ["probs"])]
    id_type = TensorProto.INT32 if form == "equal" else TensorProto.INT64
    g = helper.make_graph(nodes, "bytes", [helper.make_tensor_value_info("bytes", id_type, [1, L])],
                          [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, OUT])],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 15)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    onnx.save(m, str(path))
    return path


@pytest.mark.parametrize("form", ["equal", "onehot"])
def test_one_hot_bytes_and_softmax_build_as_a_lookup_and_one_ncnn_segment(tmp_path, form):
    model = byte_classifier(tmp_path / "bytes.onnx", form)
    proc = run_edgepack("build", str(model), "--target", "x86_64", "--out", str(tmp_path / "dist"), "--json",
                        "--select", "first")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "1 one-hot product(s) as a Gather; 1 written-out softmax(es) as Softmax" in proc.stderr, proc.stderr
    art = tmp_path / "dist" / "bytes-x86_64"
    manifest = json.loads(art.with_name(art.name + ".json").read_text())
    segments = manifest["backend"]["segments"]
    assert [s["backend"] for s in segments] == ["tvm", "ncnn"], segments
    wrap = {"Less", "Add", "Where"} if form == "onehot" else set()  # OneHot's -D..-1 count from the end
    assert set(segments[0]["ops"]) == {"Clip", "Gather"} | wrap, segments[0]["ops"]
    assert "Softmax" in segments[1]["manifest"]["layers"] and "Equal" not in segments[1]["ops"], segments[1]

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    tol = manifest["tolerance"]
    edges = [0, D - 1, D, 1000, -1, -D, -D - 1, -(2**31), 2**31 - 1]
    cases = [np.random.default_rng(5).integers(0, D, (1, L)),  # fresh bytes, not the build's inputs
             np.array([(edges * (L // len(edges) + 1))[:L]]),     # outside the table: zero one-hot rows
             np.full((1, L), -7)]                                   # nothing but zero rows
    for k, ids in enumerate(cases):
        ids = ids.astype(np.int32 if form == "equal" else np.int64)
        np.save(tmp_path / f"b{k}.npy", ids)
        run = run_artifact(art, ["run", "--threads", "1", "--input", f"bytes={tmp_path / f'b{k}.npy'}",
                                 "--output", str(tmp_path / f"out{k}")])
        assert run.returncode == 0, run.stderr
        got = np.load(json.loads(run.stdout)["outputs"]["probs"]["file"])
        want = sess.run(None, {"bytes": ids})[0]
        err = float(np.max(np.abs(got - want)))
        assert err <= tol["atol"] + tol["rtol"] * float(np.max(np.abs(want))), (k, err, got, want)
