"""constants_last: two-input BinaryOps that read a MemoryData (through Splits) first get it second, with
the op reversed, and compute the same values in ncnn (edgepack/backends/ncnn/constants_last.py)."""
from __future__ import annotations

import numpy as np
import ncnn

from edgepack.backends.ncnn.constants_last import constants_last

PARAM = """7767517
9 13
Input                    in0                      0 1 in 0=8 1=3
Split                    splitncnn_1              1 3 in in0 in0x in0y
MemoryData               grid                     0 1 m 0=8 1=3
Split                    splitncnn_0              1 3 m m1 m2 m3
BinaryOp                 sub_0                    2 1 m1 in0 a 0=1
BinaryOp                 div_1                    2 1 m2 a b 0=3
BinaryOp                 add_2                    2 1 m3 b c
BinaryOp                 mul_3                    2 1 c in0x d 0=2
BinaryOp                 rsub_4                   2 1 d in0y out0 0=7
"""


def _lines(text: str) -> dict[str, list[str]]:
    return {t[1]: t for t in (line.split() for line in text.strip().splitlines()[2:])}


def _run(param_text: str, tmp_path, x: np.ndarray, grid: np.ndarray) -> np.ndarray:
    (tmp_path / "m.param").write_text(param_text)
    (tmp_path / "m.bin").write_bytes(grid.astype(np.float32).tobytes())
    net = ncnn.Net()
    net.opt.use_packing_layout = False
    assert net.load_param(str(tmp_path / "m.param")) == 0 and net.load_model(str(tmp_path / "m.bin")) == 0
    ex = net.create_extractor()
    ex.input("in", ncnn.Mat(x))
    ret, out = ex.extract("out0")
    assert ret == 0
    return np.array(out).copy()


def test_constant_first_operands_move_second_and_the_values_stay(tmp_path):
    text = PARAM  # in0x, in0y: the input again, so the last two ops (computed blobs only) are left alone
    out, n = constants_last(text)
    assert n == 3
    lines = _lines(out)
    assert lines["sub_0"][4:7] == ["in0", "m1", "a"] and "0=7" in lines["sub_0"]
    assert lines["div_1"][4:7] == ["a", "m2", "b"] and "0=8" in lines["div_1"]
    assert lines["add_2"][4:7] == ["b", "m3", "c"] and "0=0" in lines["add_2"]
    assert lines["mul_3"][4:7] == ["c", "in0x", "d"] and "0=2" in lines["mul_3"]
    assert lines["rsub_4"][4:7] == ["d", "in0y", "out0"] and "0=7" in lines["rsub_4"]
    rng = np.random.default_rng(5)
    x = rng.uniform(0.5, 2.0, (3, 8)).astype(np.float32)
    grid = rng.uniform(3.0, 4.0, (3, 8)).astype(np.float32)
    want = _run(text, tmp_path, x, grid)
    np.testing.assert_array_equal(_run(out, tmp_path, x, grid), want)
    np.testing.assert_allclose(want, x - (grid / (grid - x) + grid) * x, rtol=1e-5)


def test_a_param_without_constants_first_is_returned_as_it_was():
    text = PARAM.replace("2 1 m1 in0 a 0=1", "2 1 in0 m1 a 0=1").replace("2 1 m2 a b 0=3", "2 1 a m2 b 0=3") \
                .replace("2 1 m3 b c", "2 1 b m3 c")
    assert constants_last(text) == (text, 0)
