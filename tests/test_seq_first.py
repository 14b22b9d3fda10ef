"""A CRNN with a sequence-first tail stays on NCNN (edgepack/backends/ncnn/seq_first.py).

The model is a hand-made onnx.helper graph (no torch) shaped like a captcha CRNN: a convolution
over a 1x8x(T*2) image, the width as time (Transpose to [T, 1, C]), a bidirectional time-major
LSTM, its [T, 1, 2H] output flattened to [T, 2H], divided by its own maximum (a per-tensor scale,
as a dynamic quantisation computes it: Reshape to [1, 1, 1, N] -> GlobalMaxPool), a classifier
MatMul and a Reshape back to [T, 1, K]. pnnx takes the scale's batch axis (0) for the T axis
of everything it touches, and without the rewrite ncnn's last Reshape gives (1, K): the build
fell back to TVM. Built for x86_64 with the default backend, NCNN must be kept, and `run` on a
fresh input must agree with onnxruntime.
"""
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

T, C, H, K = 12, 16, 12, 10


def _model(path: Path, lstm: bool, seed: int) -> Path:
    """A convolution over a 1x8x(T*2) image, the width as time ([T, 1, C, 1]), then with `lstm` a
    bidirectional time-major LSTM flattened to rows [T, 2H], else the features as rows [T, C]; the
    rows divided by their own maximum (Reshape [1, 1, 1, N] -> GlobalMaxPool), a classifier and a
    Reshape back to [T, 1, K]."""
    rng = np.random.default_rng(seed)

    def init(name, arr):
        return numpy_helper.from_array(np.asarray(arr), name)

    width = 2 * H if lstm else C
    inits = [init("convw", (rng.standard_normal((C, 1, 8, 2)) * 0.3).astype(np.float32)),
             init("convb", (rng.standard_normal(C) * 0.1).astype(np.float32)),
             init("flat", np.array([T, width], np.int64)), init("all4", np.array([1, 1, 1, T * width], np.int64)),
             init("one", np.array([1], np.int64)), init("eps", np.array(1e-2, np.float32)),
             init("Wc", rng.standard_normal((width, K)).astype(np.float32)),
             init("bc", (rng.standard_normal(K) * 0.1).astype(np.float32)),
             init("back", np.array([T, 1, K], np.int64))]
    nodes = [helper.make_node("Conv", ["image", "convw", "convb"], ["feat"], kernel_shape=[8, 2], strides=[1, 2]),
             helper.make_node("Relu", ["feat"], ["featr"]),                                # [1, C, 1, T]
             helper.make_node("Transpose", ["featr"], ["tmaj"], perm=[3, 0, 1, 2])]        # [T, 1, C, 1]
    if lstm:
        inits += [init("seqshape", np.array([T, 1, C], np.int64)),
                  init("W", (rng.standard_normal((2, 4 * H, C)) * 0.3).astype(np.float32)),
                  init("R", (rng.standard_normal((2, 4 * H, H)) * 0.3).astype(np.float32)),
                  init("B", (rng.standard_normal((2, 8 * H)) * 0.1).astype(np.float32))]
        nodes += [helper.make_node("Reshape", ["tmaj", "seqshape"], ["seq"]),              # [T, 1, C]
                  helper.make_node("LSTM", ["seq", "W", "R", "B"], ["y"], hidden_size=H, direction="bidirectional"),
                  helper.make_node("Transpose", ["y"], ["yt"], perm=[0, 2, 1, 3]),         # [T, 1, 2, H]
                  helper.make_node("Reshape", ["yt", "flat"], ["rows"])]                   # [T, 2H]
    else:
        nodes.append(helper.make_node("Reshape", ["tmaj", "flat"], ["rows"]))              # [T, C]
    nodes += [helper.make_node("Reshape", ["rows", "all4"], ["y4"]),
              helper.make_node("GlobalMaxPool", ["y4"], ["m4"]),
              helper.make_node("Reshape", ["m4", "one"], ["m"]),
              helper.make_node("Add", ["m", "eps"], ["scale"]),
              helper.make_node("Div", ["rows", "scale"], ["norm"]),
              helper.make_node("MatMul", ["norm", "Wc"], ["logits"]),
              helper.make_node("Add", ["logits", "bc"], ["biased"]),
              helper.make_node("Reshape", ["biased", "back"], ["out"])]                    # [T, 1, K]
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, path.stem, [helper.make_tensor_value_info("image", f, [1, 1, 8, 2 * T])],
                              [helper.make_tensor_value_info("out", f, [T, 1, K])], inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    onnx.save(m, str(path))
    return path


def seq_first_crnn(path: Path) -> Path:
    return _model(path, lstm=True, seed=23)


def conv_scaled_tail(path: Path) -> Path:
    """The same range-scaled tail without an LSTM: pnnx converts it to layers ncnn loads, and only
    the check against onnxruntime shows the T axis taken for the batch (ncnn gives (1, K))."""
    return _model(path, lstm=False, seed=5)


def _build_keeps_ncnn_and_agrees(model: Path, tmp_path: Path) -> dict:
    """Build for x86_64 with the default backend; NCNN kept with the tail lifted, `run` on a fresh
    input agrees with onnxruntime. The manifest."""
    dist = tmp_path / "dist"
    t0 = time.monotonic()
    proc = run_edgepack("build", str(model), "--target", "x86_64", "--out", str(dist), "--json", timeout=600)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"no JSON report (exit {proc.returncode}): {proc.stderr[-3000:]}")
    assert proc.returncode == 0 and report["ok"], proc.stderr[-4000:]
    art = dist / f"{model.stem}-x86_64"
    manifest = json.loads(art.with_name(art.name + ".json").read_text())
    assert manifest["backend"]["name"] == "ncnn", manifest.get("selection")
    assert "lift_sequence_tail x1" in manifest["backend"]["onnx_rewrites"], manifest["backend"]["onnx_rewrites"]

    # `run` on a fresh input (not the build's golden or verification ones) against onnxruntime
    x = np.random.default_rng(99).uniform(0, 1, (1, 1, 8, 2 * T)).astype(np.float32)
    np.save(tmp_path / "image.npy", x)
    ran = run_artifact(art, ["run", "--threads", "1", "--input", f"image={tmp_path / 'image.npy'}",
                             "--output", str(tmp_path / "out")])
    assert ran.returncode == 0, ran.stderr
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    ref = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"]).run(None, {"image": x})[0]
    got = np.load(json.loads(ran.stdout)["outputs"]["out"]["file"])
    assert got.shape == ref.shape == (T, 1, K)
    scale = float(np.abs(ref).max())
    assert scale > 0.5
    tol = manifest["tolerance"]
    err = float(np.abs(got - ref).max())
    assert err <= tol["atol"] + tol["rtol"] * scale, (err, scale)
    print(f"{model.stem}: ncnn {manifest['precision']}, built and checked in {time.monotonic() - t0:.0f} s, "
          f"max error {err:.2e} of scale {scale:.2f}")
    return manifest


def test_sequence_first_crnn_stays_on_ncnn_and_agrees_with_onnxruntime(tmp_path):
    _build_keeps_ncnn_and_agrees(seq_first_crnn(tmp_path / "seqcrnn.onnx"), tmp_path)


def test_a_tail_that_converts_but_disagrees_is_retried_with_the_rewrites(tmp_path):
    # pnnx's first result loads; only the check against onnxruntime (shape (1, K)) sends it back
    # through rewrite_for_ncnn (convert._convert_in), and the lifted tail must verify
    _build_keeps_ncnn_and_agrees(conv_scaled_tail(tmp_path / "convtail.onnx"), tmp_path)
