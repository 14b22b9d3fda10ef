"""Graph partitioning (issue 9 item 4): plans on tiny onnx.helper graphs, checked by running
the segments in sequence with onnxruntime against the whole graph; and partitioned artifacts
(NCNN + TVM in one executable) built for x86_64 and arm64 (qemu) and run on fresh inputs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgepack.model import load_model, simplify
from edgepack.partition import Plan, PlanError, plan

RNG_SEED = 9


def _save(model: onnx.ModelProto, path: Path) -> Path:
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _conv(name: str, x: str, y: str, cin: int, cout: int, rng) -> tuple[onnx.NodeProto, list]:
    w = numpy_helper.from_array((rng.standard_normal((cout, cin, 3, 3)) * 0.3).astype(np.float32), f"{name}_w")
    b = numpy_helper.from_array((rng.standard_normal(cout) * 0.1).astype(np.float32), f"{name}_b")
    return helper.make_node("Conv", [x, w.name, b.name], [y], name=name, pads=[1, 1, 1, 1]), [w, b]


def conv_topk_conv(path: Path, op: str = "TopK") -> Path:
    """Conv -> Relu -> (an op NCNN lacks) -> Conv: NCNN, then TVM, then NCNN."""
    rng = np.random.default_rng(RNG_SEED)
    c1, i1 = _conv("conv1", "x", "c1", 3, 8, rng)
    c2, i2 = _conv("conv2", "mid", "y", 8, 4, rng)
    nodes, inits = [c1, helper.make_node("Relu", ["c1"], ["r1"], name="relu1")], i1 + i2
    if op == "TopK":  # the 8 largest along W, sorted: 1x8x16x16 -> 1x8x16x8
        inits.append(numpy_helper.from_array(np.array([8], np.int64), "k"))
        nodes.append(helper.make_node("TopK", ["r1", "k"], ["mid", "idx"], name="topk", axis=3))
    elif op == "CumSum":
        inits.append(numpy_helper.from_array(np.array(3, np.int64), "axis"))
        nodes.append(helper.make_node("CumSum", ["r1", "axis"], ["mid"], name="cumsum"))
    else:
        raise ValueError(op)
    nodes.append(c2)
    w = 8 if op == "TopK" else 16
    g = helper.make_graph(nodes, "partition_test", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, w])], inits)
    return _save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)


def branches(path: Path) -> Path:
    """Two branches from one input, one with an op NCNN lacks, joined by Add; plus a second output."""
    rng = np.random.default_rng(RNG_SEED + 1)
    c1, i1 = _conv("conv1", "x", "c1", 3, 4, rng)
    c2, i2 = _conv("conv2", "x", "c2", 3, 4, rng)
    c3, i3 = _conv("conv3", "s", "y", 4, 4, rng)
    axis = numpy_helper.from_array(np.array(2, np.int64), "axis")
    nodes = [c1, c2, helper.make_node("CumSum", ["c1", "axis"], ["cs"], name="cumsum"),
             helper.make_node("Add", ["cs", "c2"], ["s"], name="add"), c3,
             helper.make_node("Sigmoid", ["c2"], ["side"], name="sig")]
    g = helper.make_graph(nodes, "branches", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8]),
                           helper.make_tensor_value_info("side", TensorProto.FLOAT, [1, 4, 8, 8])],
                          i1 + i2 + i3 + [axis])
    return _save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)


def where_int_mask(path: Path) -> Path:
    """Conv -> Greater (bool) -> Where -> Conv: the bool tensor must not cross into NCNN."""
    rng = np.random.default_rng(RNG_SEED + 2)
    c1, i1 = _conv("conv1", "x", "c1", 3, 4, rng)
    c2, i2 = _conv("conv2", "w", "y", 4, 4, rng)
    zero = numpy_helper.from_array(np.array(0.0, np.float32), "zero")
    nodes = [c1, helper.make_node("Greater", ["c1", "zero"], ["m"], name="gt"),
             helper.make_node("Neg", ["c1"], ["n"], name="neg"),
             helper.make_node("Where", ["m", "c1", "n"], ["w"], name="where"), c2]
    g = helper.make_graph(nodes, "where", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], i1 + i2 + [zero])
    return _save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)


# ---- the plan, with onnxruntime ----------------------------------------------------------------

NCNN_LACKS = {"TopK", "CumSum", "Where", "Greater"}


def _support(tvm_lacks=frozenset()):
    return {"ncnn": lambda op: op not in NCNN_LACKS, "tvm": lambda op: op not in tvm_lacks}


def _ort(model: onnx.ModelProto, feeds: dict) -> dict:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, {i.name: feeds[i.name] for i in sess.get_inputs()})))


def _run_in_sequence(p: Plan, feeds: dict) -> dict:
    values = dict(feeds)
    for seg in p.segments:
        assert set(seg.inputs) <= set(values), f"segment reads {seg.inputs} before they exist"
        assert [i.name for i in seg.model.graph.input] == list(seg.inputs)
        values.update(_ort(seg.model, values))
    return values


def _check_plan_equals_whole(path: Path, support) -> Plan:
    model = simplify(load_model(path))
    p = plan(model, support)
    feeds = {s.name: np.random.default_rng(3).standard_normal(s.shape).astype(np.float32) for s in model.inputs}
    want = _ort(model.proto, feeds)
    got = _run_in_sequence(p, feeds)
    for name, ref in want.items():
        np.testing.assert_array_equal(got[name], ref)  # same kernels, same order: bit-identical
    return p


def test_plan_cuts_around_the_op_ncnn_lacks(tmp_path):
    p = _check_plan_equals_whole(conv_topk_conv(tmp_path / "m.onnx"), _support())
    assert p.backends == ("ncnn", "tvm", "ncnn")
    assert p.segments[1].ops == ("TopK",)
    assert p.segments[0].outputs == p.segments[1].inputs and p.segments[1].outputs == p.segments[2].inputs
    # initializers stay with their consumer
    assert {i.name for i in p.segments[0].model.graph.initializer} == {"conv1_w", "conv1_b"}
    assert {i.name for i in p.segments[2].model.graph.initializer} == {"conv2_w", "conv2_b"}


def test_plan_one_backend_is_one_segment(tmp_path):
    p = _check_plan_equals_whole(conv_topk_conv(tmp_path / "m.onnx"), {"ncnn": lambda op: True})
    assert p.backends == ("ncnn",) and not p.is_split


def test_plan_branches_and_two_outputs(tmp_path):
    p = _check_plan_equals_whole(branches(tmp_path / "b.onnx"), _support())
    # both convs of the input and the side output first (one NCNN segment), CumSum on TVM, then
    # Add + conv3 together on NCNN: three segments, not four
    assert p.backends == ("ncnn", "tvm", "ncnn"), p.describe()
    assert p.segments[0].ops == ("Conv", "Sigmoid") and p.segments[2].ops == ("Add", "Conv")
    assert set(p.segments[0].outputs) >= {"side"}


def test_plan_keeps_bool_tensors_inside_tvm(tmp_path):
    p = _check_plan_equals_whole(where_int_mask(tmp_path / "w.onnx"), _support())
    types = {v.name: v.type.tensor_type.elem_type for s in p.segments for v in list(s.model.graph.input)
             + list(s.model.graph.output)}
    for s in p.segments:
        if s.backend == "ncnn":
            assert all(types[t] == TensorProto.FLOAT for t in s.inputs + s.outputs)
    assert p.backends == ("ncnn", "tvm", "ncnn")


def test_plan_reverse_tvm_lacks_the_op(tmp_path):
    # the same graph with the roles swapped: TVM lacks Conv here, NCNN has it
    p = _check_plan_equals_whole(conv_topk_conv(tmp_path / "m.onnx", "CumSum"),
                                 {"tvm": lambda op: op != "Conv", "ncnn": lambda op: op not in NCNN_LACKS})
    assert p.backends == ("ncnn", "tvm", "ncnn")


def test_plan_refuses_an_op_no_backend_has(tmp_path):
    with pytest.raises(PlanError, match="TopK"):
        plan(simplify(load_model(conv_topk_conv(tmp_path / "m.onnx"))), {"ncnn": lambda op: op != "TopK"})
