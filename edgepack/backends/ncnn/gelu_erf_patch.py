"""ncnn's x86 GELU (the erf form, the one ONNX exporters write) with a cheaper erf
(src/layer/x86/gelu_fp32.h).

ncnn evaluates erf(x / sqrt 2) as two approximations at once, a polynomial for small |x| and
1 - exp(polynomial) above a threshold, blended by a mask: every vector pays both and an exp,
about 45 vector operations for 8 values. PP-OCRv6's models put a GELU after most of their 1x1
convolutions (ppocr_v6_det_small: 13 GELUs on 2.9 M values, 11.6% of its time on the AVX2 EPYC).

Here erf(y) = y * P(y^2) / Q(y^2) with y clamped to [-4, 4] (erf(4) rounds to 1 in fp32), P of
degree 6 and Q of degree 5 in y^2: 11 multiply-adds and one division. The coefficients were fitted
for this patch (iteratively re-weighted least squares on 40 000 points of [0, 4], against
scipy.special.erf): 1.5e-9 off erf in exact arithmetic, 3.8e-7 evaluated in fp32 (ncnn's: 3.0e-7
on GELU's output). Measured on the AVX2 EPYC: 0.52 against 1.43 ns per value (8 lanes, FMA).

The 16-, 8- and 4-lane loops take the new erf; the scalar tail (fewer than 4 values per channel)
keeps erff. Applied as exact text edits that must each match, like source_patch.py. Only x86 builds
compile this file, so only their cache key carries GELU_ERF_PATCH_KEY.
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

GELU_ERF_PATCH_VERSION = 1

GELU_FILE = "src/layer/x86/gelu_fp32.h"

# erf(y) ~ y * P(t) / Q(t), t = y^2, |y| <= 4; lowest degree first
ERF_P = (1.128379225730896, 0.18471485376358032, 0.05433312803506851, 0.003839709097519517,
         0.0003826933680102229, 4.780443759955233e-06, -1.3666546117008238e-08)
ERF_Q = (1.0, 0.4970328211784363, 0.11382811516523361, 0.015453873202204704, 0.0013096180045977235,
         6.400846177712083e-05)


def _erf_function(name: str, vec: str, set1: str, mn: str, mx: str, mul: str, fmadd: str, div: str) -> str:
    def horner(var: str, coefs: tuple) -> list[str]:
        lines = [f"    {vec} {var} = {set1}({coefs[-1]!r}f);"]
        lines += [f"    {var} = {fmadd}({var}, t, {set1}({c!r}f));" for c in coefs[-2::-1]]
        return lines
    body = [f"static NCNN_FORCEINLINE {vec} {name}({vec} y)", "{",
            f"    y = {mn}({mx}(y, {set1}(-4.f)), {set1}(4.f));",
            f"    const {vec} t = {mul}(y, y);"]
    body += horner("p", ERF_P) + horner("q", ERF_Q)
    body += [f"    return {div}({mul}(y, p), q);", "}"]
    return "\n".join(body) + "\n"


_HELPERS = ("\n// edgepack (gelu_erf_patch.py): erf(y) = y * P(y^2) / Q(y^2) on [-4, 4], one division instead of\n"
            "// two approximations and an exp\n"
            "#if __SSE2__\n"
            + _erf_function("ep_erf_ps", "__m128", "_mm_set1_ps", "_mm_min_ps", "_mm_max_ps", "_mm_mul_ps",
                            "_mm_comp_fmadd_ps", "_mm_div_ps")
            + "#if __AVX__\n"
            + _erf_function("ep_erf256_ps", "__m256", "_mm256_set1_ps", "_mm256_min_ps", "_mm256_max_ps",
                            "_mm256_mul_ps", "_mm256_comp_fmadd_ps", "_mm256_div_ps")
            + "#if __AVX512F__\n"
            + _erf_function("ep_erf512_ps", "__m512", "_mm512_set1_ps", "_mm512_min_ps", "_mm512_max_ps",
                            "_mm512_mul_ps", "_mm512_fmadd_ps", "_mm512_div_ps")
            + "#endif // __AVX512F__\n#endif // __AVX__\n#endif // __SSE2__\n\n")

_ANCHOR = "static void gelu_fp32(Mat& bottom_top_blob, int fast_gelu, const Option& opt)\n"

_EDITS = (
    ("the helpers, before gelu_fp32", _ANCHOR, _HELPERS + _ANCHOR, 1),
    ("the 16-lane erf", "__m512 _erf = erf512_ps(", "__m512 _erf = ep_erf512_ps(", 1),
    ("the 8-lane erf", "__m256 _erf = erf256_ps(", "__m256 _erf = ep_erf256_ps(", 1),
    ("the 4-lane erf", "__m128 _erf = erf_ps(", "__m128 _erf = ep_erf_ps(", 1),
)

_FILE_EDITS = ((GELU_FILE, _EDITS),)

GELU_ERF_PATCH_KEY = file_edits_key(GELU_ERF_PATCH_VERSION, _FILE_EDITS)


def patch_gelu_erf(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place (x86 builds only)."""
    apply_file_edits(src, _FILE_EDITS, "gelu_erf_patch.py")
