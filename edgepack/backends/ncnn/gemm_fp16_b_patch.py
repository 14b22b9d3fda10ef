"""A Gemm's large constant B stays fp16 after packing where the net stores fp16, widened a run of columns at a
time as the GEMM reads it (src/layer/x86/gemm_x86.cpp).

fp16_weights_patch.py keeps a large constant B (transB=1, fp16 in the .bin) in fp16 only until
create_pipeline packs it: the packed tiles were fp32, twice the bytes, for the life of the net. A CRNN's
classifier (ddddocr_crnn: 1024 features by 8210 characters) held 33.6 MB of them, the largest part of
its peak RSS.

Where the net stores fp16 (`use_fp16_storage`: the build's fp16 rung; `EDGEPACK_NCNN_OPTIONS=fp16=0` turns it
off, to measure), B was loaded as fp16 and A is not constant, create_pipeline packs each tile as before and
keeps it in fp16 (exact: the values came from fp16). gemm_BT_x86's tile products go through ep_gemm_b_tile,
which widens an fp16 tile 48 columns at a time (whole panels: the same sums) into a per-thread fp32 buffer just
before ncnn's tile kernel reads them: half the resident kernel, the same packed values, so the same bits. The
body of gemm_BT_x86 is untouched: a local lambda named like ncnn's tile kernel hides it there.
Version 1 widened whole tiles, in `--memory lean` only: one more pass over B through memory, and the
20 x 1024 x 8210 Gemm alone ran 3.28 -> 3.61 ms on 1 thread and 2.24 -> 3.01 on 2. Other Gemm paths (A constant
too, bf16, int8, Arm) keep fp32 tiles. x86 builds only, after int8_gemv_patch.py.

Version 3: while create_pipeline packs an fp16 B in light mode (the engine's), it packs one tile column of B at
a time and hands the pages of the rows it has packed back to the system (madvise), instead of holding all of
B beside all of its packed copy until the end: ddddocr_crnn's load peaked at both, 2 x 16.8 MB.
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key
from .winograd_fp16_patch import F16C_HELPERS, immintrin_include

GEMM_FP16_B_PATCH_VERSION = 4  # part of the x86 libncnn cache key (library.py); 2: every fp16-rung net, by runs of columns; 3: B's pages released as packed;
#                                4: F16C by CPUID in every ISA's build (F16C_HELPERS)

_SIG_OLD = ("static int gemm_BT_x86(const Mat& A, const Mat& BT, const Mat& C, Mat& top_blob, int broadcast_type_C, "
            "int N, int K, int transA, int output_transpose, int constant_TILE_M, int constant_TILE_N, "
            "int constant_TILE_K, int nT, const Option& opt)\n{\n")
_SIG_NEW = F16C_HELPERS + r'''// ---- edgepack (gemm_fp16_b_patch.py) ----
#include <stdint.h>
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif
namespace {

// gemm_BT_x86's tile product for an fp32 or an fp16 tile of B. An fp16 tile is widened into this thread's
// channel of `wide` (a whole tile's floats) and ncnn's kernel runs on that: on runs of 48 columns, each widened
// just before the kernel reads it, so it is read from cache (widening the whole tile first was one more pass
// over B through memory: the 20 x 1024 x 8210 Gemm ran 10% slower on 1 thread, 34% on 2); on the whole tile
// where partial sums are kept between K tiles (topT_tile). A run is whole panels (16 columns on AVX-512, 12
// otherwise: pack_B_tile's widest), so its panels are the tile's, and the kernel places its outputs by the
// first column it is given: the same sums as on the whole tile.
static void ep_gemm_b_tile(const Mat& wide, const Mat& AT_tile, const Mat& BT_tile, const Mat& CT_tile, Mat& topT_tile, Mat& top_blob, int broadcast_type_C, int i, int max_ii, int j, int max_jj, int k, int max_kk, bool k_end)
{
    if (BT_tile.elemsize != 2u)
    {
        gemm_transB_packed_tile(AT_tile, BT_tile, CT_tile, topT_tile, top_blob, broadcast_type_C, i, max_ii, j, max_jj, k, max_kk, k_end);
        return;
    }
    const unsigned short* b = (const unsigned short*)BT_tile.data;
    float* w = (float*)wide.channel(get_omp_thread_num()).data;
    const int run = topT_tile.empty() ? 48 : max_jj;
    for (int jj0 = 0; jj0 < max_jj; jj0 += run)
    {
        const int cols = std::min(run, max_jj - jj0);
        // F16C by CPUID: ncnn's AVX build of this file has no -mf16c, and IvyBridge- or Jaguar-class CPUs (AVX
        // and F16C, no FMA) run it
        ep_fp16_widen_any(b + (size_t)jj0 * max_kk, w, cols * max_kk);
        const Mat bt(cols * max_kk, (void*)w, 4u);
        gemm_transB_packed_tile(AT_tile, bt, CT_tile, topT_tile, top_blob, broadcast_type_C, i, max_ii, j + jj0, cols, k, max_kk, k_end);
    }
}

// create_pipeline, light mode: the whole pages of B's first `rows` rows (N x K, fp16) go back to the system once
// every tile that reads them is packed, so B and its packed copy are never both whole in memory: ddddocr_crnn's
// 8210-class classifier is 16.8 MB of each. Only a B this layer alone owns, from the heap (a shared or borrowed
// one is left as it is); `done` is the address freed up to. The pages at either end, which the allocation may
// share, stay. madvise failing only leaves the pages where they were, as B_data.release() frees them anyway.
static void ep_release_b_rows(const Mat& B, int K, int rows, uintptr_t& done)
{
#if defined(__linux__)
    if (!B.refcount || *B.refcount != 1 || B.allocator)
        return;
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    const uintptr_t base = (uintptr_t)B.data;
    const uintptr_t start = std::max(done, (base + page - 1) / page * page);
    const uintptr_t end = (base + (uintptr_t)rows * K * B.elemsize) / page * page;
    if (end > start)
    {
        madvise((void*)start, end - start, MADV_DONTNEED);
        done = end;
    }
#else
    (void)B;
    (void)K;
    (void)rows;
    (void)done;
#endif
}

} // namespace

''' + _SIG_OLD + r'''    Mat ep_wide; // edgepack (gemm_fp16_b_patch.py): each thread's fp32 tile of B, when B is kept in fp16
    if (BT.elemsize == 2u)
    {
        ep_wide.create(BT.w, 1, nT, 4u, opt.workspace_allocator);
        if (ep_wide.empty())
            return -100;
    }
    // the tile products below call this, which hides ncnn's kernel: ep_gemm_b_tile widens fp16 tiles for it
    const auto gemm_transB_packed_tile = [&ep_wide](const Mat& AT_tile, const Mat& BT_tile, const Mat& CT_tile, Mat& topT_tile, Mat& top_blob, int broadcast_type_C, int i, int max_ii, int j, int max_jj, int k, int max_kk, bool k_end) {
        ep_gemm_b_tile(ep_wide, AT_tile, BT_tile, CT_tile, topT_tile, top_blob, broadcast_type_C, i, max_ii, j, max_jj, k, max_kk, k_end);
    };
'''

_CREATE_OLD = """        BT_data.create(TILE_K * TILE_N, nn_K, nn_N, 4u, (Allocator*)0);
        if (BT_data.empty())
            return -100;
"""
_CREATE_NEW = """        // edgepack (gemm_fp16_b_patch.py): where the net stores fp16, a B loaded as fp16 stays fp16 packed
        // (gemm_BT_x86 widens its tiles); with a constant A too, gemm_AT_BT_x86 reads fp32 tiles
        const bool ep_b16 = B_data.elemsize == 2u && !constantA && opt.use_fp16_storage;
        BT_data.create(TILE_K * TILE_N, nn_K, nn_N, ep_b16 ? 2u : 4u, (Allocator*)0);
        if (BT_data.empty())
            return -100;
        Mat ep_tile32; // one fp32 tile a thread, packed there first
        if (ep_b16)
        {
            ep_tile32.create(TILE_K * TILE_N, 1, opt.num_threads, 4u, (Allocator*)0);
            if (ep_tile32.empty())
                return -100;
        }
"""

# the packing loop: where B's pages are released as it goes, one tile column of B at a time, its K tiles in parallel
_LOOP_HEAD = """            if (ep_tile32.empty())
                return -100;
        }

        const int nn_NK = nn_N * nn_K;
        #pragma omp parallel for num_threads(opt.num_threads)
        for (int ppjk = 0; ppjk < nn_NK; ppjk++)
        {
"""
_LOOP_HEAD_NEW = """            if (ep_tile32.empty())
                return -100;
        }

        const int nn_NK = nn_N * nn_K;
        // edgepack (gemm_fp16_b_patch.py): B's rows released as they are packed (ep_release_b_rows)
        const bool ep_release = opt.lightmode && B_data.elemsize == 2u;
        uintptr_t ep_done = 0;
        for (int ep_lo = 0; ep_lo < nn_NK; ep_lo += ep_release ? nn_K : nn_NK)
        {
        const int ep_hi = ep_release ? ep_lo + nn_K : nn_NK;
        #pragma omp parallel for num_threads(opt.num_threads)
        for (int ppjk = ep_lo; ppjk < ep_hi; ppjk++)
        {
"""
_LOOP_TAIL = """                transpose_pack_B_tile(B_data, BT_tile, j, max_jj, k, max_kk);
            }
        }

        if (opt.lightmode)
            B_data.release();
"""
_LOOP_TAIL_NEW = """                transpose_pack_B_tile(B_data, BT_tile, j, max_jj, k, max_kk);
            }
        }
        if (ep_release)
            ep_release_b_rows(B_data, K, std::min(N, (ep_lo / nn_K + 1) * TILE_N), ep_done);
        }

        if (opt.lightmode)
            B_data.release();
"""

_PACK_OLD = """                ep_widen_fp16_block(B_data, K, j, max_jj, k, max_kk, block);
                pack_B_tile(block, BT_tile, 0, max_jj, 0, max_kk);
"""
_PACK_NEW = """                ep_widen_fp16_block(B_data, K, j, max_jj, k, max_kk, block);
                if (BT_tile.elemsize == 2u)
                {
                    // edgepack (gemm_fp16_b_patch.py): packed as ncnn packs it, kept in fp16
                    Mat tile32 = ep_tile32.channel(get_omp_thread_num());
                    pack_B_tile(block, tile32, 0, max_jj, 0, max_kk);
                    // exact: they are fp16 values widened
                    ep_fp16_narrow_any((const float*)tile32.data, (unsigned short*)BT_tile.data, max_jj * max_kk);
                    // the tail of a partial tile is widened too, never read: zeroed here, as the tile is written
                    // (zeroing all of BT first would make it resident beside the whole of B)
                    memset((unsigned short*)BT_tile.data + max_jj * max_kk, 0, (size_t)(BT_tile.w - max_jj * max_kk) * 2u);
                }
                else
                {
                    pack_B_tile(block, BT_tile, 0, max_jj, 0, max_kk);
                }
"""

_INCLUDE_OLD = '#include "x86_usability.h"\n\n#include "cpu.h"\n\nnamespace ncnn {\n'
_INCLUDE_NEW = '#include "x86_usability.h"\n\n#include "cpu.h"\n\n' + immintrin_include("gemm_fp16_b_patch.py") + '\nnamespace ncnn {\n'

_FILE_EDITS = (
    ("src/layer/x86/gemm_x86.cpp", (
        ("immintrin.h for every ISA's build", _INCLUDE_OLD, _INCLUDE_NEW, 1),
        ("gemm_BT_x86's signature", _SIG_OLD, _SIG_NEW, 1),
        ("create_pipeline's packed B", _CREATE_OLD, _CREATE_NEW, 1),
        ("the fp16 B's packing (after fp16_weights_patch.py)", _PACK_OLD, _PACK_NEW, 1),
        ("the packing loop's head", _LOOP_HEAD, _LOOP_HEAD_NEW, 1),
        ("the packing loop's end", _LOOP_TAIL, _LOOP_TAIL_NEW, 1),
    )),
)

GEMM_FP16_B_PATCH_KEY = file_edits_key(GEMM_FP16_B_PATCH_VERSION, _FILE_EDITS)


def patch_gemm_fp16_b(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place (x86 builds, after fp16_weights_patch.py)."""
    apply_file_edits(src, _FILE_EDITS, "gemm_fp16_b_patch.py")
