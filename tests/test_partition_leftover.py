"""Split on pnnx leftovers (issue 9): NCNN's op table takes every op of the graph, yet pnnx leaves a
layer ncnn cannot load (`Tensor.to`, from a Cast to int32 that the ONNX rewrites do not remove). The
split backend finds the node behind it by converting candidates alone (real pnnx), cuts it out to
TVM, and the one artifact (x86_64, real zig) runs Conv on NCNN and the casts on TVM."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from edgepack.errors import UnsupportedOpError
from edgepack.model import fix_input_shapes, load_model, simplify


def conv_cast_int_conv(path: Path) -> Path:
    """Conv -> x4 -> Cast to int32 -> Cast to float -> Conv (a quantiser-like round trip)."""
    rng = np.random.default_rng(3)

    def conv(name, x, y, cin, cout):
        w = numpy_helper.from_array((rng.standard_normal((cout, cin, 3, 3)) * 0.3).astype(np.float32), f"{name}_w")
        b = numpy_helper.from_array((rng.standard_normal(cout) * 0.1).astype(np.float32), f"{name}_b")
        return helper.make_node("Conv", [x, w.name, b.name], [y], name=name, pads=[1, 1, 1, 1]), [w, b]
    c1, i1 = conv("conv1", "x", "c1", 3, 8)
    c2, i2 = conv("conv2", "f", "y", 8, 4)
    nodes = [c1, helper.make_node("Mul", ["c1", "s"], ["m"], name="mul"),
             helper.make_node("Cast", ["m"], ["q"], name="to_int", to=TensorProto.INT32),
             helper.make_node("Cast", ["q"], ["f"], name="to_float", to=TensorProto.FLOAT), c2]
    g = helper.make_graph(nodes, "leftover", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, 16])],
                          i1 + i2 + [numpy_helper.from_array(np.array(4.0, np.float32), "s")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    onnx.save(m, str(path))
    return path


def test_the_node_behind_a_leftover_is_found(tmp_path):
    from edgepack.backends.ncnn.convert import convert
    from edgepack.partition_probe import offending_nodes, recorded
    model = simplify(fix_input_shapes(load_model(conv_cast_int_conv(tmp_path / "m.onnx")), {}))
    try:
        convert(model, "fp32", log=lambda m: None)
        raise AssertionError("pnnx converted the int32 Cast; this test needs a leftover")
    except UnsupportedOpError as exc:
        assert "Tensor.to" in exc.message
    assert recorded(model) == ["Tensor.to"]
    found = offending_nodes(model)
    assert found and set(found.values()) == {"tvm"}
    ops = {n.op_type for n in model.proto.graph.node if n.name in found}
    assert ops == {"Cast"}, found


def test_leftover_split_artifact_runs_on_fresh_inputs(tmp_path):
    src = conv_cast_int_conv(tmp_path / "castint.onnx")
    out = tmp_path / "dist"
    # --select first: the split is what is tested; timed against whole TVM (now with default schedules)
    # this tiny graph can go either way by noise
    p = subprocess.run([sys.executable, "-m", "edgepack", "build", str(src), "--target", "x86_64", "--fp32",
                        "--select", "first", "--out", str(out), "--json", "--jobs", "1"],
                       capture_output=True, text=True, timeout=1500)
    res = json.loads(p.stdout)["results"][0]
    assert res["ok"], (res, p.stderr[-2000:])
    manifest = json.loads(Path(res["file"] + ".json").read_text())
    assert manifest["backend"]["name"] == "ncnn+tvm", manifest["backend"]
    segs = [(s["backend"], s["ops"]) for s in manifest["backend"]["segments"]]
    assert ("tvm", ["Cast"]) in segs and ("ncnn", ["Conv"]) in segs, segs
    # fresh inputs, not the verification's: the artifact against onnxruntime (away from the
    # int truncation's steps, where fp32 rounding may flip an integer)
    x = np.random.default_rng(42).standard_normal((1, 3, 16, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    r = subprocess.run([res["file"], "run", "--input", f"x={tmp_path / 'x.npy'}", "--output", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = np.load(tmp_path / "o" / "y.npy")
    want = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    err = np.abs(got - want).max()
    assert err <= 5e-3 * np.abs(want).max(), err
