"""ncnn's x86 depthwise convolutions of any kernel size sum several output pixels at once
(src/layer/x86/convolutiondepthwise_packed.h, convolutiondepthwise_x86.cpp).

ncnn has dedicated depthwise kernels for 3x3 and 5x5 (stride 1 and 2) only. Every other shape,
the 7x7 depthwise of ConvNeXt-style blocks (PP-OCRv6's detector head has four, 96 channels at
10 x 10 to 80 x 80) among them, runs a generic loop that computes one output vector at a time:
49 fused multiply-adds on one accumulator, each waiting for the one before (4-5 cycles of
latency where the core could start two a cycle). On the AVX2 EPYC that loop took 10.3% of
ppocr_v6_det_small's time for 4% of its arithmetic.

The patched loop keeps eight (then four) output pixels of a row in flight: for each kernel tap it
loads the weight vector once and adds it into eight independent sums. Each sum is still bias, then
tap 0, 1, ... in ncnn's order, one multiply-add each, so the results are the same bits as ncnn's
loop; the pixels past the last block of four take ncnn's loop unchanged. Applied to the three
packings: 16 lanes (the AVX-512 build), 8 (AVX and FMA builds) and 4 (SSE2 and up), each with the
arithmetic and the activation its loop had.

Applied as exact text edits that must each match, like source_patch.py. Only x86 builds compile
these files, so only their cache key carries DW_BLOCK_PATCH_KEY.
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

DW_BLOCK_PATCH_VERSION = 1

PACKED_FILE = "src/layer/x86/convolutiondepthwise_packed.h"
X86_FILE = "src/layer/x86/convolutiondepthwise_x86.cpp"


def _block(n: int, indent: str, lanes: int, vec: str, zero: str, load: str, madd: str, finish: str,
           store: str, step: str) -> str:
    """C text of one block loop: n output pixels of a row, n sums, each in ncnn's order."""
    pad = indent + "    "
    inner = pad + "    "
    sums = range(n)
    lines = [f"{indent}for (; j + {n - 1} < outw; j += {n})", f"{indent}{{"]
    lines.append(f"{pad}const {vec} _b = bias_term ? {load}(((const float*)bias_data) + g * {lanes}) : {zero};")
    lines += [f"{pad}{vec} _s{s} = _b;" for s in sums]
    lines += [f"{pad}const float* sptr = m.row(i * stride_h) + j * stride_w * {lanes};",
              f"{pad}const int sstep = stride_w * {lanes};",
              f"{pad}for (int k = 0; k < maxk; k++)", f"{pad}{{",
              f"{inner}const float* p = sptr + space_ofs[k] * {lanes};",
              f"{inner}const {vec} _w = {load}(kptr + k * {lanes});"]
    lines += [f"{inner}_s{s} = {madd.format(val=f'{load}(p + sstep * {s})', w='_w', sum=f'_s{s}')};" for s in sums]
    lines.append(f"{pad}}}")
    for s in sums:
        if finish:
            lines.append(f"{pad}_s{s} = {finish.format(sum=f'_s{s}')};")
        lines.append(f"{pad}{store.format(off=lanes * s, sum=f'_s{s}')};")
    if step:
        lines.append(f"{pad}{step.format(n=n)};")
    lines.append(f"{indent}}}")
    return "\n".join(lines) + "\n"


def _blocks(indent: str, **isa) -> str:
    head = f"{indent}int j = 0;\n{indent}// edgepack (dw_block_patch.py): 8, then 4 output pixels at a time, each summed in ncnn's order\n"
    return head + _block(8, indent, **isa) + _block(4, indent, **isa)


def _loop_edit(depth: int, **isa) -> tuple[str, str]:
    """(ncnn's row loop head, the same with the blocks before it) for a loop nested `depth` levels deep;
    the pixels past the blocks take ncnn's loop from where the blocks stopped."""
    row, col, body = ("    " * (depth + k) for k in range(3))
    first = f"{body}{isa['vec']} _sum = {isa['zero']};\n"
    head = f"{row}for (int i = 0; i < outh; i++)\n{row}{{\n"
    old = head + f"{col}for (int j = 0; j < outw; j++)\n{col}{{\n" + first
    return old, head + _blocks(col, **isa) + f"{col}for (; j < outw; j++)\n{col}{{\n" + first


# 8 lanes (convolutiondepthwise_packed.h, the AVX build and its FMA twin): outputs at outptr + j * 8
_PACK8_OLD, _PACK8_NEW = _loop_edit(
    2, lanes=8, vec="__m256", zero="_mm256_set1_ps(0.f)", load="_mm256_loadu_ps",
    madd="_mm256_comp_fmadd_ps({val}, {w}, {sum})", finish="", store="_mm256_storeu_ps(outptr + j * 8 + {off}, {sum})",
    step="")
# 16 lanes (convolutiondepthwise_x86.cpp, AVX-512 build): outptr advances by 16 per pixel
_PACK16_OLD, _PACK16_NEW = _loop_edit(
    5, lanes=16, vec="__m512", zero="_mm512_set1_ps(0.f)", load="_mm512_loadu_ps",
    madd="_mm512_fmadd_ps({val}, {w}, {sum})", finish="", store="_mm512_storeu_ps(outptr + {off}, {sum})",
    step="outptr += {n} * 16")
# 4 lanes (convolutiondepthwise_x86.cpp, every build with SSE2): multiply then add, activation inline
_PACK4_OLD, _PACK4_NEW = _loop_edit(
    5, lanes=4, vec="__m128", zero="_mm_set1_ps(0.f)", load="_mm_loadu_ps",
    madd="_mm_add_ps(_mm_mul_ps({val}, {w}), {sum})", finish="activation_sse({sum}, activation_type, activation_params)",
    store="_mm_storeu_ps(outptr + j * 4 + {off}, {sum})", step="")

_FILE_EDITS = (
    (PACKED_FILE, (("the 8-lane generic loop", _PACK8_OLD, _PACK8_NEW, 1),)),
    (X86_FILE, (("the 16-lane generic loop", _PACK16_OLD, _PACK16_NEW, 1),
                ("the 4-lane generic loop", _PACK4_OLD, _PACK4_NEW, 1))),
)

DW_BLOCK_PATCH_KEY = file_edits_key(DW_BLOCK_PATCH_VERSION, _FILE_EDITS)


def patch_dw_block(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place (x86 builds only)."""
    apply_file_edits(src, _FILE_EDITS, "dw_block_patch.py")
