"""edgepack.onnx_lstm: unrolled LSTM/GRU against onnxruntime's own kernels, in-process."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgepack.onnx_lstm import decompose, refusals

SEQ, BATCH, IN, H = 5, 2, 3, 4


def _model(op, direction="forward", state=True, peep=False, clip=None, lbr=0, opset=17, bias=True, ys=True,
           fed=False):
    """fed: the weights are graph inputs (as in ONNX's own conformance cases), not initializers."""
    nd = 2 if direction == "bidirectional" else 1
    g = 4 if op == "LSTM" else 3
    rng = np.random.default_rng(7)
    inits = [numpy_helper.from_array(rng.normal(0, 0.6, (nd, g * H, IN)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.normal(0, 0.6, (nd, g * H, H)).astype(np.float32), "R")]
    ins = ["X", "W", "R"]
    if bias:
        inits.append(numpy_helper.from_array(rng.normal(0, 0.3, (nd, 2 * g * H)).astype(np.float32), "B"))
    ins += ["B" if bias else "", ""]
    graph_in = [helper.make_tensor_value_info("X", TensorProto.FLOAT, [SEQ, BATCH, IN])]
    if state:
        ins.append("h0")
        graph_in.append(helper.make_tensor_value_info("h0", TensorProto.FLOAT, [nd, BATCH, H]))
        if op == "LSTM":
            ins.append("c0")
            graph_in.append(helper.make_tensor_value_info("c0", TensorProto.FLOAT, [nd, BATCH, H]))
    if peep:
        ins += [""] * (7 - len(ins)) + ["P"]
        inits.append(numpy_helper.from_array(rng.normal(0, 0.5, (nd, 3 * H)).astype(np.float32), "P"))
    outs = ["Y" if ys else "", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    attrs = {"hidden_size": H, "direction": direction}
    if clip is not None:
        attrs["clip"] = clip
    if op == "GRU":
        attrs["linear_before_reset"] = lbr
    node = helper.make_node(op, ins, outs, name="rnn", **attrs)
    shapes = {"Y": [SEQ, nd, BATCH, H], "Y_h": [nd, BATCH, H], "Y_c": [nd, BATCH, H]}
    graph_out = [helper.make_tensor_value_info(o, TensorProto.FLOAT, shapes[o]) for o in outs if o]
    if fed:
        graph_in += [helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.dims)) for t in inits]
        feeds = {t.name: numpy_helper.to_array(t) for t in inits}
        inits = []
    m = helper.make_model(helper.make_graph([node], "g", graph_in, graph_out, inits),
                          opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return (m, feeds) if fed else m


def _run(m, feeds):
    s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def _check(m, fed=None):
    rng = np.random.default_rng(3)
    feeds = {i.name: rng.normal(0, 1, [d.dim_value for d in i.type.tensor_type.shape.dim]).astype(np.float32)
             for i in m.graph.input} | (fed or {})
    d = decompose(m)
    onnx.checker.check_model(d)
    assert not any(n.op_type in ("LSTM", "GRU") for n in d.graph.node)
    want, got = _run(m, feeds), _run(d, feeds)
    assert len(want) == len(got)
    for w, g in zip(want, got):
        assert w.shape == g.shape
        np.testing.assert_allclose(g, w, rtol=0, atol=2e-6)


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("state", [True, False])
def test_lstm_matches_onnxruntime(direction, state):
    _check(_model("LSTM", direction, state))


def test_lstm_peepholes_clip_no_bias_old_opset():
    _check(_model("LSTM", "bidirectional", True, peep=True, clip=0.7, bias=False, opset=11))
    _check(_model("LSTM", "forward", False, peep=True, opset=13, ys=False))


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("lbr", [0, 1])
@pytest.mark.parametrize("state", [True, False])
def test_gru_matches_onnxruntime(direction, lbr, state):
    _check(_model("GRU", direction, state, lbr=lbr))


@pytest.mark.parametrize("op,lbr", [("LSTM", 0), ("GRU", 0), ("GRU", 1)])
def test_weights_fed_as_inputs(op, lbr):
    _check(*_model(op, "bidirectional", True, peep=op == "LSTM", lbr=lbr, fed=True))
    _check(*_model(op, "reverse", False, lbr=lbr, bias=False, fed=True))


def test_refused_nodes_are_left_and_named():
    m = _model("LSTM")
    m.graph.node[0].attribute.append(helper.make_attribute("input_forget", 1))
    assert refusals(m) == {"rnn": "input_forget=1 is not decomposed"}
    assert decompose(m).graph.node[0].op_type == "LSTM"
    dyn = _model("GRU")
    dyn.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "T"
    assert "sequence length is not static" in refusals(dyn)["rnn"]


def test_model_without_recurrent_ops_is_returned_as_is():
    m = helper.make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                                            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])]))
    assert decompose(m) is m and refusals(m) == {}
