"""A speed change to the pinned ncnn's x86 LSTM (src/layer/x86/lstm_fp32.h): the input products
W_xc x_t + b_c of every time step are computed in one pass before the recurrence.

Why: ncnn's x86 LSTM computes, at each step, W_xc x_t and W_hc h_{t-1} together, so it streams both
weight matrices from memory at every step. ddddocr_crnn's bidirectional LSTM (512 in, 512 hidden,
20 steps) reads 2 x 20 x 8 MiB that way: 12.7 ms of its 22.5 ms on one core of the AVX-512 Xeon
(2026-12-01), where onnxruntime, which batches the input product over the sequence, takes 6.8 ms
for the same layer. Only the recurrent product depends on the previous step. The pass here walks
the weights unit by unit (a pair of hidden units holds 16 KiB of W_xc: it stays in L1 while four
time steps at a time are multiplied against it), so W_xc is read once per inference; each step then
starts from its precomputed row and streams only W_hc.

Same arithmetic per gate; only the order of the fp32 additions changes (the build verifies the
result against onnxruntime as before). Applied as exact text edits that must each match, like
source_patch.py: a new ncnn pin whose LSTM changed fails the libncnn build with a clear error.
Only x86 builds compile this file, so only their cache key carries LSTM_PATCH_VERSION.
"""
from __future__ import annotations

from pathlib import Path

from ...errors import BuildError

LSTM_PATCH_VERSION = 1  # part of the x86 libncnn cache key (library.py)

_HELPER = r'''// edgepack: W_xc x_t + b_c for every step t, before the recurrence (lstm_patch.py).
// xgates row t holds the gates of unit q at q * 4 (I F O G), the order the step loop wants.
static void ep_lstm_input_gates(const Mat& bottom_blob, const Mat& weight_xc, const Mat& bias_c, Mat& xgates, int hidden_size, const Option& opt)
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
        const float* w = weight_xc.row(qq);
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
        const float* w = weight_xc.row(q / 2 + q % 2);
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

# (what, old text, new text, how many times it must occur)
_EDITS = (
    ("the input-gates helper", _SIGNATURE, _HELPER + _SIGNATURE, 1),
    ("the gates workspace", _GATES,
     _GATES + "\n    Mat xgates(hidden_size * 4, T, 4u, opt.workspace_allocator);\n"
              "    if (xgates.empty())\n        return -100;\n"
              "    ep_lstm_input_gates(bottom_blob, weight_xc, bias_c, xgates, hidden_size, opt);\n", 1),
    ("the 8-lane step's bias load", "            __m256 _IFOG = _mm256_loadu_ps(bias_c_IFOG);\n",
     "            __m256 _IFOG = _mm256_loadu_ps(xgates.row(ti) + q * 4);\n", 1),
    ("the 4-lane step's bias load", "            __m128 _IFOG = _mm_loadu_ps(bias_c_IFOG);\n",
     "            __m128 _IFOG = _mm_loadu_ps(xgates.row(ti) + q * 4);\n", 1),
    ("the scalar step's bias load", _SCALAR_INIT, _SCALAR_INIT.replace("bias_c_IFOG[", "xgates.row(ti)[q * 4 + "), 1),
    ("the step's input product", _STEP_ROW,
     _STEP_ROW.replace("int i = 0;", "int i = size; // edgepack: W_xc x_t + b_c are in xgates already"), 2),
    ("the step's bias pointer", "            const float* bias_c_IFOG = (const float*)bias_c + q * 4;\n", "", 2),
)

LSTM_FILE = Path("src") / "layer" / "x86" / "lstm_fp32.h"


def patch_lstm(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place."""
    path = src / LSTM_FILE
    text = path.read_text()
    for what, old, new, count in _EDITS:
        found = text.count(old)
        if found != count:
            raise BuildError(f"{path}: expected {count} copy(ies) of {what} to patch, found {found}",
                             hint="the pinned ncnn source changed: update edgepack/backends/ncnn/lstm_patch.py")
        text = text.replace(old, new)
    path.write_text(text)
