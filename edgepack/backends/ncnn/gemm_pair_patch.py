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

def _each(fmt: str, indent: str) -> str:
    """fmt for columns c = 0..5, one line each (named registers: arrays would live on the stack)."""
    return "".join(f"{indent}{fmt.format(c=c)}\n" for c in range(6))


def _indented(text: str, ind: str) -> str:
    return "\n".join(ind + line if line else line for line in text.split("\n"))


def _halves(ind: str, start0: str, start1: str, finish: str) -> str:
    """C text of one 12-column block as two 16 x 6 halves, at indent ``ind``: A rows from pA0 / pA1,
    B from pB; sums start at start0 / start1 when k == 0, else at the partial sums in outptr /
    outptr_next; ``finish`` stores them (C text using _s0{c}, _s1{c} and h)."""
    i1, i2 = ind + " " * 4, ind + " " * 8
    return (f"{ind}for (int h = 0; h < 12; h += 6)\n{ind}{{\n"
            f"{i1}const float* pA = pA0;\n{i1}const float* pA8 = pA1;\n{i1}const float* pBh = pB + h;\n"
            + _each("__m256 _s0{c};", i1) + _each("__m256 _s1{c};", i1)
            + f"{i1}if (k == 0)\n{i1}{{\n{i2}const __m256 _c0 = {start0};\n{i2}const __m256 _c1 = {start1};\n"
            + _each("_s0{c} = _c0;", i2) + _each("_s1{c} = _c1;", i2) + f"{i1}}}\n{i1}else\n{i1}{{\n"
            + _each("_s0{c} = _mm256_load_ps(outptr + 8 * (h + {c}));", i2)
            + _each("_s1{c} = _mm256_load_ps(outptr_next + 8 * (h + {c}));", i2) + f"{i1}}}\n"
            + f"{i1}for (int kk = 0; kk < max_kk; kk += 1)\n{i1}{{\n"
            f"{i2}__m256 _pA0 = _mm256_load_ps(pA);\n{i2}__m256 _pA1 = _mm256_load_ps(pA8);\n{i2}__m256 _pB;\n"
            + "".join(f"{i2}_pB = _mm256_set1_ps(pBh[{c}]);\n"
                      f"{i2}_s0{c} = _mm256_comp_fmadd_ps(_pA0, _pB, _s0{c});\n"
                      f"{i2}_s1{c} = _mm256_comp_fmadd_ps(_pA1, _pB, _s1{c});\n" for c in range(6))
            + f"{i2}pA += 8;\n{i2}pA8 += 8;\n{i2}pBh += 12;\n{i1}}}\n"
            + _indented(finish, i1) + "\n"
            + f"{ind}}}\n")


def _stores(target0: str, target1: str, store: str = "_mm256_store_ps({t}, _s{r}{c});") -> str:
    """Lines storing _s0c to target0 and _s1c to target1 (each with {c}), for c = 0..5."""
    return "\n".join(store.format(t=t.format(c=c), r=r, c=c) for r, t in ((0, target0), (1, target1))
                     for c in range(6))


# the im2col kernel: the last k tile writes the outputs in ncnn's layout, the others topT's partial sums
_IM2COL_FINISH = ("if (k_end)\n{\n"
                  + _indented(_stores("outptr0 + (h + {c}) * out_elempack",
                                      "outptr0 + out_hstep * 8 + (h + {c}) * out_elempack",
                                      "ep_store_8_channels({t}, out_elempack, out_hstep, _s{r}{c});"), "    ")
                  + "\n}\nelse\n{\n"
                  + _indented(_stores("outptr + 8 * (h + {c})", "outptr_next + 8 * (h + {c})"), "    ")
                  + "\n}")


def _skip_blocks(ind: str, then: tuple[str, ...] = ()) -> str:
    """C text, at indent ``ind``: the panel below moves jj, pB and outptr past its 12-column blocks, which
    the panel above summed with it; then the lines ``then``."""
    lines = ("const int ep_blocks = max_jj / 12;", "jj = ep_blocks * 12;", "pB += ep_blocks * 12 * max_kk;",
             "outptr += ep_blocks * 96;", *then)
    return "".join(f"{ind}{line}\n" for line in lines)


def _paired_blocks(ind: str, next_sums: str, start0: str, start1: str, finish: str,
                   advance: tuple[str, ...] = ()) -> str:
    """C text, at indent ``ind``: every 12-column block of this panel and the one below, as _halves; the
    panel below keeps its sums ``next_sums`` (C text: the offset and a comment) past this one's; each
    block then moves the lines ``advance`` on too."""
    tail = ("pB += 12 * max_kk;", "outptr += 96;", "outptr_next += 96;", *advance)
    return (f"{ind}const float* pA0 = pAT;\n{ind}const float* pA1 = pAT + max_kk * 8;\n"
            f"{ind}float* outptr_next = outptr + {next_sums}\n{ind}for (; jj + 11 < max_jj; jj += 12)\n{ind}{{\n"
            + _halves(ind + " " * 4, start0, start1, finish)
            + "".join(f"{ind}    {line}\n" for line in tail) + f"{ind}}}\n")


# the start of ncnn's 12-column loop of an 8-row panel, which the edits keep after the paired blocks
_LOOP_REST = """        for (; jj + 11 < max_jj; jj += 12)
        {
            const float* pA = pAT;

            __m256 _sum0;"""
_WG_LOOP_REST = _indented(_LOOP_REST, "    ")  # Winograd's, one level deeper (per batch)

_LOOP_OLD = "#else  // __AVX512F__\n" + _LOOP_REST
_LOOP_NEW = ("#else  // __AVX512F__\n        if (ep_paired)\n        {\n"
             + _skip_blocks(" " * 12, ("outptr0 += ep_blocks * 12 * out_elempack;", "ep_paired = false;"))
             + "        }\n        else if (ii + 15 < max_ii && max_jj >= 12)\n        {\n"
             + _paired_blocks(" " * 12, "8 * max_jj; // where the panel below keeps its partial sums",
                              "pC ? _mm256_loadu_ps(pC) : _mm256_setzero_ps()",
                              "pC ? _mm256_loadu_ps(pC + 8) : _mm256_setzero_ps()", _IM2COL_FINISH,
                              ("outptr0 += 12 * out_elempack;",))
             + "            ep_paired = true;\n        }\n" + _LOOP_REST)

# Winograd's batched GEMM (convolution_3x3_winograd.h): the same pairing; its outputs are always the
# tile buffer, panel by panel, then batch by batch within a panel
WINOGRAD_FILE = "src/layer/x86/convolution_3x3_winograd.h"

_WG_FLAG_OLD = "    float* outptr = top_blob;\n\n    int ii = 0;\n"
_WG_FLAG_NEW = """    float* outptr = top_blob;

#if __AVX__ && !__AVX512F__
    bool ep_paired = false; // edgepack gemm_pair_patch, as in convolution_im2col_gemm.h
#endif

    int ii = 0;
"""
_WG_PANEL_OLD = ("    for (; ii + 7 < max_ii; ii += 8)\n    {\n        for (int b = 0; b < batch; b++)\n        {\n"
                 "            const float* pAT = AT_tile.row(b) + max_kk * ii;\n")
_WG_PANEL_NEW = ("    for (; ii + 7 < max_ii; ii += 8)\n    {\n"
                 "#if __AVX__ && !__AVX512F__\n"
                 "        const bool ep_skip = ep_paired; // this panel's 12-column blocks were summed with the panel above\n"
                 "        const bool ep_pair = !ep_skip && ii + 15 < max_ii && max_jj >= 12;\n"
                 "        ep_paired = ep_pair;\n"
                 "#endif\n"
                 "        for (int b = 0; b < batch; b++)\n        {\n"
                 "            const float* pAT = AT_tile.row(b) + max_kk * ii;\n")
_WG_LOOP_OLD = "#else  // __AVX512F__\n" + _WG_LOOP_REST
_WG_LOOP_NEW = ("#else  // __AVX512F__\n            if (ep_skip)\n            {\n" + _skip_blocks(" " * 16)
                + "            }\n            else if (ep_pair)\n            {\n"
                + _paired_blocks(" " * 16, "8 * batch * max_jj; // the panel below, this batch, this block",
                                 "_mm256_setzero_ps()", "_mm256_setzero_ps()",
                                 _stores("outptr + 8 * (h + {c})", "outptr_next + 8 * (h + {c})"))
                + "            }\n" + _WG_LOOP_REST)

_FILE_EDITS = (
    (IM2COL_GEMM_FILE, (("the tile kernel's store helper", _STORE_OLD, _STORE_NEW, 1),
                        ("the tile kernel's panel flag", _FLAG_OLD, _FLAG_NEW, 1),
                        ("the 8-row panel's 12-column loop", _LOOP_OLD, _LOOP_NEW, 1))),
    (WINOGRAD_FILE, (("the Winograd GEMM's panel flag", _WG_FLAG_OLD, _WG_FLAG_NEW, 1),
                     ("the Winograd GEMM's 8-row panel", _WG_PANEL_OLD, _WG_PANEL_NEW, 1),
                     ("the Winograd GEMM's 12-column loop", _WG_LOOP_OLD, _WG_LOOP_NEW, 1))),
)

GEMM_PAIR_PATCH_KEY = file_edits_key(GEMM_PAIR_PATCH_VERSION, _FILE_EDITS)


def patch_gemm_pair(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place (x86 builds only)."""
    apply_file_edits(src, _FILE_EDITS, "gemm_pair_patch.py")
