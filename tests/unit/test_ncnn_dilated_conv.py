"""edgepack/backends/ncnn/dilated_conv.py: a 3x3 Conv dilated along its height as an undilated Conv over
the row phases side by side, checked against onnxruntime in-process (dilations 2 and 3, heights that
are not a multiple of the dilation, asymmetric pads, a bias, a fused activation) and left alone where
ncnn would not take Winograd anyway or the form differs."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgepack.backends.ncnn.dilated_conv import dilated_convs_as_phases


def dilated(c: int, o: int, h: int, w: int, dilations=(2, 1), pads=(2, 1, 2, 1), bias: bool = True,
            act: str | None = "LeakyRelu", kernel=(3, 3), strides=(1, 1), group: int = 1,
            opset: int = 13, pool: dict | None = None) -> onnx.ModelProto:
    """x [1, C, H, W] -> Conv(O, kernel, dilations, pads) [-> act] [-> pool(**pool)] -> y."""
    rng = np.random.default_rng(c * 7 + o + h)
    inits = [numpy_helper.from_array(rng.standard_normal((o, c // group, *kernel)).astype(np.float32), "w")]
    ins = ["x", "w"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(o).astype(np.float32), "b"))
        ins.append("b")
    conv_out = "c" if act else ("a" if pool else "y")
    nodes = [helper.make_node("Conv", ins, [conv_out], kernel_shape=list(kernel), dilations=list(dilations),
                              pads=list(pads), strides=list(strides), group=group)]
    if act == "LeakyRelu":
        nodes.append(helper.make_node("LeakyRelu", ["c"], ["a" if pool else "y"], alpha=0.1))
    elif act == "Clip":
        inits += [numpy_helper.from_array(np.array(0, np.float32), "lo"),
                  numpy_helper.from_array(np.array(6, np.float32), "hi")]
        nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["a" if pool else "y"]))
    out = [1, o] + [(size + pads[i] + pads[i + 2] - dilations[i] * (kernel[i] - 1) - 1) // strides[i] + 1
                    for i, size in enumerate((h, w))]
    if pool:
        pool = dict(pool)
        op = pool.pop("op", "MaxPool")
        nodes.append(helper.make_node(op, ["a"], ["y"], **pool))
        pp = pool.get("pads", [0] * 4)
        out = out[:2] + [(n + pp[i] + pp[i + 2] - k) // s + 1
                         for i, (n, k, s) in enumerate(zip(out[2:], pool["kernel_shape"], pool["strides"]))]
    graph = helper.make_graph(nodes, "dilated", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, h, w])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


@pytest.mark.parametrize("c, o, h, w, d, pads, act", [
    (32, 64, 40, 17, 2, (1, 1, 1, 1), "LeakyRelu"),  # PLCMOS' form: pad 1 on each side, leaky ReLU fused
    (16, 16, 41, 9, 2, (2, 1, 2, 1), "Clip"),       # odd padded height: one extra row made and dropped
    (1, 32, 30, 12, 3, (0, 2, 3, 0), None),         # dilation 3, asymmetric pads, one input channel
    (12, 8, 25, 5, 4, (4, 1, 4, 1), "LeakyRelu"),   # dilation 4, 25 + 8 rows
])
def test_phases_side_by_side_compute_the_same_convolution(c, o, h, w, d, pads, act):
    model = dilated(c, o, h, w, dilations=(d, 1), pads=pads, act=act)
    rewritten, count = dilated_convs_as_phases(model)
    assert count == 1
    onnx.checker.check_model(rewritten)
    ops = [n.op_type for n in rewritten.graph.node]
    convs = [n for n in rewritten.graph.node if n.op_type == "Conv"]
    assert len(convs) == 1 and ops.count("Reshape") == 2 and ops.count("Slice") == 1
    attrs = {a.name: list(a.ints) for a in convs[0].attribute}
    assert attrs["dilations"] == [1, 1] and attrs["pads"] == [0, 0, 0, 2]
    if act:  # the activation moved to right after the Conv, where pnnx fuses it into ncnn's Convolution
        assert ops.index(act) == ops.index("Conv") + 1
    x = np.random.default_rng(h).standard_normal((1, c, h, w)).astype(np.float32)
    want, got = run(model, x), run(rewritten, x)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * float(np.abs(want).max()))


@pytest.mark.parametrize("why, kwargs", [
    ("dilated along the width", dict(dilations=(1, 2))),
    ("dilated both ways (ncnn's own split may take it)", dict(dilations=(2, 2))),
    ("strided", dict(strides=(1, 2))),
    ("grouped", dict(group=4)),
    ("not 3x3: no Winograd after the rewrite", dict(kernel=(5, 5), pads=(4, 2, 4, 2))),
    ("few channels: ncnn prefers no Winograd", dict(c=8, o=8)),
    ("opset 10: Pad's pads are an attribute", dict(opset=10)),
])
def test_forms_the_rewrite_leaves_alone(why, kwargs):
    args = dict(c=16, o=16, h=20, w=10)
    args.update({k: kwargs.pop(k) for k in ("c", "o") if k in kwargs})
    model = dilated(args["c"], args["o"], args["h"], args["w"], **kwargs)
    rewritten, count = dilated_convs_as_phases(model)
    assert count == 0, why
    assert [n.op_type for n in rewritten.graph.node] == [n.op_type for n in model.graph.node]


def test_an_activation_with_other_readers_stays_after_the_slice():
    model = dilated(16, 16, 20, 10)
    model.graph.output.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, [1, 16, 18, 10]))  # the Conv's output read too
    rewritten, count = dilated_convs_as_phases(model)
    assert count == 1
    ops = [n.op_type for n in rewritten.graph.node]
    assert ops.index("LeakyRelu") > ops.index("Slice")
    x = np.random.default_rng(0).standard_normal((1, 16, 20, 10)).astype(np.float32)
    sess_a = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    sess_b = ort.InferenceSession(rewritten.SerializeToString(), providers=["CPUExecutionProvider"])
    for want, got in zip(sess_a.run(None, {"x": x}), sess_b.run(None, {"x": x})):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * float(np.abs(want).max()))


@pytest.mark.parametrize("h, w, pool, crops", [
    # PLCMOS' form: (1, 4) windows drop the two straddling columns: nothing left to crop
    (40, 17, dict(kernel_shape=[1, 4], strides=[1, 4]), 0),
    # an odd padded height (one extra row) and 2x2 windows that would reach it: the pooled rows are cropped
    (41, 9, dict(kernel_shape=[2, 2], strides=[2, 2]), 1),
    (41, 10, dict(op="AveragePool", kernel_shape=[3, 2], strides=[1, 2]), 1),
])
def test_a_pooling_after_moves_before_the_crop(h, w, pool, crops):
    model = dilated(16, 24, h, w, pads=(1, 1, 1, 1) if h % 2 == 0 else (2, 1, 2, 1), pool=pool)
    rewritten, count = dilated_convs_as_phases(model)
    assert count == 1
    onnx.checker.check_model(rewritten)
    ops = [n.op_type for n in rewritten.graph.node]
    pool_op = pool.get("op", "MaxPool")
    assert ops.count(pool_op) == 1 and ops.count("Slice") == crops
    assert ops.index(pool_op) == ops.index("Reshape", ops.index("Conv")) + 1
    x = np.random.default_rng(w).standard_normal((1, 16, h, w)).astype(np.float32)
    want, got = run(model, x), run(rewritten, x)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4 * float(np.abs(want).max()))


def test_a_padded_pooling_stays_after_the_crop():
    model = dilated(16, 16, 20, 10, pool=dict(kernel_shape=[2, 2], strides=[2, 2], pads=[1, 1, 1, 1]))
    rewritten, count = dilated_convs_as_phases(model)
    assert count == 1
    ops = [n.op_type for n in rewritten.graph.node]
    assert ops.index("MaxPool") > ops.index("Slice")
    x = np.random.default_rng(1).standard_normal((1, 16, 20, 10)).astype(np.float32)
    np.testing.assert_allclose(run(rewritten, x), run(model, x), rtol=1e-5, atol=1e-4)
