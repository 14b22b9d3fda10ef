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
these files, so only their cache key carries THREAD_SPLIT_PATCH_KEY. ncnn's Arm kernels share the
structure but pack 4 or 8 channels per register, not 16, and their speed cannot be measured here.
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

THREAD_SPLIT_PATCH_VERSION = 5  # part of the x86 libncnn cache key (library.py); 2: the direct kernel; 3: activations;
#                                 4: binary ops, channel Concat and Slice; 5: a constant-B Gemm of few rows

IM2COL_FILE = "src/layer/x86/convolution_im2col_gemm.h"
PACKED_FILE = "src/layer/x86/convolution_packed.h"
WINOGRAD_FILE = "src/layer/x86/convolution_3x3_winograd.h"

# One definition per translation unit (both headers are included by convolution_x86*.cpp); the
# alignment follows ncnn's own TILE_N rounding for the ISA this unit is compiled for.
_HELPER = r'''
#ifndef EP_GEMM_SPLIT_N_DEFINED
#define EP_GEMM_SPLIT_N_DEFINED
// edgepack (thread_split_patch.py): whether to share the product between threads by N tiles
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
    "    const int ep_nn_J = ep_split ? nn_N : 1;  // nn_N: counted after ep_split_n set TILE_N\n"
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
// edgepack (thread_split_patch.py): into how many runs of output rows each block of output channels
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

# The activations that follow (Swish after nearly every convolution of a YOLO, Sigmoid, HardSwish, ...)
# hand out whole channels (blocks of 16 under AVX-512). After a convolution split by pixels, each
# thread would then read the half of every channel that the other thread wrote, and a 16-channel
# tensor is one block for one thread (nudenet_320n's 57 Swish layers: 1.10 ms on 1 thread, 1.16 on
# 2). Where pixels outnumber channels (the rule the convolutions use), each channel is cut into one
# run of pixels per thread (runs start at multiples of 16 floats, so aligned loads stay aligned).
# Element by element, so the results cannot change.
ACTIVATION_FILES = tuple(f"src/layer/x86/{name}_fp32.h" for name in
                         ("swish", "sigmoid", "hardswish", "mish", "gelu", "tanh", "elu", "selu", "erf"))
_ACTIVATION_HELPER = r'''
#ifndef EP_ELEMENTWISE_RUNS_DEFINED
#define EP_ELEMENTWISE_RUNS_DEFINED
// edgepack (thread_split_patch.py): runs of pixels per channel, one per thread where pixels
// outnumber channels (1: ncnn's loop, whole channels only).
static inline int ep_elementwise_runs(int channels, int elempack, int size, int nT)
{
    if (nT <= 1 || size / elempack <= channels * elempack || size < 64 * nT)
        return 1;
    return nT;
}
#endif // EP_ELEMENTWISE_RUNS_DEFINED

'''


def _pixel_runs_head(elempack: str) -> str:
    """A channel loop's head turned into the (channel, run) loop: q, and the run [ep_start, ep_end)
    of the channel's `size` floats (runs start at multiples of 16 floats)."""
    return ("    const int ep_runs = ep_elementwise_runs(channels, " + elempack + ", size, opt.num_threads);\n\n"
            "    #pragma omp parallel for num_threads(opt.num_threads)\n"
            "    for (int ep_qr = 0; ep_qr < channels * ep_runs; ep_qr++)\n"
            "    {\n"
            "        const int q = ep_qr % channels;\n"
            "        const int ep_r = ep_qr / channels;\n"
            "        const int ep_start = (int)((long)size * ep_r / ep_runs) / 16 * 16;\n"
            "        const int ep_end = ep_r + 1 == ep_runs ? size : (int)((long)size * (ep_r + 1) / ep_runs) / 16 * 16;\n")


_ACTIVATION_EDITS = (
    ("the run helper", "#if NCNN_RUNTIME_CPU && NCNN_FMA && __AVX__ && !__FMA__ && !__FMA4__\nvoid ",
     _ACTIVATION_HELPER + "#if NCNN_RUNTIME_CPU && NCNN_FMA && __AVX__ && !__FMA__ && !__FMA4__\nvoid ", 1),
    ("the channel loop",
     "    int size = w * h * d * elempack;\n\n"
     "    #pragma omp parallel for num_threads(opt.num_threads)\n"
     "    for (int q = 0; q < channels; q++)\n"
     "    {\n"
     "        float* ptr = bottom_top_blob.channel(q);\n\n"
     "        int i = 0;\n",
     "    int size = w * h * d * elempack;\n" + _pixel_runs_head("elempack") +
     "        float* ptr = (float*)bottom_top_blob.channel(q) + ep_start;\n"
     "        const int size = ep_end - ep_start; // this run's share\n\n"
     "        int i = 0;\n", 1),
)

# Same-shape binary ops (x + y, x * sigmoid(x) written as Mul) and in-place tensor-by-constant ops run
# the same channel loop over the same kind of data, so they get the same runs. (A product with a
# one-element blob, rare in exported graphs, keeps ncnn's loop.)
BINARYOP_FILE = "src/layer/x86/binaryop_x86.cpp"
_BINARYOP_EDITS = (
    ("the run helper", "static void binary_op_scalar(const Mat& a, float b, Mat& c, int op_type, const Option& opt)\n",
     _ACTIVATION_HELPER + "static void binary_op_scalar(const Mat& a, float b, Mat& c, int op_type, const Option& opt)\n", 1),
    ("the in-place scalar loop",
     "    #pragma omp parallel for num_threads(opt.num_threads)\n"
     "    for (int q = 0; q < channels; q++)\n"
     "    {\n"
     "        float* ptr = a.channel(q);\n\n"
     "        binary_op_vector(ptr, &b, ptr, size, 1, 1, 1, op_type);\n",
     _pixel_runs_head("a.elempack") +
     "        float* ptr = (float*)a.channel(q) + ep_start;\n\n"
     "        binary_op_vector(ptr, &b, ptr, ep_end - ep_start, 1, 1, 1, op_type);\n", 1),
    ("the same-shape loop",
     "    #pragma omp parallel for num_threads(opt.num_threads)\n"
     "    for (int q = 0; q < channels; q++)\n"
     "    {\n"
     "        const float* ptr = a.channel(q);\n"
     "        const float* ptr1 = b.channel(q);\n"
     "        float* outptr = c.channel(q);\n\n"
     "        binary_op_vector(ptr, ptr1, outptr, size, size, 1, 1, op_type);\n",
     _pixel_runs_head("a.elempack") +
     "        const float* ptr = (const float*)a.channel(q) + ep_start;\n"
     "        const float* ptr1 = (const float*)b.channel(q) + ep_start;\n"
     "        float* outptr = (float*)c.channel(q) + ep_start;\n\n"
     "        binary_op_vector(ptr, ptr1, outptr, ep_end - ep_start, ep_end - ep_start, 1, 1, op_type);\n", 1),
)

# A channel Concat or Slice whose inputs and outputs keep their packing is one memcpy of the whole
# tensor on the calling thread (nudenet_320n: 19 Concats and 10 Slices, 0.73 ms on 1 thread and 0.98
# on 2, slower because half of what one thread copies was just written into the other core's cache).
# The copy is shared the way the layers before shared the writing: one run of every channel's
# pixels per thread where pixels outnumber channels, else a range of channels per thread.
CONCAT_FILE = "src/layer/x86/concat_x86.cpp"
SLICE_FILE = "src/layer/x86/slice_x86.cpp"
_COPY_HELPER = r"""
// edgepack (thread_split_patch.py): copy every channel of m (cstep apart in both) between threads.
static void ep_copy_channels(void* dst, const void* src, const Mat& m, const Option& opt)
{
    const size_t cbytes = m.cstep * m.elemsize;
    const int channels = m.c;
    const int nT = opt.num_threads;
    if (nT <= 1 || cbytes * channels < 65536)
    {
        memcpy(dst, src, cbytes * channels);
        return;
    }
    const bool by_pixels = m.w * m.h * m.d > channels * m.elempack && cbytes >= (size_t)nT * 64;
    #pragma omp parallel for num_threads(nT)
    for (int r = 0; r < nT; r++)
    {
        unsigned char* outptr = (unsigned char*)dst;
        const unsigned char* ptr = (const unsigned char*)src;
        if (by_pixels)
        {
            const size_t a = cbytes * r / nT / 64 * 64;
            const size_t b = r + 1 == nT ? cbytes : cbytes * (r + 1) / nT / 64 * 64;
            for (int q = 0; q < channels; q++)
                memcpy(outptr + q * cbytes + a, ptr + q * cbytes + a, b - a);
        }
        else
        {
            const size_t q0 = (size_t)channels * r / nT, q1 = (size_t)channels * (r + 1) / nT;
            memcpy(outptr + q0 * cbytes, ptr + q0 * cbytes, (q1 - q0) * cbytes);
        }
    }
}

"""
_CONCAT_EDITS = (
    ("the copy helper", "int Concat_x86::forward(const std::vector<Mat>& bottom_blobs",
     _COPY_HELPER + "int Concat_x86::forward(const std::vector<Mat>& bottom_blobs", 1),
    ("the channel copy",
     "                const float* ptr = bottom_blob;\n"
     "                float* outptr = top_blob_unpacked.channel(p);\n"
     "                memcpy(outptr, ptr, size * bottom_blob.elemsize);\n",
     "                const float* ptr = bottom_blob;\n"
     "                float* outptr = top_blob_unpacked.channel(p);\n"
     "                (void)size; // the whole of bottom_blob, channel by channel\n"
     "                ep_copy_channels(outptr, ptr, bottom_blob, opt);\n", 1),
)
_SLICE_EDITS = (
    ("the copy helper", "int Slice_x86::forward(const std::vector<Mat>& bottom_blobs",
     _COPY_HELPER + "int Slice_x86::forward(const std::vector<Mat>& bottom_blobs", 1),
    ("the channel copy",
     "                const float* ptr = bottom_blob_unpacked.channel(p);\n"
     "                float* outptr = top_blob;\n"
     "                memcpy(outptr, ptr, size * top_blob.elemsize);\n",
     "                const float* ptr = bottom_blob_unpacked.channel(p);\n"
     "                float* outptr = top_blob;\n"
     "                (void)size; // the whole of top_blob, channel by channel\n"
     "                ep_copy_channels(outptr, ptr, top_blob, opt);\n", 1),
)

# A Gemm of constant B with few rows and many columns (a CRNN's classifier: 20 x 1024 x 8210) had its rows cut into
# one tile per thread: 16 + 4 rows, so one thread did four times the other's work, and each read (and, for fp16 B,
# widened) all of B: 3.3 ms on 1 thread, 3.0 on 2. Where the columns outnumber the rows 4 to 1 and the rows fit
# the one tile ncnn sized for all its threads before cutting it, they stay one tile, and ncnn's own loop for
# fewer row tiles than threads shares the column tiles between the threads instead. Each output element is
# summed by the same panel over the same K loop: the same bits (tests/test_memory.py's classifier test compares
# 1 and 2 threads bit for bit).
GEMM_FILE = "src/layer/x86/gemm_x86.cpp"
_GEMM_BT_HEAD = ("static int gemm_BT_x86(const Mat& A, const Mat& BT, const Mat& C, Mat& top_blob, int broadcast_type_C, "
                 "int N, int K, int transA, int output_transpose, int constant_TILE_M, int constant_TILE_N, "
                 "int constant_TILE_K, int nT, const Option& opt)\n{\n"
                 "    const int M = transA ? A.w : (A.dims == 3 ? A.c : A.h) * A.elempack;\n\n"
                 "    // NCNN_LOGE(\"M/N/K = %d %d %d\", M, N, K);\n\n"
                 "    int TILE_M, TILE_N, TILE_K;\n"
                 "    get_optimal_tile_mnk(M, N, K, constant_TILE_M, constant_TILE_N, constant_TILE_K, TILE_M, TILE_N, TILE_K, nT);\n")
_GEMM_HELPER = r'''// edgepack (thread_split_patch.py): TILE_M for a constant-B Gemm of few rows and many columns: all M rows in one
// tile where they fit the tile ncnn sized for its nT threads before cutting it in nT, so the threads share the
// column tiles (ncnn's nT > nn_M loop) instead of taking unequal row tiles that each read all of B
static inline void ep_gemm_rows_whole(int M, int N, int nT, int constant_TILE_M, int& TILE_M)
{
    if (nT <= 1 || constant_TILE_M > 0 || M <= TILE_M || N < 4 * M || M > TILE_M * nT)
        return;
#if __AVX512F__
    TILE_M = (M + 15) / 16 * 16;
#elif __AVX__
    TILE_M = (M + 7) / 8 * 8;
#elif __SSE2__
    TILE_M = (M + 3) / 4 * 4;
#else
    TILE_M = (M + 1) / 2 * 2;
#endif
}

'''
_GEMM_EDITS = (("the constant-B Gemm's tile sizes", _GEMM_BT_HEAD,
                _GEMM_HELPER + _GEMM_BT_HEAD + "    ep_gemm_rows_whole(M, N, nT, constant_TILE_M, TILE_M);\n", 1),)

# Every patched file with its edits: one table for the cache key and for applying them, so the two
# cannot disagree (the activation edits, shared by nine files, count once in the key).
_FILE_EDITS = ((IM2COL_FILE, _IM2COL_EDITS), (WINOGRAD_FILE, _WINOGRAD_EDITS), (PACKED_FILE, _PACKED_EDITS),
               *((name, _ACTIVATION_EDITS) for name in ACTIVATION_FILES),
               (BINARYOP_FILE, _BINARYOP_EDITS), (CONCAT_FILE, _CONCAT_EDITS), (SLICE_FILE, _SLICE_EDITS),
               (GEMM_FILE, _GEMM_EDITS))

THREAD_SPLIT_PATCH_KEY = file_edits_key(THREAD_SPLIT_PATCH_VERSION, _FILE_EDITS)


def patch_thread_split(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place."""
    apply_file_edits(src, _FILE_EDITS, "thread_split_patch.py")
