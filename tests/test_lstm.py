"""LSTM/GRU on TVM (edgepack/onnx_lstm.py unrolls them before the relax import, which has neither):
hand-made onnx.helper models (no torch) built for x86_64 and run with `run` on fresh inputs against
onnxruntime. Before the rewrite, `--backend tvm` refused both models (exit 5, LSTM) and `auto` could
not place the conv+LSTM model's LSTM, which pnnx leaves as a layer ncnn cannot load."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from clirun import run_edgepack
from edgepack.runner import run_artifact

T = 4  # sequence length (each step is unrolled: short keeps the TVM build quick)


def _init(rng, name: str, shape, scale=0.4):
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def _save(nodes, inputs, outputs, inits, path: Path) -> Path:
    m = helper.make_model(helper.make_graph(nodes, path.stem, inputs, outputs, inits),
                          opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    onnx.save(m, str(path))
    return path


def lstm_gru_stack(path: Path) -> Path:
    """Bidirectional LSTM (no initial state) -> GRU (linear_before_reset, initial state an input)."""
    rng = np.random.default_rng(11)
    i, h1, h2 = 8, 12, 10
    inits = [_init(rng, "W1", (2, 4 * h1, i)), _init(rng, "R1", (2, 4 * h1, h1)), _init(rng, "B1", (2, 8 * h1), 0.1),
             _init(rng, "W2", (1, 3 * h2, 2 * h1)), _init(rng, "R2", (1, 3 * h2, h2)),
             _init(rng, "B2", (1, 6 * h2), 0.1), numpy_helper.from_array(np.array([T, 1, 2 * h1], np.int64), "shp")]
    nodes = [helper.make_node("LSTM", ["x", "W1", "R1", "B1"], ["y1"], name="lstm", hidden_size=h1,
                              direction="bidirectional"),
             helper.make_node("Transpose", ["y1"], ["y1t"], perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["y1t", "shp"], ["y1r"]),
             helper.make_node("GRU", ["y1r", "W2", "R2", "B2", "", "h0"], ["y", "hn"], name="gru", hidden_size=h2,
                              linear_before_reset=1)]
    f = TensorProto.FLOAT
    return _save(nodes, [helper.make_tensor_value_info("x", f, [T, 1, i]), helper.make_tensor_value_info("h0", f, [1, 1, h2])],
                 [helper.make_tensor_value_info("y", f, [T, 1, 1, h2]), helper.make_tensor_value_info("hn", f, [1, 1, h2])],
                 inits, path)


def conv_lstm_conv(path: Path) -> Path:
    """Silero-VAD-like: Conv1d features -> time-major LSTM with its state as inputs -> Conv1d head;
    the state comes back out (hn, cn)."""
    rng = np.random.default_rng(12)
    c, h = 16, 8
    inits = [_init(rng, "cw", (c, 2, 3)), _init(rng, "cb", (c,), 0.1), _init(rng, "W", (1, 4 * h, c)),
             _init(rng, "R", (1, 4 * h, h)), _init(rng, "B", (1, 8 * h), 0.1), _init(rng, "ow", (1, h, 1)),
             numpy_helper.from_array(np.array([1], np.int64), "ax1")]
    nodes = [helper.make_node("Conv", ["x", "cw", "cb"], ["f"], pads=[1, 1]),
             helper.make_node("Relu", ["f"], ["fr"]),
             helper.make_node("Transpose", ["fr"], ["seq"], perm=[2, 0, 1]),             # [T, 1, C]
             helper.make_node("LSTM", ["seq", "W", "R", "B", "", "h", "c"], ["ys", "hn", "cn"], name="lstm",
                              hidden_size=h),
             helper.make_node("Squeeze", ["ys", "ax1"], ["ysq"]),                          # [T, 1, H]
             helper.make_node("Transpose", ["ysq"], ["yt"], perm=[1, 2, 0]),              # [1, H, T]
             helper.make_node("Conv", ["yt", "ow"], ["o"]),
             helper.make_node("Sigmoid", ["o"], ["prob"])]
    f = TensorProto.FLOAT
    state = [1, 1, h]
    return _save(nodes, [helper.make_tensor_value_info("x", f, [1, 2, T]), helper.make_tensor_value_info("h", f, state),
                         helper.make_tensor_value_info("c", f, state)],
                 [helper.make_tensor_value_info("prob", f, [1, 1, T]), helper.make_tensor_value_info("hn", f, state),
                  helper.make_tensor_value_info("cn", f, state)], inits, path)


def _build(model: Path, dist: Path, *args: str) -> dict:
    proc = run_edgepack("build", str(model), "--target", "x86_64", "--out", str(dist), "--json", *args, timeout=600)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"no JSON report (exit {proc.returncode}): {proc.stderr[-3000:]}")
    assert proc.returncode == 0 and report["ok"], proc.stderr[-4000:]
    return report["results"][0]


def _check_run(art: Path, model: Path, tmp: Path, seed: int) -> float:
    """`run` on a fresh input (not the build's golden one) against onnxruntime; the worst error."""
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    feeds = {i.name: rng.standard_normal(i.shape).astype(np.float32) for i in sess.get_inputs()}
    ref = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    args = ["run", "--threads", "1", "--output", str(tmp / "out")]
    for name, v in feeds.items():
        np.save(tmp / f"{name}.npy", v)
        args += ["--input", f"{name}={tmp / f'{name}.npy'}"]
    tol = json.loads(art.with_name(art.name + ".json").read_text())["tolerance"]
    proc = run_artifact(art, args)
    assert proc.returncode == 0, proc.stderr
    outs = json.loads(proc.stdout)["outputs"]
    worst = 0.0
    for name, want in ref.items():
        got = np.load(outs[name]["file"]).reshape(want.shape)
        err = float(np.max(np.abs(got - want)))
        assert err <= tol["atol"] + tol["rtol"] * float(np.max(np.abs(want))), (name, err)
        worst = max(worst, err)
    return worst


def test_tvm_builds_lstm_and_gru(tmp_path):
    model = lstm_gru_stack(tmp_path / "lstm_gru.onnx")
    t0 = time.monotonic()
    res = _build(model, tmp_path / "dist", "--backend", "tvm")
    assert res["backend"] == "tvm"
    err = _check_run(tmp_path / "dist" / "lstm_gru-x86_64", model, tmp_path, seed=21)
    print(f"tvm LSTM+GRU: built and checked in {time.monotonic() - t0:.0f} s, max error {err:.2e}")


def test_auto_places_the_lstm(tmp_path):
    """auto keeps the first candidate that verifies (NCNN, the split, TVM): whichever it is, the LSTM
    runs right; with the split, the LSTM is in a TVM segment."""
    model = conv_lstm_conv(tmp_path / "conv_lstm.onnx")
    t0 = time.monotonic()
    res = _build(model, tmp_path / "dist", "--select", "first")
    art = tmp_path / "dist" / "conv_lstm-x86_64"
    manifest = json.loads(art.with_name(art.name + ".json").read_text())
    if res["backend"] == "ncnn+tvm":
        segs = manifest["backend"]["segments"]
        assert any(s["backend"] == "tvm" and "LSTM" in s["ops"] for s in segs), segs
    err = _check_run(art, model, tmp_path, seed=22)
    print(f"auto conv+LSTM: {res['backend']}, built and checked in {time.monotonic() - t0:.0f} s, "
          f"max error {err:.2e}")


def test_an_lstm_ncnn_cannot_load_goes_to_tvm_alone(tmp_path):
    """When pnnx leaves an LSTM ncnn cannot load, the split cuts that node out to TVM (the leftover
    probe's `force`): the plan now has a TVM segment of just the LSTM (before, no plan: TVM could not
    build it either). Its segments run in sequence, the TVM one as TVM gets it (unrolled), give the
    whole graph's answers."""
    from edgepack.model import load_model, simplify
    from edgepack.onnx_lstm import decompose
    from edgepack.partition_build import plan_for
    from edgepack.targets import TargetMatrix
    model = simplify(load_model(conv_lstm_conv(tmp_path / "conv_lstm.onnx")))
    p = plan_for(model, TargetMatrix.load().get("x86_64"), force={"lstm": "tvm"})
    assert p is not None and p.backends == ("ncnn", "tvm", "ncnn"), p and p.describe()
    assert p.segments[1].ops == ("LSTM",)
    rng = np.random.default_rng(23)
    feeds = {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in model.inputs}
    values = dict(feeds)
    for seg in p.segments:
        m = decompose(seg.model) if seg.backend == "tvm" else seg.model
        assert seg.backend != "tvm" or not any(n.op_type == "LSTM" for n in m.graph.node)
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        values.update(zip([o.name for o in sess.get_outputs()],
                          sess.run(None, {i.name: values[i.name] for i in sess.get_inputs()})))
    sess = ort.InferenceSession(model.proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for o, want in zip(sess.get_outputs(), sess.run(None, feeds)):
        np.testing.assert_allclose(values[o.name], want, rtol=0, atol=1e-5)
