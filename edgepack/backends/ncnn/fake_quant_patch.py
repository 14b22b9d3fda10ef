"""Static int8's fake quantisation in one pass: divide, round, clip, multiply (x86).

quantized_qdq.py lowers each QuantizeLinear -> DequantizeLinear pair on an activation to float ops,
and pnnx writes them as four layers: BinaryOp (x / s), UnaryOp round (half to even), Clip (the integer
range) and BinaryOp (* s). Each is a pass over the tensor: on smart_turn_v3 (a QDQ transformer)
those passes were ~23% of its time after the integer GEMMs were made fast (2026-12-05 profile:
binary_op_vector 15%, Clip 4%, round 4%).

``fold_fake_quant`` rewrites such a chain in the .param (after the ncnn wheel's conversion check,
which runs stock ncnn) into one Clip line carrying the other steps as parameters: 20=s (divide
first), 21=1 (round half to even), 22=m (multiply last). The chain's own order is kept, so the result
is the same bits as the four layers on every x86 CPU: the division is IEEE division (the same
`float_control(precise)` trick as exact_div_patch.py, so -ffast-math makes no reciprocal of it), the
rounding the same instruction ncnn's UnaryOp uses on that CPU, then the Clip's max/min, then one
multiply. A link of the chain is folded only where the next layer is its blob's one reader and the
blob is not an output the runtime extracts.

Only x86 libraries carry the Clip edit, so only x86_64 builds take the folded .param; Arm builds keep
the four layers.
"""
from __future__ import annotations

from pathlib import Path

from .exact_div_patch import EXACT_DIV_MACRO
from .param_graph import Line, is_float
from .source_patch import apply_file_edits, file_edits_key

FAKE_QUANT_PATCH_VERSION = 3  # 2: the quotient by FMA corrections where it is rounded and clamped; 3: a channel split among threads
DIV_KEY, ROUND_KEY, MUL_KEY = 20, 21, 22   # Clip param keys (ncnn's Clip reads 0-1; the Layer base 30-31)

_H_OLD = """    virtual int forward_inplace(Mat& bottom_top_blob, const Option& opt) const;

protected:
"""
_H_NEW = """    virtual int load_param(const ParamDict& pd);

    virtual int forward_inplace(Mat& bottom_top_blob, const Option& opt) const;

public:
    // edgepack (fake_quant_patch.py): a fake-quantisation chain folded into this Clip
    float ep_div;  // 20: divide by this first (0: no division)
    int ep_round;  // 21: 1: round half to even after the division
    float ep_mul;  // 22: multiply by this last (1: no multiplication)
    float ep_divr; // 1 / ep_div, rounded once
    int ep_fma_quot; // 1: the quotient by FMA corrections (same rounded values; see ep_fq_quot)

protected:
    int ep_forward_fake_quant(Mat& bottom_top_blob, const Option& opt) const;
"""

_CPP_ANCHOR = "Clip_x86::Clip_x86()\n{\n"
_CPP_HELPERS = (r'''// ---- edgepack (fake_quant_patch.py) ----
// Division as IEEE division, even under -ffast-math: EP_EXACT_DIV (exact_div_patch.py's, for the
// BinaryOp division this replaces) keeps one expression free of fast-math flags, so no reciprocal is
// hoisted out of the loop. T: float, __m128, __m256 or __m512.'''
                + EXACT_DIV_MACRO + r'''
#include <math.h>

#include <algorithm>

namespace {

template<typename T>
static inline T ep_fq_div(T x, T y)
{
    EP_EXACT_DIV
    return x / y;
}

#if __SSE2__
// UnaryOp round's instruction on this CPU (unaryop_functor.h): roundps with SSE4.1, else a round
// trip through int32 in the default rounding mode (half to even); values of 2^23 or more are
// integers already and stay as they are (the int32 trip would overflow them)
static inline __m128 ep_fq_round(__m128 x)
{
#if __SSE4_1__
    return _mm_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    const __m128 big = _mm_cmpge_ps(_mm_andnot_ps(_mm_set1_ps(-0.f), x), _mm_set1_ps(8388608.f));
    const __m128 r = _mm_cvtepi32_ps(_mm_cvtps_epi32(x));
    return _mm_or_ps(_mm_and_ps(big, x), _mm_andnot_ps(big, r));
#endif
}
#endif // __SSE2__

// x / y by FMAs (Markstein): q0 = x * yr with yr = 1 / y rounded once, then two corrections
// q += (x - q y) yr, each remainder computed exactly by one fma. A division's one quotient a cycle became
// four vector FMAs' worth (vdivps is ~10 cycles a 16-lane register on Sapphire Rapids; the division was
// 12% of a QDQ transformer's time). Taken only where the quotient is then rounded to an integer and
// clamped within 2^20, with 2^-40 <= |y| <= 2^40 (load_param decides): there the rounded, clamped value
// equals the IEEE division's, checked for every float32 x against 51 divisors, with and without
// flush-to-zero (2026-12-05; the quotients themselves differ only far from any rounding boundary: below
// 1e-30, or past 2^22, where q0 is kept: it is an integer there, as is the quotient, beyond the clamp).
// A zero keeps the sign of x / y. The pragma keeps fast-math from re-associating any step.
#if __AVX512F__
static inline __m512 ep_fq_quot(__m512 x, __m512 y, __m512 yr)
{
    EP_EXACT_DIV
    const __m512 q0 = _mm512_mul_ps(x, yr);
    const __m512 q1 = _mm512_fmadd_ps(_mm512_fnmadd_ps(q0, y, x), yr, q0);
    const __m512 q2 = _mm512_or_ps(_mm512_fmadd_ps(_mm512_fnmadd_ps(q1, y, x), yr, q1), _mm512_and_ps(q0, _mm512_set1_ps(-0.f)));
    const __mmask16 big = _mm512_cmp_ps_mask(_mm512_abs_ps(q0), _mm512_set1_ps(4194304.f), _CMP_GE_OQ);
    return _mm512_mask_blend_ps(big, q2, q0);
}
#elif __AVX__
// the same on AVX2 CPUs (this file's AVX build has no FMA of its own: the loop is its own FMA function)
__attribute__((target("avx,fma"))) static inline __m256 ep_fq_quot(__m256 x, __m256 y, __m256 yr)
{
    EP_EXACT_DIV
    const __m256 q0 = _mm256_mul_ps(x, yr);
    const __m256 q1 = _mm256_fmadd_ps(_mm256_fnmadd_ps(q0, y, x), yr, q0);
    const __m256 q2 = _mm256_or_ps(_mm256_fmadd_ps(_mm256_fnmadd_ps(q1, y, x), yr, q1), _mm256_and_ps(q0, _mm256_set1_ps(-0.f)));
    const __m256 big = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), q0), _mm256_set1_ps(4194304.f), _CMP_GE_OQ);
    return _mm256_blendv_ps(q2, q0, big);
}

// divide (by FMAs), round, clip, multiply: the 8-lane part of a span; returns how far it got
__attribute__((target("avx,fma"))) static int ep_fq_span_fma(float* ptr, int size, float d, float dr, float lo, float hi, float m)
{
    const __m256 d8 = _mm256_set1_ps(d), dr8 = _mm256_set1_ps(dr), lo8 = _mm256_set1_ps(lo), hi8 = _mm256_set1_ps(hi);
    const __m256 m8 = _mm256_set1_ps(m);
    int i = 0;
    for (; i + 7 < size; i += 8)
    {
        __m256 p = _mm256_round_ps(ep_fq_quot(_mm256_loadu_ps(ptr + i), d8, dr8), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        p = _mm256_min_ps(_mm256_max_ps(p, lo8), hi8);
        if (m != 1.f)
            p = _mm256_mul_ps(p, m8);
        _mm256_storeu_ps(ptr + i, p);
    }
    return i;
}
#endif

} // namespace

int Clip_x86::load_param(const ParamDict& pd)
{
    int ret = Clip::load_param(pd);
    ep_div = pd.get(20, 0.f);
    ep_round = pd.get(21, 0);
    ep_mul = pd.get(22, 1.f);
    ep_divr = ep_div != 0.f ? ep_fq_div(1.f, ep_div) : 0.f;
    const float ad = fabsf(ep_div);
    ep_fma_quot = ep_round && ad >= 0x1p-40f && ad <= 0x1p40f && fabsf(min) <= 1048576.f && fabsf(max) <= 1048576.f;
#if NCNN_BF16
    if (ep_div != 0.f || ep_round || ep_mul != 1.f)
        support_bf16_storage = false; // the fused steps are written for fp32 blobs
#endif
    return ret;
}

namespace {

// The fused steps' parameters, passed by value: the loop keeps them in registers (read through the layer,
// each store to the blob made the compiler load them again)
struct ep_fq_params
{
    float d, dr, lo, hi, m;
    bool div, rnd, mul, fq;
};

// one channel's span: divide, round, clip as Clip does, multiply
static void ep_fq_span(float* ptr, int size, const ep_fq_params p)
{
    int i = 0;
#if __AVX512F__
    const __m512 d16 = _mm512_set1_ps(p.d);
    const __m512 lo16 = _mm512_set1_ps(p.lo);
    const __m512 hi16 = _mm512_set1_ps(p.hi);
    const __m512 m16 = _mm512_set1_ps(p.m);
    const __m512 dr16 = _mm512_set1_ps(p.dr);
    for (; i < size; i += 16)
    {
        const __mmask16 k = size - i >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (size - i)) - 1);
        __m512 x = _mm512_maskz_loadu_ps(k, ptr + i);
        if (p.fq)
            x = ep_fq_quot(x, d16, dr16);
        else if (p.div)
            x = ep_fq_div(x, d16);
        if (p.rnd)
            x = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        x = _mm512_min_ps(_mm512_max_ps(x, lo16), hi16);
        if (p.mul)
            x = _mm512_mul_ps(x, m16);
        _mm512_mask_storeu_ps(ptr + i, k, x);
    }
#else // __AVX512F__
#if __AVX__
    const __m256 d8 = _mm256_set1_ps(p.d);
    const __m256 lo8 = _mm256_set1_ps(p.lo);
    const __m256 hi8 = _mm256_set1_ps(p.hi);
    const __m256 m8 = _mm256_set1_ps(p.m);
    if (p.fq)
        i = ep_fq_span_fma(ptr, size, p.d, p.dr, p.lo, p.hi, p.m);
    for (; i + 7 < size; i += 8)
    {
        __m256 x = _mm256_loadu_ps(ptr + i);
        if (p.div)
            x = ep_fq_div(x, d8);
        if (p.rnd)
            x = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        x = _mm256_min_ps(_mm256_max_ps(x, lo8), hi8);
        if (p.mul)
            x = _mm256_mul_ps(x, m8);
        _mm256_storeu_ps(ptr + i, x);
    }
#endif // __AVX__
#if __SSE2__
    const __m128 d4 = _mm_set1_ps(p.d);
    const __m128 lo4 = _mm_set1_ps(p.lo);
    const __m128 hi4 = _mm_set1_ps(p.hi);
    const __m128 m4 = _mm_set1_ps(p.m);
    for (; i + 3 < size; i += 4)
    {
        __m128 x = _mm_loadu_ps(ptr + i);
        if (p.div)
            x = ep_fq_div(x, d4);
        if (p.rnd)
            x = ep_fq_round(x);
        x = _mm_min_ps(_mm_max_ps(x, lo4), hi4);
        if (p.mul)
            x = _mm_mul_ps(x, m4);
        _mm_storeu_ps(ptr + i, x);
    }
#endif // __SSE2__
    for (; i < size; i++)
    {
        float v = ptr[i];
        if (p.div)
            v = ep_fq_div(v, p.d);
        if (p.rnd)
            v = nearbyintf(v);
        if (v < p.lo)
            v = p.lo;
        if (v > p.hi)
            v = p.hi;
        ptr[i] = p.mul ? v * p.m : v;
    }
#endif // __AVX512F__
}

} // namespace

// The chain's steps in its own order (divide, round, clip as Clip does, multiply): the same bits as
// the BinaryOp, UnaryOp, Clip and BinaryOp layers it replaces
int Clip_x86::ep_forward_fake_quant(Mat& bottom_top_blob, const Option& opt) const
{
    const int channels = bottom_top_blob.c;
    const int size = bottom_top_blob.w * bottom_top_blob.h * bottom_top_blob.d * bottom_top_blob.elempack;
    ep_fq_params p;
    p.d = ep_div;
    p.dr = ep_divr;
    p.lo = min;
    p.hi = max;
    p.m = ep_mul;
    p.div = ep_div != 0.f;
    p.rnd = ep_round != 0;
    p.mul = ep_mul != 1.f;
#if __AVX512F__
    p.fq = p.div && ep_fma_quot;
#elif __AVX__
    p.fq = p.div && ep_fma_quot && cpu_support_x86_fma();
#else
    p.fq = false;
#endif

    // each channel in `pieces` spans of whole 16-float vectors, so that a blob of one channel (a 2-D
    // GEMM output: ncnn's Clip runs it on one thread) still spreads over every thread
    const int threads = opt.num_threads > 0 ? opt.num_threads : 1;
    const int vectors = (size + 15) / 16;
    const int pieces = channels >= threads ? 1 : std::min(vectors, (2 * threads + channels - 1) / channels);
    const int step = (vectors + pieces - 1) / pieces * 16;
    #pragma omp parallel for num_threads(opt.num_threads)
    for (int t = 0; t < channels * pieces; t++)
    {
        const int start = t % pieces * step;
        if (start < size)
            ep_fq_span((float*)bottom_top_blob.channel(t / pieces) + start, std::min(step, size - start), p);
    }

    return 0;
}
// ---- end edgepack ----

''')

_FWD_OLD = """        return forward_inplace_bf16s(bottom_top_blob, opt);
#endif

    const int w = bottom_top_blob.w;
"""
_FWD_NEW = """        return forward_inplace_bf16s(bottom_top_blob, opt);
#endif

    if (ep_div != 0.f || ep_round || ep_mul != 1.f)
        return ep_forward_fake_quant(bottom_top_blob, opt);

    const int w = bottom_top_blob.w;
"""

_FILE_EDITS = (
    ("src/layer/x86/clip_x86.h", (("Clip_x86's members", _H_OLD, _H_NEW, 1),)),
    ("src/layer/x86/clip_x86.cpp", (
        ("the fused pass, before the constructor", _CPP_ANCHOR, _CPP_HELPERS + _CPP_ANCHOR, 1),
        ("forward_inplace's dispatch", _FWD_OLD, _FWD_NEW, 1),
    )),
)

FAKE_QUANT_PATCH_KEY = file_edits_key(FAKE_QUANT_PATCH_VERSION, _FILE_EDITS)


def patch_fake_quant(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place (x86 builds)."""
    apply_file_edits(src, _FILE_EDITS, "fake_quant_patch.py")


# ---- the .param side ----

def _scalar_op(line: Line, op: str) -> str | None:
    """The scalar of a `BinaryOp x <op> scalar` line (op "3" divide, "2" multiply), else None."""
    f = line.fields
    if line.type != "BinaryOp" or not line.one_to_one() or set(f) != {"0", "1", "2"}:
        return None
    return f["2"] if f["0"] == op and f["1"] == "1" and is_float(f["2"]) and float(f["2"]) != 0.0 else None


def fold_fake_quant(param_text: str, outputs: tuple[str, ...] = ()) -> tuple[str, int]:
    """The .param with every `x / s -> round -> clip [-> * m]` chain written as one Clip line (keys 20,
    21, 22), and how many chains were folded. ``outputs`` are blobs the runtime extracts: never folded
    away. Lines and blobs not in a chain are kept as they are."""
    lines = param_text.strip().splitlines()
    if len(lines) < 2:
        return param_text, 0
    layers = [Line(s) for s in lines[2:] if s.strip()]
    readers: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        for b in layer.bottoms:
            readers.setdefault(b, []).append(i)

    def next_of(i: int) -> int | None:
        """The index of the one layer that reads layer i's one output, where no one else (and no
        extraction) does."""
        top = layers[i].tops[0]
        r = readers.get(top, [])
        return r[0] if len(r) == 1 and top not in outputs else None

    drop: set[int] = set()
    replace: dict[int, str] = {}
    for i, div in enumerate(layers):
        s = _scalar_op(div, "3")
        if s is None or i in drop:
            continue
        r = next_of(i)
        rnd = layers[r] if r is not None else None
        if rnd is None or rnd.type != "UnaryOp" or not rnd.one_to_one() or rnd.fields != {"0": "18"}:
            continue
        c = next_of(r)
        clip = layers[c] if c is not None else None
        if (clip is None or clip.type != "Clip" or not clip.one_to_one() or set(clip.fields) != {"0", "1"}
                or not all(is_float(clip.fields[k]) for k in ("0", "1"))):
            continue
        chain = [r, c]   # the links after the division, dropped
        fields = f"0={clip.fields['0']} 1={clip.fields['1']} {DIV_KEY}={s} {ROUND_KEY}=1"
        m_at = next_of(c)
        m = _scalar_op(layers[m_at], "2") if m_at is not None else None
        if m is not None:
            chain.append(m_at)
            fields += f" {MUL_KEY}={m}"
        replace[i] = f"{'Clip':<24} {clip.name:<24} 1 1 {div.bottoms[0]} {layers[chain[-1]].tops[0]} {fields}"
        drop.update(chain)
    if not replace:
        return param_text, 0
    out = [replace.get(i, layer.text) for i, layer in enumerate(layers) if i not in drop]
    n_layers, n_blobs = (int(v) for v in lines[1].split())
    # each dropped layer took one intermediate blob with it
    header = f"{n_layers - len(drop)} {n_blobs - len(drop)}"
    return "\n".join([lines[0], header] + out) + "\n", len(replace)
