"""A text encoder on int64 token ids (AttaCut-like: embedding Gather -> conv branches stacked and
max-reduced -> linear head) runs on NCNN: the stacked ReduceMax becomes element-wise Max (an exact
rewrite), and the ids enter ncnn's Embed as int32 words (token_ids.py, ep_engine_ncnn.c). Where the
NCNN op table lacks an op, the plan moves only the Gather that reads the ids to TVM. Checked with
onnxruntime (rewrite, plan) and as real artifacts (x86_64 native, arm64 under qemu) run on fresh,
negative (counted from the table's end, as ONNX's Gather does) and out-of-range ids."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgepack.backends.ncnn import rewrite as rw
from edgepack.model import load_model, simplify
from edgepack.partition import plan

VOCAB, SEQ, EMB, CH = 40, 16, 8, 6


def token_encoder(path: Path, keepdims: int = 0, reduce_axis: int = 3) -> Path:
    """ids[1,SEQ] int64 -> Gather -> Transpose -> Conv1d x2 -> Transpose -> stack(axis 3) ->
    ReduceMax(axis 3) -> MatMul/Add/Relu -> MatMul -> Reshape [1,SEQ] (opset 18: axes as inputs)."""
    rng = np.random.default_rng(11)
    inits = [numpy_helper.from_array(rng.standard_normal((VOCAB, EMB)).astype(np.float32), "emb"),
             numpy_helper.from_array(np.array([3], np.int64), "ax3"),
             numpy_helper.from_array(np.array([reduce_axis], np.int64), "rax"),
             numpy_helper.from_array((rng.standard_normal((CH, 4)) * 0.3).astype(np.float32), "w1"),
             numpy_helper.from_array((rng.standard_normal(4) * 0.1).astype(np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((4, 1)) * 0.3).astype(np.float32), "w2"),
             numpy_helper.from_array(np.array([1, SEQ], np.int64), "oshape")]
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["e"], name="embed"),
             helper.make_node("Transpose", ["e"], ["et"], name="t0", perm=[0, 2, 1])]
    for k, ks in enumerate((3, 5)):
        inits += [numpy_helper.from_array((rng.standard_normal((CH, EMB, ks)) * 0.3).astype(np.float32), f"cw{k}"),
                  numpy_helper.from_array((rng.standard_normal(CH) * 0.1).astype(np.float32), f"cb{k}")]
        nodes += [helper.make_node("Conv", ["et", f"cw{k}", f"cb{k}"], [f"c{k}"], name=f"conv{k}", pads=[ks // 2] * 2),
                  helper.make_node("Transpose", [f"c{k}"], [f"p{k}"], name=f"t{k + 1}", perm=[0, 2, 1]),
                  helper.make_node("Unsqueeze", [f"p{k}", "ax3"], [f"u{k}"], name=f"unsq{k}")]
    nodes += [helper.make_node("Concat", ["u0", "u1"], ["st"], name="stack", axis=3),
              helper.make_node("ReduceMax", ["st", "rax"], ["mx"], name="max", keepdims=keepdims)]
    head = "mx"
    if keepdims:  # [1,SEQ,CH,1] -> [1,SEQ,CH] for the head
        inits.append(numpy_helper.from_array(np.array([1, SEQ, CH], np.int64), "hshape"))
        nodes.append(helper.make_node("Reshape", ["mx", "hshape"], ["mxr"], name="unkeep"))
        head = "mxr"
    nodes += [helper.make_node("MatMul", [head, "w1"], ["h1"], name="fc1"),
              helper.make_node("Add", ["h1", "b1"], ["h1b"], name="fc1b"),
              helper.make_node("Relu", ["h1b"], ["h1r"], name="relu"),
              helper.make_node("MatMul", ["h1r", "w2"], ["h2"], name="fc2"),
              helper.make_node("Reshape", ["h2", "oshape"], ["y"], name="out")]
    g = helper.make_graph(nodes, "token_encoder", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, SEQ])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, SEQ])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    onnx.save(m, str(path))
    return path


def _ids(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, (1, SEQ)).astype(np.int64)


def _ort(model: onnx.ModelProto, feeds: dict) -> dict:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, {i.name: feeds[i.name] for i in sess.get_inputs()})))


def _through_segments(p, feeds: dict) -> dict:
    """Every value after running the plan's segments one by one in onnxruntime."""
    values = dict(feeds)
    for seg in p.segments:
        values.update(_ort(seg.model, values))
    return values


def test_stack_max_to_max_is_exact(tmp_path):
    for keep in (0, 1):
        m = onnx.load(str(token_encoder(tmp_path / f"k{keep}.onnx", keepdims=keep)))
        new = onnx.ModelProto()
        new.CopyFrom(m)
        assert rw.stack_max_to_max(new) == 1
        rw.remove_dead_nodes(new)
        onnx.checker.check_model(new, full_check=True)
        ops = [n.op_type for n in new.graph.node]
        assert "ReduceMax" not in ops and "Concat" not in ops and ops.count("Max") == 1, ops
        feeds = {"ids": _ids(keep)}
        np.testing.assert_array_equal(_ort(new, feeds)["y"], _ort(m, feeds)["y"])  # max of the same values


def test_stack_max_to_max_leaves_a_reduction_over_another_axis(tmp_path):
    m = onnx.load(str(token_encoder(tmp_path / "a2.onnx", keepdims=1, reduce_axis=2)))
    assert rw.stack_max_to_max(m) == 0 and "ReduceMax" in [n.op_type for n in m.graph.node]


def test_plan_moves_only_the_token_gather_to_tvm(tmp_path):
    model = simplify(load_model(token_encoder(tmp_path / "t.onnx")))
    # NCNN as edgepack's op table has it: no ReduceMax (the plan's rewrite removes it), Gather yes
    p = plan(model, {"ncnn": lambda op: op != "ReduceMax", "tvm": lambda op: True})
    assert p.backends == ("tvm", "ncnn"), p.describe()
    assert p.segments[0].ops == ("Gather",) and "Conv" in p.segments[1].ops and "Max" in p.segments[1].ops
    assert p.segments[0].inputs == ("ids",)
    feeds = {"ids": _ids(5)}
    np.testing.assert_array_equal(_through_segments(p, feeds)["y"], _ort(model.proto, feeds)["y"])


# ---- a real x86_64 artifact (pnnx, TVM, zig) -----------------------------------------------------

from conftest import run_edgepack  # noqa: E402
from edgepack.runner import run_artifact  # noqa: E402


def _build_first(model: Path, dist: Path, target: str = "x86_64") -> tuple[Path, dict]:
    """Build ``model`` (the first backend that verifies); the artifact and its manifest."""
    proc = run_edgepack("build", str(model), "--target", target, "--out", str(dist), "--json", "--select", "first")
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout)["results"][0]
    assert res["ok"], res
    art = dist / f"{model.stem}-{target}"
    return art, json.loads(art.with_name(art.name + ".json").read_text())


def _build_split(model: Path, dist: Path) -> tuple[Path, dict]:
    art, manifest = _build_first(model, dist)
    assert manifest["backend"]["name"] == "ncnn+tvm", manifest["backend"]
    return art, manifest


def _run(art: Path, ids: np.ndarray, tmp_path: Path, qemu_cpu: str | None = None):
    np.save(tmp_path / "ids.npy", ids)
    return run_artifact(art, ["run", "--threads", "1", "--input", f"ids={tmp_path / 'ids.npy'}",
                              "--output", str(tmp_path / "out")], qemu_cpu=qemu_cpu)


def _check_run(art: Path, manifest: dict, model: Path, ids: np.ndarray, tmp_path: Path,
               qemu_cpu: str | None = None) -> None:
    """The artifact's `run` on ``ids`` agrees with onnxruntime within the manifest's tolerance."""
    run = _run(art, ids, tmp_path, qemu_cpu)
    assert run.returncode == 0, run.stderr
    got = np.load(json.loads(run.stdout)["outputs"]["y"]["file"])
    want = _ort(onnx.load(str(model)), {"ids": ids})["y"]
    tol = manifest["tolerance"]
    assert float(np.max(np.abs(got - want))) <= tol["atol"] + tol["rtol"] * float(np.max(np.abs(want)))


@pytest.mark.parametrize("target", ["x86_64", "arm64"])
def test_token_encoder_runs_whole_on_ncnn_from_its_int64_ids(target, tmp_path):
    model = token_encoder(tmp_path / "tokens.onnx")
    art, manifest = _build_first(model, tmp_path / "dist", target)
    assert manifest["backend"]["name"] == "ncnn" and "Embed" in manifest["backend"]["layers"], manifest["backend"]
    cpu = "max" if target == "arm64" else None
    _check_run(art, manifest, model, _ids(77), tmp_path, cpu)  # fresh ids, not the build's verification inputs
    edges = np.array([[0, VOCAB - 1, -1, -VOCAB] + list(range(-6, 6))], np.int64)
    _check_run(art, manifest, model, edges, tmp_path, cpu)  # negative ids count from the end, as in ONNX
    for bad in (VOCAB, -VOCAB - 1):
        ids = _ids(3)
        ids[0, 5] = bad
        run = _run(art, ids, tmp_path, cpu)
        assert run.returncode == 3 and run.stdout == "", (run.returncode, run.stderr)
        assert f"input ids: id {bad} (element 5) is outside the embedding table's {VOCAB} rows" in run.stderr, \
            run.stderr


def test_an_integer_input_used_otherwise_keeps_the_model_off_whole_ncnn(tmp_path):
    """ids that also make a padding mask (Greater -> Cast): not an embedding lookup alone, so the
    NCNN conversion refuses it by name (the split takes the model)."""
    from edgepack.backends.ncnn.token_ids import id_inputs
    from edgepack.errors import UnsupportedOpError
    m = onnx.load(str(token_encoder(tmp_path / "t.onnx")))
    m.graph.initializer.append(numpy_helper.from_array(np.array(0, np.int64), "zero"))
    m.graph.node.extend([helper.make_node("Greater", ["ids", "zero"], ["pad"], name="mask")])
    model = load_model(tmp_path / "t.onnx")
    assert id_inputs(model.proto, model.inputs, "t.onnx") == {"ids": VOCAB}
    with pytest.raises(UnsupportedOpError, match="input ids is int64; .* it feeds Greater \\(node mask\\)"):
        id_inputs(m, model.inputs, "t.onnx")


# ---- a batch-N text CNN (DeepCut-like): lifted to batch 1 after its embedding lookups -------------

WIN, CHARS, N = 7, 20, 4


def window_cnn(path: Path) -> Path:
    """ids[N,WIN] float -> Cast int64 -> Gather -> Unsqueeze -> Transpose -> one-high Conv (two
    widths) -> Squeeze/Add/Relu/Transpose -> Reshape [-1,C] -> Gemm -> Reshape -> Pad back to WIN ->
    Max -> Concat with the embedding -> Reshape [N, -1] -> Gemm -> Sigmoid, as tf2onnx writes DeepCut."""
    rng = np.random.default_rng(12)
    emb, ch = 6, 5
    f = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)  # noqa: E731
    c64 = lambda v: np.array(v, np.int64)  # noqa: E731
    inits = {"table": f(CHARS, emb), "ax1": c64([1]), "ax2": c64([2]), "flat": c64([-1, ch]), "head": c64([N, -1]),
             "w_out": f(WIN * (emb + 3), 1), "b_out": f(1)}
    nodes = [helper.make_node("Cast", ["ids"], ["ids_i"], name="cast", to=TensorProto.INT64),
             helper.make_node("Gather", ["table", "ids_i"], ["e"], name="lookup"),
             helper.make_node("Unsqueeze", ["e", "ax1"], ["e4"], name="expand"),
             helper.make_node("Transpose", ["e4"], ["x"], name="nchw", perm=[0, 3, 1, 2])]
    branches = []
    for k, kw in enumerate((2, 3)):
        length = WIN - kw + 1
        inits |= {f"cw{k}": f(ch, emb, 1, kw), f"cb{k}": f(1, ch, 1), f"dw{k}": f(ch, 3), f"db{k}": f(3),
                  f"back{k}": c64([-1, length, 3]), f"pad{k}": c64([0, 0, 0, 0, kw - 1, 0])}
        nodes += [helper.make_node("Conv", ["x", f"cw{k}"], [f"c{k}"], name=f"conv{k}", kernel_shape=[1, kw]),
                  helper.make_node("Squeeze", [f"c{k}", "ax2"], [f"s{k}"], name=f"sq{k}"),
                  helper.make_node("Add", [f"s{k}", f"cb{k}"], [f"a{k}"], name=f"bias{k}"),
                  helper.make_node("Relu", [f"a{k}"], [f"r{k}"], name=f"relu{k}"),
                  helper.make_node("Transpose", [f"r{k}"], [f"t{k}"], name=f"nwc{k}", perm=[0, 2, 1]),
                  helper.make_node("Reshape", [f"t{k}", "flat"], [f"f{k}"], name=f"flat{k}"),
                  helper.make_node("Gemm", [f"f{k}", f"dw{k}", f"db{k}"], [f"g{k}"], name=f"dense{k}"),
                  helper.make_node("Reshape", [f"g{k}", f"back{k}"], [f"b{k}"], name=f"back{k}"),
                  helper.make_node("Pad", [f"b{k}", f"pad{k}"], [f"p{k}"], name=f"pad{k}")]
        branches.append(f"p{k}")
    nodes += [helper.make_node("Max", branches, ["m"], name="max"),
              helper.make_node("Concat", ["e", "m"], ["cat"], name="cat", axis=2),
              helper.make_node("Reshape", ["cat", "head"], ["h"], name="flatten"),
              helper.make_node("Gemm", ["h", "w_out", "b_out"], ["logit"], name="out"),
              helper.make_node("Sigmoid", ["logit"], ["y"], name="sigmoid")]
    g = helper.make_graph(nodes, "window_cnn", [helper.make_tensor_value_info("ids", TensorProto.FLOAT, [N, WIN])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [N, 1])],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    onnx.save(m, str(path))
    return path


def _window_ids(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, CHARS, (N, WIN)).astype(np.float32)


def test_lift_batch_is_exact_and_leaves_no_pad(tmp_path):
    from edgepack.partition_lift import PIN, lift_batch
    m = onnx.load(str(window_cnn(tmp_path / "w.onnx")))
    new = onnx.ModelProto()
    new.CopyFrom(m)
    assert lift_batch(new) == 1
    onnx.checker.check_model(onnx.shape_inference.infer_shapes(new), full_check=True)
    ops = [n.op_type for n in new.graph.node]
    assert "Pad" not in ops and "Gemm" not in ops, ops
    assert sorted(n.op_type for n in new.graph.node if n.name.endswith(PIN)) == ["Reshape", "Unsqueeze"]
    feeds = {"ids": _window_ids(3)}
    np.testing.assert_allclose(_ort(new, feeds)["y"], _ort(m, feeds)["y"], rtol=1e-6, atol=1e-7)


def test_lift_batch_leaves_an_op_it_does_not_handle(tmp_path):
    from edgepack.partition_lift import lift_batch
    m = onnx.load(str(window_cnn(tmp_path / "w.onnx")))
    softmax = helper.make_node("Softmax", ["logit"], ["sm"], name="softmax", axis=0)  # across the batch
    m.graph.node.insert(len(m.graph.node) - 1, softmax)
    m.graph.node[-1].input[0] = "sm"
    before = m.SerializeToString()
    assert lift_batch(m) == 0 and m.SerializeToString() == before


def test_plan_puts_the_lifted_convolutions_on_ncnn(tmp_path):
    model = simplify(load_model(window_cnn(tmp_path / "w.onnx")))
    p = plan(model, {"ncnn": lambda op: op != "Pad", "tvm": lambda op: True})
    assert p.backends == ("tvm", "ncnn", "tvm"), p.describe()
    assert set(p.segments[0].ops) == {"Cast", "Gather", "Unsqueeze"} and p.segments[2].ops == ("Reshape",)
    assert "Conv" in p.segments[1].ops
    feeds = {"ids": _window_ids(4)}
    np.testing.assert_allclose(_through_segments(p, feeds)["y"], _ort(model.proto, feeds)["y"], rtol=1e-6, atol=1e-7)


def test_window_cnn_artifact_runs_its_convolutions_on_ncnn(tmp_path):
    model = window_cnn(tmp_path / "windows.onnx")
    art, manifest = _build_split(model, tmp_path / "dist")
    segs = manifest["backend"]["segments"]
    assert [s["backend"] for s in segs] == ["tvm", "ncnn", "tvm"] and "Conv" in segs[1]["ops"], segs
    _check_run(art, manifest, model, _window_ids(99), tmp_path)
