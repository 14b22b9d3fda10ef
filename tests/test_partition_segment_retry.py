"""A failed NCNN segment gives TVM only the node pnnx could not convert (edgepack/partition_build.py).

onnx-asr's kaldi front end: a length mask TVM runs, then pre-emphasis whose shift is an edge Pad
with negative pads (pnnx leaves it as F.pad), then the power spectrum NCNN runs well. Before, the
whole NCNN segment moved to TVM, nothing was left on NCNN, and the build fell back to whole-graph
TVM. Now the probe finds the Pad, only it moves, and the convolution stays on NCNN (real pnnx,
real zig, the artifact run against onnxruntime on fresh inputs)."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import onnxruntime as ort
from clirun import run_edgepack
from models import saved_graph
from onnx import TensorProto, helper, numpy_helper

N = 400


def masked_preemphasis_conv(path: Path) -> Path:
    rng = np.random.default_rng(11)
    inits = [numpy_helper.from_array(np.arange(N, dtype=np.int64).reshape(1, N), "idx"),
             numpy_helper.from_array(np.array([1], np.int64), "axis"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
             numpy_helper.from_array(np.array([0, 1, 0, -1], np.int64), "shift"),
             numpy_helper.from_array(np.array(0.97, np.float32), "coef"),
             numpy_helper.from_array((rng.standard_normal((8, 1, 32)) * 0.2).astype(np.float32), "w")]
    nodes = [helper.make_node("Unsqueeze", ["lens", "axis"], ["l2"], name="lens_col"),
             helper.make_node("Less", ["idx", "l2"], ["mask"], name="mask"),
             helper.make_node("Where", ["mask", "x", "zero"], ["xm"], name="masked"),
             helper.make_node("Pad", ["xm", "shift"], ["prev"], mode="edge", name="shift_right"),
             helper.make_node("Mul", ["prev", "coef"], ["scaled"], name="scale"),
             helper.make_node("Sub", ["xm", "scaled"], ["emph"], name="preemphasis"),
             helper.make_node("Unsqueeze", ["emph", "axis"], ["u"], name="channel"),
             helper.make_node("Conv", ["u", "w"], ["y"], strides=[16], name="frames")]
    return saved_graph(helper.make_graph(nodes, "kaldi_small",
                                         [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, N]),
                                          helper.make_tensor_value_info("lens", TensorProto.INT64, [1])],
                                         [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 24])], inits),
                       path)


def test_only_the_shifting_pad_moves_to_tvm(tmp_path):
    src = masked_preemphasis_conv(tmp_path / "kaldi_small.onnx")
    out = tmp_path / "dist"
    p = run_edgepack("build", src, "--target", "x86_64", "--fp32", "--select", "first", "--out", out, "--json",
                     "--jobs", "1", timeout=1500)
    res = json.loads(p.stdout)["results"][0]
    assert res["ok"], (res, p.stderr[-2000:])
    assert "moving 1 of its" in p.stderr, p.stderr[-3000:]
    manifest = json.loads(Path(res["file"] + ".json").read_text())
    assert manifest["backend"]["name"] == "ncnn+tvm", manifest["backend"]
    segs = [(s["backend"], s["ops"]) for s in manifest["backend"]["segments"]]
    on_ncnn = {op for b, ops in segs if b == "ncnn" for op in ops}
    on_tvm = {op for b, ops in segs if b == "tvm" for op in ops}
    assert "Conv" in on_ncnn and "Pad" not in on_ncnn and "Pad" in on_tvm, segs
    x = np.random.default_rng(5).standard_normal((1, N)).astype(np.float32)
    lens = np.array([301], np.int64)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "lens.npy", lens)
    r = subprocess.run([res["file"], "run", "--input", f"x={tmp_path / 'x.npy'}", "--input", f"lens={tmp_path / 'lens.npy'}",
                        "--output", str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = np.load(tmp_path / "o" / "y.npy")
    want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, {"x": x, "lens": lens})[0]
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max() + 1e-5
