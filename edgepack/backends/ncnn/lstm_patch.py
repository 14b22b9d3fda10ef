"""Two speed changes to the pinned ncnn's x86 LSTM (src/layer/x86/lstm_fp32.h, lstm_x86.cpp).

1. The input products W_xc x_t + b_c of every time step are computed in one pass before the
   recurrence. ncnn computes W_xc x_t and W_hc h_{t-1} together at each step, so it streams both
   weight matrices from memory at every step: ddddocr_crnn's bidirectional LSTM (512 in, 512 hidden,
   20 steps) read 2 x 20 x 8 MiB that way, 12.7 ms of its 22.5 ms on one core of the AVX-512 Xeon
   (2026-12-01), where onnxruntime, which batches the input product over the sequence, takes 6.8 ms
   for the layer. The pass walks the weights unit by unit (a pair of hidden units holds 16 KiB of
   W_xc: it stays in L1 while four time steps at a time are multiplied against it), so W_xc is read
   once per inference; each step starts from its precomputed row and streams only W_hc.
2. Under fp16 storage, W_hc is kept in fp16 (converted with F16C as it is read), which halves what
   every step streams. Only where the lstm() that runs was compiled with F16C: the AVX-512 build of
   the layer, and the AVX build's hand-over to lstm_fma (FMA CPUs); SSE-only CPUs keep fp32. An
   fp16-storage build already stores fp16-rounded weights, so the fp16 copy adds no error there.
   Version 3 keeps W_xc in fp16 too, for memory (ddddocr_crnn: 8.4 -> 4.2 MB): the pass of 1. widens a
   pair of units' rows (16 KiB) into a per-thread buffer once and reads it for every time step.

ddddocr_crnn, 1 thread: 22.3 -> 16.3 (1) -> 11.5 ms (1+2) against onnxruntime's 13.5 ms. Same
arithmetic per gate otherwise; only the order of the fp32 additions changes (the build verifies
against onnxruntime as before). Applied as exact text edits that must each match, like
source_patch.py: a new ncnn pin whose LSTM changed fails the libncnn build with a clear error.
Only x86 builds compile these files, so only their cache key carries LSTM_PATCH_KEY.
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key
from .winograd_fp16_patch import F16C_HELPERS, immintrin_include

LSTM_PATCH_VERSION = 4  # part of the x86 libncnn cache key (library.py); 2: fp16 W_hc under fp16 storage; 3: W_xc too;
#                         4: packed straight into fp16, a row at a time

_HELPER = r'''// edgepack: W_xc x_t + b_c for every step t, before the recurrence (lstm_patch.py).
// xgates row t holds the gates of unit q at q * 4 (I F O G), the order the step loop wants.
// row r (n values) of W_xc as fp32: the row itself, or (fp16 W_xc, F16C builds) the row widened into this thread's
// channel of `wide`, where the pass below reads it for every time step (lstm_patch.py, 3)
static const float* ep_lstm_xc_row(const Mat& weight_xc, int r, int n, const Mat& wide)
{
#if __F16C__
    if (weight_xc.elemsize / weight_xc.elempack == 2u)
    {
        float* dst = (float*)wide.channel(get_omp_thread_num()).data;
        ep_wf16_widen(weight_xc.row<const unsigned short>(r), dst, n); // F16C_HELPERS
        return dst;
    }
#endif
    (void)n;
    (void)wide;
    return weight_xc.row(r);
}

static void ep_lstm_input_gates(const Mat& bottom_blob, const Mat& weight_xc, const Mat& bias_c, Mat& xgates, int hidden_size, const Mat& wide, const Option& opt)
{
    const int size = bottom_blob.w;
    const int T = bottom_blob.h;
    int remain_hidden_size_start = 0;
#if __AVX__
    const int nn_hidden_size = hidden_size >> 1;
    remain_hidden_size_start = nn_hidden_size << 1;
    #pragma omp parallel for num_threads(opt.num_threads)
    for (int qq = 0; qq < nn_hidden_size; qq++)
    {
        const int q = qq * 2;
        const float* w = ep_lstm_xc_row(weight_xc, qq, size * 8, wide);
        const __m256 _bias = _mm256_loadu_ps((const float*)bias_c + q * 4);
        int t = 0;
        for (; t + 3 < T; t += 4)
        {
            const float* x0 = bottom_blob.row(t);
            const float* x1 = bottom_blob.row(t + 1);
            const float* x2 = bottom_blob.row(t + 2);
            const float* x3 = bottom_blob.row(t + 3);
            __m256 _s0 = _bias;
            __m256 _s1 = _bias;
            __m256 _s2 = _bias;
            __m256 _s3 = _bias;
            const float* wp = w;
            for (int i = 0; i < size; i++)
            {
                __m256 _w = _mm256_loadu_ps(wp);
                _s0 = _mm256_comp_fmadd_ps(_w, _mm256_broadcast_ss(x0 + i), _s0);
                _s1 = _mm256_comp_fmadd_ps(_w, _mm256_broadcast_ss(x1 + i), _s1);
                _s2 = _mm256_comp_fmadd_ps(_w, _mm256_broadcast_ss(x2 + i), _s2);
                _s3 = _mm256_comp_fmadd_ps(_w, _mm256_broadcast_ss(x3 + i), _s3);
                wp += 8;
            }
            _mm256_storeu_ps(xgates.row(t) + q * 4, _s0);
            _mm256_storeu_ps(xgates.row(t + 1) + q * 4, _s1);
            _mm256_storeu_ps(xgates.row(t + 2) + q * 4, _s2);
            _mm256_storeu_ps(xgates.row(t + 3) + q * 4, _s3);
        }
        for (; t < T; t++)
        {
            const float* x = bottom_blob.row(t);
            __m256 _s = _bias;
            const float* wp = w;
            for (int i = 0; i < size; i++)
            {
                _s = _mm256_comp_fmadd_ps(_mm256_loadu_ps(wp), _mm256_broadcast_ss(x + i), _s);
                wp += 8;
            }
            _mm256_storeu_ps(xgates.row(t) + q * 4, _s);
        }
    }
#endif // __AVX__
    #pragma omp parallel for num_threads(opt.num_threads)
    for (int q = remain_hidden_size_start; q < hidden_size; q++)
    {
#if __AVX__
        const float* w = ep_lstm_xc_row(weight_xc, q / 2 + q % 2, size * 4, wide);
#else
        const float* w = weight_xc.row(q);
#endif
        const float* b = (const float*)bias_c + q * 4;
        for (int t = 0; t < T; t++)
        {
            const float* x = bottom_blob.row(t);
            float* out = xgates.row(t) + q * 4;
            const float* wp = w;
#if __SSE2__
            __m128 _s = _mm_loadu_ps(b);
            for (int i = 0; i < size; i++)
            {
                _s = _mm_comp_fmadd_ps(_mm_loadu_ps(wp), _mm_load1_ps(x + i), _s);
                wp += 4;
            }
            _mm_storeu_ps(out, _s);
#else
            float I = b[0], F = b[1], O = b[2], G = b[3];
            for (int i = 0; i < size; i++)
            {
                I += x[i] * wp[0];
                F += x[i] * wp[1];
                O += x[i] * wp[2];
                G += x[i] * wp[3];
                wp += 4;
            }
            out[0] = I;
            out[1] = F;
            out[2] = O;
            out[3] = G;
#endif
        }
    }
}

'''

_SIGNATURE = "static int lstm(const Mat& bottom_blob, Mat& top_blob, int reverse, const Mat& weight_xc,"
_GATES = "    Mat gates(4, hidden_size, 4u, opt.workspace_allocator);\n    if (gates.empty())\n        return -100;\n"
_SCALAR_INIT = ("            float I = bias_c_IFOG[0];\n            float F = bias_c_IFOG[1];\n"
                "            float O = bias_c_IFOG[2];\n            float G = bias_c_IFOG[3];\n")
_STEP_ROW = "            const float* x = bottom_blob.row(ti);\n\n            int i = 0;\n"

_HC_FLAG = r'''#if __F16C__
    const bool hc_fp16 = weight_hc.elemsize / weight_hc.elempack == 2u; // edgepack: fp16 W_hc (lstm_patch.py)
#else
    if (weight_hc.elemsize / weight_hc.elempack == 2u || weight_xc.elemsize / weight_xc.elempack == 2u)
        return -1; // fp16 W_hc and W_xc are only packed for code built with F16C
#endif
'''

# the recurrent product of a pair of units (8 lanes) from fp16 weights; leaves i == num_output, so the
# fp32 loops after it do nothing
_HC_PAIR_OLD = ("            const float* hidden_ptr = hidden_state;\n\n            i = 0;\n"
                "            for (; i + 3 < num_output; i += 4)\n            {\n"
                "                __m256 _h_cont0 = _mm256_broadcast_ss(hidden_ptr);\n")
_HC_PAIR_FP16 = r'''#if __F16C__
            if (hc_fp16)
            {
                const unsigned short* w16 = weight_hc.row<const unsigned short>(q / 2);
                for (; i + 3 < num_output; i += 4)
                {
                    _IFOG = _mm256_comp_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)w16)), _mm256_broadcast_ss(hidden_ptr), _IFOG);
                    _sum1 = _mm256_comp_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w16 + 8))), _mm256_broadcast_ss(hidden_ptr + 1), _sum1);
                    _sum2 = _mm256_comp_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w16 + 16))), _mm256_broadcast_ss(hidden_ptr + 2), _sum2);
                    _sum3 = _mm256_comp_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w16 + 24))), _mm256_broadcast_ss(hidden_ptr + 3), _sum3);
                    hidden_ptr += 4;
                    w16 += 32;
                }
                for (; i < num_output; i++)
                {
                    _IFOG = _mm256_comp_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)w16)), _mm256_broadcast_ss(hidden_ptr), _IFOG);
                    hidden_ptr += 1;
                    w16 += 8;
                }
            }
#endif
'''
# the same for the unit left over (4 lanes; with F16C the 8-lane layout's row q / 2 + q % 2)
_HC_ONE_OLD = ("            const float* hidden_ptr = hidden_state;\n\n            i = 0;\n#if __SSE2__\n"
               "            for (; i + 3 < num_output; i += 4)\n")
_HC_ONE_FP16 = r'''#if __F16C__
            if (hc_fp16)
            {
                const unsigned short* w16 = weight_hc.row<const unsigned short>(q / 2 + q % 2);
                for (; i < num_output; i++)
                {
                    _IFOG = _mm_comp_fmadd_ps(_mm_cvtph_ps(_mm_loadl_epi64((const __m128i*)w16)), _mm_load1_ps(hidden_ptr), _IFOG);
                    hidden_ptr += 1;
                    w16 += 4;
                }
            }
#endif
'''
_AT_I0 = "            i = 0;\n"

# (what, old text, new text, how many times it must occur)
_EDITS = (
    # F16C_HELPERS here too: lstm_x86_fma.cpp includes this file alone (in lstm_x86.cpp the first copy's guard holds)
    ("the input-gates helper", _SIGNATURE, F16C_HELPERS + _HELPER + _SIGNATURE, 1),
    ("the gates workspace", _GATES,
     _GATES + _HC_FLAG + "\n    Mat xgates(hidden_size * 4, T, 4u, opt.workspace_allocator);\n"
              "    if (xgates.empty())\n        return -100;\n"
              "    Mat ep_xc_wide; // each thread's fp32 row of an fp16 W_xc\n"
              "    if (weight_xc.elemsize / weight_xc.elempack == 2u)\n    {\n"
              "        ep_xc_wide.create(size * 8, 1, opt.num_threads, 4u, opt.workspace_allocator);\n"
              "        if (ep_xc_wide.empty())\n            return -100;\n    }\n"
              "    ep_lstm_input_gates(bottom_blob, weight_xc, bias_c, xgates, hidden_size, ep_xc_wide, opt);\n", 1),
    ("the 8-lane step's bias load", "            __m256 _IFOG = _mm256_loadu_ps(bias_c_IFOG);\n",
     "            __m256 _IFOG = _mm256_loadu_ps(xgates.row(ti) + q * 4);\n", 1),
    ("the 4-lane step's bias load", "            __m128 _IFOG = _mm_loadu_ps(bias_c_IFOG);\n",
     "            __m128 _IFOG = _mm_loadu_ps(xgates.row(ti) + q * 4);\n", 1),
    ("the scalar step's bias load", _SCALAR_INIT, _SCALAR_INIT.replace("bias_c_IFOG[", "xgates.row(ti)[q * 4 + "), 1),
    ("the step's input product", _STEP_ROW,
     _STEP_ROW.replace("int i = 0;", "int i = size; // edgepack: W_xc x_t + b_c are in xgates already"), 2),
    ("the step's bias pointer", "            const float* bias_c_IFOG = (const float*)bias_c + q * 4;\n", "", 2),
    ("the 8-lane recurrent product", _HC_PAIR_OLD, _HC_PAIR_OLD.replace(_AT_I0, _AT_I0 + _HC_PAIR_FP16), 1),
    ("the 4-lane recurrent product", _HC_ONE_OLD, _HC_ONE_OLD.replace(_AT_I0, _AT_I0 + _HC_ONE_FP16), 1),
)

# create_pipeline (lstm_x86.cpp): W_hc and W_xc in fp16 under fp16 storage, when the lstm() that will run them was
# compiled with F16C: this layer's own build (the AVX-512 one), or the AVX build's hand-over to lstm_fma. Version 4
# packs them straight into fp16: each packed row is gathered in fp32 in this thread's row buffer and narrowed
# (F16C_HELPERS), where version 3 packed both whole in fp32 and then cast them. ddddocr_crnn (2 x 2048 x 512 each):
# the load held the fp32 weights, their fp32 packed copies and the fp16 ones at once, 40 MB at its peak.
_INCLUDES_OLD = '#include "cpu.h"\n\nnamespace ncnn {\n\n#include "lstm_int8.h"\n'
_INCLUDES_NEW = ('#include "cpu.h"\n\n' + immintrin_include("lstm_patch.py")
                 + '\nnamespace ncnn {\n\n' + F16C_HELPERS + '\n#include "lstm_int8.h"\n')
_PACKED_OLD = """#if __AVX__
    weight_xc_data_packed.create(size, hidden_size / 2 + hidden_size % 2, num_directions, 32u, 8);
    bias_c_data_packed.create(hidden_size, 1, num_directions, 16u, 4);
    weight_hc_data_packed.create(num_output, hidden_size / 2 + hidden_size % 2, num_directions, 32u, 8);
#else
"""
_PACKED_NEW = r"""    // edgepack (lstm_patch.py): fp16 W_hc halves what every step streams from memory; fp16 W_xc what is held.
    // They are packed straight into fp16, a row at a time through this thread's fp32 rows (ep_rowsX)
#if defined(EP_WF16) && __F16C__
    const bool ep_hc_fp16 = opt.use_fp16_storage;
#elif defined(EP_WF16) && __AVX__ && NCNN_RUNTIME_CPU && NCNN_FMA && !__FMA__ && !__FMA4__
    const bool ep_hc_fp16 = opt.use_fp16_storage && cpu_support_x86_fma() && cpu_support_x86_f16c();
#else
    const bool ep_hc_fp16 = false;
#endif
    Mat ep_rowsX; // per thread: a packed row of W_xc, then one of W_hc
    if (ep_hc_fp16)
    {
        ep_rowsX.create((size + num_output) * 8, 1, opt.num_threads, 4u, (Allocator*)0);
        if (ep_rowsX.empty())
            return -100;
    }

#if __AVX__
    weight_xc_data_packed.create(size, hidden_size / 2 + hidden_size % 2, num_directions, ep_hc_fp16 ? 16u : 32u, 8);
    bias_c_data_packed.create(hidden_size, 1, num_directions, 16u, 4);
    weight_hc_data_packed.create(num_output, hidden_size / 2 + hidden_size % 2, num_directions, ep_hc_fp16 ? 16u : 32u, 8);
#else
"""
_PAIR_ROWS_OLD = ("            float* weight_xc_IFOG = weight_xc_data_packed_dr.row(q / 2);\n"
                  "            float* weight_hc_IFOG = weight_hc_data_packed_dr.row(q / 2);\n")
_PAIR_ROWS_NEW = ("            float* ep_rows = ep_hc_fp16 ? (float*)ep_rowsX.channel(get_omp_thread_num()).data : 0;\n"
                  "            float* weight_xc_IFOG = ep_hc_fp16 ? ep_rows : weight_xc_data_packed_dr.row(q / 2);\n"
                  "            float* weight_hc_IFOG = ep_hc_fp16 ? ep_rows + size * 8 : weight_hc_data_packed_dr.row(q / 2);\n")
_TAIL_ROWS_OLD = ("            float* weight_xc_IFOG = weight_xc_data_packed_dr.row(q / 2 + q % 2);\n"
                  "            float* weight_hc_IFOG = weight_hc_data_packed_dr.row(q / 2 + q % 2);\n")
_TAIL_ROWS_NEW = ("            float* ep_rows = ep_hc_fp16 ? (float*)ep_rowsX.channel(get_omp_thread_num()).data : 0;\n"
                  "            float* weight_xc_IFOG = ep_hc_fp16 ? ep_rows : weight_xc_data_packed_dr.row(q / 2 + q % 2);\n"
                  "            float* weight_hc_IFOG = ep_hc_fp16 ? ep_rows + size * 8 : weight_hc_data_packed_dr.row(q / 2 + q % 2);\n")


def _narrow_rows(lanes: int, row: str) -> str:
    """After a unit's (lanes 8: a pair's; 4: the odd one's) packed rows are gathered: narrowed into the fp16 rows."""
    return ("#if defined(EP_WF16)\n"
            "            if (ep_hc_fp16) // edgepack (lstm_patch.py): the gathered rows into the fp16 packed ones\n"
            "            {\n"
            f"                ep_wf16_narrow(ep_rows, (unsigned short*)weight_xc_data_packed_dr.row({row}), size * {lanes});\n"
            f"                ep_wf16_narrow(ep_rows + size * 8, (unsigned short*)weight_hc_data_packed_dr.row({row}), num_output * {lanes});\n"
            "            }\n"
            "#endif\n")


_PAIR_END_OLD = ("                weight_hc_IFOG[7] = weight_hc_G_1[i];\n\n                weight_hc_IFOG += 8;\n            }\n"
                 "        }\n#endif // __AVX__\n")
_PAIR_END_NEW = ("                weight_hc_IFOG[7] = weight_hc_G_1[i];\n\n                weight_hc_IFOG += 8;\n            }\n"
                 + _narrow_rows(8, "q / 2") + "        }\n#endif // __AVX__\n")
_TAIL_END_OLD = ("                weight_hc_IFOG[3] = weight_hc_G[i];\n\n                weight_hc_IFOG += 4;\n            }\n"
                 "        }\n    }\n\n    if (opt.lightmode)\n")
_TAIL_END_NEW = ("                weight_hc_IFOG[3] = weight_hc_G[i];\n\n                weight_hc_IFOG += 4;\n            }\n"
                 "#if __AVX__\n" + _narrow_rows(4, "q / 2 + q % 2") + "#endif\n"
                 "        }\n    }\n\n    if (opt.lightmode)\n")
_PIPELINE_EDITS = (
    ("the includes (F16C helpers)", _INCLUDES_OLD, _INCLUDES_NEW, 1),
    ("the packed weights' allocation", _PACKED_OLD, _PACKED_NEW, 1),
    ("a pair of units' packed rows", _PAIR_ROWS_OLD, _PAIR_ROWS_NEW, 1),
    ("the odd unit's packed rows", _TAIL_ROWS_OLD, _TAIL_ROWS_NEW, 1),
    ("the end of a pair of units", _PAIR_END_OLD, _PAIR_END_NEW, 1),
    ("the end of the odd unit", _TAIL_END_OLD, _TAIL_END_NEW, 1),
)
PIPELINE_FILE = Path("src") / "layer" / "x86" / "lstm_x86.cpp"

LSTM_FILE = Path("src") / "layer" / "x86" / "lstm_fp32.h"


_FILE_EDITS = ((LSTM_FILE, _EDITS), (PIPELINE_FILE, _PIPELINE_EDITS))

LSTM_PATCH_KEY = file_edits_key(LSTM_PATCH_VERSION, _FILE_EDITS)


def patch_lstm(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place."""
    apply_file_edits(src, _FILE_EDITS, "lstm_patch.py")
