"""fold_dynamic_quant: the lowered DynamicQuantizeLinear chain, as pnnx writes it (the lines below are
ddddocr_old_int8's first convolution input, from its real conversion), becomes one EpDynQuant line;
chains that differ in a constant, or whose intermediate blobs are read elsewhere, stay
(edgepack/backends/ncnn/dynamic_quant_fold.py)."""
from __future__ import annotations

import collections

from edgepack.backends.ncnn.dynamic_quant_fold import fold_dynamic_quant

CHAIN = """Input in0 0 1 in0
Split splitncnn_0 1 2 in0 1 2
Reshape reshape_582 1 1 2 3 0=10240 1=1 2=1
Split splitncnn_1 1 2 3 4 5
Pooling gmp_3 1 1 5 6 0=0 4=1
Reshape reshape_583 1 1 6 7 12=0 13=0 6="1,1,//(1,0n),0n"
Reshape reshape_584 1 1 7 8 0=1
UnaryOp neg_0 1 1 4 9 0=1
Pooling gmp_4 1 1 9 10 0=0 4=1
Reshape reshape_585 1 1 10 11 12=0 13=0 6="1,1,//(1,0n),0n"
Reshape reshape_586 1 1 11 12 0=1
ReLU relu_125 1 1 8 13
ReLU relu_126 1 1 12 14
Split splitncnn_2 1 2 14 15 16
BinaryOp add_1 2 1 13 15 17 0=0
Split splitncnn_3 1 2 17 18 19
BinaryOp mul_2 1 1 18 20 0=2 1=1 2=1.26765060e30
BinaryOp sub_3 1 1 20 21 0=7 1=1 2=1.0
ReLU relu_127 1 1 21 22
BinaryOp div_4 1 1 19 23 0=3 1=1 2=255.0
BinaryOp add_5 2 1 23 22 24 0=0
Split splitncnn_4 1 3 24 25 26 27
BinaryOp div_6 2 1 16 25 28 0=3
Clip clamp_991 1 1 28 29 0=0.0 1=255.0
UnaryOp round_7 1 1 29 30 0=18
Split splitncnn_5 1 2 30 31 32
Reshape div_8_ncnnreshape0 1 1 26 33 0=1 1=1 2=1
BinaryOp div_8 2 1 1 33 34 0=3
UnaryOp round_9 1 1 34 35 0=18
Reshape add_10_ncnnreshape0 1 1 31 36 0=1 1=1 2=1
BinaryOp add_10 2 1 35 36 37 0=0
Clip clamp_992 1 1 37 38 0=0.0 1=255.0
BinaryOp mul_11 1 1 27 39 0=2 1=1 2=5.28623052e-2
Reshape sub_14_ncnnreshape0 1 1 32 45 0=1 1=1 2=1
BinaryOp sub_14 2 1 38 45 46 0=1
Convolution conv_519 1 1 46 47 0=24 1=3 11=3 12=1 13=2 14=1 2=1 3=2 4=1 5=0 6=216 31=320
BinaryOp mul_16 2 1 47 39 out0 0=2""".splitlines()


def _param(lines: list[str]) -> str:
    tops = set()
    for line in lines:
        t = line.split()
        tops.update(t[4 + int(t[2]):4 + int(t[2]) + int(t[3])])
    return "\n".join(["7767517", f"{len(lines)} {len(tops)}"] + lines) + "\n"


def _layers(text: str) -> dict[str, list[str]]:
    return {line.split()[1]: line.split() for line in text.strip().splitlines()[2:]}


def test_the_chain_becomes_one_layer_and_its_readers_read_its_tops():
    text, n = fold_dynamic_quant(_param(CHAIN), ("out0",))
    assert n == 1
    layers = _layers(text)
    types = collections.Counter(t[0] for t in layers.values())
    assert types == {"Input": 1, "Split": 1, "EpDynQuant": 1, "BinaryOp": 2, "Convolution": 1}, types
    dq = layers["ep_dq_reshape_582"]
    # x (the Split's copy the division read) in; centred (the convolution's input), scale, zp out
    assert dq[2:5] == ["1", "3", "1"] and dq[5] == "46"
    assert layers["splitncnn_0"][2:] == ["1", "1", "in0", "1"]   # the flattening Reshape's copy gone
    assert layers["mul_11"][4] == dq[6]                             # the scale's reader outside the chain
    header = text.splitlines()[1].split()
    tops = {t for layer in layers.values() for t in layer[4 + int(layer[2]):4 + int(layer[2]) + int(layer[3])]}
    assert header == [str(len(layers)), str(len(tops))]


def test_two_outside_readers_of_the_scale_read_a_split_of_it():
    lines = CHAIN[:-1] + ["BinaryOp mul_12 1 1 39 40 0=2 1=1 2=2.0",
                          "BinaryOp add_13 2 1 47 40 41 0=0",
                          "Split splitncnn_9 1 2 27 90 91",
                          "BinaryOp mul_16 2 1 41 90 42 0=2",
                          "BinaryOp mul_17 2 1 42 91 out0 0=2"]
    lines[lines.index("BinaryOp mul_11 1 1 27 39 0=2 1=1 2=5.28623052e-2")] = "BinaryOp mul_11 1 1 27x 39 0=2 1=1 2=5.28623052e-2"
    lines = [line.replace("Split splitncnn_4 1 3 24 25 26 27", "Split splitncnn_4 1 4 24 25 26 27 27x") for line in lines]
    text, n = fold_dynamic_quant(_param(lines), ("out0",))
    assert n == 1
    layers = _layers(text)
    dq = layers["ep_dq_reshape_582"]
    split = [t for t in layers.values() if t[0] == "Split" and t[4] == dq[6]]
    assert len(split) == 1 and int(split[0][3]) == 3
    readers = {layers[k][4] for k in ("mul_11",)} | {layers["mul_16"][5], layers["mul_17"][5]}
    assert readers == set(split[0][5:]), (readers, split)


def test_other_chains_stay():
    base = _param(CHAIN)
    # another constant (not onnxruntime's 255 levels), a zero point that does not round
    for old, new in (("2=255.0", "2=254.0"), ("UnaryOp round_7 1 1 29 30 0=18", "UnaryOp round_7 1 1 29 30 0=2"),
                     ("gmp_4 1 1 9 10 0=0 4=1", "gmp_4 1 1 9 10 0=1 4=1"),   # an average, not a max
                     ("reshape_582 1 1 2 3 0=10240 1=1 2=1", "reshape_582 1 1 2 3 0=640 1=1 2=16")):  # per channel
        assert old in base
        assert fold_dynamic_quant(base.replace(old, new), ("out0",)) == (base.replace(old, new), 0), old
    # an intermediate read outside the chain, or extracted
    lines = CHAIN + ["BinaryOp mul_99 2 1 out0 17x out1 0=2"]
    lines = [line.replace("Split splitncnn_3 1 2 17 18 19", "Split splitncnn_3 1 3 17 18 19 17x") for line in lines]
    assert fold_dynamic_quant(_param(lines), ("out1",))[1] == 0
    assert fold_dynamic_quant(base, ("out0", "38"))[1] == 0


def _assert_ordered(text: str) -> None:
    """Each layer follows the producers of its bottoms (ncnn's loader would take one not yet made
    for a new blob)."""
    made = set()
    for line in text.strip().splitlines()[2:]:
        t = line.split()
        n_in, n_out = int(t[2]), int(t[3])
        assert set(t[4:4 + n_in]) <= made, line
        made.update(t[4 + n_in:4 + n_in + n_out])


def test_a_reshaped_x_made_after_the_chain_starts_comes_before_the_layer():
    # the LSTM's X: the division reads a Reshape of x that pnnx wrote after the pools
    lines = [line.replace("BinaryOp div_8 2 1 1 33 34 0=3", "Reshape rx 1 1 1 1r 0=3200 1=1 2=3\nBinaryOp div_8 2 1 1r 33 34 0=3")
             for line in CHAIN]
    lines = "\n".join(lines).splitlines()
    text, n = fold_dynamic_quant(_param(lines), ("out0",))
    assert n == 1
    _assert_ordered(text)
    assert _layers(text)["ep_dq_reshape_582"][4] == "1r"
    _assert_ordered(fold_dynamic_quant(_param(CHAIN), ("out0",))[0])
