"""A batch-N audio model (Silero-VAD-sequence-like: N chunks -> reflect Pad -> STFT-like Conv1d ->
magnitude -> Conv1d stack -> LSTM over the N chunks) keeps its front end on NCNN: the chunks are
lifted to batch 1 (partition_lift_signal.py) and only the Reshape of the model input runs on TVM.
Checked as a real x86_64 artifact, built with the default backend and run on a fresh input
against onnxruntime (the lift itself is checked in tests/unit/test_partition_lift_signal.py)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

CHUNKS, WIDTH, HIDDEN = 4, 96, 16


def chunked_vad(path: Path, tail: str = "lstm") -> Path:
    """input [CHUNKS, WIDTH], h, c [1, 1, HIDDEN] -> Pad(reflect) -> Unsqueeze -> Conv1d (STFT-like,
    stride) -> Slice real/imag -> Pow 2 -> Add -> Sqrt -> Conv1d/Relu x3 (to width 1) -> Transpose ->
    LSTM over the chunks -> Squeeze -> Relu -> Transpose -> Conv1d -> Sigmoid -> Reshape [CHUNKS],
    plus the LSTM's hn, cn. ``tail="softmax"`` puts a Softmax across the chunks after the front end
    instead (an op the lift does not handle)."""
    rng = np.random.default_rng(21)
    f = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)  # noqa: E731
    c64 = lambda v: np.array(v, np.int64)  # noqa: E731
    bins = 9  # STFT-like basis: 2 x bins filters of width 16, stride 8 -> 13 frames of 112 samples
    inits = {"pads": c64([0, 8, 0, 8]), "ax1": c64([1]), "basis": f(2 * bins, 1, 16), "two": np.float32(2.0),
             "s0": c64([0, 1]), "e0": c64([bins, 1 << 62]), "s1": c64([bins, 1]), "e1": c64([1 << 62, 1 << 62]),
             "sax": c64([1, 2]), "w0": f(12, bins, 3), "b0": f(12), "w1": f(12, 12, 3), "b1": f(12),
             "w2": f(HIDDEN, 12, 3), "b2": f(HIDDEN), "W": f(1, 4 * HIDDEN, HIDDEN), "R": f(1, 4 * HIDDEN, HIDDEN),
             "B": f(1, 8 * HIDDEN), "wo": f(1, HIDDEN, 1), "bo": f(1), "flat": c64([-1])}
    nodes = [helper.make_node("Pad", ["input", "pads"], ["padded"], name="pad", mode="reflect"),
             helper.make_node("Unsqueeze", ["padded", "ax1"], ["x"], name="unsq"),
             helper.make_node("Conv", ["x", "basis"], ["spec"], name="stft", kernel_shape=[16], strides=[8]),
             helper.make_node("Slice", ["spec", "s0", "e0", "sax"], ["re"], name="real"),
             helper.make_node("Slice", ["spec", "s1", "e1", "sax"], ["im"], name="imag"),
             helper.make_node("Pow", ["re", "two"], ["re2"], name="pow0"),
             helper.make_node("Pow", ["im", "two"], ["im2"], name="pow1"),
             helper.make_node("Add", ["re2", "im2"], ["pw"], name="power"),
             helper.make_node("Sqrt", ["pw"], ["mag"], name="mag")]
    prev = "mag"
    for k, stride in enumerate((2, 3, 2)):  # width 12 -> 6 -> 2 -> 1
        nodes += [helper.make_node("Conv", [prev, f"w{k}", f"b{k}"], [f"c{k}"], name=f"enc{k}", kernel_shape=[3],
                                   pads=[1, 1], strides=[stride]),
                  helper.make_node("Relu", [f"c{k}"], [f"r{k}"], name=f"relu{k}")]
        prev = f"r{k}"
    outputs = [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [CHUNKS])]
    if tail == "lstm":
        nodes += [helper.make_node("Transpose", [prev], ["seq"], name="to_seq", perm=[0, 2, 1]),
                  helper.make_node("LSTM", ["seq", "W", "R", "B", "", "h", "c"], ["y", "hn", "cn"], name="lstm",
                                   hidden_size=HIDDEN),
                  helper.make_node("Squeeze", ["y", "ax1"], ["ys"], name="sq"),
                  helper.make_node("Relu", ["ys"], ["yr"], name="relu_y"),
                  helper.make_node("Transpose", ["yr"], ["yt"], name="to_ncw", perm=[1, 2, 0]),
                  helper.make_node("Conv", ["yt", "wo", "bo"], ["logit"], name="head", kernel_shape=[1]),
                  helper.make_node("Sigmoid", ["logit"], ["p"], name="sigmoid"),
                  helper.make_node("Reshape", ["p", "flat"], ["probs"], name="flatten")]
        outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 1, HIDDEN]) for n in ("hn", "cn")]
    else:
        nodes += [helper.make_node("Softmax", [prev], ["sm"], name="softmax", axis=0),
                  helper.make_node("Reshape", ["sm", "flat"], ["probs"], name="flatten")]
        for k in ("W", "R", "B", "wo", "bo"):
            del inits[k]
        outputs = [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [CHUNKS * HIDDEN])]
    inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, [CHUNKS, WIDTH])]
    if tail == "lstm":
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 1, HIDDEN]) for n in ("h", "c")]
    g = helper.make_graph(nodes, "chunked_vad", inputs, outputs,
                          [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    onnx.save(m, str(path))
    return path


def vad_inputs(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input": rng.standard_normal((CHUNKS, WIDTH)).astype(np.float32),
            "h": (rng.standard_normal((1, 1, HIDDEN)) * 0.5).astype(np.float32),
            "c": (rng.standard_normal((1, 1, HIDDEN)) * 0.5).astype(np.float32)}


def test_plan_pins_only_the_input_reshape_to_tvm(tmp_path):
    from edgepack.model import load_model, simplify
    from edgepack.partition import plan
    from test_partition_tokens import _ort, _through_segments
    model = simplify(load_model(chunked_vad(tmp_path / "vad.onnx")))
    p = plan(model, {"ncnn": lambda op: True, "tvm": lambda op: True})  # NCNN's op table takes every op
    assert p.backends == ("tvm", "ncnn") and p.segments[0].ops == ("Reshape",), p.describe()
    assert {"Conv", "LSTM", "Pad", "Slice"} <= set(p.segments[1].ops)
    assert p.segments[0].inputs == ("input",) and set(p.segments[1].outputs) == {"probs", "hn", "cn"}
    feeds = vad_inputs(5)
    got, want = _through_segments(p, feeds), _ort(model.proto, feeds)
    for name in ("probs", "hn", "cn"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)


# ---- a real x86_64 artifact (pnnx, TVM, zig) -----------------------------------------------------

def test_chunked_vad_artifact_keeps_its_front_end_on_ncnn(tmp_path):
    from conftest import run_edgepack
    from edgepack.runner import run_artifact
    from test_partition_tokens import _ort
    model = chunked_vad(tmp_path / "vad.onnx")
    dist = tmp_path / "dist"
    # the default backend (auto): NCNN alone computes only the first chunk, so the lifted split is built
    proc = run_edgepack("build", str(model), "--target", "x86_64", "--out", str(dist), "--json", "--select", "first")
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout)["results"][0]
    assert res["ok"] and res["backend"] == "ncnn+tvm", res
    art = dist / "vad-x86_64"
    manifest = json.loads(art.with_name(art.name + ".json").read_text())
    segs = manifest["backend"]["segments"]
    assert [s["backend"] for s in segs] == ["tvm", "ncnn"] and segs[0]["ops"] == ["Reshape"], segs
    assert {"Conv", "LSTM", "Pad"} <= set(segs[1]["ops"]), segs
    feeds = vad_inputs(77)  # fresh, not the build's verification inputs
    args = ["run", "--threads", "1", "--output", str(tmp_path / "out")]
    for name, arr in feeds.items():
        np.save(tmp_path / f"{name}.npy", arr)
        args += ["--input", f"{name}={tmp_path / f'{name}.npy'}"]
    run = run_artifact(art, args)
    assert run.returncode == 0, run.stderr
    outs = json.loads(run.stdout)["outputs"]
    want = _ort(onnx.load(str(model)), feeds)
    tol = manifest["tolerance"]
    for name in ("probs", "hn", "cn"):
        got = np.load(outs[name]["file"])
        assert got.shape == want[name].shape, name
        err = float(np.max(np.abs(got - want[name])))
        assert err <= tol["atol"] + tol["rtol"] * float(np.max(np.abs(want[name]))), (name, err)
    bench = subprocess.run([str(art), "bench", "--runs", "5", "--warmup", "1", "--threads", "1"], capture_output=True,
                           text=True, timeout=120, env={**os.environ, "EDGEPACK_SEGMENT_TIMES": "1"})
    assert bench.returncode == 0, bench.stderr
    assert "segment 0 (tvm): 6 runs" in bench.stderr and "segment 1 (ncnn): 6 runs" in bench.stderr, bench.stderr
