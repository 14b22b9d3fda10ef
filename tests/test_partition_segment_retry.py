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


def seq_first_blocks(path: Path, blocks: int = 3, t: int = 6, c: int = 16, heads: int = 2,
                     copied_dim: bool = False) -> Path:
    """``blocks`` times what PyTorch's sequence-first nn.Transformer exports for one layer on [T, 1, C]
    (the g2p_id decoder's form): a fused QKV Gemm on the flattened sequence, heads, softmax, a
    residual, a LayerNorm spelled out, a second Gemm, then a CumSum (TVM only) before the next block.
    pnnx takes the sequence axis for the batch, and ncnn cannot compute the block as it is.
    ``copied_dim``: the last Reshape spells T as 0 (copy the input's dim), which the unit-batch
    lift (unit_batch.py) does not rewrite: the block then stays beyond NCNN."""
    rng = np.random.default_rng(3)
    inits, nodes = [], []

    def const(name, a):
        inits.append(numpy_helper.from_array(np.asarray(a), name))
        return name

    const("flat", np.array([-1, c], np.int64))
    const("seq", np.array([t, 1, c], np.int64))
    const("seq_out", np.array([0 if copied_dim else t, 1, c], np.int64))
    const("seq3", np.array([t, 1, 3 * c], np.int64))
    const("heads", np.array([t, heads, c // heads], np.int64))
    const("last", np.array([-1], np.int64))
    const("ax", np.array(2, np.int64))
    const("two", np.array(2.0, np.float32))
    const("eps", np.array(1e-5, np.float32))
    for j in range(4):
        const(f"at{j}", np.array([j * c], np.int64))
    cur = "x"
    for k in range(blocks):
        p = f"b{k}_"
        w = lambda name, *shape: const(p + name, (rng.standard_normal(shape) * 0.3).astype(np.float32))  # noqa: E731
        nodes += [helper.make_node("Add", [cur, w("pos", t, 1, c)], [p + "a"]),
                  helper.make_node("Reshape", [p + "a", "flat"], [p + "f"]),
                  helper.make_node("Gemm", [p + "f", w("wqkv", c, 3 * c), w("bqkv", 3 * c)], [p + "m"]),
                  helper.make_node("Reshape", [p + "m", "seq3"], [p + "m3"])]
        for j, part in enumerate("qkv"):
            nodes += [helper.make_node("Slice", [p + "m3", f"at{j}", f"at{j + 1}", "last"], [p + part + "s"]),
                      helper.make_node("Reshape", [p + part + "s", "heads"], [p + part + "h"]),
                      helper.make_node("Transpose", [p + part + "h"], [p + part], perm=[1, 0, 2])]
        nodes += [helper.make_node("Transpose", [p + "kh"], [p + "kt"], perm=[1, 2, 0]),
                  helper.make_node("MatMul", [p + "q", p + "kt"], [p + "s"]),
                  helper.make_node("Softmax", [p + "s"], [p + "pr"], axis=-1),
                  helper.make_node("MatMul", [p + "pr", p + "v"], [p + "o"]),
                  helper.make_node("Transpose", [p + "o"], [p + "ot"], perm=[1, 0, 2]),
                  helper.make_node("Reshape", [p + "ot", "seq"], [p + "r0"]),
                  helper.make_node("Add", [p + "a", p + "r0"], [p + "res"]),
                  helper.make_node("ReduceMean", [p + "res"], [p + "mu"], axes=[-1]),
                  helper.make_node("Sub", [p + "res", p + "mu"], [p + "d"]),
                  helper.make_node("Pow", [p + "d", "two"], [p + "d2"]),
                  helper.make_node("ReduceMean", [p + "d2"], [p + "var"], axes=[-1]),
                  helper.make_node("Add", [p + "var", "eps"], [p + "ve"]),
                  helper.make_node("Sqrt", [p + "ve"], [p + "sd"]),
                  helper.make_node("Div", [p + "d", p + "sd"], [p + "n"]),
                  helper.make_node("Reshape", [p + "n", "flat"], [p + "nf"]),
                  helper.make_node("Gemm", [p + "nf", w("w2", c, c), w("b2", c)], [p + "g"]),
                  helper.make_node("Reshape", [p + "g", "seq_out"], [p + "r"]),
                  helper.make_node("CumSum", [p + "r", "ax"], [p + "c"])]
        cur = p + "c"
    graph = helper.make_graph(nodes, "seq_first_blocks", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [t, 1, c])],
                              [helper.make_tensor_value_info(cur, TensorProto.FLOAT, [t, 1, c])], inits)
    return saved_graph(graph, path, opset=13)


def test_every_failing_ncnn_segment_moves_to_tvm_in_one_replan(tmp_path):
    """Three NCNN segments that ncnn cannot compute, between TVM-only CumSums: the split builds
    every NCNN segment before any TVM one and moves the three at once, so the plan is made twice,
    not once per failure (g2p_id's unrolled decoder: 18 failing steps, each attempt recompiling the
    growing TVM part, 16.6 min). The build lands on whole-graph TVM, verified, and runs right."""
    src = seq_first_blocks(tmp_path / "seq_first.onnx", copied_dim=True)
    out = tmp_path / "dist"
    p = run_edgepack("build", src, "--target", "x86_64", "--select", "first", "--verify-on", "native", "--out", out,
                     "--json", "--jobs", "1", timeout=1500)
    res = json.loads(p.stdout)["results"][0]
    assert res["ok"], (res, p.stderr[-2000:])
    log = p.stderr
    assert log.count("partitioned plan:") == 1, log[-4000:]
    assert [f"segment {k} (ncnn) failed" in log for k in (0, 2, 4)] == [True] * 3, log[-4000:]
    # no TVM segment was compiled for the plan that failed: its NCNN segments went first
    assert "segment 1: tvm:" not in log and "segment 3: tvm:" not in log, log[-4000:]
    manifest = json.loads(Path(res["file"] + ".json").read_text())
    assert manifest["backend"]["name"] == "tvm", manifest["backend"]
    _runs_like_onnxruntime(src, res["file"], tmp_path, 1e-4)


def test_sequence_first_blocks_run_on_ncnn_with_the_unit_batch_axis_in_front(tmp_path):
    """The same blocks with every Reshape target spelled out: pnnx's conversion cannot be computed as
    it is, and is computed after the lift puts a unit axis in front of every tensor; the three
    blocks' MatMuls, Softmax and LayerNorm run on NCNN, the CumSums on TVM, and the artifact
    matches onnxruntime on fresh input."""
    src = seq_first_blocks(tmp_path / "seq_first.onnx")
    out = tmp_path / "dist"
    p = run_edgepack("build", src, "--target", "x86_64", "--select", "first", "--verify-on", "native", "--out", out,
                     "--json", "--jobs", "1", timeout=1500)
    res = json.loads(p.stdout)["results"][0]
    assert res["ok"], (res, p.stderr[-2000:])
    manifest = json.loads(Path(res["file"] + ".json").read_text())
    assert manifest["backend"]["name"] == "ncnn+tvm", manifest["backend"]
    segs = [(s["backend"], s["ops"]) for s in manifest["backend"]["segments"]]
    assert [b for b, _ in segs] == ["ncnn", "tvm"] * 3, segs
    # each NCNN segment was converted lifted (recorded with the conversion, so also when it is cached)
    lifted = [s["manifest"].get("onnx_rewrites") for s in manifest["backend"]["segments"] if s["backend"] == "ncnn"]
    assert all("unit_batch x1" in r for r in lifted), lifted
    assert all({"MatMul", "Softmax", "Gemm"} <= set(ops) for b, ops in segs if b == "ncnn"), segs
    _runs_like_onnxruntime(src, res["file"], tmp_path, 2e-2)   # fp16 storage on NCNN


def _runs_like_onnxruntime(src: Path, artifact: str, tmp_path: Path, rel: float) -> None:
    x = np.random.default_rng(8).standard_normal((6, 1, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    r = subprocess.run([artifact, "run", "--input", f"x={tmp_path / 'x.npy'}", "--output", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = np.load(tmp_path / "o" / "b2_c.npy")
    want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert np.abs(got - want).max() <= rel * np.abs(want).max() + 1e-5, np.abs(got - want).max()
