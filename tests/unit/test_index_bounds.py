"""index_bounds.py against onnxruntime: computed indices taken modulo their extents keep every valid
index (negative ones too) where ONNX puts it, and put any other inside the tensor; check_extents finds
the extent an integer input indexes through ops that keep its values, and nothing through others."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgepack.backends.tvm.index_bounds import bounded, check_extents

DATA = np.arange(4 * 5 * 3, dtype=np.float32).reshape(4, 5, 3)


def _model(op: str, idx_shape: list[int], axis: int = 1, id_type=TensorProto.INT64, pre: str | None = None):
    inits = [numpy_helper.from_array(DATA, "data")]
    nodes, idx = [], "idx"
    if pre == "reshape":
        inits.append(numpy_helper.from_array(np.array(idx_shape, np.int64), "shape"))
        nodes.append(helper.make_node("Reshape", ["idx", "shape"], ["idx_r"]))
        idx = "idx_r"
    elif pre == "add":
        inits.append(numpy_helper.from_array(np.array(1, helper.tensor_dtype_to_np_dtype(id_type)), "one"))
        nodes.append(helper.make_node("Add", ["idx", "one"], ["idx_a"]))
        idx = "idx_a"
    if op in ("Gather", "GatherElements"):
        nodes.append(helper.make_node(op, ["data", idx], ["y"], axis=axis))
    elif op == "ScatterElements":
        inits.append(numpy_helper.from_array(np.full(idx_shape, -1.0, np.float32), "upd"))
        nodes.append(helper.make_node(op, ["data", idx, "upd"], ["y"], axis=axis))
    elif op == "GatherND":
        nodes.append(helper.make_node(op, ["data", idx], ["y"]))
    else:  # ScatterND
        inits.append(numpy_helper.from_array(np.full(idx_shape[:-1] + [3], -1.0, np.float32), "upd"))
        nodes.append(helper.make_node(op, ["data", idx, "upd"], ["y"]))
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("idx", id_type, idx_shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 16)])
    m.ir_version = 8
    return onnx.shape_inference.infer_shapes(m)


def _run(m: onnx.ModelProto, idx: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"idx": idx})[0]


CASES = [  # op, index shape, valid indices (negative ones included), out-of-range ones
    ("Gather", [2, 3], np.array([[0, 4, -1], [-5, 2, 3]]), np.array([[5, -6, 10**12], [-(10**12), 7, 0]])),
    ("GatherElements", [4, 2, 3], np.tile(np.array([[0, 4, -5], [-1, 2, 3]]), (4, 1, 1)), np.full((4, 2, 3), 9)),
    ("ScatterElements", [4, 1, 3], np.array([[[0, -1, 4]]] * 4), np.array([[[5, -6, 2**40]]] * 4)),
    ("GatherND", [2, 2], np.array([[3, -5], [-4, 4]]), np.array([[4, 0], [0, -6]])),
    ("ScatterND", [2, 2], np.array([[0, 1], [-1, -5]]), np.array([[4, 5], [-5, -6]])),
]


# GatherND / ScatterND take int64 indices only
TYPED = [(*c, t) for c in CASES for t in (TensorProto.INT64, TensorProto.INT32) if t == TensorProto.INT64
         or not c[0].endswith("ND")]


@pytest.mark.parametrize("op,shape,good,bad,id_type", TYPED,
                         ids=[f"{c[0]}-{'i64' if c[4] == TensorProto.INT64 else 'i32'}" for c in TYPED])
def test_valid_indices_land_where_onnx_puts_them_and_others_inside(op, shape, good, bad, id_type):
    m = _model(op, shape, id_type=id_type)
    new, done, left = bounded(m)
    assert (done, left) == (1, 0)
    assert [n.op_type for n in new.graph.node] == ["Mod", op]
    np_int = helper.tensor_dtype_to_np_dtype(id_type)
    np.testing.assert_array_equal(_run(new, good.astype(np_int)), _run(m, good.astype(np_int)))
    bad = bad.astype(np_int)
    with pytest.raises(Exception):  # onnxruntime refuses them in the original graph
        _run(m, bad)
    y = _run(new, bad)  # bounded: an answer from inside the tensor, no read outside it
    assert y.shape == _run(m, good.astype(np_int)).shape and np.isin(y, np.append(DATA, -1.0)).all()


def test_constant_indices_are_left_alone():
    m = _model("Gather", [2])
    m.graph.initializer.append(numpy_helper.from_array(np.array([1, 2], np.int64), "cidx"))
    m.graph.node[0].input[1] = "cidx"
    assert bounded(m) == (m, 0, 0)


def test_check_extents_follows_only_ops_that_keep_the_values():
    assert check_extents(_model("Gather", [2, 3], axis=1), ["idx"]) == {"idx": 5}
    assert check_extents(_model("Gather", [2, 3], axis=2, pre="reshape"), ["idx"]) == {"idx": 3}
    assert check_extents(_model("GatherElements", [4, 2, 3], axis=0), ["idx"]) == {"idx": 4}
    assert check_extents(_model("Gather", [2, 3], pre="add"), ["idx"]) == {}  # computed: Mod bounds it instead
    assert check_extents(_model("GatherND", [2, 2]), ["idx"]) == {}  # coordinates: Mod bounds them
