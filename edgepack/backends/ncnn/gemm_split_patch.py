"""How ncnn's x86 convolutions share a layer between threads (src/layer/x86/convolution_im2col_gemm.h,
convolution_3x3_winograd.h): by output pixels as well as output channels, where the pixels are the
bigger operand.

Both kernels are a matrix product: A = the weights (M output channels x K), B = the input rearranged
(K x N output pixels, or N Winograd tiles). ncnn gives each thread whole tiles of M and makes every
thread stream all of B. Early layers have few channels and many pixels (orientation's first 1x1:
M = 32, K = 16, N = 112 x 112), so each of two threads reads the whole of B to compute half the
channels, and the layer runs no faster on 2 threads than on 1 (0.12 -> 0.11 ms; nudenet_320n's
16-channel 3x3 layers at 80 x 80 slightly slower). Where M is 24 or 48 the two M tiles are
16 + 8 or 32 + 16, so one thread does twice the other's work. With AVX-512 (16 channels per
register) both cases cover most of a small model's early layers.

So where N > M (B is the bigger operand) the product is cut into (M tile, N tile) items, ordered
N-major so each thread gets a contiguous run of N tiles for every M tile: it reads only its part of
B, which it packed itself (ncnn's B-packing loop hands out the same runs), and the whole of the
small A. TILE_N is shortened, where the layer has fewer than 4 N tiles per thread, to a whole number
of tiles per thread. Every output element is still computed by one item, over the same K loop in
the same order as before: results are bit-identical to ncnn's own (the thread tests check this
through the built library). One thread, or N <= M, runs ncnn's loop unchanged.

Applied as exact text edits that must each match, like source_patch.py. Only x86 builds compile
these files, so only their cache key carries GEMM_SPLIT_PATCH_KEY. ncnn's Arm kernels share the
structure but pack 4 or 8 channels per register, not 16, and their speed cannot be measured here.
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_edits, edits_digest

GEMM_SPLIT_PATCH_VERSION = 2  # part of the x86 libncnn cache key (library.py); 2: the direct kernel too

IM2COL_FILE = "src/layer/x86/convolution_im2col_gemm.h"
PACKED_FILE = "src/layer/x86/convolution_packed.h"
WINOGRAD_FILE = "src/layer/x86/convolution_3x3_winograd.h"

# One definition per translation unit (both headers are included by convolution_x86*.cpp); the
# alignment follows ncnn's own TILE_N rounding for the ISA this unit is compiled for.
_HELPER = r'''
#ifndef EP_GEMM_SPLIT_N_DEFINED
#define EP_GEMM_SPLIT_N_DEFINED
// edgepack (gemm_split_patch.py): whether to share the product between threads by N tiles
// (true where N > M), and then TILE_N such that each thread gets a whole number of N tiles
// when there are fewer than 4 per thread.
static inline bool ep_split_n(int M, int N, int nT, int& TILE_N)
{
    if (nT <= 1 || N <= M)
        return false;
#if __AVX512F__
    const int align = 16;
#elif __AVX__
    const int align = 12;
#elif __SSE2__
    const int align = 4;
#else
    const int align = 1;
#endif
    int nn_N = (N + TILE_N - 1) / TILE_N;
    if (nn_N < 4 * nT && nn_N % nT != 0)
    {
        nn_N = (nn_N + nT - 1) / nT * nT;
        TILE_N = std::max(align, ((N + nn_N - 1) / nn_N + align - 1) / align * align);
    }
    return true;
}
#endif // EP_GEMM_SPLIT_N_DEFINED
'''

# The item loop: ep_ij runs over nn_M x (nn_N or 1); an item covers M tile ppj and either one N
# tile (split) or all of N (ncnn's loop).
_ITEM_HEAD = (
    "    const int ep_nn_J = ep_split ? (N + TILE_N - 1) / TILE_N : 1;\n"
    "    #pragma omp parallel for num_threads(nT)\n"
    "    for (int ep_ij = 0; ep_ij < nn_M * ep_nn_J; ep_ij++)\n"
    "    {\n"
    "        const int ppj = ep_ij % nn_M;\n"
    "        const int ep_j0 = ep_split ? ep_ij / nn_M * TILE_N : 0;\n"
    "        const int ep_j1 = ep_split ? std::min(N, ep_j0 + TILE_N) : N;\n"
    "        const int i = ppj * TILE_M;\n")
_NCNN_HEAD = (
    "    #pragma omp parallel for num_threads(nT)\n"
    "    for (int ppj = 0; ppj < nn_M; ppj++)\n"
    "    {\n"
    "        const int i = ppj * TILE_M;\n")
_NCNN_J = "        for (int j = 0; j < N; j += TILE_N)\n"
_EP_J = "        for (int j = ep_j0; j < ep_j1; j += TILE_N)\n"

_IM2COL_BODY = ("\n        Mat topT_tile;\n        if (K > TILE_K)\n            topT_tile = topT_tileX.channel(get_omp_thread_num());\n"
                "\n        const int max_ii = std::min((M - i), TILE_M);\n\n")
_WINOGRAD_BODY = ("\n        Mat top_tile = top_tileX.channel(get_omp_thread_num());\n"
                  "\n        const int max_ii = std::min((M - i), TILE_M);\n\n")

# (what, old text, new text, how many times it must occur)
_IM2COL_EDITS = (
    ("the split helper", "static void convolution_im2col_gemm_get_optimal_tile_mnk(",
     _HELPER + "\nstatic void convolution_im2col_gemm_get_optimal_tile_mnk(", 1),
    ("the forward pass's tile sizes",
     "    convolution_im2col_gemm_get_optimal_tile_mnk(M, N, K, TILE_M, TILE_N, TILE_K, nT);\n",
     "    convolution_im2col_gemm_get_optimal_tile_mnk(M, N, K, TILE_M, TILE_N, TILE_K, nT);\n"
     "    const bool ep_split = ep_split_n(M, N, nT, TILE_N);\n", 1),
    ("the product loop", _NCNN_HEAD + _IM2COL_BODY + _NCNN_J, _ITEM_HEAD + _IM2COL_BODY + _EP_J, 1),
)
_WINOGRAD_EDITS = (
    ("the split helper", "static void get_optimal_tile_mnk(int M, int N, int K, int& TILE_M, int& TILE_N, int& TILE_K, int nT)\n",
     _HELPER + "\nstatic void get_optimal_tile_mnk(int M, int N, int K, int& TILE_M, int& TILE_N, int& TILE_K, int nT)\n", 1),
    ("the F(2,3)/F(4,3)/F(6,3) passes' tile sizes",
     "    get_optimal_tile_mnk(M, N, K, TILE_M, TILE_N, TILE_K, nT);\n",
     "    get_optimal_tile_mnk(M, N, K, TILE_M, TILE_N, TILE_K, nT);\n"
     "    const bool ep_split = ep_split_n(M, N, nT, TILE_N);\n", 3),
    ("the F(2,3)/F(4,3)/F(6,3) product loops", _NCNN_HEAD + _WINOGRAD_BODY + _NCNN_J,
     _ITEM_HEAD + _WINOGRAD_BODY + _EP_J, 3),
)

# The direct kernel (convolution_packed.h) runs what the products do not: a 3-channel image into the
# first layer (nudenet_320n: 3 -> 16 channels at 160 x 160, 0.55 ms on 1 thread and on 2). Its
# AVX-512 loop hands out blocks of 16 output channels only; where the blocks do not divide evenly
# between the threads, each block's output rows are cut into one run per thread as well.
_PACKED_HELPER = r'''
// edgepack (gemm_split_patch.py): into how many runs of output rows each block of output channels
// is cut, so that the threads get equal work (1: ncnn's loop, whole blocks only).
static inline int ep_row_runs(int nn_outch, int outh, int nT)
{
    if (nT <= 1 || nn_outch % nT == 0)
        return 1;
    return std::min(nT, outh);
}
'''
_PACKED_EDITS = (
    ("the row-run helper", "static void convolution_transform_kernel_packed(",
     _PACKED_HELPER + "\nstatic void convolution_transform_kernel_packed(", 1),
    ("the AVX-512 block loop",
     "    nn_outch = outch / 16;\n"
     "    #pragma omp parallel for num_threads(opt.num_threads)\n"
     "    for (int pp = 0; pp < nn_outch; pp++)\n"
     "    {\n"
     "        const int p = pp * 16;\n",
     "    nn_outch = outch / 16;\n"
     "    const int ep_runs = ep_row_runs(nn_outch, top_blob.h, opt.num_threads);\n"
     "    #pragma omp parallel for num_threads(opt.num_threads)\n"
     "    for (int ep_pr = 0; ep_pr < nn_outch * ep_runs; ep_pr++)\n"
     "    {\n"
     "        const int pp = ep_pr % nn_outch;\n"
     "        const int ep_i0 = (int)((long)(ep_pr / nn_outch) * top_blob.h / ep_runs);\n"
     "        const int ep_i1 = (int)((long)(ep_pr / nn_outch + 1) * top_blob.h / ep_runs);\n"
     "        const int p = pp * 16;\n", 1),
    ("the AVX-512 block loop's rows",
     "        const int p = pp * 16;\n\n"
     "        // shadowed variable for less openmp task args\n"
     "        const int elempack = bottom_blob.elempack;\n"
     "        const int inch = bottom_blob.c * elempack;\n"
     "        const int outw = top_blob.w;\n"
     "        const int outh = top_blob.h;\n"
     "        const int out_elempack = top_blob.elempack;\n\n"
     "        float* outptr = top_blob.channel(p / out_elempack);\n\n"
     "        for (int i = 0; i < outh; i++)\n",
     "        const int p = pp * 16;\n\n"
     "        // shadowed variable for less openmp task args\n"
     "        const int elempack = bottom_blob.elempack;\n"
     "        const int inch = bottom_blob.c * elempack;\n"
     "        const int outw = top_blob.w;\n"
     "        const int out_elempack = top_blob.elempack;\n\n"
     "        float* outptr = top_blob.channel(p / out_elempack).row(ep_i0);\n\n"
     "        for (int i = ep_i0; i < ep_i1; i++)\n", 1),
)

GEMM_SPLIT_PATCH_KEY = f"{GEMM_SPLIT_PATCH_VERSION}-{edits_digest(_IM2COL_EDITS, _WINOGRAD_EDITS, _PACKED_EDITS)}"


def patch_gemm_split(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place."""
    apply_edits(src / IM2COL_FILE, _IM2COL_EDITS, "gemm_split_patch.py")
    apply_edits(src / WINOGRAD_FILE, _WINOGRAD_EDITS, "gemm_split_patch.py")
    apply_edits(src / PACKED_FILE, _PACKED_EDITS, "gemm_split_patch.py")
