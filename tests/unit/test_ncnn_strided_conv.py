"""edgepack/backends/ncnn/strided_conv.py: a strided few-channel Conv1D as a stride-1 convolution over
hop channels, checked against onnxruntime in-process (an exact fit, a cut and a padded signal, several
channels, shared hops) and left alone where ncnn already packs the input channels."""
from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgepack.backends.ncnn.strided_conv import strided_convs_over_hops


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


@pytest.mark.parametrize("c, length, k, s, convs, bias, fit", [
    (1, 1760, 512, 160, 2, False, None),   # openWakeWord's front end: 11 hops exactly, two Convs share them
    (1, 1942, 512, 160, 1, True, "Slice"),  # the last 22 samples no frame reads, padded taps or not: cut
    (2, 1050, 400, 160, 1, False, "Pad"),   # 480 taps of 400: the last frame's padded taps read past the end
    (4, 64, 8, 4, 1, True, None),          # channels and hop positions interleave in the frames
])
def test_hop_channels_compute_the_same_sums(c, length, k, s, convs, bias, fit):
    model = stft_like(c, length, k, s, convs, bias)
    rewritten, count = strided_convs_over_hops(model)
    assert count == convs
    onnx.checker.check_model(rewritten)
    ops = [n.op_type for n in rewritten.graph.node]
    assert ops.count("Conv") == convs and ops.count("Transpose") == 1  # one hop tensor for every Conv
    assert ops.count("Slice") == (fit == "Slice") and ops.count("Pad") == (fit == "Pad")
    for n in rewritten.graph.node:
        if n.op_type == "Conv":
            attrs = {a.name: list(a.ints) for a in n.attribute}
            assert attrs["strides"] == [1, 1] and attrs["kernel_shape"] == [1, math.ceil(k / s)]
            assert len(n.input) == (3 if bias else 2)
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
    (1, 100, 160, {}),                  # kernel shorter than the stride: gaps, nothing overlaps
    (1, 170, 160, {}),                  # 320 taps for 170: more zeros than the rewrite may add
    (1, 24, 8, {}),                     # hops of 8 samples: too short to pack
])
def test_forms_ncnn_runs_well_or_that_need_more_are_left_alone(c, k, s, attrs):
    model = stft_like(c, 2000, k, s, **attrs)
    rewritten, count = strided_convs_over_hops(model)
    assert count == 0 and rewritten == model


def test_opsets_before_pad_takes_its_pads_as_an_input_are_left_alone():
    # the padded case (its hops need a Pad) at opset 10, where Pad still takes pads as an attribute
    model = stft_like(2, 1050, 400, 160, opset=10)
    rewritten, count = strided_convs_over_hops(model)
    assert count == 0 and rewritten == model
    assert strided_convs_over_hops(stft_like(2, 1050, 400, 160, opset=11))[1] == 1


@pytest.mark.parametrize("first, last, length, cut", [
    (57, 455, 160512, ("Slice", "Pad")),  # NeMo: a 400-sample Hann window centred in a 512-point frame;
                                          # the last frame's padded taps read past the end
    (1, 399, 160000, ("Slice",)),         # kaldi: the povey window from tap 1 on
    (0, 398, 1000, ("Slice",)),           # trailing zeros only: samples past the last frame cut
])
def test_zero_taps_outside_the_window_are_not_run(first, last, length, cut):
    model = stft_like(1, length, 512, 160)
    w = numpy_helper.to_array(model.graph.initializer[0]).copy()
    w[:, :, :first] = 0
    w[:, :, last:] = 0
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(w, "w0"))
    rewritten, count = strided_convs_over_hops(model)
    assert count == 1
    onnx.checker.check_model(rewritten)
    conv = next(n for n in rewritten.graph.node if n.op_type == "Conv")
    kernel = {a.name: list(a.ints) for a in conv.attribute}["kernel_shape"]
    assert kernel == [1, math.ceil((last - first) / 160)] == [1, 3]  # 3 hops, not the 4 that 512 taps need
    ops = [n.op_type for n in rewritten.graph.node]
    assert [op for op in ops if op in ("Slice", "Pad")] == list(cut)
    x = np.random.default_rng(4).standard_normal((1, 1, length)).astype(np.float32)
    want = run(model, x)
    np.testing.assert_allclose(run(rewritten, x), want, rtol=0, atol=2e-6 * float(np.abs(want).max()) * np.sqrt(512))
