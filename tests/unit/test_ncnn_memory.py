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


DIRECT_PARAM = """7767517
7 7
Input            in0      0 1 in0
Convolution      s1       1 1 in0 a 0=32 1=3 11=3 12=1 13=1 14=1 2=1 3=1 4=1 5=1 6=9216
Convolution      s2       1 1 a b 0=64 1=3 11=3 12=1 13=2 14=1 2=1 3=2 4=1 5=1 6=18432
Convolution      pw       1 1 b c 0=128 1=1 11=1 12=1 13=1 14=0 2=1 3=1 4=0 5=1 6=8192
Convolution      head     1 1 c d 0=18 1=1 11=1 12=1 13=1 14=0 2=1 3=1 4=0 5=1 6=2304
Convolution      dilated  1 1 d e 0=32 1=3 11=3 12=2 13=1 14=2 2=2 3=1 4=2 5=1 6=5184
Convolution      k5       1 1 e out0 0=32 1=5 11=5 12=1 13=1 14=2 2=1 3=1 4=2 5=1 6=25600
"""


def test_x86_lean_hands_every_layer_the_direct_kernel_takes_to_it():
    text, masked, saved = lean_param(DIRECT_PARAM, direct=True)
    # an 18-channel head, a dilated and a 5x5 layer are not the kernel's (ep_c3_wanted)
    assert masked == ["s1", "s2", "pw"]
    lines = {ln.split()[1]: ln for ln in text.splitlines() if ln.startswith("Convolution")}
    assert all(fields(lines[n])["31"] == str(NO_WINOGRAD) for n in masked)
    assert saved == 32 * 32 * 64 * 4 - 9216 * 4  # s1's F(6,3) kernel; s2 and pw had none
    # Arm has no direct kernel: only the large-kernel rule applies
    assert lean_param(DIRECT_PARAM)[1] == []


def test_lean_hands_2x2_stride_1_layers_to_the_direct_kernel_too():
    from edgepack.backends.ncnn.memory import direct_kernel_takes
    assert direct_kernel_takes({"0": "16", "1": "2", "6": "512"})               # PP-HGNet's stem
    assert not direct_kernel_takes({"0": "16", "1": "2", "3": "2", "6": "512"})  # stride 2
    assert not direct_kernel_takes({"0": "16", "1": "2", "11": "3", "6": "768"})  # 2x3


def test_integer_convolutions_are_marked_for_f23_on_x86_and_kept_off_winograd_elsewhere():
    from edgepack.backends.ncnn.memory import INTEGER_SUMS, integer_convolutions
    lines = {ln.split()[1]: ln for ln in integer_convolutions(PARAM).splitlines() if ln.startswith("Convolution")}
    assert all(int(fields(ln)["31"]) & (NO_WINOGRAD | INTEGER_SUMS) == NO_WINOGRAD | INTEGER_SUMS for ln in lines.values())
    assert fields(lines["masked"])["31"] == str(NO_WINOGRAD | INTEGER_SUMS | 2)
    # --memory lean on such a graph: the layers it masks for memory lose the F(2,3) mark, the rest keep it
    text, masked, _ = lean_param(integer_convolutions(PARAM))
    lean = {ln.split()[1]: ln for ln in text.splitlines() if ln.startswith("Convolution")}
    assert masked == ["big", "masked"]
    assert int(fields(lean["big"])["31"]) == NO_WINOGRAD and int(fields(lean["small"])["31"]) & INTEGER_SUMS


def test_lean_leaves_gemms_as_they_are():
    """The fp16 packed B needs no mark: every fp16-rung net keeps it (gemm_fp16_b_patch.py)."""
    param = ("7767517\n3 3\nInput in0 0 1 in0\nGemm gemm_0 1 1 in0 1 10=-1 2=0 3=1 4=0 5=1 6=1 7=20 8=8210 9=1024\n"
             "Gemm gemm_1 1 1 1 out0 5=1 31=2\n")
    assert lean_param(param, direct=True) == (param, [], 0)


def test_gemm_fp16_b_patch_is_x86_only_follows_fp16_storage_and_keeps_other_paths_fp32():
    from edgepack.backends.ncnn import library
    from edgepack.backends.ncnn.gemm_fp16_b_patch import _CREATE_NEW, _PACK_NEW, _SIG_NEW
    from edgepack.targets import TargetMatrix
    matrix = TargetMatrix.load()
    names = [name for name, _, _ in library._arch_patches(matrix.get("x86_64"))]
    assert names.index("gemm_fp16_b_patch") > max(names.index("fp16_weights_patch"), names.index("int8_gemv_patch"))
    assert "gemm_fp16_b_patch" not in [name for name, _, _ in library._arch_patches(matrix.get("arm64"))]
    assert "opt.use_fp16_storage" in _CREATE_NEW and "!constantA" in _CREATE_NEW  # gemm_AT_BT reads fp32 tiles
    assert "BT_tile.elemsize == 2u" in _PACK_NEW and "elemsize != 2u" in _SIG_NEW
