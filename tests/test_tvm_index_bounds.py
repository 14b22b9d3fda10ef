"""Hostile ids against real TVM artifacts (x86_64, native). TVM's take reads where an index says: before
index_bounds.py a token id of 10**9 segfaulted the artifact and id 40 in a 40-row table read the memory
after it into the answer (exit 0). Now an input that indexes a table is refused with a clear error
(exit 3), as onnxruntime refuses it, and an index computed from the input stays inside the table."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from conftest import run_edgepack
from edgepack.runner import run_artifact
from test_partition_tokens import SEQ, VOCAB, token_encoder

TABLE = np.random.default_rng(4).standard_normal((VOCAB, 8)).astype(np.float32)


def shifted_lookup(path: Path) -> Path:
    """ids[1, SEQ] int64 -> Add 1 -> Gather(table) -> [1, SEQ, 8]: the index is computed."""
    g = helper.make_graph([helper.make_node("Add", ["ids", "one"], ["next"]),
                           helper.make_node("Gather", ["table", "next"], ["y"])], "shifted",
                          [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, SEQ])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, SEQ, 8])],
                          [numpy_helper.from_array(TABLE, "table"), numpy_helper.from_array(np.array(1, np.int64), "one")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def _build_tvm(model: Path, dist: Path) -> tuple[Path, dict]:
    proc = run_edgepack("build", str(model), "--target", "x86_64", "--backend", "tvm", "--out", str(dist))
    assert proc.returncode == 0, proc.stderr[-3000:]
    art = dist / f"{model.stem}-x86_64"
    return art, json.loads(art.with_name(art.name + ".json").read_text())["backend"]


def _run(art: Path, ids: np.ndarray, tmp_path: Path):
    np.save(tmp_path / "ids.npy", ids.astype(np.int64))
    run = run_artifact(art, ["run", "--threads", "1", "--input", f"ids={tmp_path / 'ids.npy'}",
                             "--output", str(tmp_path / "out")])
    out = np.load(json.loads(run.stdout)["outputs"]["y"]["file"]) if run.returncode == 0 else None
    return run, out


def test_ids_outside_the_table_are_refused_by_a_tvm_artifact(tmp_path):
    model = token_encoder(tmp_path / "tokens.onnx")
    art, backend = _build_tvm(model, tmp_path / "dist")
    assert backend["name"] == "tvm" and backend["inputs_id_checked"] == {"0": VOCAB}, backend
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    edges = np.array([[0, VOCAB - 1, -1, -VOCAB] + list(range(-6, 6))], np.int64)
    run, got = _run(art, edges, tmp_path)
    assert run.returncode == 0, run.stderr
    np.testing.assert_allclose(got, sess.run(None, {"ids": edges})[0], rtol=1e-5, atol=1e-5)
    for bad in (VOCAB, -VOCAB - 1, 10**9, -(2**63)):
        ids = np.zeros((1, SEQ), np.int64)
        ids[0, 5] = bad
        run, _ = _run(art, ids, tmp_path)
        assert run.returncode == 3 and run.stdout == "", (bad, run.returncode, run.stderr)
        assert f"input ids: id {bad} (element 5) is outside the embedding table's {VOCAB} rows" in run.stderr


def test_a_computed_index_stays_inside_the_table(tmp_path):
    model = shifted_lookup(tmp_path / "shifted.onnx")
    art, backend = _build_tvm(model, tmp_path / "dist")
    assert backend["indices_bounded"] == 1 and backend["inputs_id_checked"] == {}, backend
    ids = np.arange(-VOCAB - 1, VOCAB - 1)[:SEQ].reshape(1, SEQ)  # every id+1 valid, negatives from the end
    run, got = _run(art, ids, tmp_path)
    assert run.returncode == 0, run.stderr
    np.testing.assert_array_equal(got, TABLE[ids + 1])
    hostile = np.array([[10**9, 2**62, -(2**62), VOCAB - 1, -VOCAB - 2] + [3] * (SEQ - 5)], np.int64)
    run, got = _run(art, hostile, tmp_path)
    assert run.returncode == 0, run.stderr  # no error (a computed index), and no read outside the table:
    assert all(any((row == t).all() for t in TABLE) for row in got[0]), got


def test_a_prefixed_tvm_segment_checks_its_ids_too(tmp_path):
    """A partitioned build compiles every TVM segment but one under a symbol prefix, on its own path
    (partition_build._compile_tvm_segment): it carries the same engine check and bounds."""
    from edgepack.model import load_model
    from edgepack.partition_build import _compile_tvm_segment
    from edgepack.targets import TargetMatrix
    from edgepack.toolchains import Toolchain
    target = TargetMatrix.load().get("x86_64")
    model = load_model(token_encoder(tmp_path / "tokens.onnx"))
    build = _compile_tvm_segment(model, target, tmp_path / "seg", "edgepack_seg1_", Toolchain.load(target.toolchain),
                                 log=lambda _m: None)
    assert build.options["tvm.in_ids.0"] == str(VOCAB) and build.options["tvm.prefix"] == "edgepack_seg1_"
    assert build.manifest["inputs_id_checked"] == {"0": VOCAB} and build.manifest["indices_bounded"] == 1
