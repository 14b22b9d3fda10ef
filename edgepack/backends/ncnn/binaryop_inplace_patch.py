"""A two-input BinaryOp writes its output over its larger input where nothing else holds that input.

ncnn runs a two-input BinaryOp (x + y, x * scale) into a new blob, so the two inputs and the output are alive
at once. In exported graphs the larger input is usually dying there: a residual sum (x + f(x)) or a
squeeze-and-excitation product (x * se(x)) is the last reader of its map. PP-OCRv4's detector held three
96 x 80 x 80 maps at its peak that way (the lateral, its SE product and their sum), 7.4 of the 9.8 MB its
arena held (EDGEPACK_NCNN_ARENA_LOG).

Here BinaryOp_x86::forward gives the output the larger input's memory (the operand ncnn hands
binary_op_broadcast first, whose shape, element size and packing the output takes) when, in ncnn's light mode:
- nothing but this call and the net's own slot for that blob holds it: its reference count on entry is 1
  (a copy convert_layout just made) or 2 (the net's slot, which ncnn releases after this layer in light
  mode, and this call's). A blob a Split shares with a reader yet to run, a net input its caller still
  holds, or data with no count (external memory) keeps ncnn's new blob;
- it is the operand given first, unreshaped, with the output's dims, shape, element size and packing.
Every loop of binary_op_broadcast reads an element (or a vector of them) of both inputs before writing
that element of the output, and the first operand is never read at another position, so writing over it
gives the same values. Mat::create then keeps the memory (same shape, same allocator), or, where the
allocator differs, releases the reference and makes a new blob as before.

Arm builds get the same edits in BinaryOp_arm's fp32 and fp16-storage forwards (binaryop_arm.cpp,
binaryop_arm_asimdhp.cpp), whose structure is x86's: BINARYOP_INPLACE_ARM_PATCH_KEY.
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

BINARYOP_INPLACE_PATCH_VERSION = 1

FILE = "src/layer/x86/binaryop_x86.cpp"

# forward and forward_bf16s (built only with NCNN_BF16) share these lines
_REFS_OLD = ("    const Mat& A = bottom_blobs[0];\n    const Mat& B = bottom_blobs[1];\n"
             "    const int outdims = std::max(A.dims, B.dims);\n")
_REFS_NEW = _REFS_OLD + (
    "    // edgepack (binaryop_inplace_patch.py): how many hold each input on entry (0: external memory)\n"
    "    const int ep_refs_a = A.refcount ? *A.refcount : 0;\n"
    "    const int ep_refs_b = B.refcount ? *B.refcount : 0;\n")

_TOP_OLD = "    Mat& top_blob = top_blobs[0];\n"
_TOP_NEW = _TOP_OLD + r"""    // edgepack (binaryop_inplace_patch.py): the output over the operand binary_op_broadcast gets first, where
    // nothing else holds it and it has the output's shape and layout; the creates below then keep it
    {
        const bool ep_b_first = A2.elempack < B2.elempack
                                || (A2.elempack == B2.elempack && A2.w * A2.h * A2.d * A2.c * A2.elempack < B2.w * B2.h * B2.d * B2.c * B2.elempack);
        const Mat& ep_in = ep_b_first ? B : A;
        const Mat& ep_in2 = ep_b_first ? B2 : A2;
        const int ep_refs = ep_b_first ? ep_refs_b : ep_refs_a;
        if (opt.lightmode && (ep_refs == 1 || ep_refs == 2) && ep_in2.data == ep_in.data && ep_in.dims == outdims
                && ep_in2.dims == outdims && ep_in.w == outw && ep_in.h == outh && ep_in.d == outd && ep_in.c == outc
                && ep_in.elemsize == out_elemsize && ep_in.elempack == out_elempack && ep_in.allocator == opt.blob_allocator)
            top_blob = ep_in;
    }
"""


def _edits(forwards: int) -> tuple:
    """The two edits, in a file with ``forwards`` two-input forward functions."""
    return (("each input's reference count on entry", _REFS_OLD, _REFS_NEW, forwards),
            ("the output over a dying input", _TOP_OLD, _TOP_NEW, forwards))


_FILE_EDITS = ((FILE, _edits(2)),)  # forward and forward_bf16s
BINARYOP_INPLACE_PATCH_KEY = file_edits_key(BINARYOP_INPLACE_PATCH_VERSION, _FILE_EDITS)

# fp32 and bf16 forwards in binaryop_arm.cpp, the fp16-storage one in binaryop_arm_asimdhp.cpp
_ARM_FILE_EDITS = (("src/layer/arm/binaryop_arm.cpp", _edits(2)), ("src/layer/arm/binaryop_arm_asimdhp.cpp", _edits(1)))
BINARYOP_INPLACE_ARM_PATCH_KEY = file_edits_key(BINARYOP_INPLACE_PATCH_VERSION, _ARM_FILE_EDITS)


def patch_binaryop_inplace(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place (x86 builds, after thread_split_patch.py)."""
    apply_file_edits(src, _FILE_EDITS, "binaryop_inplace_patch.py")


def patch_binaryop_inplace_arm(src: Path) -> None:
    """Apply the Arm edits to an unpacked ncnn source tree, in place (aarch64 builds)."""
    apply_file_edits(src, _ARM_FILE_EDITS, "binaryop_inplace_patch.py")
