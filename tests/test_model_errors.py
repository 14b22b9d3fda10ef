"""Broken, hostile or unusual models: one `error:` line, a distinct exit code, no traceback (unless
--debug), and the `edgepack inspect` hint only where op support is the cause.

Most errors come before compilation, so these tests build nothing; one real build checks that a
PaddlePaddle-style output dim of -1 now builds."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from conftest import run_edgepack
from edgepack.model import TensorSpec
from edgepack.reference import random_inputs

INSPECT_HINT = "edgepack inspect"


def _save(path: Path, nodes, inputs, outputs, inits=(), opsets=(("", 17),)) -> Path:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def _vi(name, shape, t=T.FLOAT):
    return helper.make_tensor_value_info(name, t, shape)


def _relu(tmp_path, name="m.onnx", **kw) -> Path:
    return _save(tmp_path / name, [helper.make_node("Relu", ["x"], ["y"], name="relu")], [_vi("x", [1, 4])],
                 [_vi("y", [1, 4])], **kw)


def _build(model: Path, tmp_path: Path, *extra: str, timeout: float = 120):
    return run_edgepack(*extra, "build", str(model), "--target", "x86_64", "--out", str(tmp_path / "dist"),
                        timeout=timeout)


def _one_error(proc, code: int, *needles: str, inspect_hint: bool = False):
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    assert "[E:onnxruntime" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    for n in needles:
        assert n in proc.stderr, proc.stderr
    assert (INSPECT_HINT in proc.stderr) == inspect_hint, proc.stderr


def test_op_from_an_unregistered_domain(tmp_path):
    m = _save(tmp_path / "custom.onnx", [helper.make_node("Frobnicate", ["x"], ["y"], domain="com.example")],
              [_vi("x", [1, 4])], [_vi("y", [1, 4])], opsets=(("", 17), ("com.example", 1)))
    _one_error(_build(m, tmp_path), 5, "Frobnicate", "com.example", inspect_hint=True)


def test_opset_99(tmp_path):
    _one_error(_build(_relu(tmp_path, opsets=(("", 99),)), tmp_path), 4, "opset 99")


def test_graph_without_outputs(tmp_path):
    m = _save(tmp_path / "noout.onnx", [helper.make_node("Relu", ["x"], ["y"])], [_vi("x", [1, 4])], [])
    _one_error(_build(m, tmp_path), 4, "no outputs")


def test_declared_huge_input_is_refused_before_allocating(tmp_path):
    m = _save(tmp_path / "huge.onnx", [helper.make_node("Relu", ["x"], ["y"])], [_vi("x", [1, 3, 50000, 50000])],
              [_vi("y", [1, 3, 50000, 50000])])
    t0 = time.monotonic()
    proc = _build(m, tmp_path)
    _one_error(proc, 4, "1x3x50000x50000", "GiB", "--input-shape")
    assert time.monotonic() - t0 < 60


def test_file_over_2_gib(tmp_path):
    big = tmp_path / "big.onnx"
    with open(big, "wb") as f:  # sparse: no disk, and edgepack must refuse it without reading it
        f.truncate((2 << 30) + 4096)
    _one_error(_build(big, tmp_path), 4, "2 GiB", "external data")


def test_non_utf8_tensor_and_node_names(tmp_path):
    good = _relu(tmp_path, "good.onnx").read_bytes()
    node = tmp_path / "node.onnx"
    node.write_bytes(good.replace(b"relu", b"r\xffl\xfe"))
    _one_error(_build(node, tmp_path), 4, "not valid UTF-8", "node")
    X = _vi("xx", [1, 4])
    tensor = _save(tmp_path / "t.onnx", [helper.make_node("Relu", ["xx"], ["yy"])], [X], [_vi("yy", [1, 4])])
    tensor.write_bytes(tensor.read_bytes().replace(b"yy", b"y\xff"))
    _one_error(_build(tensor, tmp_path), 4, "not valid UTF-8", "tensor")


def test_non_utf8_file_name(tmp_path):
    src = _relu(tmp_path, "plain.onnx")
    odd = os.fsencode(str(tmp_path)) + b"/m\xffx.onnx"
    with open(odd, "wb") as f:
        f.write(src.read_bytes())
    _one_error(_build(Path(os.fsdecode(odd)), tmp_path), 4, "not valid UTF-8")


def test_onnxruntime_failing_on_the_random_input_is_caught(tmp_path):
    # a Reshape whose target shape is an input: seeded random ints are no valid shape for 6 elements
    m = _save(tmp_path / "reshape.onnx", [helper.make_node("Reshape", ["x", "s"], ["y"])],
              [_vi("x", [2, 3]), _vi("s", [3], T.INT64)], [_vi("y", ["a", "b", "c"])])
    proc = _build(m, tmp_path)
    _one_error(proc, 4, "onnxruntime", "fails on a", "s int64[3]", "Reshape")
    assert "[E:onnxruntime" not in proc.stderr      # onnxruntime's own log line stays out


def test_debug_shows_the_traceback(tmp_path):
    m = _save(tmp_path / "noout.onnx", [helper.make_node("Relu", ["x"], ["y"])], [_vi("x", [1, 4])], [])
    proc = _build(m, tmp_path, "--debug")
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "no outputs" in proc.stderr


def test_scalar_input_is_an_array():
    # Gemm's scalar bias as a 0-d input: numpy hands back a scalar, onnxruntime wants an array
    x = random_inputs((TensorSpec("c", (), "float32"),), 1)["c"]
    assert isinstance(x, np.ndarray) and x.shape == () and x.dtype == np.float32


def _minus_one_model(tmp_path) -> Path:
    """PaddlePaddle writes unknown dims as -1 (not symbolic): a classifier [-1,3,8,8] -> [-1,2]."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32) * 0.1, "w")
    shape = numpy_helper.from_array(np.array([-1, 2], np.int64), "shape")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Reshape", ["c", "shape"], ["y"])]
    return _save(tmp_path / "paddle_cls.onnx", nodes, [_vi("x", [-1, 3, 8, 8])], [_vi("y", [-1, 2])], [w, shape])


def test_output_dim_minus_one_gets_the_real_shape(tmp_path):
    from edgepack.pipeline import BuildOptions, prepare
    prep = prepare(_minus_one_model(tmp_path), BuildOptions())
    assert prep.model.inputs[0].shape == (1, 3, 8, 8)
    assert prep.model.outputs[0].shape == (1, 2)


def test_output_dim_minus_one_builds_and_verifies(tmp_path):
    proc = run_edgepack("build", str(_minus_one_model(tmp_path)), "--target", "x86_64", "--out",
                        str(tmp_path / "dist"), "--json", timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)["results"][0]
    assert res["ok"] and res["rel_err"] is not None and res["rel_err"] < 5e-3
    manifest = json.loads(Path(res["file"] + ".json").read_text())
    assert manifest["outputs"] == [{"name": "y", "shape": [1, 2], "dtype": "float32"}]
