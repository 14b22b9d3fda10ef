"""ncnn's BinaryOp divides as IEEE division does, as onnxruntime does (every arch).

ncnn is built with -ffast-math, which lets the compiler divide by multiplying with a reciprocal:
a loop whose divisor does not change (a tensor divided by a per-tensor scale, or by a constant)
computes 1/b once and multiplies, and clang turns vector divisions on x86 into a reciprocal
estimate with one Newton step. Either result can be one ulp off the quotient. That never matters
to a convolution, but it does where a quotient is rounded next: onnxruntime's dynamic int8
(`DynamicQuantizeLinear`, lowered to float ops by quantized.py) divides every activation by its
scale and rounds half to even. An input value of -3.0 with a scale of 6/255 is a tie at -127.5;
one ulp below it rounds the other way, and twelve such flips among 10240 inputs moved a captcha
model's output by 3.7% of its scale (ddddocr_old_int8, 2026-12-02).

So the division functors say `#pragma float_control(precise, on)` (clang: this one expression
keeps no fast-math flag) and divide with the plain operator, not the intrinsic: an intrinsic is an
inline function of a header compiled under -ffast-math, which the pragma would not reach.
Measured: the vector loop keeps `vdivps` / `fdiv v.4s` where it had a hoisted reciprocal and
`vmulps` / `fmul`. Everything else keeps fast-math. Armv7 keeps ncnn's vector `div_ps` (a
reciprocal estimate: armv7 NEON has no vector division); no edgepack target is armv7.
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

EXACT_DIV_PATCH_VERSION = 1

EXACT_DIV_MACRO = r'''
// edgepack (exact_div_patch.py): divide as IEEE division does, even under -ffast-math (no reciprocal)
#ifndef EP_EXACT_DIV
#if defined(__clang__)
#define EP_EXACT_DIV _Pragma("float_control(precise, on)")
#else
#define EP_EXACT_DIV
#endif
#endif
'''


def _x86_returns() -> tuple:
    edits = []
    for a, b in (("x", "y"), ("y", "x")):
        # the scalar one first: the vector ones become the same text
        edits.append((f"the scalar {a} / {b}", f"        return {a} / {b};\n",
                      f"        EP_EXACT_DIV\n        return {a} / {b};\n", 1))
        for intrinsic in ("_mm_div_ps", "_mm256_div_ps", "_mm512_div_ps"):
            edits.append((f"{intrinsic}({a}, {b})", f"        return {intrinsic}({a}, {b});\n",
                          f"        EP_EXACT_DIV\n        return {a} / {b};\n", 1))
    return tuple(edits)


_X86_EDITS = (("the macro, before the first functor", "struct binary_op_add\n{", EXACT_DIV_MACRO + "\nstruct binary_op_add\n{", 1),
              ) + _x86_returns()

_GENERIC_EDITS = (
    ("the macro, after the include", '#include "binaryop.h"\n', '#include "binaryop.h"\n' + EXACT_DIV_MACRO, 1),
    ("the scalar x / y", "        return x / y;\n", "        EP_EXACT_DIV\n        return x / y;\n", 1),
    ("the scalar y / x", "        return y / x;\n", "        EP_EXACT_DIV\n        return y / x;\n", 1),
)

_ARM_HELPERS = EXACT_DIV_MACRO + r'''
static inline float ep_exact_div(float x, float y)
{
    EP_EXACT_DIV
    return x / y;
}
#if __ARM_NEON && __aarch64__
static inline float32x4_t ep_exact_div(float32x4_t x, float32x4_t y)
{
    EP_EXACT_DIV
    return x / y;
}
#endif

namespace BinaryOp_arm_functor {'''

_ARM_EDITS = (
    ("the helpers, before the functors", "namespace BinaryOp_arm_functor {", _ARM_HELPERS, 1),
    ("aarch64 div", "MAKE_FUNCTION(binary_op_div, x / y, vdivq_f32(x, y))",
     "MAKE_FUNCTION(binary_op_div, ep_exact_div(x, y), ep_exact_div(x, y))", 1),
    ("armv7 div", "MAKE_FUNCTION(binary_op_div, x / y, div_ps(x, y))",
     "MAKE_FUNCTION(binary_op_div, ep_exact_div(x, y), div_ps(x, y))", 1),
    ("aarch64 rdiv", "MAKE_FUNCTION(binary_op_rdiv, y / x, vdivq_f32(y, x))",
     "MAKE_FUNCTION(binary_op_rdiv, ep_exact_div(y, x), ep_exact_div(y, x))", 1),
    ("armv7 rdiv", "MAKE_FUNCTION(binary_op_rdiv, y / x, div_ps(y, x))",
     "MAKE_FUNCTION(binary_op_rdiv, ep_exact_div(y, x), div_ps(y, x))", 1),
)

_FILE_EDITS = (("src/layer/x86/binaryop_functor.h", _X86_EDITS),
               ("src/layer/binaryop.cpp", _GENERIC_EDITS),
               ("src/layer/arm/binaryop_arm.cpp", _ARM_EDITS))

EXACT_DIV_PATCH_KEY = file_edits_key(EXACT_DIV_PATCH_VERSION, _FILE_EDITS)


def patch_exact_div(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place (every arch: the files of the
    others are not compiled, and editing them keeps one source tree per pin)."""
    apply_file_edits(src, _FILE_EDITS, "exact_div_patch.py")
