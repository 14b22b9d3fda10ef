"""Loops that decide on data, built and run for real (edgepack/loops.py, runtimes/common/ep_engine_loop.c):
real pnnx/ncnn, TVM, zig; onnxruntime as the reference on inputs that decode to different lengths."""
from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort

from clirun import run_edgepack
from edgepack.runner import run_artifact
from loop_models import ROWS, WIDTH, counted_model, decoder_model, doubling_model, inputs_with_lengths
from prepost_fixtures import Server


def _session(path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _build(tmp_path, model_path):
    # fp32: these tests check the loop's mechanics to 1e-4 (twelve fp16 steps would drift ~0.5%)
    proc = run_edgepack("build", model_path, "--target", "x86_64", "--verify-on", "native", "--fp32", "--out",
                        tmp_path / "dist", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp_path / "dist" / f"{model_path.stem}-x86_64"


def test_decoder_loop_answers_every_length_as_onnxruntime(tmp_path):
    path = tmp_path / "decoder.onnx"
    decoder_model(path, answer_length=True)  # the cut's length is also an output (a slot lent to the caller)
    artifact = _build(tmp_path, path)
    manifest = json.loads((artifact.parent / (artifact.name + ".json")).read_text())
    assert [s["backend"] for s in manifest["backend"]["segments"]].count("loop") == 1, manifest["backend"]
    probs = next(o for o in manifest["outputs"] if o["name"] == "probs")
    assert probs["shape"] == [1, ROWS, WIDTH] and probs["cut_to_length"]["axis"] == 1
    reference = _session(path)
    lengths = set()
    picked = {n: x for x, n in inputs_with_lengths(path, 40)}                      # one input per decode length
    for k, (n, x) in enumerate(sorted(picked.items())):
        np.save(tmp_path / f"x{k}.npy", x)
        run = run_edgepack("run", str(artifact), "--input", f"x={tmp_path / f'x{k}.npy'}", "--output", tmp_path / f"o{k}")
        assert run.returncode == 0, run.stderr
        got = np.load(tmp_path / f"o{k}" / "probs.npy")
        want_probs, want_state = reference.run(["probs", "state_f"], {"x": x})
        assert got.shape == (1, n, WIDTH) == want_probs.shape
        np.testing.assert_array_equal(np.load(tmp_path / f"o{k}" / "length.npy"), [n])
        np.testing.assert_allclose(got, want_probs, atol=1e-4)
        np.testing.assert_allclose(np.load(tmp_path / f"o{k}" / "state_f.npy"), want_state, atol=1e-4)
        lengths.add(n)
    assert len(lengths) >= 4 and ROWS in lengths, lengths   # the buffer's end and early stops
    # rows of a CSV: as JSON lines each at its own length; as CSV columns they cannot line up: refused
    rows = sorted(picked.items())[:3]
    (tmp_path / "rows.csv").write_text("".join(",".join(f"{v:.9g}" for v in x.ravel()) + "\n" for _, x in rows))
    jl = run_edgepack("run", str(artifact), "--input", tmp_path / "rows.csv", "--output", tmp_path / "out.jsonl")
    assert jl.returncode == 0, jl.stderr
    lines = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [ln["outputs"]["probs"]["shape"] for ln in lines] == [[1, n, WIDTH] for n, _ in rows]
    csv = run_edgepack("run", str(artifact), "--input", tmp_path / "rows.csv", "--output", tmp_path / "out.csv")
    assert csv.returncode == 2 and "depends on the input" in csv.stderr, (csv.returncode, csv.stderr)
    assert not (tmp_path / "out.csv").exists()
    st = run_artifact(artifact, ["selftest"])
    assert st.returncode == 0 and st.stdout.startswith("PASS"), st.stdout + st.stderr
    # the server answers at the decoded length too, request after request (the cut is undone before each run)
    server = Server(artifact)
    try:
        for n, x in sorted(picked.items())[:3]:
            status, ans = server.json("POST", "/predict", json.dumps({"x": x.tolist()}).encode(), "application/json")
            assert status == 200, ans
            assert ans["outputs"]["probs"]["shape"] == [1, n, WIDTH], ans["outputs"]["probs"]["shape"]
    finally:
        server.close()


def test_a_step_outside_the_compiled_lengths_is_an_error_not_another_answer(tmp_path):
    path = tmp_path / "counted.onnx"
    counted_model(path)
    artifact = _build(tmp_path, path)
    reference = _session(path)
    x = np.full((1, WIDTH), 0.3, np.float32)
    for x0, fits in ((3.2, True), (11.5, True), (20.0, False)):  # steps: 4, 12, 21 (the table has 12 rows)
        x[0, 0] = x0
        np.save(tmp_path / "x.npy", x)
        out = tmp_path / f"o{x0}"
        run = run_edgepack("run", str(artifact), "--input", f"x={tmp_path / 'x.npy'}", "--output", out)
        if fits:
            assert run.returncode == 0, run.stderr
            np.testing.assert_allclose(np.load(out / "state_f.npy"), reference.run(None, {"x": x})[0], atol=1e-4)
        else:
            assert run.returncode == 4, (run.returncode, run.stderr)
            assert "loop step 12" in run.stderr and "fixed length" in run.stderr, run.stderr
            assert not (out / "state_f.npy").exists()


def test_a_graph_that_is_one_loop_builds(tmp_path):
    """Nothing before or after the Loop, an If in its body (computed as Where there)."""
    path = tmp_path / "doubling.onnx"
    doubling_model(path)
    artifact = _build(tmp_path, path)
    reference = _session(path)
    for k, x in enumerate(([1, 2, 3, 4], [0.01, 0, 0, 0], [-1, -2, 0.5, 0], [30, 30, 30, 30])):
        x = np.asarray(x, np.float32)
        np.save(tmp_path / f"x{k}.npy", x)
        run = run_edgepack("run", str(artifact), "--input", f"x={tmp_path / f'x{k}.npy'}", "--output", tmp_path / f"o{k}")
        assert run.returncode == 0, run.stderr
        np.testing.assert_allclose(np.load(tmp_path / f"o{k}" / "y.npy"), reference.run(None, {"x": x})[0], rtol=1e-6)
