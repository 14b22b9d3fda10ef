"""spelled_out.py against onnxruntime: one-hot products become exact lookups (ids outside the table
included), written-out softmaxes become Softmax, and the forms that are not those stay."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgepack.model import load_model
from edgepack.spelled_out import fold_spelled_out

D, F, N = 11, 5, 9


def _save(tmp_path: Path, nodes, inputs, outputs, inits, opset: int = 15) -> Path:
    g = helper.make_graph(nodes, "m", inputs, outputs, [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    path = tmp_path / f"m{len(list(tmp_path.iterdir()))}.onnx"
    onnx.save(m, str(path))
    return path


def one_hot_model(tmp_path: Path, id_type=TensorProto.INT32, expand: bool = False, table=None, rng_values=None,
                  swap: bool = False, extra_reader: bool = False) -> Path:
    """ids[1, N] -> Reshape [1, N, 1] (-> Expand [1, N, D]) -> Equal arange(D) -> Cast -> MatMul W[D, F],
    as jax2tf writes one_hot(ids) @ W."""
    np_int = helper.tensor_dtype_to_np_dtype(id_type)
    w = np.random.default_rng(3).standard_normal((D, F)).astype(np.float32) if table is None else table
    rng = (np.arange(D) if rng_values is None else rng_values).astype(np_int).reshape(1, 1, D)
    inits = {"shape3": np.array([1, N, 1], np.int64), "range": rng, "w": w, "wide": np.array([1, N, D], np.int64)}
    nodes = [helper.make_node("Reshape", ["ids", "shape3"], ["col"])]
    col = "col"
    if expand:
        nodes.append(helper.make_node("Expand", ["col", "wide"], ["colx"]))
        col = "colx"
    nodes += [helper.make_node("Equal", ["range", col] if swap else [col, "range"], ["hot"]),
              helper.make_node("Cast", ["hot"], ["hotf"], to=TensorProto.FLOAT),
              helper.make_node("MatMul", ["hotf", "w"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N, F])]
    if extra_reader:
        nodes.append(helper.make_node("ReduceSum", ["hotf"], ["count"], keepdims=0))
        outputs.append(helper.make_tensor_value_info("count", TensorProto.FLOAT, []))
    return _save(tmp_path, nodes, [helper.make_tensor_value_info("ids", id_type, [1, N])], outputs, inits)


def one_hot_op_model(tmp_path: Path, id_type=TensorProto.INT64, values=(0.0, 1.0), axis: int = -1) -> Path:
    """ids[1, N] -> OneHot(depth D, values) -> MatMul W[D, F], as torch's F.one_hot and tf2onnx write it."""
    w = np.random.default_rng(4).standard_normal((D, F)).astype(np.float32)
    inits = {"depth": np.array(D, np.int64), "values": np.array(values, np.float32), "w": w}
    nodes = [helper.make_node("OneHot", ["ids", "depth", "values"], ["hot"], axis=axis),
             helper.make_node("MatMul", ["hot", "w"], ["y"])]
    return _save(tmp_path, nodes, [helper.make_tensor_value_info("ids", id_type, [1, N])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N, F])], inits)


def softmax_model(tmp_path: Path, axis: int = 1, keepdims: int = 0, neg_inf_max: bool = True, opset: int = 15,
                  sum_axis: int | None = None, exp_read: bool = False) -> Path:
    """x[2, 7, 3] -> ReduceMax(axis) [-> Max(-inf)] [-> Reshape] -> Sub -> Exp -> ReduceSum(axis) [-> Reshape]
    -> Div, as jax2tf writes jax.nn.softmax (opset 15: ReduceSum's axes an input)."""
    shape = [2, 7, 3]
    kept = [1 if k == axis else d for k, d in enumerate(shape)]
    sum_axis = axis if sum_axis is None else sum_axis
    inits = {"kept": np.array(kept, np.int64), "ninf": np.array(-np.inf, np.float32),
             "sax": np.array([sum_axis], np.int64)}
    nodes = [helper.make_node("ReduceMax", ["x"], ["m"], axes=[axis], keepdims=keepdims)]
    peak = "m"
    if neg_inf_max:
        nodes.append(helper.make_node("Max", ["ninf", peak], ["m2"]))
        peak = "m2"
    nodes += [helper.make_node("Reshape", [peak, "kept"], ["mk"]),
              helper.make_node("Sub", ["x", "mk"], ["d"]),
              helper.make_node("Exp", ["d"], ["e"]),
              helper.make_node("ReduceSum", ["e", "sax"] if opset >= 13 else ["e"], ["s"], keepdims=keepdims,
                               **({} if opset >= 13 else {"axes": [sum_axis]})),
              helper.make_node("Reshape", ["s", "kept"], ["sk"]),
              helper.make_node("Div", ["e", "sk"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)]
    if exp_read:
        outputs.append(helper.make_tensor_value_info("e", TensorProto.FLOAT, shape))
    if opset < 13:
        inits.pop("sax")
    return _save(tmp_path, nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)], outputs, inits,
                 opset)


def _run(proto: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _ops(model) -> list[str]:
    return [n.op_type for n in model.proto.graph.node]


# ids inside the table, at its ends, past them, and negative (a one-hot row of zeros for those)
EDGE_IDS = [0, D - 1, D, D + 7, -1, -D, -D - 1, 2**31 - 1, -(2**31), 3]


@pytest.mark.parametrize("id_type", [TensorProto.INT32, TensorProto.INT64])
@pytest.mark.parametrize("form", ["plain", "expand", "swap"])
def test_one_hot_product_becomes_an_exact_lookup(tmp_path, id_type, form):
    path = one_hot_model(tmp_path, id_type, expand=form == "expand", swap=form == "swap")
    before = load_model(path)
    after = fold_spelled_out(before)
    assert after is not before and "Gather" in _ops(after), _ops(after)
    assert not {"Equal", "MatMul", "Cast"} & set(_ops(after)), _ops(after)
    assert "1 one-hot product(s) as a Gather" in after.notes[-1]
    onnx.checker.check_model(after.proto, full_check=True)
    np_int = helper.tensor_dtype_to_np_dtype(id_type)
    for ids in (np.random.default_rng(1).integers(0, D, (1, N)), np.array([EDGE_IDS[:N]])):
        feeds = {"ids": ids.astype(np_int)}
        want, got = _run(before.proto, feeds)[0], _run(after.proto, feeds)[0]
        np.testing.assert_array_equal(got, want)  # bit for bit: the product added W[i, f] to zeros
    assert not _run(after.proto, {"ids": np.array([[D, -1, -D - 1] * 3], np_int)})[0].any()


def test_onnx_one_hot_product_becomes_an_exact_lookup_counting_negative_ids_from_the_end(tmp_path):
    id_type = TensorProto.INT64  # onnxruntime has no float OneHot kernel for int32 ids with an int64 depth
    before = load_model(one_hot_op_model(tmp_path, id_type))
    after = fold_spelled_out(before)
    assert "Gather" in _ops(after) and not {"OneHot", "MatMul"} & set(_ops(after)), _ops(after)
    onnx.checker.check_model(after.proto, full_check=True)
    np_int = helper.tensor_dtype_to_np_dtype(id_type)
    edges = [0, D - 1, -1, -D, D, -D - 1, 2**31 - 1, -(2**31), 5]  # -D..-1: rows from the end; others: zeros
    for ids in (np.random.default_rng(2).integers(-D, D, (1, N)), np.array([edges])):
        feeds = {"ids": ids.astype(np_int)}
        np.testing.assert_array_equal(_run(after.proto, feeds)[0], _run(before.proto, feeds)[0])


@pytest.mark.parametrize("values", [(0.0, 2.0), (1.0, 0.0)])
def test_onnx_one_hots_with_other_values_stay(tmp_path, values):
    before = load_model(one_hot_op_model(tmp_path, values=values))
    assert fold_spelled_out(before) is before


@pytest.mark.parametrize("change", ["table with inf", "not arange", "cast read elsewhere"])
def test_other_one_hot_forms_stay(tmp_path, change):
    table = np.ones((D, F), np.float32)
    table[2, 1] = np.inf  # 0 x inf is NaN in the product: a lookup would differ
    path = one_hot_model(tmp_path, table=table if change == "table with inf" else None,
                         rng_values=np.arange(1, D + 1) if change == "not arange" else None,
                         extra_reader=change == "cast read elsewhere")
    before = load_model(path)
    assert fold_spelled_out(before) is before


@pytest.mark.parametrize("axis,keepdims,neg_inf_max", [(1, 0, True), (1, 1, False), (2, 0, True), (0, 1, True)])
def test_written_out_softmax_becomes_softmax(tmp_path, axis, keepdims, neg_inf_max):
    path = softmax_model(tmp_path, axis, keepdims, neg_inf_max)
    before = load_model(path)
    after = fold_spelled_out(before)
    assert _ops(after) == ["Softmax"], _ops(after)
    assert after.proto.graph.node[0].attribute[0].i == axis
    onnx.checker.check_model(after.proto, full_check=True)
    x = (np.random.default_rng(axis).standard_normal((2, 7, 3)) * 20).astype(np.float32)
    x[0, 0, 0] = 80.0  # exp would overflow without the max subtracted
    np.testing.assert_allclose(_run(after.proto, {"x": x})[0], _run(before.proto, {"x": x})[0], rtol=1e-6, atol=1e-7)


def test_old_opset_softmax_over_an_inner_axis_stays(tmp_path):
    """Before opset 13 Softmax(axis) normalises over every axis from `axis` on: the last axis only."""
    inner = load_model(softmax_model(tmp_path, axis=1, opset=11))
    assert fold_spelled_out(inner) is inner
    last = fold_spelled_out(load_model(softmax_model(tmp_path, axis=2, opset=11)))
    assert _ops(last) == ["Softmax"]


@pytest.mark.parametrize("change", ["sum over another axis", "exp read elsewhere"])
def test_other_softmax_forms_stay(tmp_path, change):
    before = load_model(softmax_model(tmp_path, sum_axis=2 if change == "sum over another axis" else None,
                                      exp_read=change == "exp read elsewhere"))
    assert fold_spelled_out(before) is before
