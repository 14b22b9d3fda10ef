"""Loops stepped by the runtime (edgepack/loops.py, loop_lengths.py): the plan, the body and its wiring,
checked by stepping the extracted body with onnxruntime exactly as runtimes/common/ep_engine_loop.c
does and comparing with onnxruntime's own Loop; outputs cut to the computed length."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper as h

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import loop_models  # noqa: E402

from edgepack import loops  # noqa: E402
from edgepack.cut_outputs import apply_trims  # noqa: E402
from edgepack.loop_lengths import GUARD  # noqa: E402
from edgepack.partition_build import plan_for  # noqa: E402
from edgepack.pipeline import BuildOptions, prepare  # noqa: E402
from edgepack.reference import run_onnxruntime  # noqa: E402
from edgepack.targets import load_target_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _session(proto: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _step_loop(body: loops.LoopBody, seg_inputs: list[np.ndarray]) -> list[np.ndarray]:
    """ep_engine_loop.c's loop_run in numpy: sources, step and condition, swaps, guard, results."""
    sess = _session(body.model.proto)
    opts, blobs = body.options()
    specs = body.model.inputs

    def value(code: str, spec) -> np.ndarray | None:
        if code == "none":
            return None
        raw = seg_inputs[int(code[1:])] if code[0] == "i" else blobs[int(code[1:])]
        return np.asarray(raw).astype(spec.dtype).reshape(spec.shape)

    m = value(opts["loop.max"], specs[0])
    cond = value(opts["loop.cond"], specs[1])
    steps = int(m.reshape(-1)[0]) if m is not None else 1 << 20
    going = bool(cond.reshape(-1)[0]) if cond is not None else True
    state = {}
    for j in range(2, len(specs)):
        v = value(opts[f"loop.in.{j}"], specs[j])
        state[j] = v if v is not None else np.zeros(specs[j].shape, specs[j].dtype)
    guard = int(opts["loop.guard"]) if "loop.guard" in opts else None
    step = 0
    while step < steps and going:
        feed = {specs[0].name: np.full(specs[0].shape, step, np.int64), specs[1].name: np.full(specs[1].shape, going)}
        feed.update({specs[j].name: state[j] for j in state})
        outs = sess.run(None, feed)
        if guard is not None:
            assert bool(outs[guard].reshape(-1)[0]), f"the fixed-length check failed at step {step}"
        going = bool(outs[0].reshape(-1)[0])
        for j in state:
            if f"loop.next.{j}" in opts:
                state[j] = outs[int(opts[f"loop.next.{j}"])].reshape(specs[j].shape)
        step += 1
    return [state[int(opts[f"loop.out.{r}"])] for r in range(len([k for k in opts if k.startswith("loop.out.")]))]


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    path = tmp_path_factory.mktemp("loop") / "decoder.onnx"
    loop_models.decoder_model(path)
    return path, prepare(path, BuildOptions())


def test_outputs_cut_to_the_computed_length_as_onnxruntime_gives_them(decoder):
    path, prep = decoder
    probs = next(o for o in prep.model.outputs if o.name == "probs")
    assert probs.shape == (1, loop_models.ROWS, loop_models.WIDTH) and probs.trim[0] == 1
    reference = _session(onnx.load(str(path)))
    for x, n in loop_models.inputs_with_lengths(path, 12):
        got = run_onnxruntime(prep.model, {"x": x})
        want = reference.run(None, {"x": x})
        assert got["probs"].shape == (1, n, loop_models.WIDTH) and set(got) == {"probs", "state_f"}
        np.testing.assert_allclose(got["probs"], want[0], rtol=1e-5, atol=1e-6)


def test_body_stepped_as_the_runtime_does_equals_onnxruntimes_loop(decoder):
    """Plan -> body -> wiring -> stepping, then the segments after the loop: onnxruntime's answers on
    inputs that decode to different lengths (1 to the buffer's 12 rows)."""
    path, prep = decoder
    plan = plan_for(prep.model, load_target_file(ROOT / "targets" / "x86_64.toml"))
    assert plan is not None and "loop" in plan.backends, plan
    reference = _session(onnx.load(str(path)))
    lengths = set()
    for x, n in loop_models.inputs_with_lengths(path, 16):
        slots = {"x": x}
        for k, seg in enumerate(plan.segments):
            sub = seg.loaded(prep.model, k)
            ins = [slots[s.name] for s in sub.inputs]
            if seg.backend == "loop":
                body = loops.extract_body(sub)
                outs = _step_loop(body, ins)
            else:
                outs = _session(sub.proto).run(None, dict(zip([s.name for s in sub.inputs], ins)))
            slots.update({s.name: np.asarray(v).reshape(s.shape) for s, v in zip(sub.outputs, outs)})
        got = apply_trims(prep.model.proto, {o.name: slots[o.name] for o in prep.model.proto.graph.output})
        want = reference.run(None, {"x": x})
        np.testing.assert_allclose(got["probs"], want[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["state_f"], want[1], rtol=1e-5, atol=1e-6)
        lengths.add(n)
    assert len(lengths) >= 3, lengths


def test_wiring_folds_constant_weights_and_reads_the_encoder_every_step(decoder):
    _, prep = decoder
    plan = plan_for(prep.model, load_target_file(ROOT / "targets" / "x86_64.toml"))
    k = plan.backends.index("loop")
    body = loops.extract_body(plan.segments[k].loaded(prep.model, k))
    opts, blobs = body.options()
    names = [s.name for s in body.model.inputs]
    assert "w_rec" not in names                       # a constant invariant: a weight of the body
    enc = names.index("enc")
    assert opts[f"loop.in.{enc}"] == "i0" and f"loop.next.{enc}" not in opts  # read from its slot, not copied
    out = names.index("out")
    assert opts[f"loop.in.{out}"] == "none"           # write-only, started as a scalar: no first value
    assert body.model.inputs[out].shape == (1, loop_models.ROWS, loop_models.WIDTH)
    assert body.model.outputs[int(opts["loop.guard"])].name == GUARD
    assert all(s.is_static or s.shape == () for s in body.model.inputs + body.model.outputs)
    assert {n.op_type for n in body.model.proto.graph.node}.isdisjoint({"Range", "Slice", "Shape"})
    # enc @ w_rec is the same at every step: computed once before the loop, read as an invariant
    assert sum(n.op_type in ("MatMul", "Gemm") for n in body.model.proto.graph.node) == 1  # state @ w_rec only
    hoisted = next(s.name for s in body.model.inputs if s.name.endswith("enc_proj"))
    assert f"loop.next.{names.index(hoisted)}" not in opts


def test_the_fixed_length_check_fails_past_the_buffer(decoder):
    """Row 12 of a 12-row buffer: onnxruntime's Slice would give no rows; the compiled body must say so."""
    _, prep = decoder
    plan = plan_for(prep.model, load_target_file(ROOT / "targets" / "x86_64.toml"))
    k = plan.backends.index("loop")
    body = loops.extract_body(plan.segments[k].loaded(prep.model, k))
    # as TVM compiles it: computed indices kept inside their tensors (index_bounds.py), so the step runs
    from edgepack.backends.tvm.index_bounds import bounded
    sess = _session(bounded(body.model.proto)[0])
    guard = int(body.options()[0]["loop.guard"])
    feed = {s.name: np.zeros(s.shape, s.dtype) for s in body.model.inputs}
    for count, ok in ((0, True), (11, True), (12, False), (40, False)):
        feed["count"] = np.full(feed["count"].shape, count, np.int64)
        assert bool(sess.run(None, feed)[guard].reshape(-1)[0]) is ok, count


def _loop_model(body: onnx.GraphProto, n_out: int, extra_inits=()) -> onnx.ModelProto:
    g = h.make_graph([h.make_node("Relu", ["x"], ["r"]),
                      h.make_node("Loop", ["m", "", "r"], [f"o{i}" for i in range(n_out)], body=body)],
                     "g", [h.make_tensor_value_info("x", T.FLOAT, [1, 4])],
                     [h.make_tensor_value_info(f"o{i}", T.FLOAT, None) for i in range(n_out)],
                     [onnx.numpy_helper.from_array(np.asarray(3, np.int64), "m"), *extra_inits])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 17)])


def test_loops_the_runtime_cannot_step_are_refused_by_name():
    io = [h.make_tensor_value_info("i", T.INT64, []), h.make_tensor_value_info("c", T.BOOL, []),
          h.make_tensor_value_info("v", T.FLOAT, [1, 4])]
    scan = h.make_graph([h.make_node("Identity", ["c"], ["c2"]), h.make_node("Neg", ["v"], ["v2"]),
                         h.make_node("Identity", ["v2"], ["s"])], "b", io,
                        [h.make_tensor_value_info(n, t, None) for n, t in (("c2", T.BOOL), ("v2", T.FLOAT), ("s", T.FLOAT))])
    m = _loop_model(scan, 2)
    assert "scan outputs" in loops.unsupported_reason(m.graph.node[1], set())
    assert not loops.loops_supported(m)
    outer = h.make_graph([h.make_node("Identity", ["c"], ["c2"]), h.make_node("Add", ["v", "r"], ["v2"])], "b", io,
                         [h.make_tensor_value_info("c2", T.BOOL, None), h.make_tensor_value_info("v2", T.FLOAT, None)])
    m = _loop_model(outer, 1)
    assert "reads 'r' from outside" in loops.unsupported_reason(m.graph.node[1], set())
    # a constant read from outside is fine: it becomes a weight of the body
    const = h.make_graph([h.make_node("Identity", ["c"], ["c2"]), h.make_node("Add", ["v", "k"], ["v2"])], "b", io,
                         [h.make_tensor_value_info("c2", T.BOOL, None), h.make_tensor_value_info("v2", T.FLOAT, None)])
    m = _loop_model(const, 1, [onnx.numpy_helper.from_array(np.ones((1, 4), np.float32), "k")])
    assert loops.unsupported_reason(m.graph.node[1], {"k"}) is None


def test_inspect_shows_the_loop_segment(decoder):
    from edgepack.inspection import inspect_model
    path, _ = decoder
    report = inspect_model(path, [])
    assert "-> loop[Loop] ->" in report["targets"]["x86_64"], report["targets"]
    probs = next(o for o in report["outputs"] if o["name"] == "probs")
    assert probs["cut_to_length"]["axis"] == 1


def test_a_loop_without_a_condition_input_runs_as_onnxruntime_runs_it(tmp_path):
    """ONNX ignores the body's condition there and onnxsim unrolls all 100 steps; onnxruntime, the
    reference, stops where the body says: the build keeps the loop, with a true condition input."""
    path = tmp_path / "counted.onnx"
    loop_models.counted_model(path, condition=False)
    prep = prepare(path, BuildOptions())
    loop = [n for n in prep.model.proto.graph.node if n.op_type == "Loop"]
    assert len(loop) == 1 and loop[0].input[1], [n.op_type for n in prep.model.proto.graph.node][:12]
    reference = _session(onnx.load(str(path)))
    x = np.full((1, loop_models.WIDTH), 0.3, np.float32)
    for x0 in (0.5, 3.2, 11.5):
        x[0, 0] = x0
        np.testing.assert_allclose(run_onnxruntime(prep.model, {"x": x})["state_f"], reference.run(None, {"x": x})[0],
                                   rtol=1e-5, atol=1e-6)


def test_a_prepared_graph_that_answers_otherwise_is_named_in_the_build_notes(tmp_path, monkeypatch):
    """Without explicit_conditions onnxsim unrolls that loop over all 100 steps: the prepared graph answers
    otherwise than the model itself, and the build says so (it is verified against the prepared graph)."""
    import edgepack.pipeline as pipeline
    path = tmp_path / "counted.onnx"
    loop_models.counted_model(path, condition=False)
    kept = prepare(path, BuildOptions())
    assert not [n for n in kept.model.notes if n.startswith("warning: the prepared graph")], kept.model.notes
    monkeypatch.setattr(pipeline, "explicit_conditions", lambda model: model)
    unrolled = prepare(path, BuildOptions())
    assert not [n for n in unrolled.model.proto.graph.node if n.op_type == "Loop"]
    warned = [n for n in unrolled.model.notes if n.startswith("warning: the prepared graph")]
    assert warned and "output state_f" in warned[0] and "--no-simplify" in warned[0], unrolled.model.notes


def test_a_value_the_body_never_reads_keeps_its_first_value_when_the_loop_may_not_run(tmp_path):
    """Trip count from the input (0 steps for x < 1): the loop's answer is then the value it started from,
    so an unread carried value keeps its first value (only a loop sure to run may drop it)."""
    io = [h.make_tensor_value_info("i", T.INT64, []), h.make_tensor_value_info("c", T.BOOL, []),
          h.make_tensor_value_info("v", T.FLOAT, [1, 4])]
    body = h.make_graph([h.make_node("Identity", ["c"], ["c2"]), h.make_node("Relu", ["x_in"], ["v2"])], "b", io,
                        [h.make_tensor_value_info("c2", T.BOOL, []), h.make_tensor_value_info("v2", T.FLOAT, [1, 4])])
    body.input.append(h.make_tensor_value_info("x_in", T.FLOAT, [1, 4]))
    body.output.append(h.make_tensor_value_info("x_in", T.FLOAT, [1, 4]))
    g = h.make_graph([h.make_node("ReduceMax", ["x"], ["top"], keepdims=0), h.make_node("Floor", ["top"], ["f"]),
                      h.make_node("Cast", ["f"], ["m"], to=T.INT64),
                      h.make_node("Loop", ["m", "go", "seven", "x"], ["v_f", "x_f"], body=body)],
                     "g", [h.make_tensor_value_info("x", T.FLOAT, [1, 4])], [h.make_tensor_value_info("v_f", T.FLOAT, [1, 4])],
                     [onnx.numpy_helper.from_array(np.full((1, 4), 7, np.float32), "seven"),
                      onnx.numpy_helper.from_array(np.asarray(True), "go")])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path / "maybe.onnx"
    onnx.save(model, str(path))
    prep = prepare(path, BuildOptions())
    plan = plan_for(prep.model, load_target_file(ROOT / "targets" / "x86_64.toml"))
    k = plan.backends.index("loop")
    sub = plan.segments[k].loaded(prep.model, k)
    body = loops.extract_body(sub)
    reference = _session(model)
    for x in (np.full((1, 4), 0.5, np.float32), np.full((1, 4), 2.5, np.float32)):   # 0 steps, 2 steps
        slots = {"x": x}
        for j, seg in enumerate(plan.segments[:k]):
            s = seg.loaded(prep.model, j)
            slots.update(zip([o.name for o in s.outputs], _session(s.proto).run(None, {i.name: slots[i.name] for i in s.inputs})))
        got = _step_loop(body, [slots[s.name] for s in sub.inputs])
        np.testing.assert_allclose(got[[o.name for o in sub.outputs].index("v_f")], reference.run(None, {"x": x})[0])


def _cut_model(tmp_path, opset: int = 17, extra_reader: bool = False, length_out: bool = False):
    """y = Softmax(Slice(x, 0, n, axis 1)) with n from x, beside a trivial Loop (cuts are for loop models)."""
    from edgepack.model import load_model
    io = [h.make_tensor_value_info("i", T.INT64, []), h.make_tensor_value_info("c", T.BOOL, []),
          h.make_tensor_value_info("v", T.FLOAT, [1])]
    body = h.make_graph([h.make_node("Identity", ["c"], ["c2"]), h.make_node("Neg", ["v"], ["v2"])], "b", io,
                        [h.make_tensor_value_info("c2", T.BOOL, []), h.make_tensor_value_info("v2", T.FLOAT, [1])])
    nodes = [h.make_node("ReduceMax", ["x"], ["top"], keepdims=0), h.make_node("Abs", ["top"], ["a"]),
             h.make_node("Cast", ["a"], ["n0"], to=T.INT64), h.make_node("Reshape", ["n0", "one"], ["n"]),
             h.make_node("Slice", ["x", "zero", "n", "one"], ["rows"]),
             h.make_node("Softmax", ["rows"], ["y"], **({"axis": -1} if opset >= 13 else {})),
             h.make_node("Loop", ["three", "go", "v0"], ["w"], body=body)]
    outs = [h.make_tensor_value_info("y", T.FLOAT, [1, "rows", 4]), h.make_tensor_value_info("w", T.FLOAT, [1])]
    if extra_reader:
        nodes.append(h.make_node("ReduceSum", ["y"], ["total"], keepdims=0))
        outs.append(h.make_tensor_value_info("total", T.FLOAT, []))
    if length_out:
        outs.append(h.make_tensor_value_info("n", T.INT64, [1]))
    inits = [onnx.numpy_helper.from_array(np.asarray(v, dt), k) for k, v, dt in
             (("one", [1], np.int64), ("zero", [0], np.int64), ("three", 3, np.int64), ("go", True, np.bool_),
              ("v0", [1.0], np.float32))]
    g = h.make_graph(nodes, "cut", [h.make_tensor_value_info("x", T.FLOAT, [1, 6, 4])], outs, inits)
    m = h.make_model(g, opset_imports=[h.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.save(m, str(tmp_path / "cut.onnx"))
    return load_model(tmp_path / "cut.onnx"), m


def test_a_cut_keeps_a_length_the_model_also_answers(tmp_path):
    from edgepack.cut_outputs import trim_outputs
    model, proto = _cut_model(tmp_path, length_out=True)
    cut = trim_outputs(model)
    assert next(o for o in cut.outputs if o.name == "y").trim == (1, "n")
    x = np.full((1, 6, 4), 3.5, np.float32)
    got, want = run_onnxruntime(cut, {"x": x}), _session(proto).run(None, {"x": x})
    assert set(got) == {"y", "w", "n"} and got["y"].shape == (1, 3, 4)
    np.testing.assert_array_equal(got["n"], want[2])


def test_no_cut_where_another_op_reads_the_rows_or_an_old_softmax_spans_the_axis(tmp_path):
    """A second reader of the softmax would get all six rows once cut; before opset 13 Softmax flattens
    from axis 1, mixing the rows: both stay uncut."""
    from edgepack.cut_outputs import trim_outputs
    for kwargs in ({"extra_reader": True}, {"opset": 11}):
        model, _ = _cut_model(tmp_path, **kwargs)
        assert not any(o.trim for o in trim_outputs(model).outputs), kwargs
    model, _ = _cut_model(tmp_path)
    assert next(o for o in trim_outputs(model).outputs if o.name == "y").trim == (1, "n")
