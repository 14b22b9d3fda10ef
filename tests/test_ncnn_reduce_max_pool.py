"""A log-mel tail that clamps to the loudest value less 8 (Whisper's, via onnx-asr), with an int64
length input no node reads and an int64 constant length output, builds as one NCNN segment: the
ReduceMax runs as ncnn's Pooling (reduce_max.py), the segment runtime skips the unread input and fills
the constant output. Before, `auto` cut the graph in two and ran the tail on TVM. Checked against
onnxruntime natively and on qemu CPU models with and without AVX2."""
from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from clirun import run_artifact_on, run_edgepack
from models import saved_graph

MELS, FRAMES = 80, 300


def log_mel_tail(path):
    """mel [1, 80, 300] -> Clip -> Log10 -> ReduceMax (every axis, opset 18) -> max(x, top - 8) -> (x + 4) / 4;
    lens [1] int64 is not read; lens_out is the constant [300]."""
    mk = helper.make_node
    nodes = [mk("Clip", ["mel", "floor"], ["c"]), mk("Log", ["c"], ["ln"]), mk("Div", ["ln", "ln10"], ["lg"]),
             mk("ReduceMax", ["lg"], ["top"]), mk("Sub", ["top", "eight"], ["low"]), mk("Max", ["lg", "low"], ["m"]),
             mk("Add", ["m", "four"], ["a"]), mk("Div", ["a", "four"], ["y"])]
    consts = {"floor": np.float32(1e-10), "ln10": np.float32(np.log(10)), "eight": np.float32(8),
              "four": np.float32(4), "lens_out": np.array([FRAMES], np.int64)}
    graph = helper.make_graph(
        nodes, "tail", [helper.make_tensor_value_info("mel", TensorProto.FLOAT, [1, MELS, FRAMES]),
                        helper.make_tensor_value_info("lens", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, MELS, FRAMES]),
         helper.make_tensor_value_info("lens_out", TensorProto.INT64, [1])],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()])
    return saved_graph(graph, path, opset=18)


def test_log_mel_clamp_builds_as_one_ncnn_segment_and_matches_onnxruntime(tmp_path):
    model = log_mel_tail(tmp_path / "tail.onnx")
    proc = run_edgepack("build", model, "--target", "x86_64", "--out", tmp_path / "out", "--json")
    report = json.loads(proc.stdout) if proc.stdout.strip() else {}
    assert proc.returncode == 0 and report.get("ok"), proc.stderr[-3000:]
    backend = json.loads((tmp_path / "out" / "tail-x86_64.json").read_text())["backend"]
    assert [s["backend"] for s in backend["segments"]] == ["ncnn"], backend["segments"]
    assert "Pooling1D" in backend["segments"][0]["manifest"]["layers"]  # the GlobalMaxPool over [1, rows, n]
    # a spectrum whose quiet bins sit far below the loudest: the clamp is live
    rng = np.random.default_rng(6)
    mel = (10.0 ** rng.uniform(-14, 3, (1, MELS, FRAMES))).astype(np.float32)
    lens = np.array([FRAMES], np.int64)
    np.save(tmp_path / "mel.npy", mel)
    np.save(tmp_path / "lens.npy", lens)
    want_y, want_lens = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(
        None, {"mel": mel, "lens": lens})
    assert float((want_y == want_y.min()).mean()) > 0.1  # many values clamped
    for cpu in ("native", "Haswell-noTSX", "Nehalem"):
        got, _ = run_artifact_on(tmp_path / "out" / "tail-x86_64", cpu,
                                 {"mel": tmp_path / "mel.npy", "lens": tmp_path / "lens.npy"},
                                 tmp_path / cpu, ("y", "lens_out"))
        np.testing.assert_allclose(got["y"], want_y, rtol=0, atol=1e-5, err_msg=cpu)
        np.testing.assert_array_equal(got["lens_out"], want_lens, err_msg=cpu)
