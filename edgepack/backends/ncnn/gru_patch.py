"""Two speed changes to the pinned ncnn's generic GRU (src/layer/gru.cpp, which x86 runs: ncnn has no
x86 GRU; Arm has gru_arm.cpp).

1. The two directions of a bidirectional GRU at once, one thread each, in the forward with state
   blobs (every GRU edgepack converts has them: recurrent_forms.py writes the initial state out).
2. On CPUs with AVX2 and FMA, a direction runs `ep_gru_fma` (compiled for them by a target attribute;
   the file itself is built for baseline SSE2): the input products W_x x_t + b of every step in one
   pass before the recurrence (4 steps x 16 gate rows a block over a transposed copy of W_x, so each
   weight load serves four steps), then per step the recurrent products as 8-lane FMAs over a
   transposed W_h (h_{t-1}[i] broadcast against row i of W_h^T: no horizontal sums), then the gates 8
   units a time (sigmoid, and tanh as 1 - 2 / (1 + e^2y), over an 8-lane e^x; libm's expf and tanhf
   one unit a time had cost ~7% of PLCMOS v2; linear_before_reset's N = x_N + R (b_hN + W_hN h)).
   ncnn's loop computed each unit's six dot products one multiply at a time, in code built for SSE2:
   ~7 ms of PLCMOS v2's 30 (onnxruntime's GRU: ~1.6 ms).
   Taken where a direction runs on one thread, or its step is small (the test of 1). Other CPUs
   (SSE only, AVX without FMA, or an artifact capped with EDGEPACK_NCNN_OPTIONS=isa=...) run ncnn's
   loop. The additions come in another order than ncnn's (the build verifies against onnxruntime as
   always); 1 and 2 threads give the same bits, as each step's sums are one thread's either way.

ncnn splits each step's units between threads: two region hand-overs per step, 2000 of them for PLCMOS
v2's four direction passes of ~500 steps, each costing more than the ~15k multiply-adds a step holds
(32 units). PLCMOS v2 on 2 threads: 17.8 -> 14.8 ms against onnxruntime's 16.8 ms (2026-12-05, AVX2 EPYC,
side by side). On 2 threads the directions always go one a thread; on more only where a step holds
under 256k multiply-adds (a large step still splits well). Each direction's arithmetic is unchanged,
so 1 and 2 threads give the same bits.

Measured and dropped: the gates' sigmoid/tanh from an inline exp instead of libm's expf/tanhf (13% of
PLCMOS' profile sat in zig's libc exp/expm1): the same 1-thread time side by side (29.8 vs 29.9 ms);
the GRU's multiply-adds, compiled for baseline SSE2 in this generic file, are what is left.

Applied as exact text edits that must each match (source_patch.py): a new ncnn pin whose GRU changed
fails the libncnn build with a clear error. Only the x86 build applies them and carries GRU_PATCH_KEY.
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

GRU_PATCH_VERSION = 4  # part of the x86 libncnn cache key (library.py); 2: ep_gru_fma; 3: its gates in 8 lanes;
# 4: one small-step rule for both of its uses (same code)

_BOTH_DIRECTIONS = r'''// edgepack (gru_patch.py): the two directions of a bidirectional GRU at once, one thread each. A step
// split between threads costs two hand-overs per step, more than a small step computes; on 2 threads
// the directions always go one a thread, on more only where a step is small.
static int ep_gru_both_directions(const Mat& bottom_blob, Mat& top_forward, Mat& top_reverse, const Mat& weight_xc, const Mat& bias_c, const Mat& weight_hc, Mat& hidden, const Option& opt, const Mat& packed)
{
    const int size = bottom_blob.w;
    const int num_output = top_forward.w;
    if (opt.num_threads < 2 || (opt.num_threads > 2 && !ep_gru_small_step(size, num_output)))
    {
        Mat hidden0 = hidden.row_range(0, 1);
        int ret = gru(bottom_blob, top_forward, 0, weight_xc.channel(0), bias_c.channel(0), weight_hc.channel(0), hidden0, opt, ep_direction(packed, 0));
        if (ret != 0)
            return ret;
        Mat hidden1 = hidden.row_range(1, 1);
        return gru(bottom_blob, top_reverse, 1, weight_xc.channel(1), bias_c.channel(1), weight_hc.channel(1), hidden1, opt, ep_direction(packed, 1));
    }
    Option opt1 = opt;
    opt1.num_threads = 1;
    opt1.workspace_allocator = 0; // both threads allocate their gates at once: malloc, not the net's pool
    int rets[2] = {0, 0};
    #pragma omp parallel for num_threads(2)
    for (int d = 0; d < 2; d++)
    {
        Mat hidden_d = hidden.row_range(d, 1);
        rets[d] = gru(bottom_blob, d == 0 ? top_forward : top_reverse, d, weight_xc.channel(d), bias_c.channel(d), weight_hc.channel(d), hidden_d, opt1, ep_direction(packed, d));
    }
    return rets[0] != 0 ? rets[0] : rets[1];
}

'''
_INCLUDES_OLD = '#include "gru.h"\n'
_INCLUDES_NEW = _INCLUDES_OLD + """
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#include <math.h>
#include "cpu.h"
#define EP_GRU_FMA 1 // edgepack (gru_patch.py): ep_gru_fma below
#endif
"""

_GRU_SIGNATURE = ("static int gru(const Mat& bottom_blob, Mat& top_blob, int reverse, const Mat& weight_xc, "
                  "const Mat& bias_c, const Mat& weight_hc, Mat& hidden_state, const Option& opt)\n{\n")
# the packed weights (empty where ep_gru_fma is not taken) as a last argument, given by the forwards
_GRU_SIGNATURE_NEW = _GRU_SIGNATURE.replace("const Option& opt)", "const Option& opt, const Mat& ep_packed = Mat())")

_FMA_KERNEL = r'''// edgepack (gru_patch.py): whether a step of a direction (3H gate rows over size + H inputs) holds under
// 256k multiply-adds: too little to split between threads, which cost two hand-overs a step
static bool ep_gru_small_step(int size, int H)
{
    return 3L * H * (size + H) < (1L << 18);
}

#if EP_GRU_FMA
// edgepack (gru_patch.py): one direction of a GRU on an AVX2 + FMA CPU. Its weights packed once
// (GRU::create_pipeline): gate rows c of 3 * H (R, U, N of each unit) padded to P, a multiple of 64, as
// rows of P floats: W_x transposed (size rows), W_h transposed (H rows), then (b_R, b_U, b_WN).
static int ep_gru_pack(const Mat& weight_xc, const Mat& weight_hc, const Mat& bias_c, int size, int H, Mat& packed)
{
    const int P = packed.w;
    for (int i = 0; i < size + H; i++)
    {
        float* d = packed.row(i);
        const Mat& w = i < size ? weight_xc : weight_hc;
        const int k = i < size ? i : i - size;
        for (int c = 0; c < P; c++)
            d[c] = c < 3 * H ? w.row(c)[k] : 0.f;
    }
    float* b = packed.row(size + H);
    for (int c = 0; c < P; c++)
        b[c] = c < 3 * H ? bias_c.row(c / H)[c % H] : 0.f;
    return 0;
}

// W_x x_t + (b_R, b_U, b_WN) for the steps t0..t0+3 (those below T), 16 gate rows a block
__attribute__((target("avx2,fma"))) static void ep_gru_inputs(const Mat& bottom_blob, const Mat& packed, Mat& xg, int t0)
{
    const int size = bottom_blob.w;
    const int T = bottom_blob.h;
    const int P = packed.w;
    const float* bias = packed.row(packed.h - 1);
    const float* x0 = bottom_blob.row(t0);
    const float* x1 = bottom_blob.row(t0 + 1 < T ? t0 + 1 : T - 1);
    const float* x2 = bottom_blob.row(t0 + 2 < T ? t0 + 2 : T - 1);
    const float* x3 = bottom_blob.row(t0 + 3 < T ? t0 + 3 : T - 1);
    for (int c = 0; c < P; c += 16)
    {
        __m256 s00 = _mm256_setzero_ps(), s01 = _mm256_setzero_ps(), s10 = _mm256_setzero_ps(), s11 = _mm256_setzero_ps();
        __m256 s20 = _mm256_setzero_ps(), s21 = _mm256_setzero_ps(), s30 = _mm256_setzero_ps(), s31 = _mm256_setzero_ps();
        for (int i = 0; i < size; i++)
        {
            const float* w = packed.row(i) + c;
            const __m256 w0 = _mm256_loadu_ps(w);
            const __m256 w1 = _mm256_loadu_ps(w + 8);
            __m256 b = _mm256_broadcast_ss(x0 + i);
            s00 = _mm256_fmadd_ps(w0, b, s00);
            s01 = _mm256_fmadd_ps(w1, b, s01);
            b = _mm256_broadcast_ss(x1 + i);
            s10 = _mm256_fmadd_ps(w0, b, s10);
            s11 = _mm256_fmadd_ps(w1, b, s11);
            b = _mm256_broadcast_ss(x2 + i);
            s20 = _mm256_fmadd_ps(w0, b, s20);
            s21 = _mm256_fmadd_ps(w1, b, s21);
            b = _mm256_broadcast_ss(x3 + i);
            s30 = _mm256_fmadd_ps(w0, b, s30);
            s31 = _mm256_fmadd_ps(w1, b, s31);
        }
        const __m256 b0 = _mm256_loadu_ps(bias + c);
        const __m256 b1 = _mm256_loadu_ps(bias + c + 8);
        _mm256_storeu_ps(xg.row(t0) + c, _mm256_add_ps(s00, b0));
        _mm256_storeu_ps(xg.row(t0) + c + 8, _mm256_add_ps(s01, b1));
        if (t0 + 1 < T)
        {
            _mm256_storeu_ps(xg.row(t0 + 1) + c, _mm256_add_ps(s10, b0));
            _mm256_storeu_ps(xg.row(t0 + 1) + c + 8, _mm256_add_ps(s11, b1));
        }
        if (t0 + 2 < T)
        {
            _mm256_storeu_ps(xg.row(t0 + 2) + c, _mm256_add_ps(s20, b0));
            _mm256_storeu_ps(xg.row(t0 + 2) + c + 8, _mm256_add_ps(s21, b1));
        }
        if (t0 + 3 < T)
        {
            _mm256_storeu_ps(xg.row(t0 + 3) + c, _mm256_add_ps(s30, b0));
            _mm256_storeu_ps(xg.row(t0 + 3) + c + 8, _mm256_add_ps(s31, b1));
        }
    }
}

// out = W_h h: 64 gate rows (8 registers) at a time, h[i] broadcast against row i of W_h^T
__attribute__((target("avx2,fma"))) static void ep_gru_recurrent(const Mat& packed, int size, int H, const float* h, float* out)
{
    const int P = packed.w;
    for (int c = 0; c < P; c += 64)
    {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        __m256 a4 = _mm256_setzero_ps(), a5 = _mm256_setzero_ps(), a6 = _mm256_setzero_ps(), a7 = _mm256_setzero_ps();
        for (int i = 0; i < H; i++)
        {
            const float* w = packed.row(size + i) + c;
            const __m256 b = _mm256_broadcast_ss(h + i);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w), b, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 8), b, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 16), b, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 24), b, a3);
            a4 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 32), b, a4);
            a5 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 40), b, a5);
            a6 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 48), b, a6);
            a7 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 56), b, a7);
        }
        _mm256_storeu_ps(out + c, a0);
        _mm256_storeu_ps(out + c + 8, a1);
        _mm256_storeu_ps(out + c + 16, a2);
        _mm256_storeu_ps(out + c + 24, a3);
        _mm256_storeu_ps(out + c + 32, a4);
        _mm256_storeu_ps(out + c + 40, a5);
        _mm256_storeu_ps(out + c + 48, a6);
        _mm256_storeu_ps(out + c + 56, a7);
    }
}

// e^x in 8 lanes: 2^n e^r, n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), e^r by Cephes' expf
// polynomial; x clamped to where 2^n stays a normal float (NaN passes through: min and max return
// their second operand for a NaN)
__attribute__((target("avx2,fma"))) static inline __m256 ep_exp8(__m256 x)
{
    x = _mm256_max_ps(_mm256_set1_ps(-87.3f), _mm256_min_ps(_mm256_set1_ps(88.3f), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// one step's gates and output, 8 units a time (the tail as ncnn computes it): R = sigmoid(x_R + W_hR h),
// U likewise, N = tanh(x_N + R (b_hN + W_hN h)) as 1 - 2 / (1 + e^(2y)), out = (1 - U) N + U h
__attribute__((target("avx2,fma"))) static void ep_gru_gates(const float* xr, const float* g, const float* bias_bn, const float* h, float* out, int H)
{
    const __m256 one = _mm256_set1_ps(1.f);
    const __m256 two = _mm256_set1_ps(2.f);
    int q = 0;
    for (; q + 8 <= H; q += 8)
    {
        const __m256 R = _mm256_div_ps(one, _mm256_add_ps(one, ep_exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_add_ps(_mm256_loadu_ps(xr + q), _mm256_loadu_ps(g + q))))));
        const __m256 U = _mm256_div_ps(one, _mm256_add_ps(one, ep_exp8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_add_ps(_mm256_loadu_ps(xr + H + q), _mm256_loadu_ps(g + H + q))))));
        const __m256 y = _mm256_fmadd_ps(R, _mm256_add_ps(_mm256_loadu_ps(bias_bn + q), _mm256_loadu_ps(g + 2 * H + q)), _mm256_loadu_ps(xr + 2 * H + q));
        const __m256 N = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(one, ep_exp8(_mm256_add_ps(y, y)))));
        _mm256_storeu_ps(out + q, _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(one, U), N), _mm256_mul_ps(U, _mm256_loadu_ps(h + q))));
    }
    for (; q < H; q++)
    {
        const float R = 1.f / (1.f + expf(-(xr[q] + g[q])));
        const float U = 1.f / (1.f + expf(-(xr[H + q] + g[H + q])));
        const float N = tanhf(xr[2 * H + q] + R * (bias_bn[q] + g[2 * H + q]));
        out[q] = (1 - U) * N + U * h[q];
    }
}

// (the vector code sits in the functions above: an OpenMP region's outlined body does not take its
// function's target attribute)
static int ep_gru_fma(const Mat& bottom_blob, Mat& top_blob, int reverse, const Mat& packed, const Mat& bias_c, Mat& hidden_state, const Option& opt)
{
    const int size = bottom_blob.w;
    const int T = bottom_blob.h;
    const int H = top_blob.w;
    const int P = packed.w;
    Mat xg(P, T, 4u, opt.workspace_allocator); // row t: W_x x_t + (b_R, b_U, b_WN) for every gate row
    Mat hg(P, 4u, opt.workspace_allocator);    // one step's W_h h_{t-1}
    if (xg.empty() || hg.empty())
        return -100;

    const int TB = (T + 3) / 4;
    #pragma omp parallel for num_threads(opt.num_threads)
    for (int tb = 0; tb < TB; tb++)
        ep_gru_inputs(bottom_blob, packed, xg, tb * 4);

    float* h = hidden_state;
    float* g = hg;
    const float* bias_bn = bias_c.row(3);
    for (int t = 0; t < T; t++)
    {
        const int ti = reverse ? T - 1 - t : t;
        ep_gru_recurrent(packed, size, H, h, g);
        float* out = top_blob.row(ti);
        ep_gru_gates(xg.row(ti), g, bias_bn, h, out, H);
        for (int q = 0; q < H; q++)
            h[q] = out[q];
    }
    return 0;
}
#endif // EP_GRU_FMA

'''

_FMA_DISPATCH = """#if EP_GRU_FMA
    // edgepack (gru_patch.py): AVX2 + FMA, where the direction runs on one thread or its step is small
    if (!ep_packed.empty() && (opt.num_threads == 1 || ep_gru_small_step(bottom_blob.w, top_blob.w)))
        return ep_gru_fma(bottom_blob, top_blob, reverse, ep_packed, bias_c, hidden_state, opt);
#endif
"""

_ONE_BLOB_FORWARD = "int GRU::forward(const Mat& bottom_blob, Mat& top_blob, const Option& opt) const\n"
_CREATE_PIPELINE = r'''// edgepack (gru_patch.py): direction d of the packed weights; none where there are none (channel() of
// an empty Mat divides by its zero element size)
static Mat ep_direction(const Mat& packed, int d)
{
    return packed.empty() ? Mat() : packed.channel(d);
}

// edgepack (gru_patch.py): the weights ep_gru_fma reads, packed once per direction; none (the loop
// above) where the CPU lacks AVX2 or FMA, or the layer is int8
int GRU::create_pipeline(const Option& /*opt*/)
{
#if EP_GRU_FMA
    if (!cpu_support_x86_avx2() || !cpu_support_x86_fma() || int8_scale_term || weight_xc_data.elemsize != 4u)
        return 0;
    const int num_directions = direction == 2 ? 2 : 1;
    const int size = weight_data_size / num_directions / num_output / 3;
    const int P = (3 * num_output + 63) / 64 * 64;
    ep_packed_data.create(P, size + num_output + 1, num_directions, (size_t)4u);
    if (ep_packed_data.empty())
        return -100;
    for (int d = 0; d < num_directions; d++)
    {
        Mat packed = ep_packed_data.channel(d);
        ep_gru_pack(weight_xc_data.channel(d), weight_hc_data.channel(d), bias_c_data.channel(d), size, num_output, packed);
    }
#endif
    return 0;
}

'''
_ONE_CALL = ("            int ret = gru(bottom_blob, top_blob, direction, weight_xc_data.channel(0), bias_c_data.channel(0), "
             "weight_hc_data.channel(0), hidden, opt);\n")
_FIRST_CALL = ("            int ret = gru(bottom_blob, top_blob_forward, 0, weight_xc_data.channel(0), bias_c_data.channel(0), "
               "weight_hc_data.channel(0), hidden, opt);\n")
_SECOND_CALL = ("            int ret = gru(bottom_blob, top_blob_reverse, 1, weight_xc_data.channel(1), bias_c_data.channel(1), "
                "weight_hc_data.channel(1), hidden, opt);\n")
_HEADER_OLD = "    virtual int load_model(const ModelBin& mb);\n"
_HEADER_NEW = _HEADER_OLD + "\n    virtual int create_pipeline(const Option& opt); // edgepack (gru_patch.py)\n"
_MEMBERS_OLD = "    Mat bias_c_data;\n"
_MEMBERS_NEW = _MEMBERS_OLD + "    Mat ep_packed_data; // edgepack (gru_patch.py): ep_gru_fma's weights, [direction][size + H + 1][P]\n"

_FORWARD = "int GRU::forward(const std::vector<Mat>& bottom_blobs, std::vector<Mat>& top_blobs, const Option& opt) const\n"
_FORWARD_CALL = ("            int ret = gru(bottom_blob, top_blob_forward, 0, weight_xc_data.channel(0), bias_c_data.channel(0), "
                 "weight_hc_data.channel(0), hidden0, opt);\n")
_REVERSE_CALL = ("            int ret = gru(bottom_blob, top_blob_reverse, 1, weight_xc_data.channel(1), bias_c_data.channel(1), "
                 "weight_hc_data.channel(1), hidden1, opt);\n")

_EDITS = (
    ("its includes", _INCLUDES_OLD, _INCLUDES_NEW, 1),
    ("its one-direction loop", _GRU_SIGNATURE, _FMA_KERNEL + _GRU_SIGNATURE_NEW + _FMA_DISPATCH, 1),
    ("its weights packed once", _ONE_BLOB_FORWARD, _CREATE_PIPELINE + _ONE_BLOB_FORWARD, 1),
    ("the forwards of one direction", _ONE_CALL, _ONE_CALL.replace("hidden, opt);", "hidden, opt, ep_direction(ep_packed_data, 0));"), 2),
    ("the forward's first of two directions", _FIRST_CALL, _FIRST_CALL.replace("hidden, opt);", "hidden, opt, ep_direction(ep_packed_data, 0));"), 1),
    ("the forward's second of two directions", _SECOND_CALL, _SECOND_CALL.replace("hidden, opt);", "hidden, opt, ep_direction(ep_packed_data, 1));"), 1),
    # both directions from the forward direction's call
    ("the forward of state blobs", _FORWARD, _BOTH_DIRECTIONS + _FORWARD, 1),
    ("its forward direction", _FORWARD_CALL, "            int ret = ep_gru_both_directions(bottom_blob, top_blob_forward, "
     "top_blob_reverse, weight_xc_data, bias_c_data, weight_hc_data, hidden, opt, ep_packed_data);\n", 1),
    ("its reverse direction", _REVERSE_CALL, "            int ret = 0; // computed with the forward direction (gru_patch.py)\n", 1),
)

GRU_FILE = Path("src") / "layer" / "gru.cpp"
GRU_HEADER = Path("src") / "layer" / "gru.h"
_HEADER_EDITS = (
    ("its create_pipeline", _HEADER_OLD, _HEADER_NEW, 1),
    ("its packed weights", _MEMBERS_OLD, _MEMBERS_NEW, 1),
)
_FILE_EDITS = ((GRU_HEADER, _HEADER_EDITS), (GRU_FILE, _EDITS))

GRU_PATCH_KEY = file_edits_key(GRU_PATCH_VERSION, _FILE_EDITS)


def patch_gru(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place."""
    apply_file_edits(src, _FILE_EDITS, "gru_patch.py")
