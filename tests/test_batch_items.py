"""A batch of N > 1 on NCNN (edgepack/batch_items.py): the batch-1 graph, run once per item.

Real pnnx, libncnn, zig, qemu and onnxruntime: the example CNN (symbolic batch) built for a batch of 5
answers five distinct items as onnxruntime does, on x86_64 and under qemu's arm64; a model that mixes
its items never takes that path, and a batch fixed inside the file is left to the backends as before.
"""
from __future__ import annotations

import json
import subprocess

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from conftest import first_cpu, run_edgepack
from edgepack.batch_items import batch_size, per_item_model
from edgepack.model import load_model
from edgepack.pipeline import BuildOptions, prepare
from edgepack.runner import command_for

ITEMS = 5


@pytest.fixture(scope="module")
def batched(tiny_cnn, tmp_path_factory):
    dist = tmp_path_factory.mktemp("dist")
    proc = run_edgepack("build", str(tiny_cnn), "--target", "x86_64,arm64", "--backend", "ncnn", "--fp32",
                        "--input-shape", f"image={ITEMS}x3x64x64", "--out", str(dist), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dist


@pytest.mark.parametrize("target", ["x86_64", "arm64"])
def test_a_batch_of_five_runs_item_by_item_and_answers_as_onnxruntime(batched, tiny_cnn, target, tmp_path):
    art = batched / f"tiny_cnn-{target}"
    manifest = json.loads(art.with_name(art.name + ".json").read_text())
    assert manifest["backend"]["name"] == "ncnn" and manifest["backend"]["batch_items"] == ITEMS
    assert [i["shape"] for i in manifest["inputs"]] == [[ITEMS, 3, 64, 64]]
    # five different items: an engine that ran item 0 five times, or wrote every item's answer to
    # the first slot, would disagree
    x = np.random.default_rng(3).standard_normal((ITEMS, 3, 64, 64)).astype(np.float32) * \
        np.arange(1, ITEMS + 1, dtype=np.float32)[:, None, None, None]
    np.save(tmp_path / "x.npy", x)
    proc = subprocess.run(command_for(art, first_cpu(target)) + ["run", "--input", f"image={tmp_path / 'x.npy'}",
                                                                 "--output", str(tmp_path / "out"), "--threads", "2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    got = np.load(json.loads(proc.stdout)["outputs"]["logits"]["file"])
    want = ort.InferenceSession(str(tiny_cnn), providers=["CPUExecutionProvider"]).run(None, {"image": x})[0]
    assert got.shape == want.shape == (ITEMS, 10)
    for k in range(ITEMS):
        assert np.max(np.abs(got[k] - want[k])) <= 1e-4 * max(1.0, float(np.max(np.abs(want[k])))), k
    assert len({tuple(np.round(row, 3)) for row in got}) == ITEMS


def _batch_mixer(path, batch="N"):
    """x [N, 8] -> x - mean over the batch -> Relu: each answer depends on every item."""
    g = helper.make_graph(
        [helper.make_node("ReduceMean", ["x"], ["m"], axes=[0], keepdims=1),
         helper.make_node("Sub", ["x", "m"], ["d"]), helper.make_node("Relu", ["d"], ["y"])], "mix",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 8])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, path)
    return path


def _fixed_batch_gemm(path, n=4):
    """x [4, 8] (the batch fixed in the file) -> Gemm -> y [4, 3]."""
    w = numpy_helper.from_array(np.random.default_rng(1).standard_normal((3, 8)).astype(np.float32), "w")
    g = helper.make_graph([helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)], "fixed",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n, 3])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.save(m, path)
    return path


def test_only_a_common_leading_batch_above_one_counts(tiny_cnn, tmp_path):
    one = prepare(tiny_cnn, BuildOptions())
    assert batch_size(one.model) == 1 and one.per_item is None
    five = prepare(tiny_cnn, BuildOptions(input_shapes={"image": (ITEMS, 3, 64, 64)}))
    assert batch_size(five.model) == ITEMS
    assert [tuple(s.shape) for s in five.per_item.inputs] == [(1, 3, 64, 64)]
    assert [tuple(s.shape) for s in five.per_item.outputs] == [(1, 10)]


def test_a_model_that_mixes_its_items_gets_no_per_item_graph(tmp_path):
    prep = prepare(_batch_mixer(tmp_path / "mix.onnx"), BuildOptions(input_shapes={"x": (4, 8)}))
    assert batch_size(prep.model) == 4
    assert prep.per_item is None  # alone, an item's answer is all zeros, not what it gets among others
    # so NCNN gets the whole batch, as before: pnnx takes this [4, 8] for a matrix, and the mean over
    # its rows is right (verified against onnxruntime like every build)
    proc = run_edgepack("build", str(tmp_path / "mix.onnx"), "--target", "x86_64", "--backend", "ncnn",
                        "--input-shape", "x=4x8", "--verify-on", "native", "--out", str(tmp_path / "dist"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    manifest = json.loads((tmp_path / "dist" / "mix-x86_64.json").read_text())
    assert manifest["backend"]["batch_items"] == 1


def test_a_batch_fixed_inside_the_file_is_not_prepared_again(tmp_path):
    path = _fixed_batch_gemm(tmp_path / "fixed.onnx")
    prep = prepare(path, BuildOptions())
    assert batch_size(prep.model) == 4 and prep.per_item is None
    # per_item_model itself: a prepare_at that cannot fix the batch (the file's own 4) gives None
    model = load_model(path)
    assert per_item_model(prep.model, model, lambda shapes: prepare(path, BuildOptions(input_shapes=shapes)).model) is None
