"""Integer inputs into NCNN only as embedding ids (edgepack/backends/ncnn/token_ids.py): which graphs
qualify, the form handed to pnnx, and the check that only Embed layers read the ids after pnnx."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgepack.backends.ncnn.token_ids import as_pnnx_embeddings, embed_only, id_inputs
from edgepack.errors import UnsupportedOpError
from edgepack.model import TensorSpec


def lookup(table_rows=(30,), axis=0, ids_shape=(1, 12), dtype=TensorProto.INT64, extra=None) -> onnx.ModelProto:
    """ids -> one Gather per table (summed); ``extra`` adds a node reading ids."""
    inits, nodes, outs = [], [], []
    for k, rows in enumerate(table_rows):
        inits.append(numpy_helper.from_array(np.ones((rows, 4), np.float32), f"t{k}"))
        nodes.append(helper.make_node("Gather", [f"t{k}", "ids"], [f"e{k}"], name=f"g{k}", axis=axis))
        outs.append(f"e{k}")
    nodes.append(helper.make_node("Sum", outs, ["y"]))
    if extra is not None:
        nodes.append(extra)
    g = helper.make_graph(nodes, "ids", [helper.make_tensor_value_info("ids", dtype, list(ids_shape))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def specs(shape=(1, 12), dtype="int64"):
    return (TensorSpec("ids", tuple(shape), dtype),)


@pytest.mark.parametrize("dtype, onnx_type", [("int64", TensorProto.INT64), ("int32", TensorProto.INT32)])
def test_lookups_into_tables_of_one_size_qualify(dtype, onnx_type):
    m = lookup((30, 30), dtype=onnx_type)
    assert id_inputs(m, specs(dtype=dtype), "m.onnx") == {"ids": 30}
    assert id_inputs(m, specs((12,), dtype), "m.onnx") == {"ids": 30}   # no batch axis
    assert id_inputs(m, (TensorSpec("ids", (1, 12), "float32"),), "m.onnx") == {}  # a float input is not ids


@pytest.mark.parametrize("model, shape, why", [
    (lookup(extra=helper.make_node("Cast", ["ids"], ["f"], to=TensorProto.FLOAT, name="c")), (1, 12),
     r"it feeds Cast \(node c\)"),
    (lookup(axis=1), (1, 12), r"it feeds Gather \(node g0\)"),               # not a row lookup
    (lookup((30, 40)), (1, 12), r"one embedding table size; it indexes \[30, 40\]"),
    (lookup(ids_shape=(2, 12)), (2, 12), r"of one row \(it is \[2, 12\]\)"),  # Embed reads one row of ids
])
def test_other_uses_are_refused_by_name(model, shape, why):
    with pytest.raises(UnsupportedOpError, match=why):
        id_inputs(model, specs(shape), "m.onnx")


def test_an_unread_integer_input_is_refused():
    m = lookup()
    m.graph.input.append(helper.make_tensor_value_info("lens", TensorProto.INT64, [1]))
    with pytest.raises(UnsupportedOpError, match="input lens is int64.* it indexes none"):
        id_inputs(m, specs() + (TensorSpec("lens", (1,), "int64"),), "m.onnx")


def test_pnnx_gets_lookups_without_the_axis_attribute():
    m = lookup((30,))
    m.graph.node.append(helper.make_node("Gather", ["t0", "other"], ["z"], axis=0, name="kept"))
    out = as_pnnx_embeddings(m, {"ids": 30})
    assert [list(n.attribute) for n in out.graph.node if n.op_type == "Gather"] == [[], list(m.graph.node[-1].attribute)]
    assert len(m.graph.node[0].attribute) == 1  # the original is untouched
    assert as_pnnx_embeddings(m, {}) is m


PARAM = """7767517
6 8
Input            in0     0 1 in0
Split            split0  1 2 in0 a b
Embed            emb0    1 1 a e0 0=4 1=30 2=0 3=120
Embed            emb1    1 1 b e1 0=4 1=30 2=0 3=120
BinaryOp         add0    2 1 e0 e1 out0 0=0
Input            in1     0 1 in1
"""


def test_only_embed_layers_may_read_the_ids():
    assert embed_only(PARAM, "in0")
    assert not embed_only(PARAM.replace("Embed            emb1", "Convolution      emb1"), "in0")
    assert not embed_only(PARAM, "in1")   # read by nothing: not a lookup input at all
