"""A batch-N audio model for tests/test_partition_audio.py and tests/unit/test_partition_lift_signal.py
(Silero-VAD-sequence-like: N chunks -> reflect Pad -> STFT-like Conv1d -> magnitude -> Conv1d stack ->
LSTM over the N chunks), made with onnx.helper. No conftest import here, so both tiers can use it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

CHUNKS, WIDTH, HIDDEN = 4, 96, 16


def chunked_vad(path: Path, tail: str = "lstm") -> Path:
    """input [CHUNKS, WIDTH], h, c [1, 1, HIDDEN] -> Pad(reflect) -> Unsqueeze -> Conv1d (STFT-like,
    stride) -> Slice real/imag -> Pow 2 -> Add -> Sqrt -> Conv1d/Relu x3 (to width 1) -> Transpose ->
    LSTM over the chunks -> Squeeze -> Relu -> Transpose -> Conv1d -> Sigmoid -> Reshape [CHUNKS],
    plus the LSTM's hn, cn. ``tail="softmax"`` puts a Softmax across the chunks after the front end
    instead (an op the lift does not handle)."""
    rng = np.random.default_rng(21)
    f = lambda *s: (rng.standard_normal(s) * 0.3).astype(np.float32)  # noqa: E731
    c64 = lambda v: np.array(v, np.int64)  # noqa: E731
    bins = 9  # STFT-like basis: 2 x bins filters of width 16, stride 8 -> 13 frames of 112 samples
    inits = {"pads": c64([0, 8, 0, 8]), "ax1": c64([1]), "basis": f(2 * bins, 1, 16), "two": np.float32(2.0),
             "s0": c64([0, 1]), "e0": c64([bins, 1 << 62]), "s1": c64([bins, 1]), "e1": c64([1 << 62, 1 << 62]),
             "sax": c64([1, 2]), "w0": f(12, bins, 3), "b0": f(12), "w1": f(12, 12, 3), "b1": f(12),
             "w2": f(HIDDEN, 12, 3), "b2": f(HIDDEN), "W": f(1, 4 * HIDDEN, HIDDEN), "R": f(1, 4 * HIDDEN, HIDDEN),
             "B": f(1, 8 * HIDDEN), "wo": f(1, HIDDEN, 1), "bo": f(1), "flat": c64([-1])}
    nodes = [helper.make_node("Pad", ["input", "pads"], ["padded"], name="pad", mode="reflect"),
             helper.make_node("Unsqueeze", ["padded", "ax1"], ["x"], name="unsq"),
             helper.make_node("Conv", ["x", "basis"], ["spec"], name="stft", kernel_shape=[16], strides=[8]),
             helper.make_node("Slice", ["spec", "s0", "e0", "sax"], ["re"], name="real"),
             helper.make_node("Slice", ["spec", "s1", "e1", "sax"], ["im"], name="imag"),
             helper.make_node("Pow", ["re", "two"], ["re2"], name="pow0"),
             helper.make_node("Pow", ["im", "two"], ["im2"], name="pow1"),
             helper.make_node("Add", ["re2", "im2"], ["pw"], name="power"),
             helper.make_node("Sqrt", ["pw"], ["mag"], name="mag")]
    prev = "mag"
    for k, stride in enumerate((2, 3, 2)):  # width 12 -> 6 -> 2 -> 1
        nodes += [helper.make_node("Conv", [prev, f"w{k}", f"b{k}"], [f"c{k}"], name=f"enc{k}", kernel_shape=[3],
                                   pads=[1, 1], strides=[stride]),
                  helper.make_node("Relu", [f"c{k}"], [f"r{k}"], name=f"relu{k}")]
        prev = f"r{k}"
    outputs = [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [CHUNKS])]
    if tail == "lstm":
        nodes += [helper.make_node("Transpose", [prev], ["seq"], name="to_seq", perm=[0, 2, 1]),
                  helper.make_node("LSTM", ["seq", "W", "R", "B", "", "h", "c"], ["y", "hn", "cn"], name="lstm",
                                   hidden_size=HIDDEN),
                  helper.make_node("Squeeze", ["y", "ax1"], ["ys"], name="sq"),
                  helper.make_node("Relu", ["ys"], ["yr"], name="relu_y"),
                  helper.make_node("Transpose", ["yr"], ["yt"], name="to_ncw", perm=[1, 2, 0]),
                  helper.make_node("Conv", ["yt", "wo", "bo"], ["logit"], name="head", kernel_shape=[1]),
                  helper.make_node("Sigmoid", ["logit"], ["p"], name="sigmoid"),
                  helper.make_node("Reshape", ["p", "flat"], ["probs"], name="flatten")]
        outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 1, HIDDEN]) for n in ("hn", "cn")]
    else:
        nodes += [helper.make_node("Softmax", [prev], ["sm"], name="softmax", axis=0),
                  helper.make_node("Reshape", ["sm", "flat"], ["probs"], name="flatten")]
        for k in ("W", "R", "B", "wo", "bo"):
            del inits[k]
        outputs = [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [CHUNKS * HIDDEN])]
    inputs = [helper.make_tensor_value_info("input", TensorProto.FLOAT, [CHUNKS, WIDTH])]
    if tail == "lstm":
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 1, HIDDEN]) for n in ("h", "c")]
    g = helper.make_graph(nodes, "chunked_vad", inputs, outputs,
                          [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    onnx.save(m, str(path))
    return path


def vad_inputs(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input": rng.standard_normal((CHUNKS, WIDTH)).astype(np.float32),
            "h": (rng.standard_normal((1, 1, HIDDEN)) * 0.5).astype(np.float32),
            "c": (rng.standard_normal((1, 1, HIDDEN)) * 0.5).astype(np.float32)}
