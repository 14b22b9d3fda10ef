"""Integer GEMMs summed as integers on AVX2 CPUs (src/layer/gemm.{h,cpp}, src/layer/x86/gemm_x86.{h,cpp}).

onnxruntime's dynamic quantisation (quantize_dynamic) turns a float MatMul into DynamicQuantizeLinear
+ MatMulInteger: activations rounded to uint8, weights stored as 8-bit integers, summed in int32.
quantized.py lowers that to a float MatMul on integer-valued tensors (x - x_zp and w - w_zp, both in
[-255, 255]), which ncnn ran as an fp32 Gemm: ddddocr_old_int8's 20 x 1024 x 8210 classifier read
33.6 MB of packed fp32 weights a run and took 30% of the model's time.

A Gemm line the conversion marks with ``28=1`` (convert.py: every Gemm of constant B in a graph carrying
lowered quantisation) is taken here when the CPU has AVX2 and every value of B is an integer in
[-255, 255]: B is packed once as int16 pairs ([N/8][K/2][8][2], no fp32 copy kept: 16.8 MB instead of
33.6 for ddddocr's classifier). Each run checks that A holds integers in [-255, 255] (what the
quantiser makes), converts it to int16 pairs eight rows a block (vectorised for ncnn's packed A, where
a pack holds eight or sixteen rows' values of one depth: a scalar check had been 13% of a QDQ
transformer's time) and sums with vpmaddwd (two 16-bit products per 32-bit lane,
exact) into int32, then rounds each sum once to fp32: the fp32 Gemm's result wherever its partial sums
stayed below 2^24, and onnxruntime's int32 sum where they did not. So the outputs are the same bits on
every CPU. A run whose A fails the check (a marked layer fed something else) takes a plain fp32 loop
over the same packed weights: right, slow, and not expected. Static (QDQ) quantisation reaches this
too: quantized_qdq.py writes a MatMul of int8 weights as a MatMul of the integers, then scaled.

Taken only for: constant B stored transposed (transB=1, pnnx's layout), A not constant or
transposed, one input, alpha 1, fp32 output not transposed, K up to 32768 (int32 cannot overflow),
no int8 scales of ncnn's own; a constant C (a bias) may be a scalar, per row or per column, and is
added to the rounded sum (onnxruntime adds its bias after MatMulInteger, too). The code lives in
ncnn's AVX builds of the layer (AVX-512, FMA and AVX) as AVX2 functions picked by CPUID; SSE CPUs and
unmarked layers run ncnn's fp32 Gemm as before. CPUs with AVX-VNNI (Alder Lake and later, the N100
class) or AVX-512 VNNI (Ice Lake, Zen 4, Xeons) sum with vpdpwssd instead: one instruction for
vpmaddwd + vpaddd, the same int32 sums (patch version 4); with AVX-512's 32 registers the sums run in
two sets (even and odd pairs, added at the end), so that each accumulator waits out vpdpwssd's latency
half as often, and whole 16 x 8 blocks of an output packed 8 or 16 rows to an element are summed in
512-bit registers (two A blocks a register). Where every value of B fits int8 (int8 weights with zero
point 0: static QDQ models, quantize_dynamic's QInt8) and the CPU has VNNI, B is kept as int8 quads
([N/8][K4][8][4], half the bytes again) with its column sums, and each run shifts A by off = -min(A)
into [0, 255] (a quantiser's x - zero point spans 255 at most; a run whose A spans more takes the fp32
loop) and sums with vpdpbusd, four uint8 x int8 products a lane, twice vpdpwssd's, exact (it does not
saturate); off times the column's sum of B is taken back from each int32 sum, so the sums, and the
outputs, are the same bits as the int16 kernels' (patch version 9). The byte layout is the int16 one's
byte for byte (a 32-byte step holds 8 rows' quads instead of pairs), so one set of kernels serves both.
smart_turn_v3: 49.0 -> 37.8 ms on 1 thread (onnxruntime 33.5). A B that does not fit int8 but spans 255
at most (uint8 weights less their zero point: quantize_dynamic's QUInt8) goes in as the unsigned side,
B + shift, and A as the signed one, A + off in [-128, 127]; A's row sums (taken while converting it) then
take back B's shift (version 10). ddddocr_old_int8's 8210 x 1024 classifier: 14.5 -> 12.1 ms on 1 thread
(onnxruntime 7.4).
On AVX2 CPUs without VNNI, B is kept as bytes in the int16 pairs' order ([N/8][K2][8][2]:
uint8 of B + shift, one shift per 8-column block: B goes to bytes block by block as it is packed, so its
whole int16 packing never exists) and each thread widens the block it works on back to int16
pairs (less the shift) into a scratch of its own, which the int16 kernels read for every row block
(version 12): the same sums, B in half the bytes, and from memory half the traffic (a first version
widened inside the kernels; the column kernel's lane-crossing broadcasts made smart_turn_v3 1.7x
slower). (vpmaddubsw would take the
bytes directly, at twice the products per instruction, but it adds each pair in int16 and saturates:
onnxruntime's AVX2 u8s8 kernel does, so its sums are not always exact.)
Only x86 builds compile this file, so only their cache key carries INT8_GEMM_PATCH_KEY.
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

INT8_GEMM_PATCH_VERSION = 14  # 2: A converted 8 rows a block (AVX2 for elempack 8), the kernel reads blocks;
# 3: whole 8 x 8 blocks stored as vectors (column by column where the output packs 8 rows); 4: vpdpwssd on VNNI CPUs;
# 5: an even count of pairs (no kernel tail); 6: 16-row packed outputs stored column by column too;
# 7: 16 x 8 blocks in 512-bit registers on AVX-512 VNNI; 8: one store of column blocks for both (same code);
# 9: B that fits int8 as int8 quads, A as uint8 + an offset, vpdpbusd on VNNI CPUs; 10: B spanning 255 or less
# as uint8 (shifted), A as int8 (shifted); 11: A converted in parallel, block by block; 12: on AVX2 CPUs
# without VNNI, B kept as bytes (a shift per 8-column block), widened block by block into a per-thread scratch;
# 13: on VNNI CPUs, B's range found first and B packed straight to byte quads, block by block (no whole int16 B);
# 14: there, B's rows handed back as they are packed (ep_release_b_rows)
MARK_KEY = 28  # Gemm param key the conversion writes (ncnn's Gemm reads 0-22; the Layer base 30-31)

_DECL_OLD = "public:\n    int nT;\n    Mat AT_data;\n"
_DECL_NEW = """public:
    // edgepack (int8_gemm_patch.py): an integer B packed for integer sums, taken in create_pipeline
    int ep_int8;   // 1: B taken as int16 pairs for integer sums; 0: ncnn's fp32 Gemm
    int ep_isa;    // the sums' instructions: 0 AVX2 (vpmaddwd), 1 AVX-VNNI, 2 AVX-512 VNNI (vpdpwssd)
    int ep_u8;     // byte quads, on VNNI CPUs (vpdpbusd): 1 B fits int8, A goes in as uint8 (shifted); 2 B spans
                   // at most 255, goes in as uint8 (B + ep_bshift), A as int8 (shifted); 0 int16 pairs
    int ep_bshift; // ep_u8 == 2: what B is shifted by
    int ep_wb;     // 1: AVX2 without VNNI, B kept as bytes in the int16 pairs' order ([N/8][K2][8][2]), each 8-column
                   // block shifted by ep_wshift[block] into [0, 255], widened block by block for the int16 kernels
    Mat ep_wshift; // ep_wb: each block's shift
    Mat ep_b;      // B as int16, [N/8][K2][8][2], K2 = K/2 rounded up to an even count; or (ep_u8) bytes, [N/8][K4][8][4];
                   // or (ep_wb) bytes, [N/8][K2][8][2]
    Mat ep_colsum; // ep_u8: B's column sums (unshifted; the correction for A's shift)
    int ep_forward_int8(const std::vector<Mat>& bottom_blobs, std::vector<Mat>& top_blobs, const Option& opt) const;

""" + _DECL_OLD

_KERNEL_ANCHOR = "int Gemm_x86::create_pipeline(const Option& opt)\n{\n"
_KERNEL = r'''// ---- edgepack (int8_gemm_patch.py) ----
#if __AVX__
namespace {

// EDGEPACK_NCNN_TRACE=1 (the engine's measuring switch): say which layers took integer sums and which runs fell back
static int ep_int8_trace()
{
    const char* t = getenv("EDGEPACK_NCNN_TRACE");
    return t && t[0] == '1';
}

static inline float ep_b_value(const Mat& B, size_t i)
{
    return B.elemsize == 2u ? float16_to_float32(((const unsigned short*)B.data)[i]) : ((const float*)B.data)[i];
}

// The two kernels, stamped out once per instruction set by EP_I16_KERNELS: EP_DOT(acc, x, y) adds the
// pairwise products of the int16 lanes of x and y to the int32 lanes of acc. AVX2: vpmaddwd + vpaddd;
// AVX-VNNI (VEX) and AVX-512 VNNI (EVEX, 256-bit with VL): one vpdpwssd, the same sums (a pair of
// products of values in [-255, 255] cannot overflow, and both wrap the same way past int32).
//
// ep_i16_rows_*: R rows of int16 A times one 8-column block of int16 B, exact int32 sums. A is packed
// 8 rows a block, [K2][8 rows][2]: row r's pair q at a + q * 16 + r * 2 (one 32-byte line holds a
// pair of all 8 rows). K2, the pairs' count, is even (zero pairs pad A and B), so the two-set form
// needs no tail.
// ep_i16_cols_*: the 8 rows of one A block times one 8-column block of B, column by column: out + j * 8
// holds column j's 8 row sums, the layout of an output packed 8 rows to an element (elempack 8), so
// the sums go out as vectors instead of one strided float at a time.
#define EP_I16_KERNELS(NAME, TARGET, EP_DOT) \
template<int R> \
__attribute__((target(TARGET))) static void ep_i16_rows_##NAME(const short* a, const short* b, int K2, int* out) \
{ \
    __m256i acc[R], acc2[R]; \
    for (int r = 0; r < R; r++) \
        acc[r] = acc2[r] = _mm256_setzero_si256(); \
    for (int q = 0; q < K2; q += EP_U) \
    { \
        const __m256i bv = _mm256_loadu_si256((const __m256i*)(b + (size_t)q * 16)); \
        const __m256i bv2 = EP_U == 2 ? _mm256_loadu_si256((const __m256i*)(b + (size_t)(q + 1) * 16)) : bv; \
        for (int r = 0; r < R; r++) \
        { \
            int a2; \
            __builtin_memcpy(&a2, a + (size_t)q * 16 + r * 2, 4); \
            acc[r] = EP_DOT(acc[r], _mm256_set1_epi32(a2), bv); \
            if (EP_U == 2) \
            { \
                __builtin_memcpy(&a2, a + (size_t)(q + 1) * 16 + r * 2, 4); \
                acc2[r] = EP_DOT(acc2[r], _mm256_set1_epi32(a2), bv2); \
            } \
        } \
    } \
    for (int r = 0; r < R; r++) \
        _mm256_storeu_si256((__m256i*)(out + r * 8), _mm256_add_epi32(acc[r], acc2[r])); \
} \
__attribute__((target(TARGET))) static void ep_i16_cols_##NAME(const short* a, const short* b, int K2, int* out) \
{ \
    __m256i acc[8], acc2[8]; \
    for (int j = 0; j < 8; j++) \
        acc[j] = acc2[j] = _mm256_setzero_si256(); \
    for (int q = 0; q < K2; q += EP_U) \
    { \
        const __m256i av = _mm256_loadu_si256((const __m256i*)(a + (size_t)q * 16)); \
        const __m256i av2 = EP_U == 2 ? _mm256_loadu_si256((const __m256i*)(a + (size_t)(q + 1) * 16)) : av; \
        for (int j = 0; j < 8; j++) \
        { \
            int b2; \
            __builtin_memcpy(&b2, b + (size_t)q * 16 + j * 2, 4); \
            acc[j] = EP_DOT(acc[j], av, _mm256_set1_epi32(b2)); \
            if (EP_U == 2) \
            { \
                __builtin_memcpy(&b2, b + (size_t)(q + 1) * 16 + j * 2, 4); \
                acc2[j] = EP_DOT(acc2[j], av2, _mm256_set1_epi32(b2)); \
            } \
        } \
    } \
    for (int j = 0; j < 8; j++) \
        _mm256_storeu_si256((__m256i*)(out + j * 8), _mm256_add_epi32(acc[j], acc2[j])); \
}

#define EP_DOT_AVX2(acc, x, y) _mm256_add_epi32(acc, _mm256_madd_epi16(x, y))
#define EP_DOT_AVXVNNI(acc, x, y) _mm256_dpwssd_avx_epi32(acc, x, y)
#define EP_DOT_AVX512VNNI(acc, x, y) _mm256_dpwssd_epi32(acc, x, y)
#define EP_U 1
EP_I16_KERNELS(avx2, "avx2", EP_DOT_AVX2)
EP_I16_KERNELS(avxvnni, "avx2,avxvnni", EP_DOT_AVXVNNI)
#undef EP_U
#define EP_U 2
EP_I16_KERNELS(avx512vnni, "avx2,avx512f,avx512vl,avx512vnni", EP_DOT_AVX512VNNI)
#undef EP_U

// The same kernels over bytes: uint8 A times int8 B, four products a 32-bit lane (vpdpbusd, exact: no
// saturation). A block of 8 rows is [K4][8 rows][4] bytes, the byte offsets of [K2][8][2] int16, so the
// int16 kernels' addressing serves unchanged with K4 (an even count of quads) for K2.
#define EP_DOT_AVXVNNI_U8(acc, x, y) _mm256_dpbusd_avx_epi32(acc, x, y)
#define EP_DOT_AVX512VNNI_U8(acc, x, y) _mm256_dpbusd_epi32(acc, x, y)
#define EP_U 1
EP_I16_KERNELS(avxvnni_u8, "avx2,avxvnni", EP_DOT_AVXVNNI_U8)
#undef EP_U
#define EP_U 2
EP_I16_KERNELS(avx512vnni_u8, "avx2,avx512f,avx512vl,avx512vnni", EP_DOT_AVX512VNNI_U8)
#undef EP_U
// and with B the unsigned side (ep_u8 == 2): the kernels pass (A side, B side), vpdpbusd takes the unsigned first
#define EP_DOT_AVXVNNI_S8(acc, x, y) _mm256_dpbusd_avx_epi32(acc, y, x)
#define EP_DOT_AVX512VNNI_S8(acc, x, y) _mm256_dpbusd_epi32(acc, y, x)
#define EP_U 1
EP_I16_KERNELS(avxvnni_s8, "avx2,avxvnni", EP_DOT_AVXVNNI_S8)
#undef EP_U
#define EP_U 2
EP_I16_KERNELS(avx512vnni_s8, "avx2,avx512f,avx512vl,avx512vnni", EP_DOT_AVX512VNNI_S8)
#undef EP_U

// the kernels of one instruction set; Gemm_x86::ep_isa indexes these
typedef void (*ep_i16_fn)(const short* a, const short* b, int K2, int* out);
struct ep_i16_kernels
{
    const char* name;
    ep_i16_fn cols, rows8, rows4, rows1;
};
static const ep_i16_kernels ep_i16[3] = {
    {"AVX2", ep_i16_cols_avx2, ep_i16_rows_avx2<8>, ep_i16_rows_avx2<4>, ep_i16_rows_avx2<1>},
    {"AVX-VNNI", ep_i16_cols_avxvnni, ep_i16_rows_avxvnni<8>, ep_i16_rows_avxvnni<4>, ep_i16_rows_avxvnni<1>},
    {"AVX-512 VNNI", ep_i16_cols_avx512vnni, ep_i16_rows_avx512vnni<8>, ep_i16_rows_avx512vnni<4>, ep_i16_rows_avx512vnni<1>},
};
// byte quads, indexed [ep_u8 - 1][ep_isa]: uint8 A x int8 B, int8 A x uint8 B (none without VNNI:
// vpmaddubsw saturates its int16 pair sums)
static const ep_i16_kernels ep_u8k[2][3] = {
    {{"none", 0, 0, 0, 0},
     {"AVX-VNNI", ep_i16_cols_avxvnni_u8, ep_i16_rows_avxvnni_u8<8>, ep_i16_rows_avxvnni_u8<4>, ep_i16_rows_avxvnni_u8<1>},
     {"AVX-512 VNNI", ep_i16_cols_avx512vnni_u8, ep_i16_rows_avx512vnni_u8<8>, ep_i16_rows_avx512vnni_u8<4>, ep_i16_rows_avx512vnni_u8<1>}},
    {{"none", 0, 0, 0, 0},
     {"AVX-VNNI", ep_i16_cols_avxvnni_s8, ep_i16_rows_avxvnni_s8<8>, ep_i16_rows_avxvnni_s8<4>, ep_i16_rows_avxvnni_s8<1>},
     {"AVX-512 VNNI", ep_i16_cols_avx512vnni_s8, ep_i16_rows_avx512vnni_s8<8>, ep_i16_rows_avx512vnni_s8<4>, ep_i16_rows_avx512vnni_s8<1>}},
};

// One 8-column block of B kept as bytes (ep_wb) widened back to int16 pairs, less its shift: n bytes
// (a multiple of 16) from src to dst
__attribute__((target("avx2"))) static void ep_widen_b(const unsigned char* src, size_t n, int shift, short* dst)
{
    const __m256i s = _mm256_set1_epi16((short)shift);
    for (size_t i = 0; i < n; i += 16)
        _mm256_storeu_si256((__m256i*)(dst + i), _mm256_sub_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(src + i))), s));
}

// One 8-column block of B as int16 pairs (n values, least lo, greatest hi) to bytes, each value + shift (the
// block's least value taken to 0); 0 when the block spans more than 255
static int ep_narrow_b(const short* src, size_t n, int lo, int hi, unsigned char* dst, int* shift)
{
    if (hi - lo > 255)
        return 0;
    *shift = -lo;
    for (size_t i = 0; i < n; i++)
        dst[i] = (unsigned char)(src[i] - lo);
    return 1;
}

// 16 rows (two A blocks of 8) times one 8-column block of B on AVX-512 VNNI, column by column in 512-bit
// registers (twice the sums of an instruction of the 8-row kernels): out + j * 16 holds column j's 16
// row sums, rows 0-7 from block a0 and 8-15 from a1; two register sets, as above. DOT: vpdpwssd (int16
// pairs) or vpdpbusd (uint8 x int8 quads)
#define EP_COLS16(NAME, DOT) \
__attribute__((target("avx512f,avx512vnni"))) static void ep_cols16_##NAME(const short* a0, const short* a1, const short* b, int K2, int* out) \
{ \
    __m512i acc[8], acc2[8]; \
    for (int j = 0; j < 8; j++) \
        acc[j] = acc2[j] = _mm512_setzero_si512(); \
    for (int q = 0; q < K2; q += 2) \
    { \
        const __m512i av = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(a0 + (size_t)q * 16))), \
                                              _mm256_loadu_si256((const __m256i*)(a1 + (size_t)q * 16)), 1); \
        const __m512i av2 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(a0 + (size_t)(q + 1) * 16))), \
                                               _mm256_loadu_si256((const __m256i*)(a1 + (size_t)(q + 1) * 16)), 1); \
        for (int j = 0; j < 8; j++) \
        { \
            int b2; \
            __builtin_memcpy(&b2, b + (size_t)q * 16 + j * 2, 4); \
            acc[j] = DOT(acc[j], av, _mm512_set1_epi32(b2)); \
            __builtin_memcpy(&b2, b + (size_t)(q + 1) * 16 + j * 2, 4); \
            acc2[j] = DOT(acc2[j], av2, _mm512_set1_epi32(b2)); \
        } \
    } \
    for (int j = 0; j < 8; j++) \
        _mm512_storeu_si512((void*)(out + j * 16), _mm512_add_epi32(acc[j], acc2[j])); \
}
#define EP_DOT512_S8(acc, x, y) _mm512_dpbusd_epi32(acc, y, x)
EP_COLS16(i16, _mm512_dpwssd_epi32)
EP_COLS16(u8, _mm512_dpbusd_epi32)
EP_COLS16(s8, EP_DOT512_S8)

// Eight int32 sums as floats plus C (one per lane, or one for all: c_lanes null), to out: exact as in
// the scalar loop (each sum rounded once, then the one addition)
__attribute__((target("avx2"))) static void ep_store8(const int* sums, const float* c_lanes, float c_all, float* out)
{
    const __m256 c = c_lanes ? _mm256_loadu_ps(c_lanes) : _mm256_set1_ps(c_all);
    _mm256_storeu_ps(out, _mm256_add_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)sums)), c));
}

// One block of 8 rows of a packed A (elempack 8 or 16: row r's value k at base + k * stride + r) as int16
// pairs in the layout above, eight values at a time; 1 while every value is an integer in [-255, 255]
// (NaN fails every compare)
__attribute__((target("avx2"))) static int ep_a16_block_packed(const float* base, int stride, int K, short* dst)
{
    const __m256 lo = _mm256_set1_ps(-255.f), hi = _mm256_set1_ps(255.f);
    const __m256i low16 = _mm256_set1_epi32(0xffff);
    __m256 good = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    for (int k = 0; k < K; k += 2)
    {
        const __m256 v0 = _mm256_loadu_ps(base + (size_t)k * stride);
        const __m256 v1 = k + 1 < K ? _mm256_loadu_ps(base + (size_t)(k + 1) * stride) : _mm256_setzero_ps();
        const __m256i i0 = _mm256_cvttps_epi32(v0), i1 = _mm256_cvttps_epi32(v1);
        good = _mm256_and_ps(good, _mm256_and_ps(_mm256_cmp_ps(v0, lo, _CMP_GE_OQ), _mm256_cmp_ps(v0, hi, _CMP_LE_OQ)));
        good = _mm256_and_ps(good, _mm256_and_ps(_mm256_cmp_ps(v1, lo, _CMP_GE_OQ), _mm256_cmp_ps(v1, hi, _CMP_LE_OQ)));
        good = _mm256_and_ps(good, _mm256_cmp_ps(_mm256_cvtepi32_ps(i0), v0, _CMP_EQ_OQ));
        good = _mm256_and_ps(good, _mm256_cmp_ps(_mm256_cvtepi32_ps(i1), v1, _CMP_EQ_OQ));
        const __m256i pair = _mm256_or_si256(_mm256_and_si256(i0, low16), _mm256_slli_epi32(i1, 16));
        _mm256_storeu_si256((__m256i*)(dst + (size_t)(k / 2) * 16), pair);
    }
    return _mm256_movemask_ps(good) == 0xff;
}

// One block of 8 rows of a packed A (as above): 1 while every value is an integer in [-255, 255], and
// the block's least and greatest values folded into lo and hi
__attribute__((target("avx2"))) static int ep_a_range_packed(const float* base, int stride, int K, float* lo, float* hi)
{
    const __m256 l = _mm256_set1_ps(-255.f), h = _mm256_set1_ps(255.f);
    __m256 good = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
    __m256 vmin = _mm256_set1_ps(*lo), vmax = _mm256_set1_ps(*hi);
    for (int k = 0; k < K; k++)
    {
        const __m256 v = _mm256_loadu_ps(base + (size_t)k * stride);
        good = _mm256_and_ps(good, _mm256_and_ps(_mm256_cmp_ps(v, l, _CMP_GE_OQ), _mm256_cmp_ps(v, h, _CMP_LE_OQ)));
        good = _mm256_and_ps(good, _mm256_cmp_ps(_mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC), v, _CMP_EQ_OQ));
        vmin = _mm256_min_ps(vmin, v);
        vmax = _mm256_max_ps(vmax, v);
    }
    float t[8];
    _mm256_storeu_ps(t, vmin);
    for (int i = 0; i < 8; i++)
        *lo = std::min(*lo, t[i]);
    _mm256_storeu_ps(t, vmax);
    for (int i = 0; i < 8; i++)
        *hi = std::max(*hi, t[i]);
    return _mm256_movemask_ps(good) == 0xff;
}

// The block (checked by ep_a_range_packed: integers, value + off a byte, uint8 or int8) as byte quads,
// [K4][8][4]: four depths of a row one 32-bit lane (depths past K are 0: B's padding is 0 too); each
// row's sum of its values (unshifted) to rowsum[0..7]
__attribute__((target("avx2"))) static void ep_a8_block_packed(const float* base, int stride, int K, int K4, int off, unsigned char* dst,
                                                               int* rowsum)
{
    const __m256i o = _mm256_set1_epi32(off), byte = _mm256_set1_epi32(0xff);
    __m256i sum = _mm256_setzero_si256();
    for (int q = 0; q < K4; q++)
    {
        __m256i quad = _mm256_setzero_si256();
        for (int t = 0; t < 4; t++)
        {
            const int k = q * 4 + t;
            if (k >= K)
                break;
            const __m256i v = _mm256_cvttps_epi32(_mm256_loadu_ps(base + (size_t)k * stride));
            sum = _mm256_add_epi32(sum, v);
            quad = _mm256_or_si256(quad, _mm256_slli_epi32(_mm256_and_si256(_mm256_add_epi32(v, o), byte), 8 * t));
        }
        _mm256_storeu_si256((__m256i*)(dst + (size_t)q * 32), quad);
    }
    _mm256_storeu_si256((__m256i*)rowsum, sum);
}

// One 8-column block of B (the transposed B's rows nb * 8 .. nb * 8 + 7) as int16 pairs, [K2][8][2], into b
// (unless b is null), and its least and greatest value (the zero padding among them); 0 when a value is not
// an integer in [-255, 255] (float weights: at the first)
static int ep_pack_block(const Mat& B, int N, int K, int K2, int nb, short* b, int* lo, int* hi)
{
    int l = 0, h = 0;
    for (int j = 0; j < 8; j++)
    {
        const int n = nb * 8 + j;
        for (int k = 0; k < K2 * 2; k++)
        {
            const float v = n < N && k < K ? ep_b_value(B, (size_t)n * K + k) : 0.f;
            if (!(v >= -255.f && v <= 255.f) || v != (float)(int)v)
                return 0;
            l = std::min(l, (int)v);
            h = std::max(h, (int)v);
            if (b)
                b[(size_t)(k / 2) * 16 + j * 2 + k % 2] = (short)(int)v;
        }
    }
    *lo = l;
    *hi = h;
    return 1;
}

// One 8-column block of B as int16 pairs (p) to byte quads, [K4][8][4] (K4 an even count), each value + shift,
// and its 8 column sums (unshifted; the correction for A's shift)
static void ep_quads_block(const short* p, int K, int K4, int shift, unsigned char* q, int* colsum)
{
    memset(q, 0, (size_t)K4 * 32); // padding: 0 in either form (no share of A's shift)
    for (int j = 0; j < 8; j++)
    {
        int sum = 0;
        for (int k = 0; k < K; k++)
        {
            const int v = p[(size_t)(k / 2) * 16 + j * 2 + k % 2];
            q[(size_t)(k / 4) * 32 + j * 4 + k % 4] = (unsigned char)(v + shift);
            sum += v;
        }
        colsum[j] = sum;
    }
}

} // namespace

int Gemm_x86::ep_forward_int8(const std::vector<Mat>& bottom_blobs, std::vector<Mat>& top_blobs, const Option& opt) const
{
    const Mat& A = bottom_blobs[0];
    const int N = constantN;
    const int K = constantK;
    const int ep = A.elempack;
    const int M = (A.dims == 3 ? A.c : A.h) * ep;
    if (A.elembits() != 32 || A.w != K || M <= 0)
    {
        NCNN_LOGE("edgepack int8 gemm: input %d x %d (elembits %d), expected K %d", A.w, M, A.elembits(), K);
        return -1;
    }
    const size_t A_hstep = A.dims == 3 ? A.cstep : (size_t)A.w;
    const int K2 = (K + 3) / 4 * 2; // pairs, an even count (ep_b is packed the same way)
    const int NB = (N + 7) / 8;

    // row m of A: its values k * ep apart
    auto a_row = [&](int m) { return (const float*)A.data + (size_t)(m / ep) * ep * A_hstep + m % ep; };

    // A as int16 pairs, 8 rows a block ([K2][8][2] per block; pairs past K and rows past M are 0);
    // ok stays 1 while every value is an integer in [-255, 255]
    const int MB = (M + 7) / 8;
    const int KQ = ep_u8 ? (K + 7) / 8 * 2 : K2; // the kernels' steps: int16 pairs or uint8 quads, 32 bytes a block each
    Mat a16((size_t)KQ * 32, MB, (size_t)1u, opt.workspace_allocator);
    if (a16.empty())
        return -100;
    int ok = 1;
    // ep_u8: A + off is a byte (uint8 in [0, 255] for ep_u8 == 1, int8 in [-128, 127] for 2); the sums of
    // the shifted values are Sum (A + off)(B + bshift) = Sum AB + off Sum B + bshift Sum A + K off bshift, so
    // off times the column's sum of B (+ K off bshift) and bshift times the row's sum of A are taken back
    int off = 0;
    Mat rowsum; // ep_u8: A's row sums
    if (ep_u8)
    {
        rowsum.create(MB * 8, (size_t)4u, opt.workspace_allocator);
        if (rowsum.empty())
            return -100;
    }
    // per block of 8 rows, converted in parallel: whether its values are integers in [-255, 255], and
    // (ep_u8) its least and greatest
    std::vector<int> blk_ok(MB, 1);
    std::vector<float> blk_lo(MB, 255.f), blk_hi(MB, -255.f);
    if (ep_u8)
    {
        // A's range first (integers, at most 255 apart: what a quantiser's x - zero point gives), then
        // A + off as byte quads
        #pragma omp parallel for num_threads(opt.num_threads)
        for (int blk = 0; blk < MB; blk++)
        {
            float lo = 255.f, hi = -255.f;
            int good = 1;
            if (ep == 8 || ep == 16)
                good = ep_a_range_packed(a_row(blk * 8), ep, K, &lo, &hi);
            for (int r = 0; r < 8 && blk * 8 + r < M && good && ep != 8 && ep != 16; r++)
            {
                const float* p = a_row(blk * 8 + r);
                for (int k = 0; k < K; k++)
                {
                    const float v = p[(size_t)k * ep];
                    if (!(v >= -255.f && v <= 255.f) || v != (float)(int)v)
                    {
                        good = 0;
                        break;
                    }
                    lo = std::min(lo, v);
                    hi = std::max(hi, v);
                }
            }
            blk_ok[blk] = good;
            blk_lo[blk] = lo;
            blk_hi[blk] = hi;
        }
        float lo = 255.f, hi = -255.f;
        for (int blk = 0; blk < MB; blk++)
        {
            ok &= blk_ok[blk];
            lo = std::min(lo, blk_lo[blk]);
            hi = std::max(hi, blk_hi[blk]);
        }
        ok = ok && hi - lo <= 255.f;
        off = ok ? -(int)lo - (ep_u8 == 2 ? 128 : 0) : 0;
        #pragma omp parallel for num_threads(opt.num_threads)
        for (int blk = 0; blk < MB; blk++)
        {
            if (!ok)
                continue;
            unsigned char* dst = a16.row<unsigned char>(blk);
            if (ep == 8 || ep == 16)
            {
                ep_a8_block_packed(a_row(blk * 8), ep, K, KQ, off, dst, (int*)rowsum.data + blk * 8);
                continue;
            }
            memset(dst, 0, (size_t)KQ * 32);
            for (int r = 0; r < 8; r++)
            {
                int sum = 0;
                const float* p = a_row(blk * 8 + r);
                for (int k = 0; k < K && blk * 8 + r < M; k++)
                {
                    const int v = (int)p[(size_t)k * ep];
                    dst[(size_t)(k / 4) * 32 + r * 4 + k % 4] = (unsigned char)(v + off);
                    sum += v;
                }
                ((int*)rowsum.data)[blk * 8 + r] = sum;
            }
        }
    }
    else
    {
        #pragma omp parallel for num_threads(opt.num_threads)
        for (int blk = 0; blk < MB; blk++)
        {
            short* dst = (short*)a16.row<unsigned char>(blk);
            if (ep == 8 || ep == 16)
            {
                blk_ok[blk] = ep_a16_block_packed(a_row(blk * 8), ep, K, dst);
                memset(dst + (size_t)((K + 1) / 2) * 16, 0, (size_t)(K2 - (K + 1) / 2) * 32); // the padding pair
                continue;
            }
            memset(dst, 0, (size_t)K2 * 32);
            for (int r = 0; r < 8 && blk * 8 + r < M && blk_ok[blk]; r++)
            {
                const float* p = a_row(blk * 8 + r);
                for (int k = 0; k < K; k++)
                {
                    const float v = p[(size_t)k * ep];
                    if (!(v >= -255.f && v <= 255.f) || v != (float)(int)v)
                    {
                        blk_ok[blk] = 0;
                        break;
                    }
                    dst[(size_t)(k / 2) * 16 + r * 2 + k % 2] = (short)(int)v;
                }
            }
        }
        for (int blk = 0; blk < MB; blk++)
            ok &= blk_ok[blk];
    }
    if (!ok && ep_int8_trace())
        NCNN_LOGE("edgepack int8 gemm: input not integers in [-255, 255]%s, fp32 loop", ep_u8 ? " at most 255 apart" : "");

    int out_elempack = 1;
    if (opt.use_packing_layout)
    {
#if __AVX512F__
        out_elempack = M % 16 == 0 ? 16 : M % 8 == 0 ? 8 : M % 4 == 0 ? 4 : 1;
#else
        out_elempack = M % 8 == 0 ? 8 : M % 4 == 0 ? 4 : 1;
#endif
    }
    if (output_elempack)
        out_elempack = output_elempack;
    Mat& top_blob = top_blobs[0];
    if (output_N1M)
        top_blob.create(N, 1, M / out_elempack, 4u * out_elempack, out_elempack, opt.blob_allocator);
    else
        top_blob.create(N, M / out_elempack, 4u * out_elempack, out_elempack, opt.blob_allocator);
    if (top_blob.empty())
        return -100;
    const size_t top_hstep = top_blob.dims == 3 ? top_blob.cstep : (size_t)top_blob.w;
    const int oep = out_elempack;
    // a constant C (beta already applied by create_pipeline): a scalar, one per row or one per column
    const int c_type = constantC ? constant_broadcast_type_C : -1;
    const float* c_data = c_type == -1 ? 0 : (const float*)CT_data.data;

    const ep_i16_kernels& kernels = ep_u8 ? ep_u8k[ep_u8 - 1][ep_isa] : ep_i16[ep_isa];
    // B's value at depth k, column j of an 8-column block (the fp32 loop's; 0 past K)
    auto b_at = [&](const short* b, int k, int j) {
        if (ep_u8 == 2)
            return (float)((int)((const unsigned char*)b)[(size_t)(k / 4) * 32 + j * 4 + k % 4] - ep_bshift);
        return ep_u8 ? (float)((const signed char*)b)[(size_t)(k / 4) * 32 + j * 4 + k % 4] : (float)b[(size_t)(k / 2) * 16 + j * 2 + k % 2];
    };
    // ep_wb: each thread widens the block of B it works on into its own int16 scratch, read from there by
    // every row block (bytes come from memory, int16 pairs from cache)
    Mat b_wide;
    if (ep_wb)
    {
        b_wide.create(K2 * 32, opt.num_threads, (size_t)1u, opt.workspace_allocator);
        if (b_wide.empty())
            return -100;
    }
    #pragma omp parallel for num_threads(opt.num_threads)
    for (int nb = 0; nb < NB; nb++)
    {
        const short* b = (const short*)ep_b.row<const unsigned char>(nb);
        if (ep_wb)
        {
            short* w = (short*)b_wide.row<unsigned char>(get_omp_thread_num());
            ep_widen_b((const unsigned char*)b, (size_t)K2 * 16, ((const int*)ep_wshift.data)[nb], w);
            b = w;
        }
        const int cols = std::min(8, N - nb * 8);
        int acc[16 * 8];
        // ep_u8: the shifts' shares (above), in unsigned arithmetic: the terms may pass 2^31, the sum
        // they leave fits int32, and modulo 2^32 it comes out exact
        unsigned corr[8] = {0};
        if (ep_u8)
        {
            for (int j = 0; j < 8; j++)
                corr[j] = (unsigned)off * (unsigned)((const int*)ep_colsum.data)[nb * 8 + j]
                          + (unsigned)K * (unsigned)off * (unsigned)ep_bshift;
        }
        // sums + j * j_step + r * r_step for columns j < 8, rows m0 + r, r < rows: less the shifts' shares
        auto correct = [&](int* sums, int j_step, int r_step, int m0, int rows) {
            if (!ep_u8)
                return;
            for (int r = 0; r < rows; r++)
            {
                const unsigned row = (unsigned)ep_bshift * (unsigned)((const int*)rowsum.data)[m0 + r];
                for (int j = 0; j < 8; j++)
                {
                    int* p = sums + j * j_step + r * r_step;
                    *p = (int)((unsigned)*p - corr[j] - row);
                }
            }
        };
        // the 8 column sums of rows m..m+7 (column j's at sums + j * stride) into an output packed 8 or 16
        // rows to an element: each column's 8 row sums one vector store (half of a 16-row element's lanes)
        auto store_cols = [&](const int* sums, int stride, int m) {
            float* out = (float*)((unsigned char*)top_blob.data + (size_t)(m / oep) * top_hstep * top_blob.elemsize) + (size_t)nb * 8 * oep + m % oep;
            for (int j = 0; j < 8; j++)
                ep_store8(sums + j * stride, c_type == 1 || c_type == 2 ? c_data + m : 0,
                          c_type == 0 ? c_data[0] : c_type == 4 ? c_data[nb * 8 + j] : 0.f, out + j * oep);
        };
        for (int m0 = 0; m0 < M; m0 += 8)
        {
            const int rows = std::min(8, M - m0);
            if (ok && ep_isa == 2 && (oep == 8 || oep == 16) && m0 + 16 <= M && cols == 8)
            {
                // AVX-512 VNNI: two whole 8 x 8 blocks at once in 512-bit registers
                (ep_u8 == 1 ? ep_cols16_u8 : ep_u8 == 2 ? ep_cols16_s8 : ep_cols16_i16)(
                    (const short*)a16.row<const unsigned char>(m0 / 8), (const short*)a16.row<const unsigned char>(m0 / 8 + 1), b, KQ, acc);
                correct(acc, 16, 1, m0, 16);
                store_cols(acc, 16, m0);
                store_cols(acc + 8, 16, m0 + 8);
                m0 += 8; // (and 8 more by the loop: 16 rows done)
                continue;
            }
            if (ok && (oep == 8 || oep == 16) && rows == 8 && cols == 8)
            {
                // a whole 8 x 8 block, column by column
                kernels.cols((const short*)a16.row<const unsigned char>(m0 / 8), b, KQ, acc);
                correct(acc, 8, 1, m0, 8);
                store_cols(acc, 8, m0);
                continue;
            }
            if (ok)
            {
                const short* a = (const short*)a16.row<const unsigned char>(m0 / 8);
                int r = 0;
                for (; r + 8 <= rows; r += 8)
                    kernels.rows8(a + r * 2, b, KQ, acc + r * 8);
                for (; r + 4 <= rows; r += 4)
                    kernels.rows4(a + r * 2, b, KQ, acc + r * 8);
                for (; r < rows; r++)
                    kernels.rows1(a + r * 2, b, KQ, acc + r * 8);
                correct(acc, 1, 8, m0, rows);
            }
            for (int r = 0; r < rows; r++)
            {
                const int m = m0 + r;
                const float c_row = c_type == 0 ? c_data[0] : c_type == 1 || c_type == 2 ? c_data[m] : 0.f;
                const float* c_col = c_type == 4 ? c_data + nb * 8 : 0;
                float* out = (float*)((unsigned char*)top_blob.data + (size_t)(m / oep) * top_hstep * top_blob.elemsize) + m % oep;
                if (ok && oep == 1 && cols == 8)
                {
                    ep_store8(acc + r * 8, c_col, c_row, out + (size_t)nb * 8);
                    continue;
                }
                float s[8] = {0.f};
                if (ok)
                {
                    for (int j = 0; j < cols; j++)
                        s[j] = (float)acc[r * 8 + j]; // exact: the int32 sum, rounded once
                }
                else
                {
                    // not integers in range: fp32 sums over the same weights, depth by depth
                    const float* p = a_row(m);
                    for (int k = 0; k < K; k++)
                    {
                        const float av = p[(size_t)k * ep];
                        for (int j = 0; j < 8; j++)
                            s[j] += av * b_at(b, k, j);
                    }
                }
                for (int j = 0; j < cols; j++)
                    out[(size_t)(nb * 8 + j) * oep] = s[j] + (c_col ? c_col[j] : c_row);
            }
        }
    }
    return 0;
}
#endif // __AVX__
// ---- end edgepack ----

'''

_PACK_OLD = """    if (constantB)
    {
        const int N = constantN;
        const int K = constantK;

        int TILE_M, TILE_N, TILE_K;
        get_optimal_tile_mnk(0, N, K,"""
_PACK_NEW = """#if __AVX__
    // edgepack (int8_gemm_patch.py): a marked B packed for integer sums instead, when every value is an
    // integer in [-255, 255]; checked while packing (B's 8.4M fp16 values in ddddocr_old_int8; twice on VNNI
    // CPUs), each block of 8 rows stopping at its first value that is not (float weights: at once)
    const int ep_c = constantC ? constant_broadcast_type_C : -1;
    if (constantB && !constantA && transB && !transA && bottoms.size() == 1 && alpha == 1.f
            && (ep_c == -1 || ep_c == 0 || ep_c == 1 || ep_c == 2 || ep_c == 4)
            && !output_transpose && output_elemtype <= 1 && ep_mark == 1 && constantK >= 2 && constantK <= 32768
            && B_data.elemsize != 1u && cpu_support_x86_avx2())
    {
        const int N = constantN;
        const int K = constantK;
        const int K2 = (K + 3) / 4 * 2; // pairs, an even count (ep_b is packed the same way)
        const int NB = (N + 7) / 8;
        const int K4 = (K + 7) / 8 * 2; // byte quads, an even count
        ep_isa = cpu_support_x86_avx512_vnni() ? 2 : cpu_support_x86_avx_vnni() ? 1 : 0;
        // B goes to its packed form block by block, through an int16 scratch per thread, so the int16
        // packing of the whole B never exists beside B's own weights (ddddocr_old_int8's classifier: 16.8 MB
        // each). AVX2 without VNNI keeps bytes in the int16 pairs' order, each block shifted; VNNI CPUs keep
        // byte quads, int8 or uint8 and one shift, which B's range decides: found first, in a pass that copies nothing
        ep_wb = ep_isa == 0;
        Mat ep_bad(NB, (size_t)4u, (Allocator*)0);
        Mat ep_range(2, NB, (size_t)4u, (Allocator*)0);
        Mat scratch(K2 * 32, opt.num_threads, (size_t)1u, (Allocator*)0);
        if (ep_bad.empty() || ep_range.empty() || scratch.empty())
            return -100;
        int* bad = (int*)ep_bad.data;
        ep_int8 = 1;
        if (ep_isa > 0)
        {
            #pragma omp parallel for num_threads(opt.num_threads)
            for (int nb = 0; nb < NB; nb++)
                bad[nb] = !ep_pack_block(B_data, N, K, K2, nb, 0, ep_range.row<int>(nb), ep_range.row<int>(nb) + 1);
            int lo = 0, hi = 0;
            for (int nb = 0; nb < NB; nb++)
            {
                ep_int8 &= !bad[nb];
                lo = std::min(lo, ep_range.row<const int>(nb)[0]);
                hi = std::max(hi, ep_range.row<const int>(nb)[1]);
            }
            // int8 when every value fits, else uint8 of B + shift when B spans at most 255, else int16 pairs
            ep_u8 = lo >= -128 && hi <= 127 ? 1 : hi - lo <= 255 ? 2 : 0;
            ep_bshift = ep_u8 == 2 ? -lo : 0;
        }
        if (ep_int8)
        {
            ep_b.create(ep_wb ? K2 * 16 : ep_u8 ? K4 * 32 : K2 * 32, NB, (size_t)1u, (Allocator*)0);
            if (ep_wb)
                ep_wshift.create(NB, (size_t)4u, (Allocator*)0);
            if (ep_u8)
                ep_colsum.create(NB * 8, (size_t)4u, (Allocator*)0);
            if (ep_b.empty() || (ep_wb && ep_wshift.empty()) || (ep_u8 && ep_colsum.empty()))
                return -100;
            // On VNNI CPUs the range pass has checked every block, so none fails here: B's rows go back to the
            // system a run of 64 blocks at a time as they are packed (ep_release_b_rows, gemm_fp16_b_patch.py), and
            // B and its packed form are never both whole (ddddocr_old_int8: 16.8 MB of fp16 B beside 8.4 MB of
            // quads). Elsewhere a block may fail, and ncnn's fp32 Gemm then needs the whole of B.
            const int ep_run = ep_isa > 0 ? 64 : NB;
            uintptr_t ep_done = 0;
            for (int nb0 = 0; nb0 < NB; nb0 += ep_run)
            {
                const int nb1 = std::min(NB, nb0 + ep_run);
                #pragma omp parallel for num_threads(opt.num_threads)
                for (int nb = nb0; nb < nb1; nb++)
                {
                    const int direct = ep_isa > 0 && !ep_u8; // int16 pairs, kept as packed
                    short* b = (short*)(direct ? ep_b.row<unsigned char>(nb) : scratch.row<unsigned char>(get_omp_thread_num()));
                    int lo = 0, hi = 0;
                    int fail = !ep_pack_block(B_data, N, K, K2, nb, b, &lo, &hi);
                    // a block spanning more than 255 cannot be bytes: ncnn's fp32 Gemm takes the layer
                    if (ep_wb && !fail)
                        fail = !ep_narrow_b(b, (size_t)K2 * 16, lo, hi, ep_b.row<unsigned char>(nb), (int*)ep_wshift.data + nb);
                    if (ep_u8 && !fail)
                        ep_quads_block(b, K, K4, ep_bshift, ep_b.row<unsigned char>(nb), (int*)ep_colsum.data + nb * 8);
                    bad[nb] = fail;
                }
                if (ep_isa > 0)
                    ep_release_b_rows(B_data, K, std::min(N, nb1 * 8), ep_done);
            }
            for (int nb = 0; nb < NB; nb++)
                ep_int8 &= !bad[nb];
        }
        if (ep_int8)
        {
            B_data.release();
            if (ep_int8_trace())
                NCNN_LOGE("edgepack int8 gemm: %d x %d taken (%s, %s)", N, K,
                          ep_u8 == 1 ? "uint8 x int8" : ep_u8 == 2 ? "int8 x uint8" : ep_wb ? "int16 pairs, B as bytes"
                          : "int16 pairs", ep_i16[ep_isa].name);
        }
        else
        {
            ep_b.release();
            ep_wshift.release();
            ep_colsum.release();
            ep_wb = 0;
            ep_u8 = 0;
            ep_bshift = 0;
        }
    }
#endif // __AVX__

    if (constantB && !ep_int8)
    {
        const int N = constantN;
        const int K = constantK;

        int TILE_M, TILE_N, TILE_K;
        get_optimal_tile_mnk(0, N, K,"""

_FWD_OLD = """#if NCNN_INT8
    if (quantize_term)
    {
        // return Gemm::forward_int8(bottom_blobs, top_blobs, opt);
        return forward_int8(bottom_blobs, top_blobs, opt);
    }
#endif
"""
_FWD_NEW = _FWD_OLD + """
#if __AVX__
    if (ep_int8)
        return ep_forward_int8(bottom_blobs, top_blobs, opt);
#endif
"""

# the mark is a Gemm parameter: read with the others (src/layer/gemm.{h,cpp})
_GEMM_H_OLD = "    int output_transpose;\n"
_GEMM_H_NEW = _GEMM_H_OLD + "    int ep_mark; // edgepack (int8_gemm_patch.py): 28=1, an integer GEMM\n"
_GEMM_LOAD_OLD = "    output_transpose = pd.get(14, 0);\n"
_GEMM_LOAD_NEW = _GEMM_LOAD_OLD + f"    ep_mark = pd.get({MARK_KEY}, 0);\n"

_FILE_EDITS = (
    ("src/layer/gemm.h", (("Gemm's output_transpose", _GEMM_H_OLD, _GEMM_H_NEW, 1),)),
    ("src/layer/gemm.cpp", (("Gemm::load_param's output_transpose", _GEMM_LOAD_OLD, _GEMM_LOAD_NEW, 1),)),
    ("src/layer/x86/gemm_x86.h", (("Gemm_x86's members", _DECL_OLD, _DECL_NEW, 1),)),
    ("src/layer/x86/gemm_x86.cpp", (
        ("the kernel, before create_pipeline", _KERNEL_ANCHOR, _KERNEL + _KERNEL_ANCHOR + "    ep_int8 = 0;\n    ep_isa = 0;\n    ep_u8 = 0;\n    ep_bshift = 0;\n    ep_wb = 0;\n", 1),
        ("the fp32 packing of a constant B", _PACK_OLD, _PACK_NEW, 1),
        ("forward's quantised branch", _FWD_OLD, _FWD_NEW, 1),
    )),
)

INT8_GEMM_PATCH_KEY = file_edits_key(INT8_GEMM_PATCH_VERSION, _FILE_EDITS)


def patch_int8_gemm(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place (x86 builds, after fp16_weights_patch.py,
    whose B may still be fp16 here)."""
    apply_file_edits(src, _FILE_EDITS, "int8_gemm_patch.py")


def mark_integer_gemms(param_text: str) -> tuple[str, int]:
    """The .param text with every Gemm of constant B marked as an integer GEMM (for graphs with lowered
    dynamic quantisation), and how many were marked. The library still checks B and each run's A."""
    out, marked = [], 0
    for line in param_text.splitlines():
        t = line.split()
        if len(t) > 4 and t[0] == "Gemm" and t[2].isdigit() and t[3].isdigit():
            head = 4 + int(t[2]) + int(t[3])
            fields = dict(kv.split("=", 1) for kv in t[head:] if "=" in kv and not kv.startswith("-"))
            if fields.get("5") == "1":
                rest = [kv for kv in t[head:] if not kv.startswith(f"{MARK_KEY}=")]
                line = " ".join(t[:head] + rest + [f"{MARK_KEY}=1"])
                marked += 1
        out.append(line)
    return "\n".join(out) + "\n", marked
