"""Winograd F(4,3) kernels kept in fp16 on x86 CPUs with F16C (src/layer/x86/convolution_x86.cpp and
convolution_3x3_winograd.h; issue 10 item 5, memory in the default `fast` mode).

ncnn's x86 3x3 stride-1 convolutions keep their Winograd-transformed kernels for the life of the net, 36/9
(F(4,3): layers with more than 32 channels on a side, when pnnx gives no shapes) or 64/9 (F(6,3)) times
the layer's fp32 weights: on nudenet_320n 27.7 MB, two thirds of what the artifact holds after loading.
ncnn's Arm build keeps them in fp16 where it computes in fp16; x86 has no fp16 arithmetic, and its tile
kernel (with edgepack's paired panels, gemm_pair_patch.py) reads fp32.

Here, where the net stores in fp16 (`use_fp16_storage`: the build's fp16 rung; the fp32 rung turns it
off) and the CPU has F16C, create_pipeline narrows each F(4,3) kernel to fp16 once it is transformed
(round to nearest), and the convolution widens 16 rows (32 with AVX-512: a whole pair of panels) of a
kernel tile at a time into a per-thread buffer and runs ncnn's tile kernel on it unchanged: its packing
puts each run of rows in one stretch of every batch row, and its output for those rows in one stretch of
the output tile. So the sums are those of an fp32 kernel rounded to fp16, in ncnn's order.

The transform's fractions (G has 1/4 ... 1/24) put many kernel values below fp16's least normal number,
where it keeps few bits (a 40 -> 24 layer came out 1.2e-3 of scale off; a 24 -> 24 F(6,3) layer 1% here
and 19x its scale under qemu's Haswell, whose handling of those subnormals differs from this host's): the kernel is stored times a power of two that puts
its largest value in [2^13, 2^14), and widened times the inverse, exactly (kept in two more halves at the end
of each kernel row). F(6,3)'s fractions reach
1/8100 and its output transform multiplies by up to 32: in fp16, scaled as above, a 24 -> 24 layer was still
0.84% of scale off and a 32 -> 32 one 1.3%, so it keeps fp32 (its kernels are the small ones: at most 32 x 32
channels). F(2,3) keeps fp32 too: integer-sum
layers (integer_winograd_patch.py) take it and must stay exact. The build's verification against
onnxruntime decides, as for every fp16 rung, whether the whole model is close enough.

The widening is one pass over a kernel tile per output tile column (N), into a buffer the tile kernel
then reads from cache; for deep layers on small maps, where the kernel is read once or twice a run, the
fp16 kernel halves what comes from memory. Only x86 builds compile it, so only their cache key carries
WINOGRAD_FP16_PATCH_KEY.
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

WINOGRAD_FP16_PATCH_VERSION = 2  # 2: the F16C conversions in their own block (F16C_HELPERS)

_HELPERS_ANCHOR = "static int conv3x3s1_winograd23(const Mat& bottom_blob, Mat& top_blob, const Mat& AT, const Mat& bias, int nT, const Option& opt)\n{"
# F16C conversions, shared with gemm_conv_fp16_patch.py: each header that needs them carries this block, and
# its guard keeps one copy per translation unit (convolution_x86.cpp includes the Winograd header first,
# convolution_x86_fma.cpp the im2col one)
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
// n fp32 values times 2^s to fp16, rounded to nearest (F16C: these functions run only where CPUID has it)
__attribute__((target("avx,f16c"))) static void ep_wf16_narrow(const float* s, unsigned short* d, size_t n, float scale)
{
    const __m256 k = _mm256_set1_ps(scale);
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i*)(d + i), _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(s + i), k), _MM_FROUND_TO_NEAREST_INT));
    if (i < n)
    {
        float tail[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        unsigned short out[8];
        for (size_t t = i; t < n; t++)
            tail[t - i] = s[t];
        _mm_storeu_si128((__m128i*)out, _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(tail), k), _MM_FROUND_TO_NEAREST_INT));
        for (size_t t = i; t < n; t++)
            d[t] = out[t - i];
    }
}

// n fp16 values times `unscale` (a power of two: exact) to fp32
__attribute__((target("avx,f16c"))) static void ep_wf16_widen(const unsigned short* s, float* d, int n, float unscale)
{
    const __m256 k = _mm256_set1_ps(unscale);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(d + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + i))), k));
    for (; i < n; i++)
        d[i] = _cvtsh_ss(s[i]) * unscale;
}
#endif // x86-64, clang/gcc
#endif // EP_WF16_HELPERS_DEFINED
// ---- end edgepack ----
'''

_HELPERS = F16C_HELPERS + r'''// ---- edgepack (winograd_fp16_patch.py) ----
#ifndef EP_WINOGRAD_FP16_DEFINED
#define EP_WINOGRAD_FP16_DEFINED

// create_pipeline: a transformed kernel (AT) kept in fp16 where the net stores fp16 and the CPU has F16C;
// whether it was. The transform's fractions (1/4 .. 1/24 in G) put many of a kernel's values below fp16's
// least normal number (6.1e-05), where it keeps few bits; so the kernel is stored times 2^s, its largest
// value in [2^13, 2^14), and each row of the fp16 kernel is two halves longer, where 2^-s is kept (as a
// float's bytes) for the widening: any tile can read it from its first row.
static bool ep_winograd_kernel_fp16(Mat& AT, int M, int K, const Option& opt)
{
#if EP_WF16
    if (AT.empty() || AT.elemsize != 4u || AT.elempack != 1 || !opt.use_fp16_storage || !cpu_support_x86_f16c())
        return false;
    // the largest value the tiles hold: a tile of max_ii x max_kk (M and K's last tiles may be partial) fills
    // the first max_ii * max_kk values of each of its rows, the rest is whatever the allocation held before
    int TILE_M, TILE_N, TILE_K;
    get_optimal_tile_mnk(M, 0, K, TILE_M, TILE_N, TILE_K, opt.num_threads); // as the transform tiled it
    if ((M + TILE_M - 1) / TILE_M != AT.c || (K + TILE_K - 1) / TILE_K != AT.d)
        return false; // not the tiling this reads: keep fp32
    float largest = 0.f;
    for (int i = 0; i < M; i += TILE_M)
    {
        for (int k = 0; k < K; k += TILE_K)
        {
            const Mat tile = AT.channel(i / TILE_M).depth(k / TILE_K);
            const int n = std::min(M - i, TILE_M) * std::min(K - k, TILE_K);
            for (int y = 0; y < AT.h; y++)
            {
                const float* p = tile.row(y);
                for (int j = 0; j < n; j++)
                    largest = std::max(largest, fabsf(p[j]));
            }
        }
    }
    if (!(largest < 3.0e38f)) // inf or NaN: keep fp32
        return false;
    int e = 0;
    if (largest > 0.f)
        frexpf(largest, &e); // largest = m * 2^e, m in [0.5, 1)
    const int s = std::min(100, std::max(-100, 14 - e));
    const float scale = ldexpf(1.f, s);
    const float unscale = ldexpf(1.f, -s);
    Mat half;
    half.create(AT.w + 2, AT.h, AT.d, AT.c, 2u, (Allocator*)0);
    if (half.empty())
        return false; // keeps fp32
    for (int q = 0; q < AT.c; q++)
    {
        for (int z = 0; z < AT.d; z++)
        {
            const Mat src = AT.channel(q).depth(z);
            Mat dst = half.channel(q).depth(z);
            for (int y = 0; y < AT.h; y++)
            {
                unsigned short* row = dst.row<unsigned short>(y);
                ep_wf16_narrow(src.row(y), row, (size_t)AT.w, scale);
                memcpy(row + AT.w, &unscale, sizeof(float));
            }
        }
    }
    AT = half;
    return true;
#else
    (void)AT;
    (void)M;
    (void)K;
    (void)opt;
    return false;
#endif
}

// floats of one thread's widening buffer for tiles of TILE_K and B batches (0: the kernel is fp32)
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

// gemm_transB_packed_tile for an fp32 or fp16 kernel tile: fp16 tiles are widened EP_WF16_ROWS rows at a
// time into `wide` (ep_wf16_buffer_floats) and the tile kernel runs on each run of rows as on a tile of its own
static void ep_winograd_gemm(const Mat& AT_tile, const Mat& BT_tile, Mat& top_tile, int batch, int max_ii, int max_jj, int k, int max_kk, Mat& wide)
{
#if EP_WF16
    if (AT_tile.elemsize == 2u)
    {
        const unsigned short* at = (const unsigned short*)AT_tile.data;
        float unscale;
        memcpy(&unscale, at + AT_tile.w - 2, sizeof(float));
        for (int ii0 = 0; ii0 < max_ii; ii0 += EP_WF16_ROWS)
        {
            const int rows = std::min(EP_WF16_ROWS, max_ii - ii0);
            const int len = rows * max_kk;
            const int stride = (len + 15) / 16 * 16; // every batch row 64-byte aligned, as in the fp32 tile
            for (int b = 0; b < batch; b++)
                ep_wf16_widen(at + (size_t)AT_tile.w * b + (size_t)max_kk * ii0, (float*)wide.data + (size_t)stride * b, len, unscale);
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
    // edgepack (winograd_fp16_patch.py): each thread's buffer for widening an fp16 kernel
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

        // edgepack (winograd_fp16_patch.py): F(4,3) kernels in fp16 where the net stores fp16
        if (ep_winograd_kernel_fp16(weight_winograd43_data, num_output, num_input, opt) && getenv("EDGEPACK_NCNN_TRACE"))
            NCNN_LOGE("edgepack winograd: %d -> %d 3x3, F(4,3) kernel in fp16", num_input, num_output);

        if (opt.lightmode)
            weight_data.release();

        return 0;
    }
"""

_INCLUDE_OLD = '#include "convolution_x86.h"\n'
_INCLUDE_NEW = _INCLUDE_OLD + """
#if defined(__x86_64__) && (defined(__clang__) || defined(__GNUC__))
#include <immintrin.h> // edgepack (winograd_fp16_patch.py): F16C functions with a target attribute, in every ISA's build
#endif
"""

_FILE_EDITS = (
    ("src/layer/x86/convolution_3x3_winograd.h", (
        ("the fp16 kernel helpers, before F(2,3)'s convolution", _HELPERS_ANCHOR, _HELPERS + _HELPERS_ANCHOR, 1),
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
