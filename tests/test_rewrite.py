"""ONNX rewrites that keep models on NCNN (edgepack/backends/ncnn/rewrite.py).

Each rewrite runs on a tiny graph with the pattern real models have (SVTR's qkv split, YOLOX's
Focus, a time-major CRNN head) and must give onnxruntime's exact outputs before and after; the
last tests convert such graphs with the real pnnx and ncnn and show that pnnx leaves layers ncnn
cannot load without the rewrites, and none with them.
"""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgepack.backends.ncnn import rewrite as rw

OPSET = 13


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in inits])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def _run(m: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, feeds)


def _feeds(m: onnx.ModelProto) -> dict:
    rng = np.random.default_rng(7)
    return {i.name: rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
            for i in m.graph.input}


def _same_after(fn, m: onnx.ModelProto, exact: bool = True) -> tuple[onnx.ModelProto, int]:
    """Apply one rewrite to a copy; outputs must be bit-identical to the original's, or (exact=False,
    for rewrites that reorder a Conv's input channels, so the sum runs in another order) agree to
    rounding."""
    new = onnx.ModelProto()
    new.CopyFrom(m)
    fired = fn(new)
    rw.remove_dead_nodes(new)
    onnx.checker.check_model(new)
    feeds = _feeds(m)
    for a, b in zip(_run(m, feeds), _run(new, feeds)):
        assert a.shape == b.shape
        if exact:
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5 * float(np.abs(a).max()))
    return new, fired


def _ops(m: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in m.graph.node]


def qkv_model(n=40, heads=2, dim=4) -> onnx.ModelProto:
    """SVTR attention's split: [1,N,3*H*D] -> [1,N,3,H,D] -> perm(2,0,3,1,4) -> slice+squeeze axis 0."""
    nodes = [helper.make_node("Reshape", ["x", "shape5"], ["r"]),
             helper.make_node("Transpose", ["r"], ["t"], perm=[2, 0, 3, 1, 4])]
    inits = [("shape5", np.array([1, n, 3, heads, dim], np.int64)), ("ax0", np.array([0], np.int64))]
    outs = []
    for i in range(3):
        inits += [(f"s{i}", np.array([i], np.int64)), (f"e{i}", np.array([i + 1], np.int64))]
        nodes += [helper.make_node("Slice", ["t", f"s{i}", f"e{i}", "ax0"], [f"sl{i}"]),
                  helper.make_node("Squeeze", [f"sl{i}", "ax0"], [f"q{i}"])]
        outs.append((f"q{i}", [1, heads, n, dim]))
    # attention scores, so the three pieces meet again as in the real model
    nodes += [helper.make_node("Transpose", ["q1"], ["k_t"], perm=[0, 1, 3, 2]),
              helper.make_node("MatMul", ["q0", "k_t"], ["att"]),
              helper.make_node("Softmax", ["att"], ["p"], axis=-1),
              helper.make_node("MatMul", ["p", "q2"], ["y"])]
    return _model(nodes, [("x", [1, n, 3 * heads * dim])], [("y", [1, heads, n, dim])], inits)


def focus_model(c=3, h=8, w=8) -> onnx.ModelProto:
    """YOLOX's Focus: four stride-2 slices of H/W concatenated on channels, then a conv."""
    nodes, inits = [], [("big", np.array([2**62, 2**62], np.int64)), ("hw", np.array([2, 3], np.int64)),
                        ("st", np.array([2, 2], np.int64)),
                        ("wconv", np.random.default_rng(0).standard_normal((8, 4 * c, 3, 3)).astype(np.float32))]
    for i, (a, b) in enumerate([(0, 0), (1, 0), (0, 1), (1, 1)]):
        inits.append((f"start{i}", np.array([a, b], np.int64)))
        nodes.append(helper.make_node("Slice", ["x", f"start{i}", "big", "hw", "st"], [f"p{i}"]))
    nodes += [helper.make_node("Concat", [f"p{i}" for i in range(4)], ["cat"], axis=1),
              helper.make_node("Conv", ["cat", "wconv"], ["y"], pads=[1, 1, 1, 1])]
    return _model(nodes, [("x", [1, c, h, w])], [("y", [1, 8, h // 2, w // 2])], inits)


def chained_focus_model(c=3, h=8, w=6, order=((0, 0), (1, 0), (0, 1), (1, 1))) -> onnx.ModelProto:
    """Focus as torch exports x[..., a::2, b::2]: a Slice on H, then a Slice on W; the Concat feeds two Convs."""
    rng = np.random.default_rng(1)
    inits = [("big", np.array([2**62], np.int64)), ("two", np.array([2], np.int64)),
             ("ax2", np.array([2], np.int64)), ("ax3", np.array([3], np.int64)),
             ("zero", np.array([0], np.int64)), ("one", np.array([1], np.int64)),
             ("wa", rng.standard_normal((5, 4 * c, 3, 3)).astype(np.float32)),
             ("wb", rng.standard_normal((4, 4 * c, 1, 1)).astype(np.float32)), ("bb", np.ones(4, np.float32))]
    nodes = []
    for i, (a, b) in enumerate(order):
        start = {0: "zero", 1: "one"}
        nodes += [helper.make_node("Slice", ["x", start[a], "big", "ax2", "two"], [f"r{i}"]),
                  helper.make_node("Slice", [f"r{i}", start[b], "big", "ax3", "two"], [f"p{i}"])]
    nodes += [helper.make_node("Concat", [f"p{i}" for i in range(4)], ["cat"], axis=1),
              helper.make_node("Conv", ["cat", "wa"], ["ya"], pads=[1, 1, 1, 1]),
              helper.make_node("Conv", ["cat", "wb", "bb"], ["yb"])]
    return _model(nodes, [("x", [1, c, h, w])], [("ya", [1, 5, h // 2, w // 2]), ("yb", [1, 4, h // 2, w // 2])],
                  inits)


def time_major_head_model(t=6, c=8, hidden=5, classes=4) -> onnx.ModelProto:
    """An unrolled-RNN CRNN head: conv features [1,C,1,T] -> [T,1,C] (batch axis second), one Gemm
    cell per time step, steps stacked back to [T,1,H], Reshape [T,H] -> classifier -> [T,1,K]."""
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("Conv", ["x", "wc"], ["f"]), helper.make_node("Squeeze", ["f", "ax2"], ["s"]),
             helper.make_node("Transpose", ["s"], ["tm"], perm=[2, 0, 1])]
    inits = [("wc", rng.standard_normal((c, 3, 1, 1)).astype(np.float32)), ("ax2", np.array([2], np.int64)),
             ("ax0", np.array([0], np.int64)), ("wg", rng.standard_normal((c, hidden)).astype(np.float32)),
             ("shape2", np.array([t, hidden], np.int64)),
             ("wo", rng.standard_normal((hidden, classes)).astype(np.float32)),
             ("shape3", np.array([t, 1, classes], np.int64))]
    for i in range(t):
        inits.append((f"i{i}", np.array(i, np.int64)))
        nodes += [helper.make_node("Gather", ["tm", f"i{i}"], [f"g{i}"], axis=0),
                  helper.make_node("Gemm", [f"g{i}", "wg"], [f"h{i}"]),
                  helper.make_node("Tanh", [f"h{i}"], [f"a{i}"]),
                  helper.make_node("Unsqueeze", [f"a{i}", "ax0"], [f"u{i}"])]
    nodes += [helper.make_node("Concat", [f"u{i}" for i in range(t)], ["seq"], axis=0),
              helper.make_node("Reshape", ["seq", "shape2"], ["flat"]),
              helper.make_node("Gemm", ["flat", "wo"], ["logits"]),
              helper.make_node("Reshape", ["logits", "shape3"], ["y"])]
    return _model(nodes, [("x", [1, 3, 1, t])], [("y", [t, 1, classes])], inits)


def crnn_lstm_model(t=7, c=6, hidden=4) -> onnx.ModelProto:
    """ddddocr's CRNN tail as onnxsim leaves it: a bidirectional LSTM whose Y_h/Y_c are unused and
    whose output is merged by Reshape [-1, 2H] (torch's export says [0, 0, -1])."""
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("LSTM", ["x", "W", "R", "B"], ["y", "yh", "yc"], direction="bidirectional",
                              hidden_size=hidden),
             helper.make_node("Transpose", ["y"], ["yt"], perm=[0, 2, 1, 3]),
             helper.make_node("Reshape", ["yt", "shape"], ["flat"]),
             helper.make_node("Gemm", ["flat", "wo"], ["out"])]
    inits = [("W", rng.standard_normal((2, 4 * hidden, c)).astype(np.float32)),
             ("R", rng.standard_normal((2, 4 * hidden, hidden)).astype(np.float32)),
             ("B", rng.standard_normal((2, 8 * hidden)).astype(np.float32)),
             ("shape", np.array([-1, 2 * hidden], np.int64)),
             ("wo", rng.standard_normal((2 * hidden, 3)).astype(np.float32))]
    return _model(nodes, [("x", [t, 1, c])], [("out", [t, 3])], inits)


def streaming_lstm_model(hidden=4, c=6) -> onnx.ModelProto:
    """Silero VAD's decoder step: state [2,1,H] split by Gather+Unsqueeze into h0/c0, a one-step LSTM
    whose Y is unused, Y_h read twice (the next layer and the new state), W given by a Constant node."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((1, 4 * hidden, c)).astype(np.float32)
    nodes = [helper.make_node("Constant", [], ["W"], value=numpy_helper.from_array(w)),
             helper.make_node("Unsqueeze", ["R2", "ax0"], ["R"]),
             helper.make_node("Gather", ["state", "i0"], ["h"], axis=0),
             helper.make_node("Gather", ["state", "i1"], ["cst"], axis=0),
             helper.make_node("Unsqueeze", ["h", "ax0"], ["h0"]),
             helper.make_node("Unsqueeze", ["cst", "ax0"], ["c0"]),
             helper.make_node("LSTM", ["x", "W", "R", "B", "", "h0", "c0"], ["y", "yh", "yc"], hidden_size=hidden),
             helper.make_node("Squeeze", ["yh", "ax0"], ["feat"]),
             helper.make_node("Relu", ["feat"], ["out"]),
             helper.make_node("Concat", ["yh", "yc"], ["state_n"], axis=0)]
    inits = [("R2", rng.standard_normal((4 * hidden, hidden)).astype(np.float32)),
             ("B", rng.standard_normal((1, 8 * hidden)).astype(np.float32)), ("ax0", np.array([0], np.int64)),
             ("i0", np.array(0, np.int64)), ("i1", np.array(1, np.int64))]
    return _model(nodes, [("x", [1, 1, c]), ("state", [2, 1, hidden])], [("out", [1, hidden]),
                                                                           ("state_n", [2, 1, hidden])], inits)


# ---- one rewrite at a time ----------------------------------------------------------------------

def test_strided_slice_to_conv_is_exact_and_removes_every_strided_slice():
    new, fired = _same_after(rw.strided_slice_to_conv, focus_model())
    assert fired == 4 and "Slice" not in _ops(new) and _ops(new).count("Conv") == 5


@pytest.mark.parametrize("make", [focus_model, chained_focus_model,
                                  lambda: chained_focus_model(order=((1, 1), (0, 1), (0, 0), (1, 0)))])
def test_focus_becomes_one_pixel_unshuffle_and_its_convs_read_the_new_channel_order(make):
    new, fired = _same_after(rw.focus_to_pixel_unshuffle, make(), exact=False)
    assert fired == 1
    assert _ops(new).count("Slice") == 0 and "Concat" not in _ops(new)
    assert _ops(new)[:3] == ["Reshape", "Transpose", "Reshape"]


def test_focus_rewrite_leaves_a_concat_that_is_not_four_distinct_picks():
    m = chained_focus_model(order=((0, 0), (1, 0), (0, 1), (0, 1)))  # one pixel picked twice
    new, fired = _same_after(rw.focus_to_pixel_unshuffle, m)
    assert fired == 0 and "Concat" in _ops(new)


def test_focus_rewrite_leaves_a_concat_read_by_something_else_than_a_conv():
    m = focus_model()
    m.graph.node.append(helper.make_node("Relu", ["cat"], ["z"]))
    m.graph.output.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 12, 4, 4]))
    new, fired = _same_after(rw.focus_to_pixel_unshuffle, m)
    assert fired == 0 and "Concat" in _ops(new)


def test_strided_slice_to_conv_leaves_slices_whose_size_a_conv_cannot_match():
    # H=7 from start 0 keeps 4 rows; a stride-2 conv gives 3: must stay a Slice
    m = _model([helper.make_node("Slice", ["x", "s", "e", "a", "st"], ["y"])], [("x", [1, 2, 7, 8])],
               [("y", [1, 2, 4, 4])], [("s", np.array([0, 0], np.int64)), ("e", np.array([99, 99], np.int64)),
                                       ("a", np.array([2, 3], np.int64)), ("st", np.array([2, 2], np.int64))])
    new, fired = _same_after(rw.strided_slice_to_conv, m)
    assert fired == 0 and _ops(new) == ["Slice"]


def test_slice_before_transpose_moves_the_cut_to_the_untransposed_axis():
    new, fired = _same_after(rw.slice_before_transpose, qkv_model())
    assert fired == 3
    for node in new.graph.node:
        if node.op_type == "Slice":  # no Slice reads a Transpose any more
            assert next(p for p in new.graph.node if node.input[0] in p.output).op_type == "Reshape"


def test_squeeze_before_transpose_is_exact():
    m = qkv_model()
    step1, _ = _same_after(rw.slice_before_transpose, m)
    new, fired = _same_after(rw.squeeze_before_transpose, step1)
    assert fired == 3
    producers = {o: n.op_type for n in new.graph.node for o in n.output}
    assert all(producers[n.input[0]] != "Transpose" for n in new.graph.node if n.op_type == "Squeeze")


def test_gather_before_transpose_is_exact():
    m = _model([helper.make_node("Transpose", ["x"], ["t"], perm=[2, 0, 1, 3]),
                helper.make_node("Gather", ["t", "i"], ["y"], axis=0)],
               [("x", [1, 5, 3, 4])], [("y", [1, 5, 4])], [("i", np.array(2, np.int64))])
    new, fired = _same_after(rw.gather_before_transpose, m)
    assert fired == 1 and _ops(new) == ["Gather", "Transpose"]
    assert helper.get_attribute_value(new.graph.node[0].attribute[0]) == 2  # gathers on the source axis


def test_slice_of_split_reshape_and_merge_leave_no_5d_tensor():
    m = qkv_model()
    new, applied = rw.rewrite_for_ncnn(m)
    assert {"slice_before_transpose", "squeeze_before_transpose", "slice_of_split_reshape",
            "merge_reshape_chains"} <= set(applied)
    feeds = _feeds(m)
    np.testing.assert_array_equal(_run(m, feeds)[0], _run(new, feeds)[0])
    shapes = rw._Graph(new).shapes
    assert max(len(s) for s in shapes.values()) <= 4, "a 5-D tensor is left for ncnn"


def test_unit_axis_first_before_reshape_is_exact():
    new, fired = _same_after(rw.unit_axis_first_before_reshape, time_major_head_model())
    assert fired == 1  # only the [T,1,H] -> [T,H] reshape: the final [T,K] -> [T,1,K] has no unit axis
    producers = {o: n for n in new.graph.node for o in n.output}
    first = next(n for n in new.graph.node if n.op_type == "Reshape")
    assert helper.get_attribute_value(producers[first.input[0]].attribute[0]) == [1, 0, 2]


def test_lstm_outputs_as_pnnx_expects_is_exact():
    new, fired = _same_after(rw.lstm_outputs_as_pnnx_expects, crnn_lstm_model())
    lstm = next(n for n in new.graph.node if n.op_type == "LSTM")
    assert fired == 2 and list(lstm.output) == ["y"]  # unused Y_h/Y_c dropped
    shapes = [rw._Graph(new).const_ints(n.input[1]) for n in new.graph.node if n.op_type == "Reshape"]
    assert shapes[0] == [0, 0, -1]


def test_fold_constant_shape_ops_is_exact():
    new, fired = _same_after(rw.fold_constant_shape_ops, streaming_lstm_model())
    assert fired == 1 and "R" in {i.name for i in new.graph.initializer}


def test_gather_unsqueeze_to_slice_is_exact():
    new, fired = _same_after(rw.gather_unsqueeze_to_slice, streaming_lstm_model())
    assert fired == 2 and "Gather" not in _ops(new) and _ops(new).count("Slice") == 2


def test_lstm_state_from_sequence_output_is_exact():
    new, fired = _same_after(rw.lstm_state_from_sequence_output, streaming_lstm_model())
    assert fired == 1
    readers = [n.op_type for n in new.graph.node if "yh" in n.input]
    assert readers == ["Concat"]  # the new state still reads Y_h; the next layer reads Y


def test_rewrites_fire_on_nothing_in_a_plain_cnn():
    m = _model([helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Relu", ["c"], ["y"])],
               [("x", [1, 3, 8, 8])], [("y", [1, 4, 6, 6])],
               [("w", np.ones((4, 3, 3, 3), np.float32))])
    new, applied = rw.rewrite_for_ncnn(m)
    assert applied == {} and _ops(new) == ["Conv", "Relu"]


def test_rewritten_names_are_unique_and_deterministic():
    a, _ = rw.rewrite_for_ncnn(qkv_model())
    b, _ = rw.rewrite_for_ncnn(qkv_model())
    assert a.SerializeToString() == b.SerializeToString()
    names = [o for n in a.graph.node for o in n.output] + [i.name for i in a.graph.initializer]
    assert len(names) == len(set(names))


# ---- through the real pnnx and ncnn -------------------------------------------------------------

def _pnnx_leftovers(m: onnx.ModelProto, tmp_path) -> list[str]:
    import subprocess

    import ncnn

    from edgepack.backends.ncnn.convert import parse_param_layers, pnnx_executable
    tmp_path.mkdir(parents=True, exist_ok=True)
    onnx.save(m, tmp_path / "model.onnx")
    shape = ",".join("[" + ",".join(str(d.dim_value) for d in i.type.tensor_type.shape.dim) + "]"
                     for i in m.graph.input)
    subprocess.run([str(pnnx_executable()), "model.onnx", f"inputshape={shape}"], cwd=tmp_path,
                   capture_output=True, timeout=300, check=True)
    layers = parse_param_layers((tmp_path / "model.ncnn.param").read_text())
    bad = sorted(t for t, _ in layers if ncnn.layer_to_index(t) < 0)
    if ncnn.Net().load_param(str(tmp_path / "model.ncnn.param")) != 0:
        bad.append("(ncnn cannot load the .param)")  # a known layer type written without its params
    return bad


@pytest.mark.parametrize("make", [qkv_model, focus_model, chained_focus_model, time_major_head_model,
                                  crnn_lstm_model, streaming_lstm_model])
def test_pnnx_leaves_layers_ncnn_lacks_without_the_rewrites_and_none_with_them(make, tmp_path):
    m = make()
    assert _pnnx_leftovers(m, tmp_path / "before"), "pnnx now converts this pattern: the rewrite may be unneeded"
    new, applied = rw.rewrite_for_ncnn(m)
    assert applied
    assert _pnnx_leftovers(new, tmp_path / "after") == []


def test_convert_rewrites_then_checks_against_onnxruntime_on_the_original(tmp_path):
    """edgepack's NCNN conversion retries with rewrites and records them; its own check compares the
    converted model with onnxruntime on the unrewritten graph."""
    from edgepack.backends.ncnn.convert import convert
    from edgepack.model import load_model
    onnx.save(qkv_model(), tmp_path / "qkv.onnx")
    converted = convert(load_model(tmp_path / "qkv.onnx"), "fp32", log=lambda m: None)
    assert any(r.startswith("slice_of_split_reshape") for r in converted.rewrites)
    assert converted.check_error < 1e-4


def test_focus_converts_to_one_reorg_that_agrees_with_onnxruntime(tmp_path):
    """The Focus rewrite's point: ncnn runs one Reorg instead of four depthwise Convs and a Concat,
    and pnnx's Reorg order matches the reordered Conv weights (checked by convert on the original)."""
    from edgepack.backends.ncnn.convert import convert
    from edgepack.model import load_model
    onnx.save(chained_focus_model(c=3, h=16, w=12), tmp_path / "focus.onnx")
    converted = convert(load_model(tmp_path / "focus.onnx"), "fp32", log=lambda m: None)
    assert any(r.startswith("focus_to_pixel_unshuffle") for r in converted.rewrites)
    assert "Reorg" in converted.layer_types
    assert "ConvolutionDepthWise" not in converted.layer_types and "Concat" not in converted.layer_types
    # outputs reach ~30 (108 products of N(0,1) each); Reorg in the other channel order is off by ~4
    assert converted.check_error < 1e-3
