"""im2col + GEMM convolution kernels kept in fp16 on x86 CPUs with F16C (src/layer/x86/convolution_x86.cpp and
convolution_im2col_gemm.h; issue 10 item 5, memory in the default `fast` mode).

ncnn's x86 convolutions that are not Winograd (every 1 x 1, and 3 x 3 at stride 2 or with more than 16 channels on
a side) pack their weights for im2col + GEMM once, in fp32, for the life of the net: twice the bytes pnnx stores
at the fp16 rung. On YOLO11s-seg that is 28 MB of packed fp32 kernels for 14 MB of fp16 weights, the largest
share of what `fast` holds after Winograd's (already fp16, winograd_fp16_patch.py).

Here, where the net stores fp16 (`use_fp16_storage`: the build's fp16 rung; the fp32 rung and the switch
`EDGEPACK_NCNN_OPTIONS=fp16=0` turn it off) and the CPU has F16C, create_pipeline narrows the packed kernel to
fp16 when every value it holds converts exactly (fp16 weights widened by the loader always do; a kernel that does
not keeps fp32). The convolution widens
EP_WF16_ROWS rows of a kernel tile at a time (a pair of panels, as the Winograd patch does) into a per-thread
buffer and runs ncnn's tile kernel on each run of rows as on a tile of its own: the packing puts each panel's
rows in one stretch of the tile, and the tile kernel places its partial sums and outputs by the first row it is
given. So the kernel's values, and the order of every sum, are those of the fp32 kernel: the same bits. The cost
is one widening of a TILE_M x TILE_K block per output tile column, small beside the block's TILE_N products.
Only x86 builds compile it, after winograd_fp16_patch.py, whose F16C conversions it shares (F16C_HELPERS).
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key
from .winograd_fp16_patch import F16C_HELPERS

GEMM_CONV_FP16_PATCH_VERSION = 2  # 2: exact narrowing shared (F16C_HELPERS' ep_wf16_narrow_exact)

_HELPERS_ANCHOR = "static int convolution_im2col_gemm(const Mat& bottom_blob, Mat& top_blob, const Mat& AT, const Mat& bias, "
_HELPERS = F16C_HELPERS + r'''// ---- edgepack (gemm_conv_fp16_patch.py) ----
#ifndef EP_GEMM_CONV_FP16_DEFINED
#define EP_GEMM_CONV_FP16_DEFINED
// create_pipeline: the packed kernel (AT, from convolution_im2col_gemm_transform_kernel) kept in fp16 where the
// net stores fp16, the CPU has F16C and every value the tiles hold converts exactly; whether it was
static bool ep_im2col_kernel_fp16(Mat& AT, int M, int K, const Option& opt)
{
#if EP_WF16
    if (AT.empty() || AT.elemsize != 4u || AT.elempack != 1 || AT.dims != 3 || !opt.use_fp16_storage || !cpu_support_x86_f16c())
        return false;
    int TILE_M, TILE_N, TILE_K;
    convolution_im2col_gemm_get_optimal_tile_mnk(M, 0, K, TILE_M, TILE_N, TILE_K, opt.num_threads); // as packed
    if ((M + TILE_M - 1) / TILE_M != AT.c || (K + TILE_K - 1) / TILE_K != AT.h || AT.w != TILE_M * TILE_K)
        return false; // not the tiling this reads: keep fp32
    Mat half(AT.w, AT.h, AT.c, 2u, (Allocator*)0);
    if (half.empty())
        return false;
    for (int q = 0; q < AT.c; q++)
    {
        for (int y = 0; y < AT.h; y++)
        {
            // a tile of max_ii x max_kk fills the first values of its row; the rest was never written
            const int n = std::min(M - q * TILE_M, TILE_M) * std::min(K - y * TILE_K, TILE_K);
            unsigned short* d = half.channel(q).row<unsigned short>(y);
            if (!ep_wf16_narrow_exact(AT.channel(q).row(y), d, n))
                return false;
            memset(d + n, 0, (size_t)(AT.w - n) * 2u);
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

// convolution_gemm_transB_packed_tile for an fp32 or fp16 kernel tile: fp16 tiles are widened EP_WF16_ROWS rows
// at a time into `wide` (EP_WF16_ROWS x TILE_K floats) and the tile kernel runs on each run of rows as on a tile
// of its own, its partial sums (topT_tile: max_jj values a row) at that run's rows
static void ep_im2col_gemm_tile(const Mat& AT_tile, const Mat& BT_tile, const Mat& CT_tile, Mat& topT_tile, Mat& top_blob, int i, int max_ii, int j, int max_jj, int k, int max_kk, bool k_end, Mat& wide)
{
#if EP_WF16
    if (AT_tile.elemsize == 2u)
    {
        const unsigned short* at = (const unsigned short*)AT_tile.data;
        for (int ii0 = 0; ii0 < max_ii; ii0 += EP_WF16_ROWS)
        {
            const int rows = std::min(EP_WF16_ROWS, max_ii - ii0);
            ep_wf16_widen(at + (size_t)max_kk * ii0, (float*)wide.data, rows * max_kk);
            const Mat at_rows(rows * max_kk, wide.data, 4u);
            Mat top_rows;
            if (!topT_tile.empty())
                top_rows = Mat(rows * max_jj, (float*)topT_tile.data + (size_t)ii0 * max_jj, 4u);
            convolution_gemm_transB_packed_tile(at_rows, BT_tile, CT_tile, top_rows, top_blob, i + ii0, rows, j, max_jj, k, max_kk, k_end);
        }
        return;
    }
#endif
    (void)wide;
    convolution_gemm_transB_packed_tile(AT_tile, BT_tile, CT_tile, topT_tile, top_blob, i, max_ii, j, max_jj, k, max_kk, k_end);
}
#endif // EP_GEMM_CONV_FP16_DEFINED
// ---- end edgepack ----

'''

_TOP_OLD = """    Mat topT_tileX;
    if (K > TILE_K)
    {
        topT_tileX.create(TILE_N * TILE_M, 1, nT, 4u, opt.workspace_allocator);
        if (topT_tileX.empty())
            return -100;
    }
"""
_TOP_NEW = _TOP_OLD + """
    // edgepack (gemm_conv_fp16_patch.py): each thread's buffer for widening an fp16 kernel (64-byte rows)
    Mat ep_wideX;
#if EP_WF16
    if (AT.elemsize == 2u)
    {
        ep_wideX.create((EP_WF16_ROWS * TILE_K + 15) / 16 * 16, 1, nT, 4u, opt.workspace_allocator);
        if (ep_wideX.empty())
            return -100;
    }
#endif
"""
_TILE_OLD = "            topT_tile = topT_tileX.channel(get_omp_thread_num());\n"
_TILE_NEW = _TILE_OLD + "        Mat ep_wide = ep_wideX.empty() ? Mat() : ep_wideX.channel(get_omp_thread_num());\n"
_GEMM_OLD = ("                convolution_gemm_transB_packed_tile(AT_tile, BT_tile, bias, topT_tile, top_blob, i, max_ii, j, max_jj, "
             "k, max_kk, k_end);\n")
_GEMM_NEW = ("                ep_im2col_gemm_tile(AT_tile, BT_tile, bias, topT_tile, top_blob, i, max_ii, j, max_jj, k, max_kk, k_end, "
             "ep_wide);\n")

_PIPELINE_OLD = ("        convolution_im2col_gemm_transform_kernel(weight_data, weight_sgemm_data, num_input, num_output, kernel_w, "
                 "kernel_h, opt);\n")
_PIPELINE_NEW = _PIPELINE_OLD + """        // edgepack (gemm_conv_fp16_patch.py): the packed kernel in fp16 where its values convert exactly
        if (ep_im2col_kernel_fp16(weight_sgemm_data, num_output, num_input * kernel_w * kernel_h, opt) && getenv("EDGEPACK_NCNN_TRACE"))
            NCNN_LOGE("edgepack gemm conv: %d -> %d %dx%d, kernel in fp16", num_input, num_output, kernel_w, kernel_h);
"""

_FILE_EDITS = (
    ("src/layer/x86/convolution_im2col_gemm.h", (
        ("the fp16 kernel helpers, before the convolution", _HELPERS_ANCHOR, _HELPERS + _HELPERS_ANCHOR, 1),
        ("the partial sums' allocation", _TOP_OLD, _TOP_NEW, 1),
        ("each thread's partial sums", _TILE_OLD, _TILE_NEW, 1),
        ("the tile products", _GEMM_OLD, _GEMM_NEW, 1),
    )),
    ("src/layer/x86/convolution_x86.cpp", (
        ("create_pipeline's im2col + GEMM branch", _PIPELINE_OLD, _PIPELINE_NEW, 1),
    )),
)

GEMM_CONV_FP16_PATCH_KEY = file_edits_key(GEMM_CONV_FP16_PATCH_VERSION, _FILE_EDITS)


def patch_gemm_conv_fp16(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place (x86 builds, after winograd_fp16_patch.py)."""
    apply_file_edits(src, _FILE_EDITS, "gemm_conv_fp16_patch.py")
