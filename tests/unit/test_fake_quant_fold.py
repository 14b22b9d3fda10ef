"""fold_fake_quant: which divide-round-clip chains of a .param become one Clip line, and the header's
counts after it (edgepack/backends/ncnn/fake_quant_patch.py)."""
from __future__ import annotations

from edgepack.backends.ncnn.fake_quant_patch import fold_fake_quant


def _param(lines: list[str]) -> str:
    blobs = {b for line in lines for b in _blobs(line)}
    return "\n".join(["7767517", f"{len(lines)} {len(blobs)}"] + lines) + "\n"


def _blobs(line: str) -> list[str]:
    t = line.split()
    n = int(t[2]) + int(t[3])
    return t[4:4 + n]


def _layers(text: str) -> list[list[str]]:
    return [line.split() for line in text.strip().splitlines()[2:]]


CHAIN = ["Input in0 0 1 in0",
         "BinaryOp div_0 1 1 in0 1 0=3 1=1 2=9.61455330e-3",
         "UnaryOp round_1 1 1 1 2 0=18",
         "Clip clamp_2 1 1 2 3 0=-128.0 1=127.0",
         "BinaryOp mul_3 1 1 3 4 0=2 1=1 2=9.61455330e-3",
         "GELU gelu_4 1 1 4 out0"]


def test_a_whole_chain_becomes_one_clip_and_the_header_counts_follow():
    text, n = fold_fake_quant(_param(CHAIN), ("out0",))
    assert n == 1
    layers = _layers(text)
    assert [t[0] for t in layers] == ["Input", "Clip", "GELU"]
    clip = layers[1]
    assert clip[2:6] == ["1", "1", "in0", "4"]
    assert clip[6:] == ["0=-128.0", "1=127.0", "20=9.61455330e-3", "21=1", "22=9.61455330e-3"]
    # the header counts what is left, as ncnn sizes its tables from it
    lines = text.strip().splitlines()
    assert lines[1] == f"{len(layers)} {len({b for line in lines[2:] for b in _blobs(line)})}" == "3 3"


def test_the_multiply_is_left_out_where_it_is_not_a_scalar_one():
    lines = CHAIN[:4] + ["MemoryData m 0 1 m 0=1", "BinaryOp mul_3 2 1 3 m 4 0=2", "GELU gelu_4 1 1 4 out0"]
    text, n = fold_fake_quant(_param(lines), ("out0",))
    assert n == 1
    clip = next(t for t in _layers(text) if t[0] == "Clip")
    assert clip[4:6] == ["in0", "3"] and "22=" not in " ".join(clip)


def test_chains_with_another_reader_an_output_or_other_ops_are_kept():
    # the rounded blob is an output
    assert fold_fake_quant(_param(CHAIN), ("2", "out0"))[1] == 0
    # the quotient is read by another layer too (pnnx would have put a Split there, which is not a UnaryOp)
    split = CHAIN[:2] + ["Split sp 1 2 1 1a 1b", "UnaryOp round_1 1 1 1a 2 0=18", "Clip clamp_2 1 1 2 3 0=-1.0 1=1.0",
                         "TanH t 1 1 1b 5", "BinaryOp add 2 1 3 5 out0 0=0"]
    assert fold_fake_quant(_param(split), ("out0",))[1] == 0
    for changed in (("0=3 1=1 2=9.61455330e-3", "0=2 1=1 2=9.61455330e-3"),   # a multiply first
                    ("0=3 1=1 2=9.61455330e-3", "0=3 1=1 2=7"),                # a scalar ncnn reads as an int
                    ("0=3 1=1 2=9.61455330e-3", "0=3 1=1 2=0.0"),              # a division by zero
                    ("round_1 1 1 1 2 0=18", "floor_1 1 1 1 2 0=2"),           # floor, not round
                    ("0=-128.0 1=127.0", "0=-128.0")):                         # a one-sided clip
        lines = [line.replace(*changed) for line in CHAIN]
        assert fold_fake_quant(_param(lines), ("out0",))[1] == 0, changed


def test_two_chains_in_a_row_fold_each_and_nothing_else_moves():
    lines = CHAIN[:5] + ["BinaryOp div_5 1 1 4 5 0=3 1=1 2=0.5", "UnaryOp round_6 1 1 5 6 0=18",
                         "Clip clamp_7 1 1 6 out0 0=0.0 1=255.0"]
    text, n = fold_fake_quant(_param(lines), ("out0",))
    assert n == 2
    layers = _layers(text)
    assert [(t[0], t[4], t[5]) for t in layers[1:]] == [("Clip", "in0", "4"), ("Clip", "4", "out0")]
    assert layers[2][6:] == ["0=0.0", "1=255.0", "20=0.5", "21=1"]
    assert text.strip().splitlines()[1] == "3 3"
