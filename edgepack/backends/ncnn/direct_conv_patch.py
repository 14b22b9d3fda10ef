"""A direct kernel for ncnn's x86 1x1 and 2x2 convolutions and its 3x3 ones with few input channels
(src/layer/x86/convolution_x86.cpp, convolution_x86.h, convolution_x86_fma.cpp), for AVX-512 CPUs and
for CPUs with FMA and F16C (AVX2 class: Haswell and later, Zen, Gracemont).

ncnn runs a 3x3 stride-1 layer with more than 8 channels on either side as Winograd, a stride-2 one
and every 1x1 as a GEMM (im2col first for the 3x3). Both pay off where K = input channels x 9 is
large and the product big. Real detectors and classifiers are full of layers where it is not: on one
core of the AVX-512 Xeon (FMA peak ~200 GFLOP/s), ddddocr_det's 12 -> 24 layer at 208 x 208 ran at
36-47 GFLOP/s (Winograd's input and output transforms), its 24 -> 48 stride-2 layer at 50-62
(im2col), its 48 -> 24 1x1 layers at 104 x 104 at 35, and the 1x1 layers of four corpus CNNs at
55-130 (the GEMM packs both operands first); onnxruntime's direct NCHWc kernels reach ~160.

The kernel computes two registers of output channels x a row of output pixels at a time: on AVX-512
32 channels x 12 pixels, for every (input channel, ky, kx) two weight vectors and 12 broadcast input
values, 24 FMAs from 14 loads; with 8 lanes 16 channels x 6 pixels, 12 FMAs from 8 loads (16
registers). The weights of a block ([input channel x k x k][block], zero-padded past the layer's
channels) are read in order. It reads the input in whatever packing ncnn gave it (1, 4, 8 or 16
channels per pixel) and writes 8- or 16-channel packing, so the layers around it are unchanged.
Threads take runs of output rows (3x3), or of pixels (unpadded 1x1, walked 96 pixels at a time),
like the rest of thread_split_patch.py's layers.

A layer with a zero border is bordered row by row in a per-thread scratch (`ep_c3_forward_padded`)
rather than copied whole with its border first; the sums are the same.

`--memory lean` (memory.py) marks the layers it wants with ncnn's no-Winograd feature bit; the kernel
then takes every one it can run, whatever the break-even, and keeps their weights as fp16 when each
converts exactly (pnnx stores fp16 unless a build asks for fp32), for half the bytes.
Version 8 keeps fp16 weights in `fast` too, at the fp16 rung (`use_fp16_storage`), on layers of 64K weights
(256 KiB in fp32) and more: the deep layers, on small maps, where the weights are most of the layer's bytes and
the widening costs least (`EDGEPACK_NCNN_OPTIONS=direct=3` keeps fp32 weights there, to measure it). fp16 weights
are widened a block of output channels at a time into a per-thread buffer that every pixel block of the span
reads; widened in the kernel, once every V::pixels pixels, they cost YOLO11s-seg 7% on 1 thread.

Taken otherwise where `ep_c3_wanted` says: fp32 with packing, output channels a multiple of 8, and
- 3x3, dilation 1: stride 1 below 16 input channels, stride 2 up to 96 (per-layer break-even
  measured on ddddocr_det and nudenet_320n: at stride 1 Winograd ties at 16 and wins at 32 and 64; at
  stride 2 the direct kernel wins up to 96, loses at 128 and 192);
- 1x1, stride 1, up to 768 input and 512 output channels: it won on all 96 such layers of
  ddddocr_det, nudenet_320n, orientation and ppocr_v4_det (ties on two tiny ones); larger layers
  were not measured on AVX-512. The 8-lane kernel, measured layer by layer on an AVX2 EPYC
  (`bench/bench_direct_conv.py`, `EDGEPACK_NCNN_OPTIONS=direct=0` against `direct=2`): 0.80-0.99x of
  ncnn's time up to 768 input and 1536 output channels (384 -> 768 at 3 x 80: 0.90x), 1.05-1.09x
  from 1024 input channels; so on AVX2 CPUs it takes 1x1 layers up to 768 -> 1536;
- 2x2, stride 1, up to 64 input channels: PP-HGNet's stem (PP-OCRv6), padded right and bottom, which
  ncnn runs with its generic packed kernel (no Winograd or GEMM for 2x2 there). On PP-OCRv6 tiny det
  (16 -> 8 and 8 -> 16 at 160 x 160) its 11.7% of the time in that kernel went, and the model ran
  5-9% faster on 1 thread (alternating runs, same session).
The kernel sums each output over (input channel, ky, kx) in fp32 in that order, one fused
multiply-add each: not bit-identical to Winograd or GEMM, so the build verifies against onnxruntime
as for any kernel (and tests/test_ncnn_direct_conv.py checks the order bit for bit, on both widths).

ncnn compiles convolution_x86.cpp once per ISA and picks a build by CPUID: AVX-512, AVX (for AVX and
AVX2 CPUs, compiled with -mavx only, calling FMA helpers compiled apart in convolution_x86_fma.cpp
where the CPU has FMA) or SSE2. The AVX-512 build holds the 16-lane kernel; the 8-lane one lives in
convolution_x86_fma.cpp, and the AVX build of the layer calls it where the CPU has FMA and F16C. SSE
CPUs and AVX CPUs without FMA (Sandy Bridge) run ncnn's kernels. The break-even is the one measured
on AVX-512, but for the wider 1x1 limit above on AVX2 CPUs. `EDGEPACK_NCNN_OPTIONS=direct=0|2`
(isa_cap_patch.py) turns the kernel off or onto every layer it can run, to measure it.

Applied as exact text edits that must each match, like source_patch.py. Only x86 builds compile
these files, so only their cache key carries DIRECT_CONV_PATCH_KEY.
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

DIRECT_CONV_PATCH_VERSION = 8  # 8: fp16 weights on large layers at the fp16 rung; part of the x86 libncnn cache key (library.py)

CONV_FILE = "src/layer/x86/convolution_x86.cpp"
CONV_HEADER = "src/layer/x86/convolution_x86.h"
FMA_FILE = "src/layer/x86/convolution_x86_fma.cpp"

# The kernel for one register width. ep_c3_isa (in an anonymous namespace: each file that compiles the
# kernel gets its own, so the AVX-512 and the FMA copies can never be merged by the linker) says how
# wide a register is and how many output pixels a step computes:
# - AVX-512: 16 lanes, blocks of 32 output channels (2 registers) x 12 pixels: 24 accumulators, 2
#   weights and 1 broadcast of the 32 registers;
# - FMA (AVX2-class CPUs): 8 lanes, blocks of 16 output channels x 6 pixels: 12 + 2 + 1 of the 16.
_BODY = r'''
namespace {

#if __AVX512F__
struct ep_c3_isa
{
    typedef __m512 v;
    enum { lanes = 16, pixels = 12, mid_pixels = 4 };
    static inline v load(const float* p) { return _mm512_loadu_ps(p); }
    static inline v load(const unsigned short* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
    static inline v set1(float x) { return _mm512_set1_ps(x); }
    static inline v fmadd(v a, v b, v c) { return _mm512_fmadd_ps(a, b, c); }
    static inline void store(float* p, v a) { _mm512_storeu_ps(p, a); }
    static inline void store(unsigned short* p, v a) { _mm256_storeu_si256((__m256i*)p, _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }
    static inline bool fp16_exact(v a) { return _mm512_cmp_ps_mask(_mm512_cvtph_ps(_mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)), a, _CMP_EQ_OQ) == 0xffff; }
    // the two halves of a register, for an output packed 8 channels per pixel
    static inline void store_lo8(float* p, v a) { _mm256_storeu_ps(p, _mm512_castps512_ps256(a)); }
    static inline void store_hi8(float* p, v a) { _mm256_storeu_ps(p, _mm512_extractf32x8_ps(a, 1)); }
};
#else
struct ep_c3_isa
{
    typedef __m256 v;
    enum { lanes = 8, pixels = 6, mid_pixels = 2 };
    static inline v load(const float* p) { return _mm256_loadu_ps(p); }
    static inline v load(const unsigned short* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
    static inline v set1(float x) { return _mm256_set1_ps(x); }
    static inline v fmadd(v a, v b, v c) { return _mm256_fmadd_ps(a, b, c); }
    static inline void store(float* p, v a) { _mm256_storeu_ps(p, a); }
    static inline void store(unsigned short* p, v a) { _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)); }
    static inline bool fp16_exact(v a) { return _mm256_movemask_ps(_mm256_cmp_ps(_mm256_cvtph_ps(_mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)), a, _CMP_EQ_OQ)) == 0xff; }
    // 8 lanes: the output is always packed 8 (ep_c3_supported), so only a whole register is stored
    static inline void store_lo8(float* p, v a) { _mm256_storeu_ps(p, a); }
    static inline void store_hi8(float*, v) {}
};
#endif
typedef ep_c3_isa V;
enum { EP_C3_BLOCK = 2 * V::lanes }; // output channels per block

// Whether each of the n weights survives a round trip through fp16. pnnx stores weights as fp16
// unless a build asks for fp32, so the kernel can usually keep the same values at half the bytes.
static bool ep_c3_fp16_exact(const float* w, size_t n)
{
    size_t i = 0;
    for (; i + V::lanes <= n; i += V::lanes)
    {
        if (!V::fp16_exact(V::load(w + i)))
            return false;
    }
    float tail[V::lanes] = {0.f};
    memcpy(tail, w + i, (n - i) * sizeof(float));
    return V::fp16_exact(V::load(tail));
}

// wp: [ceil(num_output / block)][num_input * maxk][block], zero past num_output, as fp32 or fp16 (W);
// one block of output channels at a time through an fp32 scratch row, so no fp32 copy of the whole
// layer is made.
template<typename W>
static void ep_c3_pack_weights(const float* w, int num_input, int maxk, int num_output, W* wp)
{
    const int K = num_input * maxk;
    float row[EP_C3_BLOCK];
    for (int oc0 = 0; oc0 < num_output; oc0 += EP_C3_BLOCK)
    {
        for (int k = 0; k < K; k++)
        {
            for (int j = 0; j < EP_C3_BLOCK; j++)
                row[j] = oc0 + j < num_output ? w[(size_t)(oc0 + j) * K + k] : 0.f;
            W* dst = wp + ((size_t)(oc0 / EP_C3_BLOCK) * K + k) * EP_C3_BLOCK;
            V::store(dst, V::load(row));
            V::store(dst + V::lanes, V::load(row + V::lanes));
        }
    }
}

// NP output pixels x NV registers of output channels, a KS x KS kernel at stride S over input
// packed EP channels per pixel. kx is not unrolled: unrolled, the compiler keeps each broadcast for
// the three kx that reuse it and spills the accumulators.
template<typename W, int NP, int NV, int S, int EP, int KS>
static inline void ep_c3_block(const float* in, int inw, size_t in_cstep, int num_input, const W* wp, const float* bias,
                               int oc0, int num_output, int oy, int ox, float* out, size_t out_cstep, int outw, int out_ep)
{
    V::v acc[NV][NP];
    _Pragma("unroll") for (int v = 0; v < NV; v++)
    {
        V::v b = V::load(bias + v * V::lanes);
        _Pragma("unroll") for (int p = 0; p < NP; p++) acc[v][p] = b;
    }
    const W* wk = wp;
    if (KS == 1)
    {
        // a 1x1 kernel: the EP channels of a group unrolled, each pixel's value at a fixed offset
        // from the group's row, so no channel costs address arithmetic (the same sums, same order)
        const size_t px = ((size_t)(oy * S) * inw + (size_t)ox * S) * EP;
        for (int g = 0; g < num_input; g += EP)
        {
            const float* row = in + (size_t)(g / EP) * in_cstep + px;
            _Pragma("unroll") for (int e = 0; e < EP; e++)
            {
                V::v w0 = V::load(wk);
                V::v w1 = NV > 1 ? V::load(wk + V::lanes) : w0;
                _Pragma("unroll") for (int p = 0; p < NP; p++)
                {
                    V::v x = V::set1(row[p * S * EP + e]);
                    acc[0][p] = V::fmadd(w0, x, acc[0][p]);
                    if (NV > 1) acc[NV - 1][p] = V::fmadd(w1, x, acc[NV - 1][p]);
                }
                wk += EP_C3_BLOCK;
            }
        }
    }
    else
    for (int ic = 0; ic < num_input; ic++)
    {
        const float* inp = in + (size_t)(ic / EP) * in_cstep + ic % EP;
        _Pragma("unroll") for (int ky = 0; ky < KS; ky++)
        {
            const float* row = inp + ((size_t)(oy * S + ky) * inw + (size_t)ox * S) * EP;
            _Pragma("nounroll") for (int kx = 0; kx < KS; kx++)
            {
                V::v w0 = V::load(wk + (ky * KS + kx) * EP_C3_BLOCK);
                V::v w1 = NV > 1 ? V::load(wk + (ky * KS + kx) * EP_C3_BLOCK + V::lanes) : w0;
                _Pragma("unroll") for (int p = 0; p < NP; p++)
                {
                    V::v x = V::set1(row[(p * S + kx) * EP]);
                    acc[0][p] = V::fmadd(w0, x, acc[0][p]);
                    if (NV > 1) acc[NV - 1][p] = V::fmadd(w1, x, acc[NV - 1][p]);
                }
            }
        }
        wk += KS * KS * EP_C3_BLOCK;
    }
    const size_t pix = (size_t)oy * outw + ox;
    _Pragma("unroll") for (int v = 0; v < NV; v++)
    {
        const int oc = oc0 + v * V::lanes;
        if (out_ep == V::lanes)
        {
            float* o = out + (size_t)(oc / V::lanes) * out_cstep + pix * V::lanes;
            _Pragma("unroll") for (int p = 0; p < NP; p++) V::store(o + p * V::lanes, acc[v][p]);
        }
        else // 16 lanes into an output packed 8 (ep_c3_supported allows nothing else)
        {
            float* o0 = out + (size_t)(oc / 8) * out_cstep + pix * 8;
            _Pragma("unroll") for (int p = 0; p < NP; p++) V::store_lo8(o0 + p * 8, acc[v][p]);
            if (oc + 8 < num_output)
            {
                float* o1 = o0 + out_cstep;
                _Pragma("unroll") for (int p = 0; p < NP; p++) V::store_hi8(o1 + p * 8, acc[v][p]);
            }
        }
    }
}

// output pixels [ox0, ox1) of row oy
template<typename W, int NV, int S, int EP, int KS>
static void ep_c3_row(const float* in, int inw, size_t in_cstep, int num_input, const W* wp, const float* bias,
                      int oc0, int num_output, int oy, int ox0, int ox1, float* out, size_t out_cstep, int outw, int out_ep)
{
    int ox = ox0;
    for (; ox + V::pixels <= ox1; ox += V::pixels)
        ep_c3_block<W, V::pixels, NV, S, EP, KS>(in, inw, in_cstep, num_input, wp, bias, oc0, num_output, oy, ox, out, out_cstep, outw, out_ep);
    for (; ox + V::mid_pixels <= ox1; ox += V::mid_pixels)
        ep_c3_block<W, V::mid_pixels, NV, S, EP, KS>(in, inw, in_cstep, num_input, wp, bias, oc0, num_output, oy, ox, out, out_cstep, outw, out_ep);
    for (; ox < ox1; ox++)
        ep_c3_block<W, 1, NV, S, EP, KS>(in, inw, in_cstep, num_input, wp, bias, oc0, num_output, oy, ox, out, out_cstep, outw, out_ep);
}

// a block of output channels' weights as fp32: fp32 ones as they are; fp16 ones widened into this thread's buffer,
// which every pixel block of the span then reads (one widening a block and span, not one every V::pixels pixels:
// in the kernel it cost YOLO11s-seg 5-7%); 0 where the buffer cannot grow
static inline const float* ep_c3_fp32_weights(const float* w, size_t)
{
    return w;
}

static const float* ep_c3_fp32_weights(const unsigned short* w, size_t n)
{
    static thread_local float* buf = 0; // a thread's, for the process's life: the largest block it met
    static thread_local size_t cap = 0;
    if (cap < n)
    {
        float* grown = (float*)realloc(buf, n * sizeof(float));
        if (!grown)
            return 0;
        buf = grown;
        cap = n;
    }
    for (size_t i = 0; i < n; i += V::lanes) // n: whole blocks of 2 registers
        V::store(buf + i, V::load(w + i));
    return buf;
}

// every block of output channels for output pixels [ox0, ox1) of row oy
template<typename W>
static void ep_c3_span(const float* in, int inw, size_t in_cstep, int ep, int num_input, int ks, const W* wp, const float* bias,
                       int num_output, int stride, int oy, int ox0, int ox1, float* out, size_t out_cstep, int outw, int out_ep)
{
    const int K = num_input * ks * ks;
    for (int oc0 = 0; oc0 < num_output; oc0 += EP_C3_BLOCK)
    {
        const W* w = wp + (size_t)(oc0 / EP_C3_BLOCK) * K * EP_C3_BLOCK;
        const float* wf = ep_c3_fp32_weights(w, (size_t)K * EP_C3_BLOCK);
        const bool two = num_output - oc0 > V::lanes;
#define EP_C3_ROW(NV, S, EP, KS) (wf ? ep_c3_row<float, NV, S, EP, KS>(in, inw, in_cstep, num_input, wf, bias + oc0, oc0, num_output, oy, ox0, ox1, out, out_cstep, outw, out_ep) \
                                     : ep_c3_row<W, NV, S, EP, KS>(in, inw, in_cstep, num_input, w, bias + oc0, oc0, num_output, oy, ox0, ox1, out, out_cstep, outw, out_ep))
#define EP_C3_EP(NV, S, KS) if (ep == 1) EP_C3_ROW(NV, S, 1, KS); else if (ep == 4) EP_C3_ROW(NV, S, 4, KS); else if (ep == 8) EP_C3_ROW(NV, S, 8, KS); else EP_C3_ROW(NV, S, 16, KS)
        if (ks == 1)
        {
            if (two) { EP_C3_EP(2, 1, 1); } else { EP_C3_EP(1, 1, 1); }
        }
        else if (ks == 2)
        {
            if (two) { EP_C3_EP(2, 1, 2); } else { EP_C3_EP(1, 1, 2); }
        }
        else if (stride == 1)
        {
            if (two) { EP_C3_EP(2, 1, 3); } else { EP_C3_EP(1, 1, 3); }
        }
        else
        {
            if (two) { EP_C3_EP(2, 2, 3); } else { EP_C3_EP(1, 2, 3); }
        }
#undef EP_C3_EP
#undef EP_C3_ROW
    }
}

// the packings and kernels the kernel is written for: input packed 1, 4, 8 (or 16 with 16 lanes),
// output packed 8 or a whole register
static inline bool ep_c3_supported(int ep, int out_ep, int ks, int stride)
{
    return (ep == 1 || ep == 4 || ep == 8 || (ep == 16 && V::lanes == 16)) && (out_ep == 8 || out_ep == V::lanes)
           && ((ks == 3 && (stride == 1 || stride == 2)) || ((ks == 1 || ks == 2) && stride == 1));
}

// in: the padded input (inw pixels wide), in_cstep floats between its channel groups of ep channels;
// wp (fp32 or fp16, W) and bias (num_output rounded up to a block, zero-padded) from ep_c3_prepare;
// out: the output, out_cstep floats between its groups of out_ep channels. Threads take runs of
// output rows, or of pixels for an unpadded 1x1.
template<typename W>
static int ep_c3_forward(const float* in, int inw, size_t in_cstep, int ep, int num_input, int ks, const W* wp, const float* bias,
                         int num_output, int stride, float* out, size_t out_cstep, int outw, int outh, int out_ep, int nthreads)
{
    if (!ep_c3_supported(ep, out_ep, ks, stride))
        return -1;
    if (ks == 1 && inw == outw)
    {
        // one run of pixels per thread, walked 96 pixels at a time so each stretch of input stays
        // in cache while every block of output channels reads it
        const int npix = outw * outh;
        const int run = ((npix + nthreads - 1) / nthreads + V::pixels - 1) / V::pixels * V::pixels;
        #pragma omp parallel for num_threads(nthreads)
        for (int t = 0; t < nthreads; t++)
        {
            const int end = (t + 1) * run < npix ? (t + 1) * run : npix;
            for (int x0 = t * run; x0 < end; x0 += 96)
                ep_c3_span(in, npix, in_cstep, ep, num_input, 1, wp, bias, num_output, 1, 0, x0, x0 + 96 < end ? x0 + 96 : end, out, out_cstep, npix, out_ep);
        }
        return 0;
    }
    #pragma omp parallel for num_threads(nthreads)
    for (int oy = 0; oy < outh; oy++)
        ep_c3_span(in, inw, in_cstep, ep, num_input, ks, wp, bias, num_output, stride, oy, 0, outw, out, out_cstep, outw, out_ep);
    return 0;
}

// The direct kernel on an input without its border: each thread copies the KS input rows that one
// output row needs into a zero-bordered scratch (KS rows x the padded width, per channel group) and
// runs the kernel on that, so the whole input is never copied with its border (that copy was the
// largest buffer alive at a detector's first layers: nudenet_320n's 3 x 322 x 322 and 16 x 162 x 162
// floats). scratch: nthreads x (num_input / ep) x scratch_cstep floats.
template<typename W>
static int ep_c3_forward_padded(const float* in, int inw, int inh, size_t in_cstep, int ep, int num_input, int ks, const W* wp, const float* bias,
                                int num_output, int stride, int pad_left, int pad_top, float* out, size_t out_cstep, int outw, int outh, int out_ep,
                                float* scratch, size_t scratch_cstep, int nthreads)
{
    if (!ep_c3_supported(ep, out_ep, ks, stride))
        return -1;
    const int pw = (outw - 1) * stride + ks;
    const int groups = num_input / ep;
    const int lz = pad_left < pw ? pad_left : pw;
    const int n = inw < pw - lz ? inw : pw - lz;
    const int run = (outh + nthreads - 1) / nthreads;
    #pragma omp parallel for num_threads(nthreads)
    for (int t = 0; t < nthreads; t++)
    {
        float* rows = scratch + (size_t)t * groups * scratch_cstep;
        for (int oy = t * run; oy < outh && oy < (t + 1) * run; oy++)
        {
            for (int g = 0; g < groups; g++)
            {
                for (int ky = 0; ky < ks; ky++)
                {
                    float* dst = rows + g * scratch_cstep + (size_t)ky * pw * ep;
                    const int iy = oy * stride + ky - pad_top;
                    if (iy < 0 || iy >= inh || n <= 0)
                    {
                        memset(dst, 0, sizeof(float) * pw * ep);
                        continue;
                    }
                    memset(dst, 0, sizeof(float) * lz * ep);
                    memcpy(dst + (size_t)lz * ep, in + g * in_cstep + (size_t)iy * inw * ep, sizeof(float) * n * ep);
                    memset(dst + (size_t)(lz + n) * ep, 0, sizeof(float) * (pw - lz - n) * ep);
                }
            }
            ep_c3_span(rows, pw, scratch_cstep, ep, num_input, ks, wp, bias, num_output, stride, 0, 0, outw,
                       out + (size_t)oy * outw * out_ep, out_cstep, outw, out_ep);
        }
    }
    return 0;
}

// create_pipeline's part: the packed weights (fp16 when half_ok and every weight converts exactly)
// and the bias zero-padded to whole blocks. 0, or -100 when out of memory.
static int ep_c3_prepare(const float* weight, const float* bias, int num_input, int maxk, int num_output, bool half_ok, Mat& wp, Mat& bp)
{
    const int nb = (num_output + EP_C3_BLOCK - 1) / EP_C3_BLOCK;
    const bool half = half_ok && ep_c3_fp16_exact(weight, (size_t)num_output * num_input * maxk);
    wp.create(nb * num_input * maxk * EP_C3_BLOCK, half ? (size_t)2u : (size_t)4u);
    bp.create(nb * EP_C3_BLOCK, (size_t)4u);
    if (wp.empty() || bp.empty())
        return -100;
    if (half)
        ep_c3_pack_weights(weight, num_input, maxk, num_output, (unsigned short*)wp.data);
    else
        ep_c3_pack_weights(weight, num_input, maxk, num_output, (float*)wp.data);
    bp.fill(0.f);
    if (bias)
        memcpy(bp.data, bias, num_output * sizeof(float));
    return 0;
}

// forward's parts, for fp32 or fp16 weights (wp.elemsize)
static int ep_c3_run(const float* in, int inw, size_t in_cstep, int ep, int num_input, int ks, const Mat& wp, const Mat& bp,
                     int num_output, int stride, float* out, size_t out_cstep, int outw, int outh, int out_ep, int nthreads)
{
    if (wp.elemsize == 2u)
        return ep_c3_forward(in, inw, in_cstep, ep, num_input, ks, (const unsigned short*)wp.data, (const float*)bp.data, num_output, stride, out, out_cstep, outw, outh, out_ep, nthreads);
    return ep_c3_forward(in, inw, in_cstep, ep, num_input, ks, (const float*)wp.data, (const float*)bp.data, num_output, stride, out, out_cstep, outw, outh, out_ep, nthreads);
}

static int ep_c3_run_padded(const float* in, int inw, int inh, size_t in_cstep, int ep, int num_input, int ks, const Mat& wp, const Mat& bp,
                            int num_output, int stride, int pad_left, int pad_top, float* out, size_t out_cstep, int outw, int outh, int out_ep,
                            float* scratch, size_t scratch_cstep, int nthreads)
{
    if (wp.elemsize == 2u)
        return ep_c3_forward_padded(in, inw, inh, in_cstep, ep, num_input, ks, (const unsigned short*)wp.data, (const float*)bp.data, num_output, stride,
                                    pad_left, pad_top, out, out_cstep, outw, outh, out_ep, scratch, scratch_cstep, nthreads);
    return ep_c3_forward_padded(in, inw, inh, in_cstep, ep, num_input, ks, (const float*)wp.data, (const float*)bp.data, num_output, stride,
                                pad_left, pad_top, out, out_cstep, outw, outh, out_ep, scratch, scratch_cstep, nthreads);
}

} // namespace
'''

_SIGNATURES = r'''
int ep_c3_prepare_fma(const float* weight, const float* bias, int num_input, int maxk, int num_output, bool half_ok, Mat& wp, Mat& bp)
int ep_c3_run_fma(const float* in, int inw, size_t in_cstep, int ep, int num_input, int ks, const Mat& wp, const Mat& bp, int num_output, int stride, float* out, size_t out_cstep, int outw, int outh, int out_ep, int nthreads)
int ep_c3_run_padded_fma(const float* in, int inw, int inh, size_t in_cstep, int ep, int num_input, int ks, const Mat& wp, const Mat& bp, int num_output, int stride, int pad_left, int pad_top, float* out, size_t out_cstep, int outw, int outh, int out_ep, float* scratch, size_t scratch_cstep, int nthreads)
'''.strip().splitlines()


def _name(signature: str) -> str:
    """The function name in a signature."""
    return signature[:signature.index("(")].split()[-1]


def _forwarder(signature: str, callee: str) -> str:
    """A function with this signature that passes its parameters on to ``callee``."""
    params = signature[signature.index("(") + 1:-1].split(", ")
    args = ", ".join(p.split()[-1].lstrip("&*") for p in params)
    return f"{signature}\n{{\n    return {callee}({args});\n}}\n"


# convolution_x86_fma.cpp (compiled with -mavx -mfma -mf16c): the 8-lane kernel and its entry points,
# which the AVX build of the layer calls on CPUs with FMA and F16C.
_FMA_KERNEL = ("\n#if __FMA__ && __F16C__ && !__AVX512F__\n// edgepack (direct_conv_patch.py): the direct kernel"
               " for CPUs with FMA and F16C (AVX2 class)" + _BODY
               + "".join("\n" + _forwarder(s, _name(s).removesuffix("_fma")) for s in _SIGNATURES)
               + "#endif // __FMA__ && __F16C__ && !__AVX512F__\n\n")

# convolution_x86.cpp: which layers the kernel takes (every build); the 16-lane kernel in the AVX-512
# build; forwarders to convolution_x86_fma.cpp in the AVX build (ncnn's layer for AVX and AVX2 CPUs,
# compiled with -mavx only), used where the CPU has FMA and F16C.
_KERNEL = r'''
// edgepack (direct_conv_patch.py): direct 3x3 and 1x1 convolutions for layers with few input channels.
#if __AVX512F__
#define EP_C3_WHERE 1 // the kernel is in this file
#elif __AVX__ && !__FMA__ && NCNN_RUNTIME_CPU && NCNN_FMA && NCNN_F16C
#define EP_C3_WHERE 2 // the kernel is in convolution_x86_fma.cpp
#else
#define EP_C3_WHERE 0
#endif

#if EP_C3_WHERE
extern int g_ep_direct_conv; // src/cpu.cpp (isa_cap_patch.py): 0 none, 1 by break-even, 2 every layer it can run

static bool ep_c3_wanted(int num_input, int num_output, int kernel_w, int kernel_h, int dilation_w, int dilation_h, int stride_w, int stride_h, const Option& opt)
{
    if (!opt.use_packing_layout || opt.use_bf16_storage || dilation_w != 1 || dilation_h != 1 || stride_w != stride_h || num_output % 8 != 0
        || g_ep_direct_conv == 0)
        return false;
    // `--memory lean` (memory.py) masks Winograd on every layer it wants here: no transformed
    // kernels, no im2col or GEMM workspace, whatever the break-even (and so does direct=2)
    if (!opt.use_winograd_convolution || g_ep_direct_conv == 2)
        return (kernel_w == 3 && kernel_h == 3 && (stride_w == 1 || stride_w == 2)) || (kernel_w == kernel_h && kernel_w <= 2 && stride_w == 1);
    // 3x3, measured break-even (direct_conv_patch.py): Winograd wins from 16 input channels at
    // stride 1, im2col + GEMM from 128 at stride 2
    if (kernel_w == 3 && kernel_h == 3)
        return stride_w == 1 ? num_input < 16 : stride_w == 2 && num_input <= 96;
    // 1x1: faster than ncnn's GEMM on every layer measured (AVX-512: up to 768 -> 384 channels; the
    // 8-lane kernel on an AVX2 EPYC, bench/bench_direct_conv.py: 0.80-0.99x up to 768 input and 1536
    // output channels, 1.05-1.09x from 1024 input channels)
    if (kernel_w == 1 && kernel_h == 1 && stride_w == 1)
#if EP_C3_WHERE == 2
        return num_input <= 768 && num_output <= 1536;
#else
        return num_input <= 768 && num_output <= 512;
#endif
    // 2x2 at stride 1 (PP-HGNet's stem, padded right and bottom): ncnn runs it with its generic
    // packed kernel, neither Winograd nor GEMM
    if (kernel_w == 2 && kernel_h == 2 && stride_w == 1)
        return num_input <= 64;
    return false;
}
#endif

#if EP_C3_WHERE == 1
''' + _BODY + r'''
static inline bool ep_c3_available()
{
    return true;
}
#elif EP_C3_WHERE == 2
''' + "".join(f"{s};\n" for s in _SIGNATURES) + r'''
static inline bool ep_c3_available()
{
    return cpu_support_x86_fma() && cpu_support_x86_f16c();
}
''' + "".join(_forwarder("static inline " + s.replace("_fma(", "(", 1), _name(s)) for s in _SIGNATURES) + r'''#endif // EP_C3_WHERE
'''

_CREATE = r'''
#if EP_C3_WHERE
    if (ep_c3_available() && ep_c3_wanted(num_input, num_output, kernel_w, kernel_h, dilation_w, dilation_h, stride_w, stride_h, opt))
    {
        // fp16 weights where each converts exactly: in `--memory lean` on every layer; at the fp16 rung on
        // layers of 64K weights and more, whose weights outweigh their maps (direct=3: fp32 there, to measure)
        const bool ep_half = !opt.use_winograd_convolution
                             || (opt.use_fp16_storage && g_ep_direct_conv == 1 && num_input * kernel_w * kernel_h * num_output >= (1 << 16));
        int ret = ep_c3_prepare(weight_data, bias_term ? (const float*)bias_data : 0, num_input, kernel_w * kernel_h, num_output,
                                ep_half, weight_ep_c3, bias_ep_c3);
        if (ret != 0)
            return ret;

        if (opt.lightmode)
            weight_data.release();

        return 0;
    }
#endif // EP_C3_WHERE

'''

_FORWARD_PADDED = r'''
#if EP_C3_WHERE
    if (!weight_ep_c3.empty() && pad_value == 0.f && pad_left >= 0 && pad_right >= 0 && pad_top >= 0 && pad_bottom >= 0
        && (pad_left > 0 || pad_right > 0 || pad_top > 0 || pad_bottom > 0))
    {
        // create_pipeline chose the direct kernel (ep_c3_wanted), and the layer has a zero border:
        // the kernel borders the input row by row (ep_c3_forward_padded), no bordered copy
        if (elemsize != (size_t)4u * elempack)
            return -1;
        const int outw = (w + pad_left + pad_right - kernel_w) / stride_w + 1;
        const int outh = (h + pad_top + pad_bottom - kernel_h) / stride_h + 1;
#if __AVX512F__
        const int out_elempack = num_output % 16 == 0 ? 16 : 8; // as below: ep_c3_wanted asked for a multiple of 8
#else
        const int out_elempack = 8;
#endif
        top_blob.create(outw, outh, num_output / out_elempack, (size_t)4u * out_elempack, out_elempack, opt.blob_allocator);
        if (top_blob.empty())
            return -100;
        const int pw = (outw - 1) * stride_w + kernel_w;
        const size_t scratch_cstep = ((size_t)pw * kernel_h * elempack + 15) / 16 * 16;
        Mat scratch((int)(scratch_cstep * channels * opt.num_threads), (size_t)4u, opt.workspace_allocator);
        if (scratch.empty())
            return -100;
        int ret = ep_c3_run_padded(bottom_blob, w, h, bottom_blob.cstep * elempack, elempack, channels * elempack, kernel_w, weight_ep_c3, bias_ep_c3,
                                   num_output, stride_w, pad_left, pad_top, (float*)top_blob.data, top_blob.cstep * out_elempack, outw, outh, out_elempack,
                                   scratch, scratch_cstep, opt.num_threads);
        if (ret != 0)
            return ret;

        if (activation)
        {
            activation->forward_inplace(top_blob, opt);
        }
        return 0;
    }
#endif // EP_C3_WHERE

'''

_FORWARD = r'''
#if EP_C3_WHERE
    if (!weight_ep_c3.empty())
    {
        // create_pipeline chose the direct kernel (ep_c3_wanted): fp32, packed, 3x3, 2x2 or 1x1
        if (elemsize != (size_t)4u * elempack)
            return -1;
        int ret = ep_c3_run(bottom_blob_bordered, w, bottom_blob_bordered.cstep * elempack, elempack, num_input, kernel_w, weight_ep_c3, bias_ep_c3,
                            num_output, stride_w, (float*)top_blob.data, top_blob.cstep * out_elempack, outw, outh, out_elempack, opt.num_threads);
        if (ret != 0)
            return ret;

        if (activation)
        {
            activation->forward_inplace(top_blob, opt);
        }
        return 0;
    }
#endif // EP_C3_WHERE
'''

# fp32 create_pipeline (the bf16 one offers no Winograd F(6,3)), and the fp32 forward (the one with
# the dilation hand-over); the kernel goes after the early returns for int8, bf16 and dilation.
_WINOGRAD_CHOICE = ("#endif // __SSE2__\n\n    bool prefer_winograd = (opt.use_winograd23_convolution"
                    " || opt.use_winograd43_convolution || opt.use_winograd63_convolution)")
_BORDER_FORWARD = ("        return forward_bf16s(bottom_blob, top_blob, opt);\n    }\n#endif\n\n    int w = bottom_blob.w;\n"
                   "    int h = bottom_blob.h;\n    int channels = bottom_blob.c;\n    size_t elemsize = bottom_blob.elemsize;\n"
                   "    int elempack = bottom_blob.elempack;\n\n"
                   "    const int kernel_extent_w = dilation_w * (kernel_w - 1) + 1;\n"
                   "    const int kernel_extent_h = dilation_h * (kernel_h - 1) + 1;\n\n    Mat bottom_blob_bordered;\n")
_DILATION_FORWARD = ("            return forwardDilation_x86(bottom_blob_bordered, top_blob, opt);\n        }\n    }\n\n"
                     "    const int num_input = channels * elempack;\n")

_CONV_EDITS = (
    ("the kernel, after the includes",
     "namespace ncnn {\n\n#include \"convolution_3x3.h\"\n",
     "namespace ncnn {\n" + _KERNEL + "\n#include \"convolution_3x3.h\"\n", 1),
    ("create_pipeline's kernel choice",
     _WINOGRAD_CHOICE,
     _WINOGRAD_CHOICE.replace("\n\n", "\n" + _CREATE, 1), 1),
    ("forward's kernel choice, bordered by the kernel",
     _BORDER_FORWARD,
     _BORDER_FORWARD.replace("\n\n    Mat bottom_blob_bordered;\n", "\n" + _FORWARD_PADDED + "    Mat bottom_blob_bordered;\n"), 1),
    ("forward's kernel choice",
     _DILATION_FORWARD,
     _DILATION_FORWARD + _FORWARD, 1),
)

_HEADER_EDITS = (
    ("the kernel's weights",
     "    Mat weight_winograd63_data;\n",
     "    Mat weight_winograd63_data;\n    Mat weight_ep_c3; // edgepack direct_conv_patch.py\n    Mat bias_ep_c3;\n", 1),
)

_FMA_EDITS = (
    ("the FMA kernel, at the end",
     "#endif // NCNN_BF16\n\n} // namespace ncnn\n",
     "#endif // NCNN_BF16\n" + _FMA_KERNEL + "} // namespace ncnn\n", 1),
)

_FILE_EDITS = ((CONV_FILE, _CONV_EDITS), (CONV_HEADER, _HEADER_EDITS), (FMA_FILE, _FMA_EDITS))

DIRECT_CONV_PATCH_KEY = file_edits_key(DIRECT_CONV_PATCH_VERSION, _FILE_EDITS)


def patch_direct_conv(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place."""
    apply_file_edits(src, _FILE_EDITS, "direct_conv_patch.py")
