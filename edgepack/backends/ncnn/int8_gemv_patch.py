"""A dynamically quantised vector times integer weights in byte quads (src/layer/x86/innerproduct_x86.{h,cpp}).

A quantised LSTM multiplies H, quantised at every step, by its recurrent weights: edgepack lowers that
to an InnerProduct of the centred integers (EpDynQuant's first top, dynamic_quant_fold.py) by the
integer weights (quantized_lstm.py), which ncnn ran as its fp16-storage gemv: ddddocr_old_int8's 40
steps read a 2 MB fp16 kernel each (the size of the core's L2), 18% of the model's time after the fold.

An InnerProduct the fold marks with ``28=1`` (its input a one-row Reshape of an EpDynQuant's centred
tensor) is taken here, in ncnn's AVX-512 build, when the CPU has AVX-512 VNNI, the layer has no bias,
activation or int8 scales of ncnn's own, its output count is a multiple of 16 and every weight is an
integer in [-128, 127]. The weights are then packed once as int8 quads ([N/16][K/4][16][4], 1 MB for
a 2048 x 512 step: half the fp16 kernel) with their per-output sums after them, and shared between
layers with the same weights through shared_weights_patch.py's table (kind 12). Each run shifts the
input by off = -min(x) into [0, 255] (a quantiser's centred values span 255 at most) and sums with
vpdpbusd, four uint8 x int8 products a lane, exact; off times each output's weight sum is taken back,
and the int32 sum is rounded once to float: the fp32/fp16 kernels' result wherever their partial sums
stay below 2^24 (at most 255 x 128 x K: K up to 513), so the same bits. A run whose input is not
integers spanning 255 or less takes a scalar float loop over the same weights (right, slow, not
expected). Other CPUs and unmarked layers run ncnn's kernels as before.
Only x86 builds carry this edit, so only their cache key has INT8_GEMV_PATCH_KEY.
"""
from __future__ import annotations

from pathlib import Path

from .param_graph import Graph, join_param, split_param
from .source_patch import apply_file_edits, file_edits_key

INT8_GEMV_PATCH_VERSION = 2  # 2: weights checked only where no shared kernel has them (start-up)
MARK_KEY = 28   # InnerProduct param key the fold writes (ncnn's InnerProduct reads 0-18; the Layer base 30-31)

_H_OLD = "    virtual int load_model(const ModelBin& mb);\n"
_H_NEW = """    virtual int load_param(const ParamDict& pd);
    virtual int load_model(const ModelBin& mb);
"""
_H_MEMBERS_OLD = "public:\n    Layer* flatten;\n"
_H_MEMBERS_NEW = """public:
    // edgepack (int8_gemv_patch.py): integer weights as int8 quads for a centred integer input
    int ep_mark;  // 28: the fold says the input is a quantiser's centred integers
    Mat ep_w8;    // [N/16][K4][16][4] int8, then N int32 weight sums; empty: ncnn's kernels
    bool ep_take_i8(const Option& opt);
    int ep_forward_i8(const Mat& bottom_blob, Mat& top_blob, const Option& opt) const;

""" + _H_MEMBERS_OLD

_CTOR_OLD = "    flatten = 0;\n}\n\n"
_CTOR_NEW = "    flatten = 0;\n    ep_mark = 0;\n}\n\n"

_CODE_ANCHOR = "int InnerProduct_x86::create_pipeline(const Option& opt)\n{\n"
_CODE = r'''// ---- edgepack (int8_gemv_patch.py) ----
int InnerProduct_x86::load_param(const ParamDict& pd)
{
    ep_mark = pd.get(28, 0);
    return InnerProduct::load_param(pd);
}

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

bool InnerProduct_x86::ep_take_i8(const Option& opt)
{
    if (!cpu_support_x86_avx512_vnni() || bias_term || activation_type || int8_scale_term || num_output % 16)
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
        NCNN_LOGE("edgepack int8 gemv: %d x %d taken (AVX-512 VNNI)", num_output, num_input);
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
    Mat a;
    a.create(K4, (size_t)4u, opt.workspace_allocator);
    if (a.empty())
        return -100;
    unsigned char* ab = (unsigned char*)a.data;
    for (int k = 0; k < K4 * 4; k++)
        ab[k] = k < num_input ? (unsigned char)((int)x[k] + off) : 0;
    const int blocks = num_output / 16;
    #pragma omp parallel for num_threads(opt.num_threads)
    for (int b = 0; b < blocks; b++)
        ep_gemv_block((const int*)ab, w8 + (size_t)b * K4 * 64, wsum + b * 16, off, K4, out + b * 16);
    return 0;
}
#endif // __AVX512F__

'''

_PIPE_OLD = "#if NCNN_INT8\n    if (opt.use_int8_inference && weight_data.elemsize == (size_t)1u)\n"
_PIPE_NEW = """#if __AVX512F__
    if (ep_mark && ep_take_i8(opt))
        return 0;
#endif

""" + _PIPE_OLD

_FWD_OLD = "int InnerProduct_x86::forward(const Mat& bottom_blob, Mat& top_blob, const Option& opt) const\n{\n"
_FWD_NEW = _FWD_OLD + """#if __AVX512F__
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
