"""`--memory lean`: a Gemm's large constant B stays fp16 after packing, widened one tile at a time as
the GEMM reads it (src/layer/x86/gemm_x86.cpp).

fp16_weights_patch.py keeps a large constant B (transB=1, fp16 in the .bin) in fp16 only until
create_pipeline packs it: the packed tiles are fp32, twice the bytes, for the life of the net. A CRNN's
classifier (ddddocr_crnn: 1024 features by 8210 characters) holds 33.6 MB of them, the largest part of
its peak RSS.

In a Gemm marked with featmask bit 9 (memory.FP16_PACKED: lean mode marks every Gemm on x86), when B
was loaded as fp16 and A is not constant, create_pipeline packs each tile as before and keeps it in
fp16 (exact: the values came from fp16), and gemm_BT_x86 widens each (j, k) tile of B into a per-thread
fp32 buffer (a few hundred KiB) just before ncnn's tile kernel reads it: half the resident kernel, the
same packed values, so the same bits. The body of gemm_BT_x86 is untouched: its B parameter becomes a
small view whose channel(j).row_range(k, 1), the only way the body reads B, returns the widened tile.
It costs speed, which is why `fast` keeps fp32 tiles: the 20 x 1024 x 8210 Gemm alone, side by side,
3.28 -> 3.61 ms on 1 thread and 2.24 -> 3.01 on 2 (the widening is one more pass over B a run). Other
Gemm paths (A constant too, bf16, int8, Arm) keep fp32 tiles. x86 builds only, after int8_gemv_patch.py.
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

GEMM_FP16_B_PATCH_VERSION = 1  # part of the x86 libncnn cache key (library.py)

_SIG_OLD = ("static int gemm_BT_x86(const Mat& A, const Mat& BT, const Mat& C, Mat& top_blob, int broadcast_type_C, "
            "int N, int K, int transA, int output_transpose, int constant_TILE_M, int constant_TILE_N, "
            "int constant_TILE_K, int nT, const Option& opt)\n{\n")
_SIG_NEW = r'''// ---- edgepack (gemm_fp16_b_patch.py) ----
namespace {

// n values of an fp32 tile into an fp16 one (exact: they are fp16 values widened)
static void ep_narrow_tile(const Mat& src, Mat& dst, int n)
{
    const float* s = src;
    unsigned short* d = (unsigned short*)dst.data;
    int i = 0;
#if __F16C__
    for (; i + 7 < n; i += 8)
        _mm_storeu_si128((__m128i*)(d + i), _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
#endif
    for (; i < n; i++)
        d[i] = float32_to_float16(s[i]);
}

// gemm_BT_x86's packed B: fp32 tiles as they are, fp16 tiles widened into this thread's buffer
struct EpPackedB
{
    const Mat& packed;
    const Mat& scratch; // nT channels of one tile's fp32, when packed is fp16

    struct Channel
    {
        const EpPackedB& b;
        int c;
        Mat row_range(int r, int n) const
        {
            Mat tile = b.packed.channel(c).row_range(r, n);
            if (tile.elemsize != 2u)
                return tile;
            Mat out = b.scratch.channel(get_omp_thread_num());
            const unsigned short* s = (const unsigned short*)tile.data;
            float* d = out;
            const int count = tile.w * n;
            int i = 0;
#if __F16C__
            for (; i + 7 < count; i += 8)
                _mm256_storeu_ps(d + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s + i))));
#endif
            for (; i < count; i++)
                d[i] = float16_to_float32(s[i]);
            return out;
        }
    };

    Channel channel(int c) const
    {
        Channel ch = {*this, c};
        return ch;
    }
};

} // namespace

static int gemm_BT_x86(const Mat& A, const Mat& ep_BT_packed, const Mat& C, Mat& top_blob, int broadcast_type_C, int N, int K, int transA, int output_transpose, int constant_TILE_M, int constant_TILE_N, int constant_TILE_K, int nT, const Option& opt)
{
    Mat ep_scratch;
    if (ep_BT_packed.elemsize == 2u)
    {
        ep_scratch.create(ep_BT_packed.w, 1, nT, 4u, opt.workspace_allocator);
        if (ep_scratch.empty())
            return -100;
    }
    const EpPackedB BT = {ep_BT_packed, ep_scratch};
'''

_CREATE_OLD = """        BT_data.create(TILE_K * TILE_N, nn_K, nn_N, 4u, (Allocator*)0);
        if (BT_data.empty())
            return -100;
"""
_CREATE_NEW = """        // edgepack (gemm_fp16_b_patch.py): in a layer lean mode marks (featmask bit 9), a B loaded as fp16 stays
        // fp16 packed (gemm_BT_x86 widens its tiles); with a constant A too, gemm_AT_BT_x86 reads fp32 tiles
        const bool ep_b16 = B_data.elemsize == 2u && !constantA && (featmask & (1 << 9));
        BT_data.create(TILE_K * TILE_N, nn_K, nn_N, ep_b16 ? 2u : 4u, (Allocator*)0);
        if (BT_data.empty())
            return -100;
        Mat ep_tile32; // one fp32 tile a thread, packed there first
        if (ep_b16)
        {
            // the tail of a partial tile is widened too, never read (Mat::fill writes 4-byte words)
            memset(BT_data.data, 0, BT_data.total() * BT_data.elemsize);
            ep_tile32.create(TILE_K * TILE_N, 1, opt.num_threads, 4u, (Allocator*)0);
            if (ep_tile32.empty())
                return -100;
        }
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
                    ep_narrow_tile(tile32, BT_tile, max_jj * max_kk);
                }
                else
                {
                    pack_B_tile(block, BT_tile, 0, max_jj, 0, max_kk);
                }
"""

_FILE_EDITS = (
    ("src/layer/x86/gemm_x86.cpp", (
        ("gemm_BT_x86's signature", _SIG_OLD, _SIG_NEW, 1),
        ("create_pipeline's packed B", _CREATE_OLD, _CREATE_NEW, 1),
        ("the fp16 B's packing (after fp16_weights_patch.py)", _PACK_OLD, _PACK_NEW, 1),
    )),
)

GEMM_FP16_B_PATCH_KEY = file_edits_key(GEMM_FP16_B_PATCH_VERSION, _FILE_EDITS)


def patch_gemm_fp16_b(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place (x86 builds, after fp16_weights_patch.py)."""
    apply_file_edits(src, _FILE_EDITS, "gemm_fp16_b_patch.py")
