"""`--memory lean`'s .param rewrite (edgepack/backends/ncnn/memory.py): which layers lose Winograd."""
from __future__ import annotations

import pytest

from edgepack.backends.ncnn.memory import KERNEL_LIMIT, NO_WINOGRAD, lean_param, winograd_bytes

PARAM = """7767517
5 5
Input            in0      0 1 in0
Convolution      big      1 1 in0 a 0=128 1=3 11=3 12=1 13=1 14=1 2=1 3=1 4=1 5=1 6=147456
Convolution      small    1 1 a b 0=32 1=3 11=3 12=1 13=1 14=1 2=1 3=1 4=1 5=1 6=36864
Convolution      strided  1 1 b c 0=256 1=3 11=3 12=1 13=2 14=1 2=1 3=2 4=1 5=1 6=294912
Convolution      masked   1 1 c out0 0=256 1=3 11=3 2=1 3=1 4=1 5=1 6=589824 31=2
"""


def fields(line: str) -> dict:
    t = line.split()
    return dict(kv.split("=") for kv in t[4 + int(t[2]) + int(t[3]):])


def test_only_large_winograd_kernels_are_masked():
    text, masked, saved = lean_param(PARAM)
    assert masked == ["big", "masked"]  # strided has no Winograd; small's F(6,3) kernel is 256 KiB
    lines = {ln.split()[1]: ln for ln in text.splitlines() if ln.startswith("Convolution")}
    assert fields(lines["big"])["31"] == str(NO_WINOGRAD)
    assert fields(lines["masked"])["31"] == str(NO_WINOGRAD | 2)  # the mask it had is kept
    assert "31=" not in lines["small"] and "31=" not in lines["strided"]
    assert saved == 128 * 128 * 27 * 4 + 256 * 256 * 27 * 4
    assert text.splitlines()[:2] == ["7767517", "5 5"]


@pytest.mark.parametrize("cin,cout,tiles", [(32, 32, 64), (16, 64, 36), (8, 8, 0), (128, 128, 36)])
def test_kernel_size_follows_ncnns_dynamic_shape_choice(cin, cout, tiles):
    f = {"0": str(cout), "1": "3", "6": str(cin * cout * 9)}
    assert winograd_bytes(f) == (cin * cout * tiles * 4, cin * cout * 9 * 4)


def test_limit_is_one_mib():
    assert KERNEL_LIMIT == 2**20
