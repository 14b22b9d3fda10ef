"""A batch-N audio model (Silero-VAD-sequence-like: N chunks -> reflect Pad -> STFT-like Conv1d ->
magnitude -> Conv1d stack -> LSTM over the N chunks; tests/audio_fixtures.py) keeps its front end on
NCNN: the chunks are lifted to batch 1 (partition_lift_signal.py) and only the Reshape of the model
input runs on TVM. Checked as a plan against onnxruntime and as a real x86_64 artifact, built with
the default backend and run on a fresh input (the lift itself: tests/unit/test_partition_lift_signal.py)."""
from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import onnx
from audio_fixtures import chunked_vad, vad_inputs
from conftest import run_edgepack
from test_partition_tokens import _ort, _through_segments

from edgepack.model import load_model, simplify
from edgepack.partition import plan
from edgepack.runner import run_artifact


def test_plan_pins_only_the_input_reshape_to_tvm(tmp_path):
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
