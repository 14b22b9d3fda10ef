"""One speed change to the pinned ncnn's generic GRU (src/layer/gru.cpp, which x86 runs: ncnn has no
x86 GRU; Arm has gru_arm.cpp): the two directions of a bidirectional GRU at once, one thread each, in
the forward with state blobs (every GRU edgepack converts has them: recurrent_forms.py writes the
initial state out).

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

GRU_PATCH_VERSION = 1  # part of the x86 libncnn cache key (library.py)

_BOTH_DIRECTIONS = r'''// edgepack (gru_patch.py): the two directions of a bidirectional GRU at once, one thread each. A step
// split between threads costs two hand-overs per step, more than a small step computes; on 2 threads
// the directions always go one a thread, on more only where a step is small.
static int ep_gru_both_directions(const Mat& bottom_blob, Mat& top_forward, Mat& top_reverse, const Mat& weight_xc, const Mat& bias_c, const Mat& weight_hc, Mat& hidden, const Option& opt)
{
    const int size = bottom_blob.w;
    const int num_output = top_forward.w;
    const bool small_steps = 3L * num_output * (size + num_output) < (1L << 18);
    if (opt.num_threads < 2 || (opt.num_threads > 2 && !small_steps))
    {
        Mat hidden0 = hidden.row_range(0, 1);
        int ret = gru(bottom_blob, top_forward, 0, weight_xc.channel(0), bias_c.channel(0), weight_hc.channel(0), hidden0, opt);
        if (ret != 0)
            return ret;
        Mat hidden1 = hidden.row_range(1, 1);
        return gru(bottom_blob, top_reverse, 1, weight_xc.channel(1), bias_c.channel(1), weight_hc.channel(1), hidden1, opt);
    }
    Option opt1 = opt;
    opt1.num_threads = 1;
    opt1.workspace_allocator = 0; // both threads allocate their gates at once: malloc, not the net's pool
    int rets[2] = {0, 0};
    #pragma omp parallel for num_threads(2)
    for (int d = 0; d < 2; d++)
    {
        Mat hidden_d = hidden.row_range(d, 1);
        rets[d] = gru(bottom_blob, d == 0 ? top_forward : top_reverse, d, weight_xc.channel(d), bias_c.channel(d), weight_hc.channel(d), hidden_d, opt1);
    }
    return rets[0] != 0 ? rets[0] : rets[1];
}

'''
_FORWARD = "int GRU::forward(const std::vector<Mat>& bottom_blobs, std::vector<Mat>& top_blobs, const Option& opt) const\n"
_FORWARD_CALL = ("            int ret = gru(bottom_blob, top_blob_forward, 0, weight_xc_data.channel(0), bias_c_data.channel(0), "
                 "weight_hc_data.channel(0), hidden0, opt);\n")
_REVERSE_CALL = ("            int ret = gru(bottom_blob, top_blob_reverse, 1, weight_xc_data.channel(1), bias_c_data.channel(1), "
                 "weight_hc_data.channel(1), hidden1, opt);\n")

_EDITS = (
    # both directions from the forward direction's call
    ("the forward of state blobs", _FORWARD, _BOTH_DIRECTIONS + _FORWARD, 1),
    ("its forward direction", _FORWARD_CALL, "            int ret = ep_gru_both_directions(bottom_blob, top_blob_forward, "
     "top_blob_reverse, weight_xc_data, bias_c_data, weight_hc_data, hidden, opt);\n", 1),
    ("its reverse direction", _REVERSE_CALL, "            int ret = 0; // computed with the forward direction (gru_patch.py)\n", 1),
)

GRU_FILE = Path("src") / "layer" / "gru.cpp"
_FILE_EDITS = ((GRU_FILE, _EDITS),)

GRU_PATCH_KEY = file_edits_key(GRU_PATCH_VERSION, _FILE_EDITS)


def patch_gru(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place."""
    apply_file_edits(src, _FILE_EDITS, "gru_patch.py")
