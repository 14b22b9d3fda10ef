"""edgepack/signal_lowering.py: ONNX's STFT op as a strided convolution, against onnxruntime's STFT, and
the forms it leaves alone."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgepack.model import LoadedModel, _value_specs
from edgepack.signal_lowering import lower_stft

L, N, STEP = 1000, 64, 16


def stft_model(rank: int = 2, onesided: int = 1, window: str = "const", length: bool = False,
               channels: int = 1) -> LoadedModel:
    """x [1, L] or [1, L, channels] -> STFT(step 16, a Hann window of 64 and/or frame_length 64) -> y,
    then y * y (a reader of the output, as a power spectrum has)."""
    bins = N // 2 + 1 if onesided else N
    frames = (L - N) // STEP + 1
    hann = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N) / N)).astype(np.float32)
    inits = [numpy_helper.from_array(np.array(STEP, dtype=np.int64), "step"),
             numpy_helper.from_array(np.array(N, dtype=np.int64), "n")]
    nodes, ins = [], ["sig", "step"]
    if window == "const":
        inits.append(numpy_helper.from_array(hann, "window"))
        ins.append("window")
    elif window == "computed":  # scaled by something only known at run time
        inits.append(numpy_helper.from_array(hann, "hann"))
        nodes.append(helper.make_node("Mul", ["hann", "gain"], ["window"]))
        ins.append("window")
    else:
        ins.append("")
    if length:
        ins.append("n")
    nodes += [helper.make_node("Identity", ["x"], ["sig"]),
              helper.make_node("STFT", ins, ["s"], onesided=onesided),
              helper.make_node("Mul", ["s", "s"], ["y"])]
    shape = [1, L] if rank == 2 else [1, L, channels]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)]
    if window == "computed":
        inputs.append(helper.make_tensor_value_info("gain", TensorProto.FLOAT, []))
    graph = helper.make_graph(nodes, "stft", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, frames, bins, 2])], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    names = {i.name for i in proto.graph.initializer}
    return LoadedModel(Path("stft.onnx"), proto, _value_specs(proto.graph.input, names),
                       _value_specs(proto.graph.output, set()), 17)


def run(model: LoadedModel, feeds: dict) -> np.ndarray:
    sess = ort.InferenceSession(model.proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


@pytest.mark.parametrize("rank, onesided, window, length", [
    (2, 1, "const", False),   # onnx-asr's Whisper / NeMo front ends: [B, L], a Hann window
    (3, 1, "const", True),    # [B, L, 1], window and frame_length both given
    (2, 0, "const", False),   # every bin, not only the unique ones
    (3, 1, "none", True),     # no window: a rectangular one of frame_length
])
def test_stft_as_a_convolution_matches_onnxruntime(rank, onesided, window, length):
    model = stft_model(rank, onesided, window, length)
    lowered = lower_stft(model)
    assert lowered is not model and "STFT as a strided convolution: 1 node(s)" in lowered.notes[-1]
    onnx.checker.check_model(lowered.proto)
    ops = [n.op_type for n in lowered.proto.graph.node]
    assert "STFT" not in ops and ops.count("Conv") == 1
    x = np.random.default_rng(rank + onesided).standard_normal((1, L) if rank == 2 else (1, L, 1)).astype(np.float32)
    want, got = run(model, {"x": x}), run(lowered, {"x": x})
    assert got.shape == want.shape
    # sums of 64 products in another order than the FFT's: within a few ulps of the power's scale
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize("form", [
    {"window": "computed"},          # a window only known at run time
    {"rank": 3, "channels": 2},      # a complex signal
])
def test_other_stfts_are_left_for_the_backends_to_refuse(form):
    model = stft_model(**form)
    assert lower_stft(model) is model
