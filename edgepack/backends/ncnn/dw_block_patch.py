"""ncnn's depthwise convolutions of any kernel size sum several output pixels at once, on x86
(src/layer/x86/convolutiondepthwise_packed.h, convolutiondepthwise_x86.cpp) and on Arm
(src/layer/arm/convolutiondepthwise_arm.cpp, convolutiondepthwise_arm_asimdhp.cpp).

ncnn has dedicated depthwise kernels for 3x3 and 5x5 (stride 1 and 2) only. Every other shape,
the 7x7 depthwise of ConvNeXt-style blocks (PP-OCRv6's detector head has four, 96 channels at
10 x 10 to 80 x 80) among them, runs a generic loop that computes one output vector at a time:
49 fused multiply-adds on one accumulator, each waiting for the one before (4-5 cycles of
latency where the core could start two a cycle). On the AVX2 EPYC that loop took 10.3% of
ppocr_v6_det_small's time for 4% of its arithmetic.

The patched loop keeps eight (then four) output pixels of a row in flight: for each kernel tap it
loads the weight vector once and adds it into eight independent sums. Each sum is still bias, then
tap 0, 1, ... in ncnn's order, one multiply-add each, so the results are the same bits as ncnn's
loop; the pixels past the last block of four take ncnn's loop unchanged. Applied to each packing
with the arithmetic and the activation its loop had: x86 16 lanes (the AVX-512 build), 8 (AVX and
FMA builds) and 4 (SSE2 and up); Arm 4 lanes of fp32, fp16 storage summed in fp32, and fp16
arithmetic in 8 and 4 lanes (the same dependency chain on every Arm core; not timed on Arm here).

Applied as exact text edits that must each match, like source_patch.py; each arch's key carries only
its own table (DW_BLOCK_PATCH_KEY, DW_BLOCK_ARM_PATCH_KEY).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

DW_BLOCK_PATCH_VERSION = 1

PACKED_FILE = "src/layer/x86/convolutiondepthwise_packed.h"
X86_FILE = "src/layer/x86/convolutiondepthwise_x86.cpp"


@dataclass(frozen=True)
class _Loop:
    """How one of ncnn's generic loops loads, sums and stores: C text with {p}, {val}, {w}, {sum}, {off}, {n}."""
    lanes: int
    vec: str          # the vector type
    zero: str
    load: str         # a vector from element pointer {p}
    bias: str         # the bias vector of channel group g
    madd: str         # {sum} + {val} * {w}, as ncnn's loop writes it
    store: str        # sum {sum} to pixel j + {off} / lanes
    finish: str = ""  # the fused activation, where the loop applies it inline
    step: str = ""    # where outptr moves with the pixels
    elem: str = "float"


def _block(n: int, indent: str, loop: _Loop) -> str:
    """C text of one block loop: n output pixels of a row, n sums, each in ncnn's order."""
    pad = indent + "    "
    inner = pad + "    "
    sums = range(n)
    lanes, vec, elem = loop.lanes, loop.vec, loop.elem
    row = "m.row(i * stride_h)" if elem == "float" else f"m.row<const {elem}>(i * stride_h)"
    lines = [f"{indent}for (; j + {n - 1} < outw; j += {n})", f"{indent}{{"]
    lines.append(f"{pad}const {vec} _b = bias_term ? {loop.bias} : {loop.zero};")
    lines += [f"{pad}{vec} _s{s} = _b;" for s in sums]
    lines += [f"{pad}const {elem}* sptr = {row} + j * stride_w * {lanes};",
              f"{pad}const int sstep = stride_w * {lanes};",
              f"{pad}for (int k = 0; k < maxk; k++)", f"{pad}{{",
              f"{inner}const {elem}* p = sptr + space_ofs[k] * {lanes};",
              f"{inner}const {vec} _w = {loop.load.format(p=f'kptr + k * {lanes}')};"]
    lines += [f"{inner}_s{s} = {loop.madd.format(val=loop.load.format(p=f'p + sstep * {s}'), w='_w', sum=f'_s{s}')};"
              for s in sums]
    lines.append(f"{pad}}}")
    for s in sums:
        if loop.finish:
            lines.append(f"{pad}_s{s} = {loop.finish.format(sum=f'_s{s}')};")
        lines.append(f"{pad}{loop.store.format(off=lanes * s, sum=f'_s{s}')};")
    if loop.step:
        lines.append(f"{pad}{loop.step.format(n=n)};")
    lines.append(f"{indent}}}")
    return "\n".join(lines) + "\n"


def _blocks(indent: str, loop: _Loop) -> str:
    head = f"{indent}int j = 0;\n{indent}// edgepack (dw_block_patch.py): 8, then 4 output pixels at a time, each summed in ncnn's order\n"
    return head + _block(8, indent, loop) + _block(4, indent, loop)


def _loop_edit(depth: int, loop: _Loop, lead: str = "") -> tuple[str, str]:
    """(ncnn's row loop head, the same with the blocks before it) for a loop nested `depth` levels deep,
    after the text `lead` where the head alone is not unique in its file; the pixels past the blocks
    take ncnn's loop from where the blocks stopped."""
    row, col, body = ("    " * (depth + k) for k in range(3))
    first = f"{body}{loop.vec} _sum = {loop.zero};\n"
    head = f"{lead}{row}for (int i = 0; i < outh; i++)\n{row}{{\n"
    old = head + f"{col}for (int j = 0; j < outw; j++)\n{col}{{\n" + first
    return old, head + _blocks(col, loop) + f"{col}for (; j < outw; j++)\n{col}{{\n" + first


# 8 lanes (convolutiondepthwise_packed.h, the AVX build and its FMA twin): outputs at outptr + j * 8
_PACK8_OLD, _PACK8_NEW = _loop_edit(2, _Loop(
    8, "__m256", "_mm256_set1_ps(0.f)", "_mm256_loadu_ps({p})", "_mm256_loadu_ps(((const float*)bias_data) + g * 8)",
    "_mm256_comp_fmadd_ps({val}, {w}, {sum})", "_mm256_storeu_ps(outptr + j * 8 + {off}, {sum})"))
# 16 lanes (convolutiondepthwise_x86.cpp, AVX-512 build): outptr advances by 16 per pixel
_PACK16_OLD, _PACK16_NEW = _loop_edit(5, _Loop(
    16, "__m512", "_mm512_set1_ps(0.f)", "_mm512_loadu_ps({p})", "_mm512_loadu_ps(((const float*)bias_data) + g * 16)",
    "_mm512_fmadd_ps({val}, {w}, {sum})", "_mm512_storeu_ps(outptr + {off}, {sum})", step="outptr += {n} * 16"))
# 4 lanes (convolutiondepthwise_x86.cpp, every build with SSE2): multiply then add, activation inline
_PACK4_OLD, _PACK4_NEW = _loop_edit(5, _Loop(
    4, "__m128", "_mm_set1_ps(0.f)", "_mm_loadu_ps({p})", "_mm_loadu_ps(((const float*)bias_data) + g * 4)",
    "_mm_add_ps(_mm_mul_ps({val}, {w}), {sum})", "_mm_storeu_ps(outptr + j * 4 + {off}, {sum})",
    finish="activation_sse({sum}, activation_type, activation_params)"))

# Arm (aarch64): 4 lanes of fp32 (convolutiondepthwise_arm.cpp), fp16 storage summed in fp32 and fp16
# arithmetic, 8 and 4 lanes (convolutiondepthwise_arm_asimdhp.cpp, for CPUs with fp16 arithmetic)
_ARM_LEAD = ("                    const {t}* kptr = (const {t}*)weight_data_tm + maxk * g * {lanes};\n"
             "                    const Mat m = bottom_blob_bordered.channel(g);\n\n")
_ARM_FP32_OLD, _ARM_FP32_NEW = _loop_edit(5, _Loop(
    4, "float32x4_t", "vdupq_n_f32(0.f)", "vld1q_f32({p})", "vld1q_f32(((const float*)bias_data) + g * 4)",
    "vmlaq_f32({sum}, {val}, {w})", "vst1q_f32(outptr + j * 4 + {off}, {sum})",
    finish="activation_ps({sum}, activation_type, activation_params)"), _ARM_LEAD.format(t="float", lanes=4))
_ARM_FP16S_OLD, _ARM_FP16S_NEW = _loop_edit(5, _Loop(
    4, "float32x4_t", "vdupq_n_f32(0.f)", "vcvt_f32_f16(vld1_f16({p}))", "vld1q_f32(((const float*)bias_data) + g * 4)",
    "vfmaq_f32({sum}, {val}, {w})", "vst1_f16(outptr + j * 4 + {off}, vcvt_f16_f32({sum}))",
    finish="activation_ps({sum}, activation_type, activation_params)", elem="__fp16"), _ARM_LEAD.format(t="__fp16", lanes=4))
_ARM_FP16SA8_OLD, _ARM_FP16SA8_NEW = _loop_edit(5, _Loop(
    8, "float16x8_t", "vdupq_n_f16((__fp16)0.f)", "vld1q_f16({p})", "vld1q_f16(((const __fp16*)bias_data_fp16) + g * 8)",
    "vfmaq_f16({sum}, {val}, {w})", "vst1q_f16(outptr + j * 8 + {off}, {sum})",
    finish="activation_ps_f16({sum}, activation_type, activation_params)", elem="__fp16"), _ARM_LEAD.format(t="__fp16", lanes=8))
_ARM_FP16SA4_OLD, _ARM_FP16SA4_NEW = _loop_edit(5, _Loop(
    4, "float16x4_t", "vdup_n_f16((__fp16)0.f)", "vld1_f16({p})", "vld1_f16(((const __fp16*)bias_data_fp16) + g * 4)",
    "vfma_f16({sum}, {val}, {w})", "vst1_f16(outptr + j * 4 + {off}, {sum})",
    finish="activation_ps_f16({sum}, activation_type, activation_params)", elem="__fp16"), _ARM_LEAD.format(t="__fp16", lanes=4))

_ARM_FILE_EDITS = (
    ("src/layer/arm/convolutiondepthwise_arm.cpp", (("the fp32 generic loop", _ARM_FP32_OLD, _ARM_FP32_NEW, 1),)),
    ("src/layer/arm/convolutiondepthwise_arm_asimdhp.cpp", (
        ("the fp16-storage generic loop", _ARM_FP16S_OLD, _ARM_FP16S_NEW, 1),
        ("the fp16-arithmetic 8-lane generic loop", _ARM_FP16SA8_OLD, _ARM_FP16SA8_NEW, 1),
        ("the fp16-arithmetic 4-lane generic loop", _ARM_FP16SA4_OLD, _ARM_FP16SA4_NEW, 1))),
)

_FILE_EDITS = (
    (PACKED_FILE, (("the 8-lane generic loop", _PACK8_OLD, _PACK8_NEW, 1),)),
    (X86_FILE, (("the 16-lane generic loop", _PACK16_OLD, _PACK16_NEW, 1),
                ("the 4-lane generic loop", _PACK4_OLD, _PACK4_NEW, 1))),
)

DW_BLOCK_PATCH_KEY = file_edits_key(DW_BLOCK_PATCH_VERSION, _FILE_EDITS)
DW_BLOCK_ARM_PATCH_KEY = file_edits_key(DW_BLOCK_PATCH_VERSION, _ARM_FILE_EDITS)


def patch_dw_block(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place (x86 builds only)."""
    apply_file_edits(src, _FILE_EDITS, "dw_block_patch.py")


def patch_dw_block_arm(src: Path) -> None:
    """The same for aarch64 builds (fp32, fp16 storage and fp16 arithmetic loops)."""
    apply_file_edits(src, _ARM_FILE_EDITS, "dw_block_patch.py")
