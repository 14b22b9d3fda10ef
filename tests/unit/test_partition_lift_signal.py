"""The lift of a batch-N signal front end to batch 1 (edgepack/partition_lift_signal.py), in process
with onnxruntime: same outputs before and after, batch 1 up to the LSTM, and a graph it cannot
lift left as it was."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

from audio_fixtures import CHUNKS, WIDTH, chunked_vad, vad_inputs

from edgepack.partition_lift import PIN
from edgepack.partition_lift_signal import lift_signal


def _ort(model: onnx.ModelProto, feeds: dict) -> dict:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return {o.name: v for o, v in zip(sess.get_outputs(), sess.run(None, {i.name: feeds[i.name]
                                                                              for i in sess.get_inputs()}))}


def test_lift_signal_is_exact_and_batch_one_up_to_the_lstm(tmp_path):
    m = onnx.load(str(chunked_vad(tmp_path / "vad.onnx")))
    new = onnx.ModelProto()
    new.CopyFrom(m)
    assert lift_signal(new) == 1
    inferred = onnx.shape_inference.infer_shapes(new, strict_mode=True)
    onnx.checker.check_model(inferred, full_check=True)
    pinned = [n for n in new.graph.node if n.name.endswith(PIN)]
    assert [n.op_type for n in pinned] == ["Reshape"] and pinned[0].input[0] == "input"
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in inferred.graph.value_info}
    assert shapes[pinned[0].output[0]] == [1, 1, CHUNKS, WIDTH]
    # every tensor between the pinned Reshape and the LSTM is batch 1 (what pnnx needs)
    lstm = next(n for n in new.graph.node if n.op_type == "LSTM")
    order = [n for n in new.graph.node]
    front = order[order.index(pinned[0]) + 1:order.index(lstm)]
    assert {n.op_type for n in front} >= {"Conv", "Pad", "Slice", "Pow", "Sqrt"}
    assert "Unsqueeze" not in {n.op_type for n in front}  # [N, W] -> [N, 1, W] is the same held tensor
    for n in front[:-1]:  # the last (the Transpose into the LSTM) puts the chunks on the sequence axis
        assert shapes[n.output[0]][0] == 1, (n.name, shapes[n.output[0]])
    assert all(len(shapes[n.output[0]]) == 4 for n in front if n.op_type == "Conv")
    for seed in (1, 2):
        feeds = vad_inputs(seed)
        want, got = _ort(m, feeds), _ort(new, feeds)
        assert set(got) == {"probs", "hn", "cn"}
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6)


def test_lift_signal_leaves_an_op_it_does_not_handle(tmp_path):
    m = onnx.load(str(chunked_vad(tmp_path / "vad.onnx", tail="softmax")))  # a Softmax across the chunks
    before = m.SerializeToString()
    assert lift_signal(m) == 0 and m.SerializeToString() == before


def test_lift_signal_needs_a_chunked_float_input(tmp_path):
    m = onnx.load(str(chunked_vad(tmp_path / "vad.onnx")))
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 1  # one chunk: nothing to lift
    m.graph.node[0].input[0] = "input"
    before = m.SerializeToString()
    assert lift_signal(m) == 0 and m.SerializeToString() == before
