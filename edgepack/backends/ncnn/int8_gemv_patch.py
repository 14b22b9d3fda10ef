"""A dynamically quantised vector times integer weights in byte quads (src/layer/x86/innerproduct_x86.{h,cpp}).

A quantised LSTM multiplies H, quantised at every step, by its recurrent weights: edgepack lowers that
to an InnerProduct of the centred integers (EpDynQuant's first top, dynamic_quant_fold.py) by the
integer weights (quantized_lstm.py), which ncnn ran as its fp16-storage gemv: ddddocr_old_int8's 40
steps read a 2 MB fp16 kernel each (the size of the core's L2), 18% of the model's time after the fold.

An InnerProduct the fold marks with ``28=1`` (its input a one-row Reshape of an EpDynQuant's centred
tensor) is taken here when the layer has no bias, activation or int8 scales of ncnn's own, its output
count is a multiple of 16, every weight is an integer in [-128, 127] and the CPU has AVX-512 VNNI (in
ncnn's AVX-512 build) or AVX2 (in its AVX builds: AVX-512, FMA, AVX; version 3). The weights are then
packed once as int8 quads ([N/16][K/4][16][4], 1 MB for a 2048 x 512 step: half the fp16 kernel) with
their per-output sums after them, and shared between layers with the same weights through
shared_weights_patch.py's table (kind 12). Each run shifts the input by off = -min(x) into [0, 255] (a
quantiser's centred values span 255 at most). With VNNI it sums with vpdpbusd, four uint8 x int8
products a lane, exact; without, each 16 weight bytes (4 outputs x 4 depths) are widened to int16
(vpmovsxbw) and multiplied by the input quad as int16 pairs (vpmaddwd, exact: a pair sums to 65280 at
most), two partial sums an output, added at the end: the same int32 sums either way. off times each
output's weight sum is taken back, and the int32 sum is rounded once to float: the fp32/fp16 kernels'
result wherever their partial sums stay below 2^24 (at most 255 x 128 x K: K up to 513), so the same
bits. On an AVX2 EPYC (Zen 3, 512 KB of L2) ncnn's fp16 gemv had been 20% of ddddocr_old_int8's time.
A run whose input is not integers spanning 255 or less takes a scalar float loop over the same weights
(right, slow, not expected). Other CPUs and unmarked layers run ncnn's kernels as before.
Only x86 builds carry this edit, so only their cache key has INT8_GEMV_PATCH_KEY.
"""
from __future__ import annotations

from pathlib import Path

from .param_graph import Graph, join_param, split_param
from .source_patch import apply_file_edits, file_edits_key

INT8_GEMV_PATCH_VERSION = 3  # 2: weights checked only where no shared kernel has them (start-up); 3: AVX2 CPUs too
MARK_KEY = 28   # InnerProduct param key the fold writes (ncnn's InnerProduct reads 0-18; the Layer base 30-31)

_H_OLD = "    virtual int load_model(const ModelBin& mb);\n"
_H_NEW = """    virtual int load_param(const ParamDict& pd);
    virtual int load_model(const ModelBin& mb);
"""
_H_MEMBERS_OLD = "public:\n    Layer* flatten;\n"
_H_MEMBERS_NEW = """public:
    // edgepack (int8_gemv_patch.py): integer weights as int8 quads for a centred integer input
    int ep_mark;  // 28: the fold says the input is a quantiser's centred integers
    int ep_isa;   // 2: AVX-512 VNNI (uint8 quads, vpdpbusd), 1: AVX2 (int16 quads, vpmaddwd)
    Mat ep_w8;    // [N/16][K4][16][4] int8, then N int32 weight sums; empty: ncnn's kernels
    bool ep_take_i8(const Option& opt);
    int ep_forward_i8(const Mat& bottom_blob, Mat& top_blob, const Option& opt) const;

""" + _H_MEMBERS_OLD

_CTOR_OLD = "    flatten = 0;\n}\n\n"
_CTOR_NEW = "    flatten = 0;\n    ep_mark = 0;\n    ep_isa = 0;\n}\n\n"

_CODE_ANCHOR = "int InnerProduct_x86::create_pipeline(const Option& opt)\n{\n"
_CODE = r'''// ---- edgepack (int8_gemv_patch.py) ----
int InnerProduct_x86::load_param(const ParamDict& pd)
{
    ep_mark = pd.get(28, 0);
    return InnerProduct::load_param(pd);
}

#if __AVX__
#if __AVX512F__
// one block of 16 outputs: int32 sums of uint8 quads of a (K4 of them) by the block's int8 quads,
// less off times each output's weight sum, rounded once to float
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static void ep_gemv_block(const int* a, const signed char* w,
                                                                                  const int* wsum, int off, int K4, float* out)
{
    __m512i s0 = _mm512_setzero_si512();
    __m512i s1 = _mm512_setzero_si512();
    __m512i s2 = _mm512_setzero_si512();
    __m512i s3 = _mm512_setzero_si512();
    int k = 0;
    for (; k + 3 < K4; k += 4)
    {
        s0 = _mm512_dpbusd_epi32(s0, _mm512_set1_epi32(a[k]), _mm512_loadu_si512(w));
        s1 = _mm512_dpbusd_epi32(s1, _mm512_set1_epi32(a[k + 1]), _mm512_loadu_si512(w + 64));
        s2 = _mm512_dpbusd_epi32(s2, _mm512_set1_epi32(a[k + 2]), _mm512_loadu_si512(w + 128));
        s3 = _mm512_dpbusd_epi32(s3, _mm512_set1_epi32(a[k + 3]), _mm512_loadu_si512(w + 192));
        w += 256;
    }
    for (; k < K4; k++)
    {
        s0 = _mm512_dpbusd_epi32(s0, _mm512_set1_epi32(a[k]), _mm512_loadu_si512(w));
        w += 64;
    }
    __m512i s = _mm512_add_epi32(_mm512_add_epi32(s0, s1), _mm512_add_epi32(s2, s3));
    s = _mm512_sub_epi32(s, _mm512_mullo_epi32(_mm512_set1_epi32(off), _mm512_loadu_si512(wsum)));
    _mm512_storeu_ps(out, _mm512_cvtepi32_ps(s));
}
#endif // __AVX512F__

// the same block without VNNI: a holds K4 quads of int16 (the centred input + off, in [0, 255]); each
// 16 bytes of w (4 outputs x 4 depths) widened to int16 and multiplied pairwise by the quad broadcast to
// every 64 bits: lanes 2i and 2i+1 of sum j hold output 4j+i's two halves (exact int32 sums)
__attribute__((target("avx2"))) static void ep_gemv_block_avx2(const short* a, const signed char* w,
                                                               const int* wsum, int off, int K4, float* out)
{
    __m256i s0 = _mm256_setzero_si256();
    __m256i s1 = _mm256_setzero_si256();
    __m256i s2 = _mm256_setzero_si256();
    __m256i s3 = _mm256_setzero_si256();
    for (int k = 0; k < K4; k++)
    {
        long long quad;
        memcpy(&quad, a + (size_t)k * 4, sizeof(quad));
        const __m256i x = _mm256_set1_epi64x(quad);
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)w)), x));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + 16))), x));
        s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + 32))), x));
        s3 = _mm256_add_epi32(s3, _mm256_madd_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(w + 48))), x));
        w += 64;
    }
    int t[32];
    _mm256_storeu_si256((__m256i*)t, s0);
    _mm256_storeu_si256((__m256i*)(t + 8), s1);
    _mm256_storeu_si256((__m256i*)(t + 16), s2);
    _mm256_storeu_si256((__m256i*)(t + 24), s3);
    for (int o = 0; o < 16; o++)
        out[o] = (float)(t[2 * o] + t[2 * o + 1] - off * wsum[o]);
}

bool InnerProduct_x86::ep_take_i8(const Option& opt)
{
#if __AVX512F__
    const int isa = cpu_support_x86_avx512_vnni() ? 2 : cpu_support_x86_avx2() ? 1 : 0;
#else
    const int isa = cpu_support_x86_avx2() ? 1 : 0;
#endif
    if (!isa || bias_term || activation_type || int8_scale_term || num_output % 16)
        return false;
    const int num_input = weight_data_size / num_output;
    if (num_input <= 0 || num_input > 65536 || (weight_data.elemsize != 2u && weight_data.elemsize != 4u))
        return false;
    const int K4 = (num_input + 3) / 4;
    const size_t bytes = (size_t)K4 * 64 * (num_output / 16);
    // a shared kernel was packed from these weights, which passed the check: each distinct weight is
    // checked and packed once (38 LSTM steps checking 1M weights each took 120 ms of start-up)
    const EpKernelKey key = ep_kernel_key(weight_data, num_output, 12);
    if (!ep_take_shared(key, ep_w8))
    {
        const size_t n = (size_t)num_input * num_output;
        for (size_t i = 0; i < n; i++)
        {
            const float v = weight_data.elemsize == 2u ? float16_to_float32(((const unsigned short*)weight_data.data)[i]) : ((const float*)weight_data.data)[i];
            if (!(v >= -128.f && v <= 127.f) || v != (float)(int)v)
                return false;
        }
        Mat packed;
        packed.create((int)(bytes + (size_t)num_output * 4), (size_t)1u); // the default allocator: shareable
        if (packed.empty())
            return false;
        signed char* dst = (signed char*)packed.data;
        int* wsum = (int*)(dst + bytes);
        for (int o = 0; o < num_output; o++)
        {
            int sum = 0;
            for (int k = 0; k < K4 * 4; k++)
            {
                int v = 0;
                if (k < num_input)
                {
                    const size_t i = (size_t)o * num_input + k;
                    v = (int)(weight_data.elemsize == 2u ? float16_to_float32(((const unsigned short*)weight_data.data)[i]) : ((const float*)weight_data.data)[i]);
                }
                dst[((size_t)(o / 16) * K4 + k / 4) * 64 + (o % 16) * 4 + k % 4] = (signed char)v;
                sum += v;
            }
            wsum[o] = sum;
        }
        ep_w8 = packed;
        ep_share(key, ep_w8);
    }
    const char* t = getenv("EDGEPACK_NCNN_TRACE");
    if (t && t[0] == '1')
        NCNN_LOGE("edgepack int8 gemv: %d x %d taken (%s)", num_output, num_input, isa == 2 ? "AVX-512 VNNI" : "AVX2");
    ep_isa = isa;
    if (opt.lightmode)
        weight_data.release();
    return true;
}

int InnerProduct_x86::ep_forward_i8(const Mat& bottom_blob, Mat& top_blob, const Option& opt) const
{
    const int num_input = weight_data_size / num_output;
    if (bottom_blob.dims != 1 || bottom_blob.w * bottom_blob.elempack != num_input || bottom_blob.elembits() != 32)
        return -1; // the fold marks only layers fed a one-row Reshape
    const int out_elempack = opt.use_packing_layout ? 16 : 1;
    top_blob.create(num_output / out_elempack, (size_t)4u * out_elempack, out_elempack, opt.blob_allocator);
    if (top_blob.empty())
        return -100;
    const float* x = bottom_blob;
    float lo = x[0], hi = x[0];
    bool integers = true;
    for (int k = 0; k < num_input; k++)
    {
        lo = x[k] < lo ? x[k] : lo;
        hi = x[k] > hi ? x[k] : hi;
        // (the range first: no int conversion of a NaN or of a float past int's)
        if (!(x[k] >= -65536.f && x[k] <= 65536.f) || x[k] != (float)(int)x[k])
            integers = false;
    }
    const int K4 = (num_input + 3) / 4;
    const signed char* w8 = (const signed char*)ep_w8.data;
    const int* wsum = (const int*)(w8 + (size_t)K4 * 64 * (num_output / 16));
    float* out = top_blob;
    if (!integers || hi - lo > 255.f)
    {
        // not a quantiser's centred integers: float sums over the same weights
        for (int o = 0; o < num_output; o++)
        {
            float s = 0.f;
            for (int k = 0; k < num_input; k++)
                s += x[k] * (float)w8[((size_t)(o / 16) * K4 + k / 4) * 64 + (o % 16) * 4 + k % 4];
            out[o] = s;
        }
        return 0;
    }
    const int off = -(int)lo;
    const int blocks = num_output / 16;
    Mat a;
    a.create(K4, (size_t)8u, opt.workspace_allocator); // room for int16 quads
    if (a.empty())
        return -100;
#if __AVX512F__
    if (ep_isa == 2)
    {
        unsigned char* ab = (unsigned char*)a.data;
        for (int k = 0; k < K4 * 4; k++)
            ab[k] = k < num_input ? (unsigned char)((int)x[k] + off) : 0;
        #pragma omp parallel for num_threads(opt.num_threads)
        for (int b = 0; b < blocks; b++)
            ep_gemv_block((const int*)ab, w8 + (size_t)b * K4 * 64, wsum + b * 16, off, K4, out + b * 16);
        return 0;
    }
#endif
    short* as = (short*)a.data;
    for (int k = 0; k < K4 * 4; k++)
        as[k] = k < num_input ? (short)((int)x[k] + off) : 0;
    #pragma omp parallel for num_threads(opt.num_threads)
    for (int b = 0; b < blocks; b++)
        ep_gemv_block_avx2(as, w8 + (size_t)b * K4 * 64, wsum + b * 16, off, K4, out + b * 16);
    return 0;
}
#endif // __AVX__

'''

_PIPE_OLD = "#if NCNN_INT8\n    if (opt.use_int8_inference && weight_data.elemsize == (size_t)1u)\n"
_PIPE_NEW = """#if __AVX__
    if (ep_mark && ep_take_i8(opt))
        return 0;
#endif

""" + _PIPE_OLD

_FWD_OLD = "int InnerProduct_x86::forward(const Mat& bottom_blob, Mat& top_blob, const Option& opt) const\n{\n"
_FWD_NEW = _FWD_OLD + """#if __AVX__
    if (!ep_w8.empty())
        return ep_forward_i8(bottom_blob, top_blob, opt);
#endif

"""

_FILE_EDITS = (
    ("src/layer/x86/innerproduct_x86.h", (("load_param", _H_OLD, _H_NEW, 1),
                                          ("the members", _H_MEMBERS_OLD, _H_MEMBERS_NEW, 1))),
    ("src/layer/x86/innerproduct_x86.cpp", (("the constructor", _CTOR_OLD, _CTOR_NEW, 1),
                                            ("the kernel", _CODE_ANCHOR, _CODE + _CODE_ANCHOR, 1),
                                            ("create_pipeline", _PIPE_OLD, _PIPE_NEW, 1),
                                            ("forward", _FWD_OLD, _FWD_NEW, 1))),
)

INT8_GEMV_PATCH_KEY = file_edits_key(INT8_GEMV_PATCH_VERSION, _FILE_EDITS)


def patch_int8_gemv(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place (x86 builds; after
    shared_weights_patch and fp16_weights_patch, whose table and load it uses)."""
    apply_file_edits(src, _FILE_EDITS, "int8_gemv_patch.py")


def mark_integer_gemvs(param_text: str) -> tuple[str, int]:
    """The .param with every InnerProduct fed a one-row Reshape (0=K only) of an EpDynQuant's centred
    top marked 28=1, and how many were marked. The library still checks the weights and each input."""
    parsed = split_param(param_text)
    if parsed is None:
        return param_text, 0
    magic, layers = parsed
    g = Graph(layers)
    producer = {t: layers[i] for t, i in g.producer.items()}
    value = g.value
    centred = {layer.tops[0] for layer in layers if layer.type == "EpDynQuant"}
    marked = 0
    for layer in layers:
        if layer.type != "InnerProduct" or not layer.one_to_one():
            continue
        r = producer.get(value(layer.bottoms[0]))
        if r is None or r.type != "Reshape" or not r.one_to_one() or set(r.fields) != {"0"} or \
                value(r.bottoms[0]) not in centred:
            continue
        layer.fields[str(MARK_KEY)] = "1"
        layer.text = layer.render()
        marked += 1
    if not marked:
        return param_text, 0
    return join_param(magic, layers), marked
