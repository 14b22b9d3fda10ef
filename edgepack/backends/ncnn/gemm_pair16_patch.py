"""ncnn's GEMM tile kernels on AVX-512 sum two 16-row panels at once, 32 x 12 instead of 16 x 16: the
im2col convolution's (convolution_gemm_transB_packed_tile in src/layer/x86/convolution_im2col_gemm.h),
Winograd's (gemm_transB_packed_tile in convolution_3x3_winograd.h) and the Gemm layer's (gemm_fp32.h,
which MatMul also runs).

ncnn's AVX-512 tile kernel sums a 16 x 16 block: for each k one vector of A (16 output channels) and
16 broadcasts of B (16 pixels), 17 loads for 16 fused multiply-adds. A Sapphire Rapids core issues two
512-bit FMAs a cycle but only two 512-bit loads, so the loop waits on loads: magika's 256 -> 512
convolution ran at ~140 GFLOP/s on one core and Whisper's STFT convolution at ~130, where
onnxruntime's GEMM (two vectors of A, 12 broadcasts) reaches ~180 (measured in a stand-alone copy of
both loops: 129 against 175 GFLOP/s on magika's shape).

Where a 16-row panel has another below it, the patched loop sums both panels' 32 x 12 blocks over the
panel's 16-column blocks of B (ncnn packs B 16 columns wide on AVX-512; three blocks are four groups of
12 columns, the group's first column at offset 0, 12, 8 or 4 of its block, a constant of each copy of
the kernel); per k two vectors of A and 12 broadcasts, 14 loads for 24 FMAs in 24 accumulators. A
remainder of one or two 16-column blocks goes as 32 x 8 halves. The panel below then skips those
columns; the tail blocks of 8, 4, 2 and 1 columns take ncnn's loops as before. Each output is still its
start (zero, the bias, or the partial sum of earlier k tiles) plus A x B over k in order, one FMA
each: the same bits as ncnn's kernel. Partial sums of a k tile that is not the last go where ncnn keeps
them (a panel's 16 sums per column, column after column).

Applied as exact text edits that must each match, like source_patch.py; x86 builds only, after
gemm_pair_patch.py (whose AVX and AVX2 edits are next to these).
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

GEMM_PAIR16_PATCH_VERSION = 2

IM2COL_GEMM_FILE = "src/layer/x86/convolution_im2col_gemm.h"

WINOGRAD_FILE = "src/layer/x86/convolution_3x3_winograd.h"

# the kernel goes at the end of x86_usability.h (after its transposes), which every x86 layer includes
USABILITY_FILE = "src/layer/x86/x86_usability.h"
_HELPERS_OLD = "#endif // X86_USABILITY_H"
_HELPERS_NEW = """#if __AVX512F__ && (defined(__x86_64__) || defined(_M_X64))
// edgepack gemm_pair16_patch: NC columns' sums of 16 output channels (s[c]) stored in ncnn's layout,
// p at channel 0 of the first column
template<int NC>
static NCNN_FORCEINLINE void ep_store_16_channels(float* p, int out_elempack, size_t out_hstep, __m512* s)
{
    if (out_elempack == 1)
    {
        __m512 t[16];
        for (int c = 0; c < 16; c++)
            t[c] = c < NC ? s[c] : _mm512_setzero_ps();
        transpose16x16_ps(t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], t[10], t[11], t[12], t[13], t[14], t[15]);
        for (int r = 0; r < 16; r++)
            _mm512_mask_storeu_ps(p + out_hstep * r, (__mmask16)((1u << NC) - 1), t[r]);
        return;
    }
    for (int c = 0; c < NC; c++)
    {
        float* q = p + c * out_elempack;
        if (out_elempack == 16)
        {
            _mm512_storeu_ps(q, s[c]);
        }
        else if (out_elempack == 8)
        {
            _mm256_storeu_ps(q, _mm512_extractf32x8_ps(s[c], 0));
            _mm256_storeu_ps(q + out_hstep * 8, _mm512_extractf32x8_ps(s[c], 1));
        }
        else
        {
            _mm_storeu_ps(q, _mm512_extractf32x4_ps(s[c], 0));
            _mm_storeu_ps(q + out_hstep * 4, _mm512_extractf32x4_ps(s[c], 1));
            _mm_storeu_ps(q + out_hstep * 8, _mm512_extractf32x4_ps(s[c], 2));
            _mm_storeu_ps(q + out_hstep * 12, _mm512_extractf32x4_ps(s[c], 3));
        }
    }
}

// edgepack gemm_pair16_patch: NC columns of two 16-row panels (A at pA0, pA1), the first column at
// offset O of the 16-column block of B at pB (columns past 15 in the next block); sums start at c0 /
// c1 (or, given colC, at each column's colC[c]) when k == 0, else at the partial sums in sum0 / sum1;
// the last k tile writes the outputs at out0 / out1, the others the partial sums back
template<int NC, int O>
static inline void ep_pair16_block(const float* pA0, const float* pA1, const float* pB, int max_kk, int k, bool k_end,
                            __m512 c0, __m512 c1, const float* colC, float* sum0, float* sum1, float* out0, float* out1,
                            int out_elempack, size_t out_hstep)
{
    __m512 s0[NC];
    __m512 s1[NC];
    for (int c = 0; c < NC; c++)
    {
        s0[c] = k != 0 ? _mm512_load_ps(sum0 + 16 * c) : colC ? _mm512_set1_ps(colC[c]) : c0;
        s1[c] = k != 0 ? _mm512_load_ps(sum1 + 16 * c) : colC ? _mm512_set1_ps(colC[c]) : c1;
    }
    const float* pB0 = pB + O;
    const float* pB1 = pB + 16 * max_kk + O - 16;
    for (int kk = 0; kk < max_kk; kk++)
    {
        const __m512 a0 = _mm512_load_ps(pA0);
        const __m512 a1 = _mm512_load_ps(pA1);
#if defined(__clang__)
#pragma clang loop unroll(full)
#endif
        for (int c = 0; c < NC; c++)
        {
            const __m512 b = _mm512_set1_ps(O + c < 16 ? pB0[c] : pB1[c]);
            s0[c] = _mm512_fmadd_ps(a0, b, s0[c]);
            s1[c] = _mm512_fmadd_ps(a1, b, s1[c]);
        }
        pA0 += 16;
        pA1 += 16;
        pB0 += 16;
        pB1 += 16;
    }
    if (k_end)
    {
        ep_store_16_channels<NC>(out0, out_elempack, out_hstep, s0);
        ep_store_16_channels<NC>(out1, out_elempack, out_hstep, s1);
    }
    else
    {
        for (int c = 0; c < NC; c++)
        {
            _mm512_store_ps(sum0 + 16 * c, s0[c]);
            _mm512_store_ps(sum1 + 16 * c, s1[c]);
        }
    }
}

// edgepack gemm_pair16_patch: the first n16 columns (whole 16-column blocks of B from pB) of two 16-row
// panels (A at pA0, pA1); 16 sums a column, the panel's first column's at sum0 / sum1, its outputs at out0 /
// out1 (ncnn's layout, out_elempack apart a column) in the last k tile; sums start at c0 / c1, or at
// colC[column] where given
static inline void ep_pair16_columns(const float* pA0, const float* pA1, const float* pB, int n16, int max_kk, int k, bool k_end,
                              __m512 c0, __m512 c1, const float* colC, float* sum0, float* sum1, float* out0, float* out1,
                              int out_elempack, size_t out_hstep)
{
#define EP_PAIR16_BLOCK(NC, O, col)                                                                   \\
    ep_pair16_block<NC, O>(pA0, pA1, pB + (col) / 16 * 16 * max_kk, max_kk, k, k_end, c0, c1,        \\
                           colC ? colC + (col) : colC, sum0 + 16 * (col), sum1 + 16 * (col),         \\
                           out0 + (col) * out_elempack, out1 + (col) * out_elempack, out_elempack, out_hstep)
    int jj = 0;
    for (; jj + 47 < n16; jj += 48)
    {
        EP_PAIR16_BLOCK(12, 0, jj);
        EP_PAIR16_BLOCK(12, 12, jj + 12);
        EP_PAIR16_BLOCK(12, 8, jj + 24);
        EP_PAIR16_BLOCK(12, 4, jj + 36);
    }
    for (; jj < n16; jj += 16)
    {
        EP_PAIR16_BLOCK(8, 0, jj);
        EP_PAIR16_BLOCK(8, 8, jj + 8);
    }
#undef EP_PAIR16_BLOCK
}
#endif // __AVX512F__

#endif // X86_USABILITY_H"""

_FLAG_OLD = "    float* outptr = topT_tile;\n\n#if __AVX__ && !__AVX512F__\n"
_FLAG_NEW = """    float* outptr = topT_tile;

#if __AVX512F__
    // edgepack gemm_pair16_patch: this 16-row panel's 16-column blocks were summed with the panel above
    bool ep_paired16 = false;
#endif

#if __AVX__ && !__AVX512F__
"""

# the start of ncnn's 16-column loop of a 16-row panel (x86-64 only: it needs 32 registers)
_LOOP_REST = """#if defined(__x86_64__) || defined(_M_X64)
        for (; jj + 15 < max_jj; jj += 16)
        {
            const float* pA = pAT;

            __m512 _sum0;
            __m512 _sum1;
            __m512 _sum2;
            __m512 _sum3;
            __m512 _sum4;
            __m512 _sum5;
            __m512 _sum6;
            __m512 _sum7;
            __m512 _sum8;
"""
_LOOP_OLD = "        int jj = 0;\n" + _LOOP_REST
_LOOP_NEW = """        int jj = 0;
#if defined(__x86_64__) || defined(_M_X64)
        if (ep_paired16 || (ii + 31 < max_ii && max_jj >= 16))
        {
            const int ep_n16 = max_jj / 16 * 16;
            if (!ep_paired16)
            {
                // the panel below keeps its partial sums after this one's, its outputs 16 channels on
                ep_pair16_columns(pAT, pAT + max_kk * 16, pB, ep_n16, max_kk, k, k_end,
                                  pC ? _mm512_loadu_ps(pC) : _mm512_setzero_ps(),
                                  pC ? _mm512_loadu_ps(pC + 16) : _mm512_setzero_ps(), 0, outptr, outptr + 16 * max_jj,
                                  outptr0, outptr0 + out_hstep * 16, out_elempack, out_hstep);
            }
            ep_paired16 = !ep_paired16; // the panel below skips the blocks summed with this one
            jj = ep_n16;
            pB += ep_n16 * max_kk;
            outptr += ep_n16 * 16;
            outptr0 += ep_n16 * out_elempack;
        }
#endif
""" + _LOOP_REST

# Winograd's batched GEMM: the same pairing, batch by batch; its outputs are always the tile buffer's
# sums, panel by panel, then batch by batch within a panel

_WG_FLAG_OLD = "    float* outptr = top_blob;\n\n#if __AVX__ && !__AVX512F__\n"
_WG_FLAG_NEW = """    float* outptr = top_blob;

#if __AVX512F__
    bool ep_paired16 = false; // edgepack gemm_pair16_patch, as in convolution_im2col_gemm.h
#endif

#if __AVX__ && !__AVX512F__
"""
_WG_PANEL_OLD = """    for (; ii + 15 < max_ii; ii += 16)
    {
        for (int b = 0; b < batch; b++)
        {
            const float* pAT = AT_tile.row(b) + max_kk * ii;
            const float* pB = BT_tile.row(b);

            int jj = 0;
            for (; jj + 15 < max_jj; jj += 16)
"""
_WG_PANEL_NEW = """    for (; ii + 15 < max_ii; ii += 16)
    {
#if defined(__x86_64__) || defined(_M_X64)
        const bool ep_skip16 = ep_paired16; // this panel's 16-column blocks were summed with the panel above
        const bool ep_pair16 = !ep_skip16 && ii + 31 < max_ii && max_jj >= 16;
        ep_paired16 = ep_pair16;
#endif
        for (int b = 0; b < batch; b++)
        {
            const float* pAT = AT_tile.row(b) + max_kk * ii;
            const float* pB = BT_tile.row(b);

            int jj = 0;
#if defined(__x86_64__) || defined(_M_X64)
            if (ep_skip16 || ep_pair16)
            {
                const int ep_n16 = max_jj / 16 * 16;
                if (ep_pair16)
                {
                    // the panel below, this batch: batch x 16 x max_jj sums on
                    float* ep_next = outptr + batch * 16 * max_jj;
                    ep_pair16_columns(pAT, pAT + max_kk * 16, pB, ep_n16, max_kk, k, false, _mm512_setzero_ps(),
                                      _mm512_setzero_ps(), 0, outptr, ep_next, outptr, ep_next, 16, 0);
                }
                jj = ep_n16;
                pB += ep_n16 * max_kk;
                outptr += ep_n16 * 16;
            }
#endif
            for (; jj + 15 < max_jj; jj += 16)
"""

# the Gemm layer's tile kernel (gemm_fp32.h): the same pairing where sums start from zero or from a C of
# one value per column (broadcast type 4: pnnx's MatMul + bias, Linear on 2-D input); other kinds of C
# keep ncnn's loops. ncnn moves a per-column C's pointer on as its first k tile passes each block
GEMM_FILE = "src/layer/x86/gemm_fp32.h"

_GEMM_FLAG_OLD = """    float* outptr = topT_tile;

    int ii = 0;
#if __SSE2__
#if __AVX__
#if __AVX512F__
    for (; ii + 15 < max_ii; ii += 16)
"""
_GEMM_FLAG_NEW = """    float* outptr = topT_tile;

#if __AVX512F__
    bool ep_paired16 = false; // edgepack gemm_pair16_patch, as in convolution_im2col_gemm.h
#endif

    int ii = 0;
#if __SSE2__
#if __AVX__
#if __AVX512F__
    for (; ii + 15 < max_ii; ii += 16)
"""
_GEMM_LOOP_OLD = """        int jj = 0;
        for (; jj + 15 < max_jj; jj += 16)
        {
            __m512 _sum0;
"""
_GEMM_LOOP_NEW = """        int jj = 0;
#if defined(__x86_64__) || defined(_M_X64)
        if (ep_paired16 || (ii + 31 < max_ii && max_jj >= 16 && (!pC || broadcast_type_C == 4)))
        {
            const int ep_n16 = max_jj / 16 * 16;
            const bool ep_cols = pC && broadcast_type_C == 4;
            if (!ep_paired16)
            {
                ep_pair16_columns(pAT, pAT + max_kk * 16, pB, ep_n16, max_kk, k, k_end, _mm512_setzero_ps(),
                                  _mm512_setzero_ps(), ep_cols ? pC : 0, outptr, outptr + 16 * max_jj, outptr0,
                                  outptr0 + out_hstep * 16, out_elempack, out_hstep);
            }
            ep_paired16 = !ep_paired16; // the panel below skips the blocks summed with this one
            jj = ep_n16;
            pB += ep_n16 * max_kk;
            outptr += ep_n16 * 16;
            outptr0 += ep_n16 * out_elempack;
            if (ep_cols && k == 0)
                pC += ep_n16;
        }
#endif
        for (; jj + 15 < max_jj; jj += 16)
        {
            __m512 _sum0;
"""

_FILE_EDITS = (
    (USABILITY_FILE, (("the 32-row kernel, at the end", _HELPERS_OLD, _HELPERS_NEW, 1),)),
    (IM2COL_GEMM_FILE, (("the tile kernel's 16-row panel flag", _FLAG_OLD, _FLAG_NEW, 1),
                        ("the 16-row panel's 16-column loop", _LOOP_OLD, _LOOP_NEW, 1))),
    (WINOGRAD_FILE, (("the Winograd GEMM's 16-row panel flag", _WG_FLAG_OLD, _WG_FLAG_NEW, 1),
                     ("the Winograd GEMM's 16-row panel", _WG_PANEL_OLD, _WG_PANEL_NEW, 1))),
    (GEMM_FILE, (("the Gemm tile kernel's 16-row panel flag", _GEMM_FLAG_OLD, _GEMM_FLAG_NEW, 1),
                 ("the Gemm tile kernel's 16-row panel", _GEMM_LOOP_OLD, _GEMM_LOOP_NEW, 1))),
)

GEMM_PAIR16_PATCH_KEY = file_edits_key(GEMM_PAIR16_PATCH_VERSION, _FILE_EDITS)


def patch_gemm_pair16(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place (x86 builds only, after gemm_pair_patch)."""
    apply_file_edits(src, _FILE_EDITS, "gemm_pair16_patch.py")
