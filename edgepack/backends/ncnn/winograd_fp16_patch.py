"""Winograd kernels kept as fp16 3x3 weights on x86 CPUs with F16C (src/layer/x86/convolution_x86.cpp and
convolution_3x3_winograd.h; issue 10 item 5, memory in the default `fast` mode).

ncnn's x86 3x3 stride-1 convolutions keep their Winograd-transformed kernels for the life of the net: 16/9
(F(2,3): integer-sum layers, integer_winograd_patch.py), 36/9 (F(4,3): layers with more than 32 channels on a
side, when pnnx gives no shapes) or 64/9 (F(6,3)) times the layer's fp32 weights; on nudenet_320n 27.7 MB, two
thirds of what the artifact held after loading. Version 2 kept F(4,3) kernels in fp16, scaled by a power of
two: still 4x the layer's fp16 weights (YOLO11s-seg 23 MB, ddddocr_det 17 MB), the largest share of what
`fast` held, and rounded (a layer came out 1.2e-3 of its scale off; F(6,3)'s smaller fractions were worse, so
it kept fp32).

Here, where the net stores in fp16 (`use_fp16_storage`: the build's fp16 rung; the fp32 rung and the switch
`EDGEPACK_NCNN_OPTIONS=fp16=0` turn it off), the CPU has F16C and every weight of the layer is an fp16 value
(fp16 weights widened by the loader always are; so are the small integers of integer-sum layers), the
kernel transform ncnn chose (F(2,3), F(4,3) or F(6,3)) keeps the layer's 3x3 weights in fp16 instead of making
its fp32 kernel. (Version 3 made the fp32 kernel and then replaced it: a load transient of 36/9 of a layer's
fp32 weights, 11 MB on ddddocr_crnn, where freed blocks stayed resident until the first run.) The convolution transforms EP_WF16_ROWS rows (a pair of panels) of a kernel tile at a time into a
per-thread buffer, straight into pack_A_tile's layout, with ncnn's own transform arithmetic on the same
values, and runs ncnn's tile kernel on each run of rows as on a tile of its own: its packing puts each run of
rows in one stretch of every batch row, and its output for those rows in one stretch of the output tile. So
the kernel values are the fp32 kernel's but for the order -ffast-math lets the compiler give that
arithmetic (F(2,3)'s halves of small integers stay exact in any order).

The cost is the transform, vectorised across a panel's rows, once per kernel tile per output tile column
(N): small beside the tile's T x T x TILE_N products per weight, except on deep layers over small maps,
where one tile column holds every output tile.

Only x86 builds compile it, so only their cache key carries WINOGRAD_FP16_PATCH_KEY.
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

WINOGRAD_FP16_PATCH_VERSION = 4  # 2: the F16C conversions in their own block (F16C_HELPERS); 3: fp16 3x3 weights, transformed per tile,
#                                  every variant; 4: made instead of the fp32 kernel, not after it

# before the first kernel transform (F(2,3)'s): the helpers need only get_optimal_tile_mnk and gemm_transB_packed_tile
_HELPERS_ANCHOR = "static inline void conv3x3s1_winograd23_transform_kernel_tile(const Mat& kernel, Mat& A, int inch, int i, int max_ii, int k, int max_kk)\n{"
# F16C conversions, shared with gemm_conv_fp16_patch.py, lstm_patch.py, gemm_fp16_b_patch.py and
# fp16_weights_patch.py: each file that needs them carries this block, and its guard keeps one copy per translation
# unit (convolution_x86.cpp includes the Winograd header first, convolution_x86_fma.cpp the im2col one)
F16C_HELPERS = r'''// ---- edgepack (winograd_fp16_patch.py): F16C conversions ----
#ifndef EP_WF16_HELPERS_DEFINED
#define EP_WF16_HELPERS_DEFINED
#if defined(__x86_64__) && (defined(__clang__) || defined(__GNUC__))
#define EP_WF16 1
#if __AVX512F__
#define EP_WF16_ROWS 32 // a pair of 16-row panels (gemm_pair16_patch)
#else
#define EP_WF16_ROWS 16 // a pair of 8-row panels (gemm_pair_patch)
#endif
// n fp32 values to fp16 in d; whether every one converted exactly (NaN does not). F16C: these functions run
// only where CPUID has it
__attribute__((target("avx,f16c"))) static bool ep_wf16_narrow_exact(const float* s, unsigned short* d, int n)
{
    int i = 0;
    for (; i + 8 <= n; i += 8)
    {
        const __m256 v = _mm256_loadu_ps(s + i);
        const __m128i h = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
        if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_cvtph_ps(h), v, _CMP_NEQ_UQ)))
            return false;
        _mm_storeu_si128((__m128i*)(d + i), h);
    }
    for (; i < n; i++)
    {
        const unsigned short h = _cvtss_sh(s[i], _MM_FROUND_TO_NEAREST_INT);
        if (!(_cvtsh_ss(h) == s[i]))
            return false;
        d[i] = h;
    }
    return true;
}

// n fp32 values to fp16, rounded to nearest as ncnn's cast is
__attribute__((target("avx,f16c"))) static void ep_wf16_narrow(const float* s, unsigned short* d, int n)
{
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i*)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++)
        d[i] = _cvtss_sh(s[i], _MM_FROUND_TO_NEAREST_INT);
}

// n fp16 values to fp32
__attribute__((target("avx,f16c"))) static void ep_wf16_widen(const unsigned short* s, float* d, int n)
{
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + i))));
    for (; i < n; i++)
        d[i] = _cvtsh_ss(s[i]);
}
#endif // x86-64, clang/gcc

// n fp16 values to fp32, and n fp32 values to fp16 rounded to nearest, on any CPU: with F16C where CPUID has it
// (a build compiled without -mf16c, as ncnn's AVX one is, still takes it on IvyBridge or Jaguar), else with
// ncnn's scalar conversions
static inline void ep_fp16_widen_any(const unsigned short* s, float* d, int n)
{
#if EP_WF16
    if (cpu_support_x86_f16c())
    {
        ep_wf16_widen(s, d, n);
        return;
    }
#endif
    for (int i = 0; i < n; i++)
        d[i] = float16_to_float32(s[i]);
}

static inline void ep_fp16_narrow_any(const float* s, unsigned short* d, int n)
{
#if EP_WF16
    if (cpu_support_x86_f16c())
    {
        ep_wf16_narrow(s, d, n);
        return;
    }
#endif
    for (int i = 0; i < n; i++)
        d[i] = float32_to_float16(s[i]);
}
#endif // EP_WF16_HELPERS_DEFINED
// ---- end edgepack ----
'''


def immintrin_include(patch: str) -> str:
    """The include a file needs, in every ISA's build, before F16C_HELPERS (or its own F16C functions with a
    target attribute): ncnn compiles its baseline and AVX builds without -mf16c, so their own includes leave
    F16C's intrinsics out."""
    return ("#if defined(__x86_64__) && (defined(__clang__) || defined(__GNUC__))\n"
            f"#include <immintrin.h> // edgepack ({patch}): F16C functions with a target attribute, in every ISA's build\n"
            "#endif\n")


_HELPERS = F16C_HELPERS + r'''// ---- edgepack (winograd_fp16_patch.py) ----
#ifndef EP_WINOGRAD_FP16_DEFINED
#define EP_WINOGRAD_FP16_DEFINED

// Rows of the panel pack_A_tile starts with `left` rows of a tile still to pack: this build's widest first
static inline int ep_wk_panel_width(int left)
{
#if __AVX512F__
    if (left >= 16)
        return 16;
#endif
#if __AVX__
    if (left >= 8)
        return 8;
#endif
#if __SSE2__
    if (left >= 4)
        return 4;
#endif
    return left >= 2 ? 2 : 1;
}

// conv3x3s1_winograd{23,43,63}_transform_kernel, first: where the net stores fp16 (not bf16), the CPU has F16C
// and every weight is an fp16 value, AT becomes the layer's 3x3 weights in fp16 instead of the transformed fp32
// kernel, which is then never made (its 16/9, 36/9 or 64/9 times the fp32 weights were a transient of every
// load). Tiled as the transform tiles AT: tile (i, k) is AT.channel(i / TILE_M).depth(k / TILE_K), its rows in
// pack_A_tile's panels, and in a panel of P rows, for each input channel, the 9 taps of the P rows (tap-major).
// ep_wk_panel transforms them as the convolution goes. Whether AT was made (if not, the fp32 transform runs).
static bool ep_winograd_kernel_fp16(const Mat& kernel, Mat& AT, int inch, int outch, const Option& opt)
{
#if EP_WF16
    if (kernel.empty() || kernel.elemsize != 4u || !opt.use_fp16_storage || opt.use_bf16_storage || !cpu_support_x86_f16c())
        return false;
    const int M = outch;
    const int K = inch;
    int TILE_M, TILE_N, TILE_K;
    get_optimal_tile_mnk(M, 0, K, TILE_M, TILE_N, TILE_K, opt.num_threads); // as the transform tiles it
    const int nn_M = (M + TILE_M - 1) / TILE_M;
    const int nn_K = (K + TILE_K - 1) / TILE_K;
    Mat g;
    g.create(TILE_M * TILE_K * 9, 1, nn_K, nn_M, 2u, (Allocator*)0);
    if (g.empty())
        return false;
    float taps[9 * 16];
    for (int i = 0; i < M; i += TILE_M)
    {
        for (int k = 0; k < K; k += TILE_K)
        {
            const int max_ii = std::min(M - i, TILE_M);
            const int max_kk = std::min(K - k, TILE_K);
            unsigned short* d = (unsigned short*)g.channel(i / TILE_M).depth(k / TILE_K).data;
            for (int ii = 0; ii < max_ii;)
            {
                const int P = ep_wk_panel_width(max_ii - ii);
                for (int kk = 0; kk < max_kk; kk++)
                {
                    const float* k0 = (const float*)kernel + (size_t)(i + ii) * inch * 9 + (size_t)(k + kk) * 9;
                    for (int t = 0; t < 9; t++)
                        for (int r = 0; r < P; r++)
                            taps[t * P + r] = k0[(size_t)r * inch * 9 + t];
                    if (!ep_wf16_narrow_exact(taps, d, 9 * P))
                        return false; // not fp16 values: keep fp32
                    d += 9 * P;
                }
                ii += P;
            }
        }
    }
    AT = g;
    return true;
#else
    (void)kernel;
    (void)AT;
    (void)inch;
    (void)outch;
    (void)opt;
    return false;
#endif
}

#if EP_WF16
// One row of ncnn's F(m,3) kernel transform (conv3x3s1_winograd{23,43,63}_transform_kernel_tile, T = m + 2
// values), expression for expression
template<int T>
static inline void ep_wk_row(float r0, float r1, float r2, float* z)
{
    if (T == 4)
    {
        z[0] = r0;
        z[1] = r0 * 0.5f + r1 * 0.5f + r2 * 0.5f;
        z[2] = r0 * 0.5f - r1 * 0.5f + r2 * 0.5f;
        z[3] = r2;
    }
    else if (T == 6)
    {
        const float sq2 = 1.41421356237f;
        const float ktm0 = 2.0f / 3;
        const float ktm1 = sq2 / 3;
        const float ktm2 = 1.0f / 3;
        const float ktm3 = 1.0f / 6;
        const float ktm4 = sq2 / 6;
        z[0] = r0;
        z[1] = -r0 * ktm0 - r1 * ktm1 - r2 * ktm2;
        z[2] = -r0 * ktm0 + r1 * ktm1 - r2 * ktm2;
        z[3] = r0 * ktm3 + r1 * ktm4 + r2 * ktm2;
        z[4] = r0 * ktm3 - r1 * ktm4 + r2 * ktm2;
        z[5] = r2;
    }
    else
    {
        const float ktm0 = 2.0f / 9;
        const float ktm1 = 1.0f / 45;
        const float ktm2 = 2.0f / 45;
        const float ktm3 = 1.0f / 90;
        const float ktm4 = 1.0f / 180;
        z[0] = r0;
        z[1] = -r0 * ktm0 - r1 * ktm0 - r2 * ktm0;
        z[2] = -r0 * ktm0 + r1 * ktm0 - r2 * ktm0;
        z[3] = r0 * ktm3 + r1 * ktm1 + r2 * ktm2;
        z[4] = r0 * ktm3 - r1 * ktm1 + r2 * ktm2;
        z[5] = r0 * ktm1 + r1 * ktm3 + r2 * ktm4;
        z[6] = r0 * ktm1 - r1 * ktm3 + r2 * ktm4;
        z[7] = r2;
    }
}

// One panel of P rows of an fp16 3x3 kernel (ep_winograd_kernel_fp16's layout, max_kk input channels) through
// F(T-2,3)'s kernel transform into pack_A_tile's layout: batch b's values for input channel kk at
// dst + b * bstride + kk * P. Each step vectorises across the panel's rows.
template<int P, int T>
static void ep_wk_panel(const unsigned short* g, int max_kk, float* dst, int bstride)
{
    float w[9 * P];
    float tmp[T][3][P];
    for (int kk = 0; kk < max_kk; kk++)
    {
        ep_wf16_widen(g + (size_t)kk * 9 * P, w, 9 * P);
        for (int m = 0; m < 3; m++)
        {
            for (int r = 0; r < P; r++)
            {
                float z[T];
                ep_wk_row<T>(w[(m * 3) * P + r], w[(m * 3 + 1) * P + r], w[(m * 3 + 2) * P + r], z);
                for (int t = 0; t < T; t++)
                    tmp[t][m][r] = z[t];
            }
        }
        for (int m = 0; m < T; m++)
        {
            float* o = dst + (size_t)(m * T) * bstride + (size_t)kk * P;
            for (int r = 0; r < P; r++)
            {
                float z[T];
                ep_wk_row<T>(tmp[m][0][r], tmp[m][1][r], tmp[m][2][r], z);
                for (int t = 0; t < T; t++)
                    o[t * bstride + r] = z[t];
            }
        }
    }
}

// ep_wk_panel for a panel of P rows, with T from the batch count (16, 36 or 64)
template<int T>
static void ep_wk_panel_rows(int P, const unsigned short* g, int max_kk, float* dst, int bstride)
{
    if (P == 16)
        ep_wk_panel<16, T>(g, max_kk, dst, bstride);
    else if (P == 8)
        ep_wk_panel<8, T>(g, max_kk, dst, bstride);
    else if (P == 4)
        ep_wk_panel<4, T>(g, max_kk, dst, bstride);
    else if (P == 2)
        ep_wk_panel<2, T>(g, max_kk, dst, bstride);
    else
        ep_wk_panel<1, T>(g, max_kk, dst, bstride);
}
#endif

// floats of one thread's transform buffer for tiles of TILE_K and B batches (0: the kernel is fp32)
static size_t ep_wf16_buffer_floats(const Mat& AT, int TILE_K, int B)
{
#if EP_WF16
    if (AT.elemsize == 2u)
        return (size_t)((EP_WF16_ROWS * TILE_K + 15) / 16 * 16) * B;
#endif
    (void)AT;
    (void)TILE_K;
    (void)B;
    return 0;
}

// gemm_transB_packed_tile for an fp32 kernel tile or fp16 3x3 weights: these are transformed EP_WF16_ROWS rows at
// a time into `wide` (ep_wf16_buffer_floats) and the tile kernel runs on each run of rows as on a tile of its own
static void ep_winograd_gemm(const Mat& AT_tile, const Mat& BT_tile, Mat& top_tile, int batch, int max_ii, int max_jj, int k, int max_kk, Mat& wide)
{
#if EP_WF16
    if (AT_tile.elemsize == 2u) // ep_winograd_kernel_fp16's 3x3 weights
    {
        const unsigned short* g = (const unsigned short*)AT_tile.data;
        for (int ii0 = 0; ii0 < max_ii; ii0 += EP_WF16_ROWS)
        {
            const int rows = std::min(EP_WF16_ROWS, max_ii - ii0);
            const int stride = (rows * max_kk + 15) / 16 * 16; // every batch row 64-byte aligned, as in the fp32 tile
            for (int ii = ii0; ii < ii0 + rows;)
            {
                const int P = ep_wk_panel_width(max_ii - ii);
                const unsigned short* gp = g + (size_t)ii * max_kk * 9;
                float* dp = (float*)wide.data + (size_t)(ii - ii0) * max_kk;
                if (batch == 16)
                    ep_wk_panel_rows<4>(P, gp, max_kk, dp, stride);
                else if (batch == 36)
                    ep_wk_panel_rows<6>(P, gp, max_kk, dp, stride);
                else
                    ep_wk_panel_rows<8>(P, gp, max_kk, dp, stride);
                ii += P;
            }
            Mat at_rows(stride, batch, wide.data, 4u);
            Mat top_rows(batch * max_jj * rows, (float*)top_tile.data + (size_t)ii0 * batch * max_jj, 4u);
            gemm_transB_packed_tile(at_rows, BT_tile, top_rows, batch, rows, max_jj, k, max_kk);
        }
        return;
    }
#endif
    (void)wide;
    gemm_transB_packed_tile(AT_tile, BT_tile, top_tile, batch, max_ii, max_jj, k, max_kk);
}
#endif // EP_WINOGRAD_FP16_DEFINED
// ---- end edgepack ----

'''

_TOP_OLD = """    Mat top_tileX(TILE_N * B * TILE_M, 1, nT, 4u, opt.workspace_allocator);
    if (top_tileX.empty())
        return -100;
"""
_TOP_NEW = _TOP_OLD + """
    // edgepack (winograd_fp16_patch.py): each thread's buffer for transforming fp16 3x3 weights
    const size_t ep_wide_floats = ep_wf16_buffer_floats(AT, TILE_K, B);
    Mat ep_wideX;
    if (ep_wide_floats)
    {
        ep_wideX.create((int)ep_wide_floats, 1, nT, 4u, opt.workspace_allocator);
        if (ep_wideX.empty())
            return -100;
    }
"""
_TILE_OLD = "        Mat top_tile = top_tileX.channel(get_omp_thread_num());\n"
_TILE_NEW = _TILE_OLD + "        Mat ep_wide = ep_wide_floats ? ep_wideX.channel(get_omp_thread_num()) : Mat();\n"
_GEMM_OLD = "                gemm_transB_packed_tile(AT_tile, BT_tile, top_tile, B, max_ii, max_jj, k, max_kk);\n"
_GEMM_NEW = "                ep_winograd_gemm(AT_tile, BT_tile, top_tile, B, max_ii, max_jj, k, max_kk, ep_wide);\n"

# the end of create_pipeline's Winograd branch (the fp32 one: the bf16 branch has no braces there)
_PIPELINE_OLD = """            else
            {
                // should never reach here
            }
        }

        if (opt.lightmode)
            weight_data.release();

        return 0;
    }
"""
_PIPELINE_NEW = """            else
            {
                // should never reach here
            }
        }

        // edgepack (winograd_fp16_patch.py): which kernel the transform made as fp16 3x3 weights
        const int ep_m = weight_winograd23_data.elemsize == 2u ? 2
                         : weight_winograd43_data.elemsize == 2u ? 4
                         : weight_winograd63_data.elemsize == 2u ? 6 : 0;
        if (ep_m && getenv("EDGEPACK_NCNN_TRACE"))
            NCNN_LOGE("edgepack winograd: %d -> %d 3x3, F(%d,3) kernel as fp16 3x3 weights", num_input, num_output, ep_m);

        if (opt.lightmode)
            weight_data.release();

        return 0;
    }
"""

_INCLUDE_OLD = '#include "convolution_x86.h"\n'
_INCLUDE_NEW = _INCLUDE_OLD + "\n" + immintrin_include("winograd_fp16_patch.py")


def _transform_kernel_edit(m: int) -> tuple:
    """The F(m,3) kernel transform makes the fp16 3x3 form where it can, and only otherwise its fp32 kernel."""
    head = (f"static void conv3x3s1_winograd{m}3_transform_kernel(const Mat& kernel, Mat& AT, int inch, int outch, "
            "const Option& opt)\n{\n")
    return (f"F({m},3)'s kernel transform", head,
            head + "    if (ep_winograd_kernel_fp16(kernel, AT, inch, outch, opt)) // edgepack (winograd_fp16_patch.py)\n"
                   "        return;\n\n", 1)


_FILE_EDITS = (
    ("src/layer/x86/convolution_3x3_winograd.h", (
        ("the fp16 kernel helpers, before F(2,3)'s kernel transform", _HELPERS_ANCHOR, _HELPERS + _HELPERS_ANCHOR, 1),
        *(_transform_kernel_edit(m) for m in (2, 4, 6)),
        ("the output tiles' allocation (F(2,3), F(4,3), F(6,3))", _TOP_OLD, _TOP_NEW, 3),
        ("each thread's output tile", _TILE_OLD, _TILE_NEW, 3),
        ("the tile products", _GEMM_OLD, _GEMM_NEW, 3),
    )),
    ("src/layer/x86/convolution_x86.cpp", (
        ("immintrin.h for the baseline build", _INCLUDE_OLD, _INCLUDE_NEW, 1),
        ("create_pipeline's Winograd branch", _PIPELINE_OLD, _PIPELINE_NEW, 1),
    )),
)

WINOGRAD_FP16_PATCH_KEY = file_edits_key(WINOGRAD_FP16_PATCH_VERSION, _FILE_EDITS)


def patch_winograd_fp16(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place (x86 builds, after winograd_strips_patch.py)."""
    apply_file_edits(src, _FILE_EDITS, "winograd_fp16_patch.py")
