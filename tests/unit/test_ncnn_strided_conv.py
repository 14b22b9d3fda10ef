"""edgepack/backends/ncnn/strided_conv.py: a strided few-channel Conv1D as a 2-D Convolution of one row,
checked against onnxruntime in-process (an exact fit, a cut signal, several channels, one shared row)
and left alone where ncnn already packs the input channels or the kernel is short; a many-channel
Conv1D (Whisper's encoder front) as a 2-D Convolution of one row, whatever its stride and pads."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgepack.backends.ncnn.strided_conv import strided_convs_as_rows, wide_convs_as_rows


def stft_like(c: int, length: int, k: int, s: int, convs: int = 1, bias: bool = False, opset: int = 13,
              **attrs) -> onnx.ModelProto:
    """x [1, C, L] -> `convs` Convs (O=33, C, K, stride s) on the same x, summed."""
    rng = np.random.default_rng(k + s + c)
    inits, nodes, outs = [], [], []
    for i in range(convs):
        inits.append(numpy_helper.from_array(rng.standard_normal((33, c, k)).astype(np.float32), f"w{i}"))
        ins = ["x", f"w{i}"]
        if bias:
            inits.append(numpy_helper.from_array(rng.standard_normal(33).astype(np.float32), f"b{i}"))
            ins.append(f"b{i}")
        nodes.append(helper.make_node("Conv", ins, [f"c{i}"], kernel_shape=[k], strides=[s], **attrs))
        outs.append(f"c{i}")
    nodes.append(helper.make_node("Sum", outs, ["y"]))
    pads = attrs.get("pads", [0, 0])
    frames = (length + sum(pads) - attrs.get("dilations", [1])[0] * (k - 1) - 1) // s + 1
    graph = helper.make_graph(nodes, "stft", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, length])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 33, frames])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _conv_attrs(model: onnx.ModelProto) -> list[dict]:
    return [{a.name: list(a.ints) for a in n.attribute} for n in model.graph.node if n.op_type == "Conv"]


@pytest.mark.parametrize("c, length, k, s, convs, bias, cut", [
    (1, 1760, 512, 160, 2, False, True),   # openWakeWord's front end: two Convs share a row; 128 samples unread
    (1, 1942, 512, 160, 1, True, True),    # the last 22 samples no frame reads: cut
    (2, 1050, 400, 160, 1, False, True),   # two channels, the last 10 samples unread
    (4, 64, 16, 4, 1, True, False),        # several channels; frames fit the signal exactly
    (1, 2000, 100, 160, 1, False, True),   # a kernel shorter than the stride: gaps between frames
])
def test_one_row_convolution_computes_the_same_sums(c, length, k, s, convs, bias, cut):
    model = stft_like(c, length, k, s, convs, bias)
    rewritten, count = strided_convs_as_rows(model)
    assert count == convs
    onnx.checker.check_model(rewritten)
    ops = [n.op_type for n in rewritten.graph.node]
    assert ops.count("Conv") == convs and ops.count("Reshape") == convs + 1  # one row for every Conv
    assert ops.count("Slice") == cut
    for n in rewritten.graph.node:
        if n.op_type == "Conv":
            assert len(n.input) == (3 if bias else 2)
    assert all(a["strides"] == [1, s] and a["kernel_shape"] == [1, k] for a in _conv_attrs(rewritten))
    assert len(model.graph.node) == convs + 1  # the input model is not modified
    x = np.random.default_rng(3).standard_normal((1, c, length)).astype(np.float32)
    want = run(model, x)
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(run(rewritten, x), want, rtol=0, atol=2e-6 * scale * np.sqrt(k))


@pytest.mark.parametrize("c, k, s, attrs", [
    (32, 512, 160, {}),                 # ncnn packs 32 channels already
    (1, 512, 1, {}),                    # no stride
    (1, 512, 160, {"pads": [4, 4]}),
    (1, 512, 160, {"dilations": [2]}),
    (1, 10, 5, {}),                     # a short kernel (a speech encoder's first layer): not measured
])
def test_forms_ncnn_runs_well_or_that_need_more_are_left_alone(c, k, s, attrs):
    model = stft_like(c, 2000, k, s, **attrs)
    rewritten, count = strided_convs_as_rows(model)
    assert count == 0 and rewritten == model


def test_opsets_before_slice_takes_its_bounds_as_inputs_are_left_alone():
    model = stft_like(2, 1050, 400, 160, opset=9)
    rewritten, count = strided_convs_as_rows(model)
    assert count == 0 and rewritten == model
    assert strided_convs_as_rows(stft_like(2, 1050, 400, 160, opset=10))[1] == 1


@pytest.mark.parametrize("first, last, length", [
    (57, 455, 160512),   # NeMo: a 400-sample Hann window centred in a 512-point frame
    (1, 399, 160000),    # kaldi: the povey window from tap 1 on
    (0, 398, 1000),      # trailing zeros only
])
def test_zero_taps_outside_the_window_are_not_run(first, last, length):
    model = stft_like(1, length, 512, 160)
    w = numpy_helper.to_array(model.graph.initializer[0]).copy()
    w[:, :, :first] = 0
    w[:, :, last:] = 0
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(w, "w0"))
    rewritten, count = strided_convs_as_rows(model)
    assert count == 1
    onnx.checker.check_model(rewritten)
    assert [a["kernel_shape"] for a in _conv_attrs(rewritten)] == [[1, last - first]]
    cut = next(n for n in rewritten.graph.node if n.op_type == "Slice")
    starts = next(numpy_helper.to_array(i) for i in rewritten.graph.initializer if i.name == cut.input[1])
    assert starts.tolist() == [first]
    x = np.random.default_rng(4).standard_normal((1, 1, length)).astype(np.float32)
    want = run(model, x)
    np.testing.assert_allclose(run(rewritten, x), want, rtol=0, atol=2e-6 * float(np.abs(want).max()) * np.sqrt(512))


@pytest.mark.parametrize("c, length, k, s, attrs", [
    (80, 200, 3, 1, {"pads": [1, 1]}),   # Whisper's conv1: 80 mel bins -> 33 here, "same" padding
    (32, 201, 3, 2, {"pads": [1, 1]}),   # Whisper's conv2: stride 2 over an odd length
    (16, 50, 2, 1, {}),                  # two taps, no padding
    (12, 64, 5, 3, {"pads": [0, 2]}),    # asymmetric pads, a stride that does not divide the length
    (48, 64, 5, 1, {"pads": [6, 6], "dilations": [3]}),   # AttaCut's dilated Conv1Ds: "same" padding
    (48, 64, 9, 1, {"pads": [8, 8], "dilations": [2]}),
    (20, 70, 3, 2, {"pads": [1, 3], "dilations": [4]}),   # dilated and strided, pads apart
])
def test_many_channel_conv1d_as_a_row_computes_the_same_sums(c, length, k, s, attrs):
    model = stft_like(c, length, k, s, bias=True, **attrs)
    rewritten, count = wide_convs_as_rows(model)
    assert count == 1
    onnx.checker.check_model(rewritten)
    assert [n.op_type for n in rewritten.graph.node] == ["Reshape", "Conv", "Reshape", "Sum"]
    pads = attrs.get("pads", [0, 0])
    assert _conv_attrs(rewritten) == [{"kernel_shape": [1, k], "strides": [1, s], "pads": [0, pads[0], 0, pads[1]],
                                       "dilations": [1, attrs.get("dilations", [1])[0]], "group": []}]
    x = np.random.default_rng(5).standard_normal((1, c, length)).astype(np.float32)
    want = run(model, x)
    np.testing.assert_allclose(run(rewritten, x), want, rtol=0, atol=2e-6 * float(np.abs(want).max()) * np.sqrt(c * k))


@pytest.mark.parametrize("c, attrs", [
    (8, {}),                      # few channels: the strided rule's, or ncnn's Convolution1D
    (16, {"k": 1}),               # pointwise: no faster as a row (PLCMOS' 512 -> 128), less exact on Arm fp16
    (16, {"group": 2}),
])
def test_conv1d_forms_the_row_rule_leaves_alone(c, attrs):
    k = attrs.pop("k", 3)
    model = stft_like(c, 100, k, 1, **attrs) if "group" not in attrs else _grouped(c)
    rewritten, count = wide_convs_as_rows(model)
    assert count == 0 and rewritten == model


def _grouped(c: int) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.ones((4, c // 2, 3), np.float32), "w")
    node = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3], group=2)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 100])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 98])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
