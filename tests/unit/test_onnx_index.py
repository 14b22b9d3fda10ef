"""edgepack/onnx_index.py: the constants and tensor tables every graph rewrite starts from."""
import numpy as np
from onnx import TensorProto, helper, numpy_helper

from edgepack.onnx_index import constants, tensor_infos


def _model(batch="N"):
    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "w")
    k = helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.array([2.0], np.float32)))
    mm = helper.make_node("MatMul", ["x", "w"], ["y0"])
    mul = helper.make_node("Mul", ["y0", "k"], ["y"])
    g = helper.make_graph([k, mm, mul], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_constants_hold_initializers_and_constant_nodes():
    c = constants(_model())
    assert set(c) == {"w", "k"}
    assert c["w"].shape == (4, 3) and c["k"].tolist() == [2.0]


def test_inferred_dims_keep_symbols_as_none_and_static_only_when_known():
    infos = tensor_infos(_model())
    assert infos["y0"].dims == (None, 3) and infos["y0"].static is None
    assert infos["w"].static == (4, 3) and infos["w"].elem_type == TensorProto.FLOAT
    assert infos["y"].np_dtype == np.float32
    fixed = tensor_infos(_model(batch=2))
    assert fixed["y"].static == (2, 3)


def test_without_inference_or_initializers_only_what_the_graph_records():
    infos = tensor_infos(_model(), infer=False, initializers=False)
    assert "y0" not in infos and "w" not in infos
    assert infos["y"].dims is None          # declared without a shape: rank unknown
    assert infos["x"].dims == (None, 4)


def test_unknown_ops_leave_their_outputs_unknown_and_the_rest_inferred():
    m = _model(batch=2)
    m.graph.node.append(helper.make_node("NoSuchOp", ["y"], ["z"], domain="nowhere.example"))
    m.opset_import.append(helper.make_opsetid("nowhere.example", 1))
    infos = tensor_infos(m)
    assert infos["y"].static == (2, 3)
    assert "z" not in infos or infos["z"].dims is None
