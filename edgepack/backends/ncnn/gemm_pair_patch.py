"""ncnn's im2col convolution GEMM on AVX and AVX2 computes two 8-row panels at once, 16 x 6 instead
of 8 x 12 (src/layer/x86/convolution_im2col_gemm.h, convolution_gemm_transB_packed_tile).

Without AVX-512 the tile kernel sums an 8 x 12 block: for each k it loads one vector of A (8 output
channels) and broadcasts 12 values of B (12 pixels) from memory, 13 loads for 12 fused multiply-adds.
A core issues two FMAs a cycle but fewer 256-bit loads than that, so the loop waits on loads: magika's
256 -> 512 convolution ran at ~88 GFLOP/s on the AVX2 EPYC, Whisper's STFT convolution (as a one-row
2-D Conv) at ~75, where onnxruntime's GEMM kernel (6 x 16) gets more.

Where a panel has another 8-row panel below it, the patched loop takes each 12-column block in two
halves of 6 columns and sums both panels' 16 x 6 block: per k two vectors of A and 6 broadcasts, 8
loads for 12 FMAs, 12 accumulators of 16 registers. The second panel's 12-column blocks are then done
and skipped when the loop reaches it; its other columns take ncnn's loops as before. Each output is
still its start (zero, the bias, or the partial sum of earlier k tiles) plus A x B over k in order, one
FMA each: the same bits as ncnn's kernel. The partial sums of a k tile that is not the last go where
ncnn keeps them (topT), so later tiles find them unchanged.

Applied as exact text edits that must each match, like source_patch.py; x86 builds only.
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

GEMM_PAIR_PATCH_VERSION = 1

IM2COL_GEMM_FILE = "src/layer/x86/convolution_im2col_gemm.h"

_FLAG_OLD = "    float* outptr = topT_tile;\n\n    int ii = 0;\n"
_FLAG_NEW = """    float* outptr = topT_tile;

#if __AVX__ && !__AVX512F__
    // edgepack gemm_pair_patch: this 8-row panel's 12-column blocks were summed with the panel above
    bool ep_paired = false;
#endif

    int ii = 0;
"""

_STORE_OLD = "static void convolution_gemm_transB_packed_tile(const Mat& AT_tile,"
_STORE_NEW = """#if __AVX__ && !__AVX512F__
// edgepack gemm_pair_patch: 8 output channels at one pixel, p pointing at the first, in ncnn's layout
static inline void ep_store_8_channels(float* p, int out_elempack, int out_hstep, __m256 s)
{
    if (out_elempack == 8)
    {
        _mm256_storeu_ps(p, s);
    }
    else if (out_elempack == 4)
    {
        _mm_storeu_ps(p, _mm256_castps256_ps128(s));
        _mm_storeu_ps(p + out_hstep * 4, _mm256_extractf128_ps(s, 1));
    }
    else
    {
        float t[8];
        _mm256_storeu_ps(t, s);
        for (int r = 0; r < 8; r++)
            p[out_hstep * r] = t[r];
    }
}
#endif

static void convolution_gemm_transB_packed_tile(const Mat& AT_tile,"""

_LOOP_OLD = """#else  // __AVX512F__
        for (; jj + 11 < max_jj; jj += 12)
        {
            const float* pA = pAT;

            __m256 _sum0;"""


def _each(fmt: str, indent: str) -> str:
    """fmt for columns c = 0..5, one line each (named registers: arrays would live on the stack)."""
    return "".join(f"{indent}{fmt.format(c=c)}\n" for c in range(6))


_I5, _I6 = " " * 20, " " * 24
_LOOP_NEW = ("""#else  // __AVX512F__
        if (ep_paired)
        {
            const int ep_blocks = max_jj / 12;
            jj = ep_blocks * 12;
            pB += ep_blocks * 12 * max_kk;
            outptr += ep_blocks * 96;
            outptr0 += ep_blocks * 12 * out_elempack;
            ep_paired = false;
        }
        else if (ii + 15 < max_ii && max_jj >= 12)
        {
            float* outptr_next = outptr + 8 * max_jj; // where the panel below keeps its partial sums
            for (; jj + 11 < max_jj; jj += 12)
            {
                for (int h = 0; h < 12; h += 6)
                {
                    const float* pA = pAT;
                    const float* pA8 = pAT + max_kk * 8;
                    const float* pBh = pB + h;
"""
             + _each("__m256 _s0{c};", _I5) + _each("__m256 _s1{c};", _I5) + """                    if (k == 0)
                    {
                        const __m256 _c0 = pC ? _mm256_loadu_ps(pC) : _mm256_setzero_ps();
                        const __m256 _c1 = pC ? _mm256_loadu_ps(pC + 8) : _mm256_setzero_ps();
""" + _each("_s0{c} = _c0;", _I6) + _each("_s1{c} = _c1;", _I6) + """                    }
                    else
                    {
""" + _each("_s0{c} = _mm256_load_ps(outptr + 8 * (h + {c}));", _I6)
             + _each("_s1{c} = _mm256_load_ps(outptr_next + 8 * (h + {c}));", _I6) + """                    }

                    for (int kk = 0; kk < max_kk; kk += 1)
                    {
                        __m256 _pA0 = _mm256_load_ps(pA);
                        __m256 _pA1 = _mm256_load_ps(pA8);
                        __m256 _pB;
""" + "".join(f"{_I6}_pB = _mm256_set1_ps(pBh[{c}]);\n"
              f"{_I6}_s0{c} = _mm256_comp_fmadd_ps(_pA0, _pB, _s0{c});\n"
              f"{_I6}_s1{c} = _mm256_comp_fmadd_ps(_pA1, _pB, _s1{c});\n" for c in range(6)) + """                        pA += 8;
                        pA8 += 8;
                        pBh += 12;
                    }

                    if (k_end)
                    {
""" + _each("ep_store_8_channels(outptr0 + (h + {c}) * out_elempack, out_elempack, out_hstep, _s0{c});", _I6)
             + _each("ep_store_8_channels(outptr0 + out_hstep * 8 + (h + {c}) * out_elempack, out_elempack, out_hstep, "
                     "_s1{c});", _I6) + """                    }
                    else
                    {
""" + _each("_mm256_store_ps(outptr + 8 * (h + {c}), _s0{c});", _I6)
             + _each("_mm256_store_ps(outptr_next + 8 * (h + {c}), _s1{c});", _I6) + """                    }
                }
                pB += 12 * max_kk;
                outptr += 96;
                outptr_next += 96;
                outptr0 += 12 * out_elempack;
            }
            ep_paired = true;
        }
        for (; jj + 11 < max_jj; jj += 12)
        {
            const float* pA = pAT;

            __m256 _sum0;""")

_FILE_EDITS = (
    (IM2COL_GEMM_FILE, (("the tile kernel's store helper", _STORE_OLD, _STORE_NEW, 1),
                        ("the tile kernel's panel flag", _FLAG_OLD, _FLAG_NEW, 1),
                        ("the 8-row panel's 12-column loop", _LOOP_OLD, _LOOP_NEW, 1))),
)

GEMM_PAIR_PATCH_KEY = file_edits_key(GEMM_PAIR_PATCH_VERSION, _FILE_EDITS)


def patch_gemm_pair(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place (x86 builds only)."""
    apply_file_edits(src, _FILE_EDITS, "gemm_pair_patch.py")
