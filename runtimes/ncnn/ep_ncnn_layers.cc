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
 * with rounding half to even and IEEE division (this file is built without -ffast-math); only the sign
 * of a zero may differ (ncnn's round keeps -0, the adder here gives +0), which no sum or product sees.
 * bottom: x (any shape and packing); tops: centred (x's shape and packing), scale and zp (one float
 * each). */
#include <math.h>

#include <vector>

#include "ncnn/c_api.h"
#include "ncnn/layer.h"
#include "ncnn/mat.h"
#include "ncnn/net.h"

namespace {

/* Round half to even for |v| < 2^22 by the float adder (SSE2 has no rounding instruction, and rintf
 * is a call per element there). Larger |v| keep their sign and a magnitude above 255, which is all
 * the clip after it reads. */
inline float round_even(float v) {
    const float magic = 12582912.0f; /* 1.5 * 2^23 */
    return v >= 0.f ? (v + magic) - magic : (v - magic) + magic;
}

inline float relu(float v) { return v < 0.f ? 0.f : v; }

inline float clip255(float v) {
    if (v < 0.f) v = 0.f;
    if (v > 255.f) v = 255.f;
    return v;
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
        float mx = -INFINITY, nmx = -INFINITY;
        for (int q = 0; q < channels; q++) {
            const float *p = x.channel(q);
            for (size_t i = 0; i < per; i++) {
                mx = p[i] > mx ? p[i] : mx;
                nmx = -p[i] > nmx ? -p[i] : nmx;
            }
        }
        const float hi = relu(mx), nlo = relu(nmx);
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
        for (int q = 0; q < channels; q++) {
            const float *p = x.channel(q);
            float *o = out.channel(q);
            for (size_t i = 0; i < per; i++)
                o[i] = clip255(round_even(p[i] / scale) + zp) - zp;
        }
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
