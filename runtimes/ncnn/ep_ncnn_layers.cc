/* Layers the engine adds to ncnn (registered on every net before its .param is read).
 *
 * EpDynQuant: onnxruntime's DynamicQuantizeLinear (uint8) and the centring that follows it, in one
 * pass, where the lowered form (edgepack/quantized.py, `quantise`) took some 30 ncnn layers
 * (two global max pools, a dozen scalar ops, a divide-round-add-clip-subtract pass over the tensor and
 * the Reshapes and Splits between them). A dynamically quantised model quantises every convolution's
 * input and, in a quantised LSTM, H before every step: ddddocr_old_int8 ran 2,300 layers, 2,000 of
 * them these. edgepack/backends/ncnn/dynamic_quant_fold.py writes the layer in place of the chain.
 *
 * It computes what the chain computed, step by step in the same float operations, so its outputs
 * are the chain's bits:
 *   hi = relu(max x), nlo = relu(max -x)  (ncnn's ReLU: v < 0 ? 0 : v)
 *   span = hi + nlo
 *   scale = span / 255 + relu(1 - span * 2^100)   (1 for an all-zero tensor, as onnxruntime)
 *   zp = round(clip(nlo / scale, 0, 255))
 *   centred = clip(round(x / scale) + zp, 0, 255) - zp
 * with rounding half to even and IEEE division (this file is built without -ffast-math), sixteen lanes
 * at a time on CPUs with AVX-512 (the same operations, so the same bits: the layer was ~7% of
 * ddddocr_old_int8's time in four-lane loops), else four (SSE2, the x86_64 baseline; NEON). Only the sign of a zero may differ from the chain's
 * (max(-x) is taken as -min(x)), which no sum or product sees.
 * bottom: x (any shape and packing); tops: centred (x's shape and packing), scale and zp (one float
 * each). */
#include <math.h>

#if defined(__SSE2__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

#include <vector>

#include "ncnn/c_api.h"
#include "ncnn/cpu.h"
#include "ncnn/layer.h"
#include "ncnn/mat.h"
#include "ncnn/net.h"

namespace {

/* Round half to even by the float adder: exact for |v| < 2^22 (SSE2 has no rounding instruction,
 * and rintf is a call per element there). Larger |v| keep their sign and a magnitude above 255, which
 * is all the clip after it reads. Done on |v| with the sign put back, as ncnn's round keeps it. */
const float kMagic = 12582912.0f; /* 1.5 * 2^23 */

inline float round_even(float v) { return copysignf((fabsf(v) + kMagic) - kMagic, v); }

inline float relu(float v) { return v < 0.f ? 0.f : v; }

inline float clip255(float v) {
    if (v < 0.f) v = 0.f;
    if (v > 255.f) v = 255.f;
    return v;
}

/* mx = max(mx, max p[0..n)), mn = min(mn, min p[0..n)) */
void extremes(const float *p, size_t n, float &mx, float &mn) {
    size_t i = 0;
#if defined(__SSE2__)
    __m128 vmx = _mm_set1_ps(mx), vmn = _mm_set1_ps(mn);
    for (; i + 4 <= n; i += 4) {
        __m128 v = _mm_loadu_ps(p + i);
        vmx = _mm_max_ps(vmx, v);
        vmn = _mm_min_ps(vmn, v);
    }
    float a[4], b[4];
    _mm_storeu_ps(a, vmx);
    _mm_storeu_ps(b, vmn);
    for (int k = 0; k < 4; k++) {
        mx = a[k] > mx ? a[k] : mx;
        mn = b[k] < mn ? b[k] : mn;
    }
#elif defined(__aarch64__)
    float32x4_t vmx = vdupq_n_f32(mx), vmn = vdupq_n_f32(mn);
    for (; i + 4 <= n; i += 4) {
        float32x4_t v = vld1q_f32(p + i);
        vmx = vmaxq_f32(vmx, v);
        vmn = vminq_f32(vmn, v);
    }
    mx = vmaxvq_f32(vmx);
    mn = vminvq_f32(vmn);
#endif
    for (; i < n; i++) {
        mx = p[i] > mx ? p[i] : mx;
        mn = p[i] < mn ? p[i] : mn;
    }
}

/* o = clip(round(p / scale) + zp, 0, 255) - zp over n floats */
void centre(const float *p, float *o, size_t n, float scale, float zp) {
    size_t i = 0;
#if defined(__SSE2__)
    const __m128 vs = _mm_set1_ps(scale), vz = _mm_set1_ps(zp), magic = _mm_set1_ps(kMagic);
    const __m128 sign = _mm_set1_ps(-0.f), lo = _mm_setzero_ps(), hi = _mm_set1_ps(255.f);
    for (; i + 4 <= n; i += 4) {
        __m128 q = _mm_div_ps(_mm_loadu_ps(p + i), vs);
        __m128 s = _mm_and_ps(q, sign);
        __m128 r = _mm_or_ps(_mm_sub_ps(_mm_add_ps(_mm_andnot_ps(sign, q), magic), magic), s);
        __m128 y = _mm_min_ps(_mm_max_ps(_mm_add_ps(r, vz), lo), hi);
        _mm_storeu_ps(o + i, _mm_sub_ps(y, vz));
    }
#elif defined(__aarch64__)
    const float32x4_t vs = vdupq_n_f32(scale), vz = vdupq_n_f32(zp);
    const float32x4_t lo = vdupq_n_f32(0.f), hi = vdupq_n_f32(255.f);
    for (; i + 4 <= n; i += 4) {
        float32x4_t r = vrndnq_f32(vdivq_f32(vld1q_f32(p + i), vs)); /* half to even, as ncnn's round */
        float32x4_t y = vminq_f32(vmaxq_f32(vaddq_f32(r, vz), lo), hi);
        vst1q_f32(o + i, vsubq_f32(y, vz));
    }
#endif
    for (; i < n; i++) o[i] = clip255(round_even(p[i] / scale) + zp) - zp;
}

#if defined(__x86_64__)
/* extremes and centre in sixteen lanes, the same operations in the same order per element */
__attribute__((target("avx512f"))) void extremes16(const float *p, size_t n, float &mx, float &mn) {
    size_t i = 0;
    __m512 vmx = _mm512_set1_ps(mx), vmn = _mm512_set1_ps(mn);
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(p + i);
        vmx = _mm512_max_ps(vmx, v);
        vmn = _mm512_min_ps(vmn, v);
    }
    float a[16], b[16];
    _mm512_storeu_ps(a, vmx);
    _mm512_storeu_ps(b, vmn);
    for (int k = 0; k < 16; k++) {
        mx = a[k] > mx ? a[k] : mx;
        mn = b[k] < mn ? b[k] : mn;
    }
    extremes(p + i, n - i, mx, mn);
}

__attribute__((target("avx512f"))) void centre16(const float *p, float *o, size_t n, float scale, float zp) {
    size_t i = 0;
    const __m512 vs = _mm512_set1_ps(scale), vz = _mm512_set1_ps(zp), magic = _mm512_set1_ps(kMagic);
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    const __m512 lo = _mm512_setzero_ps(), hi = _mm512_set1_ps(255.f);
    for (; i + 16 <= n; i += 16) {
        __m512 q = _mm512_div_ps(_mm512_loadu_ps(p + i), vs);
        __m512i qi = _mm512_castps_si512(q);
        __m512i s = _mm512_and_si512(qi, sign);
        __m512 a = _mm512_castsi512_ps(_mm512_andnot_si512(sign, qi));
        __m512 r = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(_mm512_sub_ps(_mm512_add_ps(a, magic), magic)), s));
        __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(r, vz), lo), hi);
        _mm512_storeu_ps(o + i, _mm512_sub_ps(y, vz));
    }
    centre(p + i, o + i, n - i, scale, zp);
}
#endif

/* Tensors of this many floats and more are split between the threads. */
const size_t kParallelMin = 32768;

bool use_avx512() {
#if defined(__x86_64__)
    return ncnn::cpu_support_x86_avx512() != 0;
#else
    return false;
#endif
}

void scan(bool wide, const float *p, size_t n, float &mx, float &mn) {
#if defined(__x86_64__)
    if (wide) return extremes16(p, n, mx, mn);
#endif
    (void)wide;
    extremes(p, n, mx, mn);
}

void centre_any(bool wide, const float *p, float *o, size_t n, float scale, float zp) {
#if defined(__x86_64__)
    if (wide) return centre16(p, o, n, scale, zp);
#endif
    (void)wide;
    centre(p, o, n, scale, zp);
}

/* Piece k of `pieces` equal parts of the channels' floats (channels lie cstep apart, `per` floats
 * each): fn(data, channel, offset, count) for each channel span the piece covers, in order. */
template<typename Fn>
void over_piece(const ncnn::Mat &x, int channels, size_t per, int k, int pieces, Fn fn) {
    const size_t total = (size_t)channels * per;
    const size_t begin = total * k / pieces, end = total * (k + 1) / pieces;
    for (size_t at = begin; at < end;) {
        const size_t c = at / per, off = at % per;
        const size_t n = per - off < end - at ? per - off : end - at;
        fn((const float *)x.channel((int)c) + off, c, off, n);
        at += n;
    }
}

/* fn(0..pieces-1), one piece a thread on ncnn's OpenMP runtime (simpleomp: this file is compiled with
 * -fopenmp, bundle.py); one piece runs here, without a fork */
template<typename Fn>
void for_pieces(int pieces, Fn fn) {
    if (pieces == 1) {
        fn(0);
        return;
    }
    #pragma omp parallel for num_threads(pieces)
    for (int k = 0; k < pieces; k++) fn(k);
}

class EpDynQuant : public ncnn::Layer {
public:
    EpDynQuant() {
        one_blob_only = false;
        support_inplace = false;
        support_packing = true; /* element-wise but for one max over all: any packing will do */
    }

    int forward(const std::vector<ncnn::Mat> &bottoms, std::vector<ncnn::Mat> &tops,
                const ncnn::Option &opt) const override {
        const ncnn::Mat &x = bottoms[0];
        if (x.elembits() != 32 || x.n > 1 || tops.size() != 3) return -1;
        /* channels (dims 3 and 4) lie cstep apart; within one, w*h*d*elempack floats */
        const int channels = x.dims >= 3 ? x.c : 1;
        const size_t per = (size_t)x.w * x.h * x.d * x.elempack;
        const bool wide = use_avx512();
        /* big tensors in one piece per thread (the pieces' extremes combined in order, then each
         * centres its own): a convolution's input is 100k floats and more, H of an LSTM step 512 */
        const size_t total = (size_t)channels * per;
        const int pieces = opt.num_threads > 1 && total >= kParallelMin ? opt.num_threads : 1;
        std::vector<float> pmx(pieces, -INFINITY), pmn(pieces, INFINITY);
        for_pieces(pieces, [&](int k) {
            over_piece(x, channels, per, k, pieces, [&](const float *p, size_t, size_t, size_t n) {
                scan(wide, p, n, pmx[k], pmn[k]);
            });
        });
        float mx = -INFINITY, mn = INFINITY;
        for (int k = 0; k < pieces; k++) {
            mx = pmx[k] > mx ? pmx[k] : mx;
            mn = pmn[k] < mn ? pmn[k] : mn;
        }
        const float hi = relu(mx), nlo = relu(-mn); /* max(-x) is -min(x) */
        const float span = hi + nlo;
        const float scale = span / 255.f + relu(1.f - span * 0x1p100f);
        const float zp = round_even(clip255(nlo / scale));

        ncnn::Mat &out = tops[0];
        out.create_like(x, opt.blob_allocator);
        tops[1].create(1, 4u, opt.blob_allocator);
        tops[2].create(1, 4u, opt.blob_allocator);
        if (out.empty() || tops[1].empty() || tops[2].empty()) return -100;
        ((float *)tops[1].data)[0] = scale;
        ((float *)tops[2].data)[0] = zp;
        for_pieces(pieces, [&](int k) {
            over_piece(x, channels, per, k, pieces, [&](const float *p, size_t c, size_t off, size_t n) {
                centre_any(wide, p, (float *)out.channel((int)c) + off, n, scale, zp);
            });
        });
        return 0;
    }
};

ncnn::Layer *create_dyn_quant(void *) { return new EpDynQuant; }

} // namespace

/* Register the engine's layers on `net` (before its .param is loaded). 0 on success. */
extern "C" int ep_ncnn_register_layers(ncnn_net_t net) {
    ncnn::Net *n = static_cast<ncnn::Net *>(net->pthis);
    return n->register_custom_layer("EpDynQuant", create_dyn_quant);
}
