"""edgepack/scan_framing.py and signal_lowering.lower_dft: onnx-asr's WeSpeaker front end frames its
waveform with a Scan and transforms the frames with ONNX's DFT op, neither of which a backend runs.
Each lowering against onnxruntime running the original op, and the forms each leaves alone."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgepack.model import LoadedModel, _value_specs
from edgepack.scan_framing import lower_framing_scans
from edgepack.signal_lowering import lower_dft

P, H, T = 240, 160, 20   # WeSpeaker: a 400-sample frame every 160 samples


def _loaded(nodes, inputs: dict, output: tuple[str, list], inits=(), opset: int = 17) -> LoadedModel:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
                              [helper.make_tensor_value_info(output[0], TensorProto.FLOAT, output[1])], list(inits))
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    proto.ir_version = 8
    onnx.checker.check_model(proto)
    names = {i.name for i in proto.graph.initializer}
    return LoadedModel(Path("m.onnx"), proto, _value_specs(proto.graph.input, names),
                       _value_specs(proto.graph.output, set()), opset)


def framing_scan(start: int = H, keep_state: bool = False) -> LoadedModel:
    """state [1, P], hops [1, T, H] -> Scan(frame = prev ++ curr, next = frame[start:]) -> frames * 2."""
    body = helper.make_graph(
        [helper.make_node("Concat", ["prev", "curr"], ["frame"], axis=-1),
         helper.make_node("Slice", ["frame", "from", "to", "axis", "one"], ["next"])], "body",
        [helper.make_tensor_value_info("prev", TensorProto.FLOAT, [1, P]),
         helper.make_tensor_value_info("curr", TensorProto.FLOAT, [1, H])],
        [helper.make_tensor_value_info("next", TensorProto.FLOAT, [1, P]),
         helper.make_tensor_value_info("frame", TensorProto.FLOAT, [1, P + H])])
    inits = [numpy_helper.from_array(np.array([start], np.int64), "from"),
             numpy_helper.from_array(np.array([2 ** 62], np.int64), "to"),
             numpy_helper.from_array(np.array([1], np.int64), "axis"),
             numpy_helper.from_array(np.array([1], np.int64), "one"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    nodes = [helper.make_node("Scan", ["state", "hops"], ["last", "frames"], body=body, num_scan_inputs=1,
                              scan_input_axes=[1], scan_output_axes=[1]),
             helper.make_node("Mul", ["frames", "two"], ["y"])]
    if keep_state:  # the final state is read: not a pure framing
        nodes[1:] = [helper.make_node("ReduceSum", ["last"], ["s"], keepdims=1),
                     helper.make_node("Mul", ["frames", "s"], ["y"])]
    return _loaded(nodes, {"state": [1, P], "hops": [1, T, H]}, ("y", [1, T, P + H]), inits)


def run(model: LoadedModel, feeds: dict) -> np.ndarray:
    return ort.InferenceSession(model.proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_a_framing_scan_becomes_one_gather_of_the_same_samples():
    model = framing_scan()
    lowered = lower_framing_scans(model)
    assert lowered is not model and lowered.notes[-1] == "Scan framing as a Gather: 1 node(s)"
    onnx.checker.check_model(lowered.proto)
    assert [n.op_type for n in lowered.proto.graph.node] == ["Reshape", "Concat", "Gather", "Mul"]
    rng = np.random.default_rng(1)
    feeds = {"state": rng.standard_normal((1, P)).astype(np.float32),
             "hops": rng.standard_normal((1, T, H)).astype(np.float32)}
    np.testing.assert_array_equal(run(lowered, feeds), run(model, feeds))


@pytest.mark.parametrize("form", ["state kept shorter", "final state read"])
def test_other_scans_stay(form):
    model = framing_scan(start=H + 1) if form == "state kept shorter" else framing_scan(keep_state=True)
    assert lower_framing_scans(model) is model


def dft_model(width: int = 400, n: int | None = 512, onesided: int = 1, inverse: int = 0, opset: int = 17) -> LoadedModel:
    """frames [1, T, width, 1] -> DFT(length n) over the frames' axis -> power |X|^2 summed over re/im."""
    inits = [numpy_helper.from_array(np.array([-1], np.int64), "last")]
    ins = ["x", "n" if n else ""]
    if n:
        inits.append(numpy_helper.from_array(np.array(n, np.int64), "n"))
    attrs = dict(onesided=onesided, inverse=inverse)
    if opset >= 20:
        inits.append(numpy_helper.from_array(np.array(-2, np.int64), "ax"))
        ins.append("ax")
    else:
        attrs["axis"] = -2
    bins = (n or width) // 2 + 1 if onesided else (n or width)
    power = (helper.make_node("ReduceSumSquare", ["s", "last"], ["y"], keepdims=0) if opset >= 18 else
             helper.make_node("ReduceSumSquare", ["s"], ["y"], axes=[-1], keepdims=0))
    return _loaded([helper.make_node("DFT", ins, ["s"], **attrs), power],
                   {"x": [1, T, width, 1]}, ("y", [1, T, bins]), inits, opset)


@pytest.mark.parametrize("width, n, onesided, opset", [
    (400, 512, 1, 17),    # WeSpeaker: 400-sample frames, a 512-point transform
    (64, None, 0, 17),    # every bin, the length the frames'
    (100, 128, 1, 20),    # the axis as an input (opset 20)
])
def test_a_dft_of_real_frames_is_a_matmul_by_the_basis(width, n, onesided, opset):
    model = dft_model(width, n, onesided, opset=opset)
    lowered = lower_dft(model)
    assert lowered is not model and lowered.notes[-1] == "DFT as a MatMul: 1 node(s)"
    onnx.checker.check_model(lowered.proto)
    assert "DFT" not in [n.op_type for n in lowered.proto.graph.node]
    x = np.random.default_rng(width).standard_normal((1, T, width, 1)).astype(np.float32)
    want, got = run(model, {"x": x}), run(lowered, {"x": x})
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * float(np.abs(want).max()))


def test_an_inverse_or_shorter_dft_stays():
    inverse = dft_model(inverse=1, onesided=0)
    assert lower_dft(inverse) is inverse
    shorter = dft_model(width=400, n=256)
    assert lower_dft(shorter) is shorter
