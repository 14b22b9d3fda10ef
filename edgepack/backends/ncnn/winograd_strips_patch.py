"""Winograd convolutions over strips of rows where a map's transformed input would not stay in cache (x86).

ncnn's x86 Winograd (convolution_3x3_winograd.h, F(2,3), F(4,3) and F(6,3)) transforms the input of the
whole map into one buffer (BT: 16, 36 or 64 values per tile, times input channels) and then runs the
GEMMs over it. For a large map that buffer is far larger than any cache: DNSMOS' 128 -> 64 3x3 layer on its
900 x 161 spectrogram builds 170 MB of it, written once and read back from memory, and on a Sapphire Rapids
host ncnn's default took 315 ms a run against 258 ms with the direct kernel and 206 ms for onnxruntime
(peak RSS 399 MB). Here the call is made once per strip of output rows (a whole number of tiles, so the
tile grid is the map's), each strip's transformed input about EP_WINOGRAD_STRIP_BYTES, reading the padded
input rows it needs (two more than its output rows) through views of the same blobs: the same tiles and
the same transforms; the GEMM's blocking over tiles follows the strip's tile count, so the sums may be
added in another order than the whole map's (a float rounding, as between thread counts).

Maps whose whole buffer is at most twice a strip's run as before. Only x86 builds compile this file, so
only their cache key carries WINOGRAD_STRIPS_PATCH_KEY.

Version 2 does the same for im2col + GEMM (convolution_im2col_gemm.h), which also builds the whole map's
im2col (kernel size times input channels per output pixel) before its GEMMs: YOLO11s-seg's 3x3 stride-2
layer after its stem made 28.8 MB of it from a 320 x 320 x 32 map, and that one buffer was half of the
model's 58 MB of tensors at their peak (arena held-peak, EDGEPACK_NCNN_TRACE). Each strip reads the input
rows its output rows need ((rows - 1) x stride + (kernel - 1) x dilation + 1). The GEMM's K and M
blocking do not depend on the pixel count, so the sums are added in the same order: the same bits as the
whole map.

Arm builds (WINOGRAD_STRIPS_ARM_PATCH_KEY) get the same strips in Convolution_arm's fp32 path (CPUs
without fp16 arithmetic: Cortex-A53/A72, the Raspberry Pi 3 and 4) and its fp16 arithmetic path
(convolution_arm_asimdhp.cpp: A55/A76/A78, the Pi 5 and Jetson Orin), whose Winograd and im2col + GEMM
build the whole map's buffer the same way. The helpers count 4 bytes a value, so an fp16 path's strips
hold about half of STRIP_BYTES: Arm cores have 256 KB to 1 MB of L2. ncnn's Arm GEMM tiles K and M without looking at
the pixel count either (convolution_im2col_gemm_get_optimal_tile_mnk and its _fp16sa twin).

Version 3 (Arm version 2) borders each strip itself. forward used to run make_padding first: a bordered
copy of the whole input, alive through the layer. YOLO11s-seg's mask branch (3x3, 128 -> 128 channels on
160 x 160) copied 13 MB so. Now forward notes the border make_padding would add (EpConvInput: explicit pads
or ONNX SAME's) and each strip copies only the rows it reads, bordered (copy_make_border on a view of them);
a map small enough to run whole is bordered whole, as before. The paths that read the map whole (the
direct kernels, the dilated split) make the whole bordered copy first, as before. A border wider than the
kernel, or a negative one, is made up front as before. The same values reach the kernels: the same bits.

Version 4 (Arm version 3) cuts rows too. A strip is at least one output row, and a map of one row (a 1-D
convolution that the converter wrote as a 2-D one of one row: Whisper's STFT, 400 taps at stride 160 over
480,400 samples, and every Conv1D of conv1d_to_row) ran whole: Whisper's 4.9 MB im2col sat beside its
1.9 MB input and 4.8 MB output, the model's peak. Where one output row's im2col is over two strips and
the kernel is one row high, each row now runs in pieces of columns of about a strip's im2col (a multiple
of 16), each reading the input columns its windows cover through a view. The K and M blocking are the
same, so again the same bits.

STRIP_BYTES went from 2 MiB to 1 MiB with version 4. Once binaryop_inplace_patch.py took the third map out of
PP-OCRv4's detector's sums, its peak was an F(4,3) layer's strips: the bordered input rows, the transformed
input and the transformed output (0.9 + 2.0 + 2.0 MB) beside the maps. Peak RSS 21.7 -> 20.2 MiB there,
ddddocr_det 27.4 -> 26.9, YOLO11s-seg 68.6 -> 67.1; speed within +-3% run to run on four corpus CNNs at 1 and 2
threads (Zen 4, 1 MiB of L2 a core).
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

WINOGRAD_STRIPS_PATCH_VERSION = 4  # 2: im2col + GEMM in strips too; 3: the strips border their own rows; 4: columns
STRIP_BYTES = 1 << 20   # a strip's transformed input or im2col: 1 MiB (2 MiB until version 4: see the docstring)

_X86_ANCHOR = "// edgepack (direct_conv_patch.py): direct 3x3"  # what follows the namespace's start on x86
_HELPER = r'''// ---- edgepack (winograd_strips_patch.py) ----
// a convolution's input as its kernels read it: src with a constant border (the rows and columns
// make_padding adds; all 0 where src is bordered already), made whole or a few rows at a time, so that
// the strips below need no bordered copy of the whole map
struct EpConvInput
{
    Mat src;
    int top, bottom, left, right;
    float value;

    int w() const { return src.w + left + right; }
    int h() const { return src.h + top + bottom; }

    // dst = rows [y0, y0 + n) of the bordered map: src itself, a view of its rows, or a bordered copy of
    // the src rows they cover (top and bottom are under the kernel's extent, at most n: a strip covers
    // at least one src row)
    int rows(int y0, int n, Mat& dst, const Option& opt) const
    {
        const int s0 = std::max(0, y0 - top);
        const int s1 = std::min(src.h, y0 + n - top);
        const int t = s0 - (y0 - top);
        const int b = (y0 + n - top) - s1;
        const bool unbordered = t == 0 && b == 0 && left == 0 && right == 0;
        if (unbordered && s0 == 0 && s1 == src.h)
        {
            dst = src;
            return 0;
        }
        Mat view(src.w, s1 - s0, src.c, (unsigned char*)src.data + (size_t)s0 * src.w * src.elemsize, src.elemsize, src.elempack);
        view.cstep = src.cstep;
        if (unbordered)
        {
            dst = view;
            return 0;
        }
        Option opt_b = opt;
        opt_b.blob_allocator = opt.workspace_allocator;
        copy_make_border(view, dst, t, b, left, right, BORDER_CONSTANT, value, opt_b);
        return dst.empty() ? -100 : 0;
    }
};

// an input make_padding has bordered already (or that needs no border)
static EpConvInput ep_bordered_input(const Mat& bordered)
{
    EpConvInput in = {bordered, 0, 0, 0, 0, 0.f};
    return in;
}

// the border make_padding would give src (explicit pads, or ONNX SAME's), left for the kernels to make
// (true), or false where make_padding should make it now: no border, a border wider than the kernel
// (every strip must cover a src row) or a negative (cropping) one
static bool ep_deferred_input(const Mat& src, int kernel_extent_w, int kernel_extent_h, int stride_w, int stride_h,
                              int pad_left, int pad_right, int pad_top, int pad_bottom, float pad_value, EpConvInput& in)
{
    int t = pad_top, b = pad_bottom, l = pad_left, r = pad_right; // explicit pads: make_padding's first case
    const bool explicit_pads = pad_left > 0 || pad_right > 0 || pad_top > 0 || pad_bottom > 0;
    const bool same = (pad_left == -233 || pad_left == -234) && pad_right == pad_left && pad_top == pad_left && pad_bottom == pad_left;
    if (!explicit_pads && !same)
        return false;
    if (!explicit_pads)
    {
        const int wpad = kernel_extent_w + (src.w - 1) / stride_w * stride_w - src.w;
        const int hpad = kernel_extent_h + (src.h - 1) / stride_h * stride_h - src.h;
        if (wpad <= 0 && hpad <= 0)
            return false;
        const bool upper = pad_left == -233; // SAME_UPPER puts the odd pixel after, SAME_LOWER before
        t = upper ? hpad / 2 : hpad - hpad / 2;
        b = hpad - t;
        l = upper ? wpad / 2 : wpad - wpad / 2;
        r = wpad - l;
    }
    if (src.dims != 3 || t < 0 || b < 0 || l < 0 || r < 0 || t >= kernel_extent_h || b >= kernel_extent_h)
        return false;
    EpConvInput deferred = {src, t, b, l, r, pad_value};
    in = deferred;
    return true;
}

// run(in_rows, out_rows) once per strip of strip_rows output rows (the last one partial); the input holds
// the rows the strip's windows read, (rows - 1) x stride + (kernel - 1) x dilation + 1 of them
template<class F>
static int ep_run_strips(const EpConvInput& in, Mat& out, int strip_rows, int kernel_h, int dilation_h, int stride_h, const Option& opt, F run)
{
    for (int y0 = 0; y0 < out.h; y0 += strip_rows)
    {
        const int rows = std::min(strip_rows, out.h - y0);
        const int in_rows_n = (rows - 1) * stride_h + (kernel_h - 1) * dilation_h + 1;
        Mat in_rows;
        int ret = in.rows(y0 * stride_h, in_rows_n, in_rows, opt);
        if (ret != 0)
            return ret;
        Mat out_rows(out.w, rows, out.c, (unsigned char*)out.data + (size_t)y0 * out.w * out.elemsize, out.elemsize, out.elempack);
        out_rows.cstep = out.cstep;
        ret = run(in_rows, out_rows);
        if (ret != 0)
            return ret;
    }
    return 0;
}

// run(whole bordered input, out)
template<class F>
static int ep_run_whole(const EpConvInput& in, Mat& out, const Option& opt, F run)
{
    Mat whole;
    const int ret = in.rows(0, in.h(), whole, opt);
    return ret != 0 ? ret : run(whole, out);
}

// run(in, out) on the whole map, or once per strip of output rows (a whole number of m-row tiles) where the
// map's transformed input, (m + 2)^2 values per tile and input channel, exceeds two strips' worth; the input
// strip is its output rows plus the two more a 3x3 window reads (the bordered input has out.h + 2 rows)
template<class F>
static int ep_winograd_strips(const EpConvInput& in, Mat& out, int m, const Option& opt, F run)
{
    const size_t tile_values = (size_t)(m + 2) * (m + 2) * in.src.c * in.src.elempack;
    const size_t row_bytes = tile_values * ((out.w + m - 1) / m) * sizeof(float); // one row of tiles
    const int h_tiles = (out.h + m - 1) / m;
    const size_t strip = EP_WINOGRAD_STRIP_BYTES;
    if (in.src.dims != 3 || out.dims != 3 || in.h() != out.h + 2 || row_bytes * h_tiles <= 2 * strip)
        return ep_run_whole(in, out, opt, run);
    const int strip_tiles = std::max(1, (int)(strip / row_bytes));
    return ep_run_strips(in, out, strip_tiles * m, 3, 1, 1, opt, run);
}

// run(in_cols, out_cols) once per piece of cols output columns of each output row, for a kernel one row
// high (a 1-D convolution written as a 2-D one of one row: an STFT, a Conv1D): each piece reads the input
// columns its windows cover, (cols - 1) x stride + (kernel - 1) x dilation + 1, through views of the same
// channels (on a map of one row a run of columns is a plain Mat with the channel step of its map)
template<class F>
static int ep_run_columns(const EpConvInput& in, Mat& out, int cols, int kernel_w, int dilation_w, int stride_w, int stride_h, const Option& opt, F run)
{
    for (int y = 0; y < out.h; y++)
    {
        Mat in_row;
        int ret = in.rows(y * stride_h, 1, in_row, opt);
        if (ret != 0)
            return ret;
        for (int x0 = 0; x0 < out.w; x0 += cols)
        {
            const int n = std::min(cols, out.w - x0);
            const int in_n = (n - 1) * stride_w + (kernel_w - 1) * dilation_w + 1;
            Mat in_cols(in_n, 1, in_row.c, (unsigned char*)in_row.data + (size_t)x0 * stride_w * in_row.elemsize, in_row.elemsize, in_row.elempack);
            in_cols.cstep = in_row.cstep;
            Mat out_cols(n, 1, out.c, (unsigned char*)out.data + ((size_t)y * out.w + x0) * out.elemsize, out.elemsize, out.elempack);
            out_cols.cstep = out.cstep;
            ret = run(in_cols, out_cols);
            if (ret != 0)
                return ret;
        }
    }
    return 0;
}

// run(in, out) on the whole map, or once per strip of output rows where the map's im2col, k_values floats
// per output pixel (kernel size times input channels), exceeds two strips' worth; a strip reads the input
// rows its output rows need. Where one output row's im2col alone exceeds two strips and the kernel is one
// row high, each row runs in pieces of columns instead (Whisper's STFT: 400 taps over 3001 frames of one
// row, 4.9 MB of im2col beside its 4.8 MB output)
template<class F>
static int ep_gemm_strips(const EpConvInput& in, Mat& out, int kernel_w, int kernel_h, int dilation_w, int dilation_h, int stride_w, int stride_h, size_t k_values, const Option& opt, F run)
{
    const size_t row_bytes = k_values * out.w * sizeof(float); // one output row's im2col
    const size_t strip = EP_WINOGRAD_STRIP_BYTES;
    if (in.src.dims != 3 || out.dims != 3 || row_bytes * out.h <= 2 * strip
            || in.h() < (out.h - 1) * stride_h + (kernel_h - 1) * dilation_h + 1
            || in.w() < (out.w - 1) * stride_w + (kernel_w - 1) * dilation_w + 1)
        return ep_run_whole(in, out, opt, run);
    if (kernel_h == 1 && row_bytes > 2 * strip)
        return ep_run_columns(in, out, std::max(16, (int)(strip / (k_values * sizeof(float))) / 16 * 16), kernel_w, dilation_w, stride_w, stride_h, opt, run);
    return ep_run_strips(in, out, std::max(1, (int)(strip / row_bytes)), kernel_h, dilation_h, stride_h, opt, run);
}
// ---- end edgepack ----

'''


def _helpers(anchor: str, what: str = "the strip helpers, at the namespace's start") -> tuple:
    """Insert the strip helpers at the namespace's start of a file (each is its own translation unit)."""
    head = "namespace ncnn {\n\n"
    return (what, head + anchor,
            head + f"#define EP_WINOGRAD_STRIP_BYTES ((size_t){STRIP_BYTES})\n" + _HELPER + anchor, 1)


def _winograd_calls(suffix: str, bias: str, source: str) -> tuple:
    """The (old, new) text of forward's three Winograd calls (suffix "" or Arm's "_fp16sa"), reading
    ``source`` (an EpConvInput)."""
    calls = [(m, f"conv3x3s1_winograd{m}{suffix}(%s, %s, weight_winograd{m}_data, {bias}, _nT, opt)") for m in (23, 43, 63)]
    old = ("        int ret = 0;\n"
           + "".join(f"        {'else ' if i else ''}if (prefer_winograd{m})\n        {{\n"
                     f"            ret = {call % ('bottom_blob_bordered', 'top_blob')};\n        }}\n"
                     for i, (m, call) in enumerate(calls))
           + "        else\n        {\n            // should never reach here\n        }\n")
    new = ("        // edgepack (winograd_strips_patch.py): strips of rows where the map's transformed input is large\n"
           "        const int ep_m = prefer_winograd23 ? 2 : prefer_winograd43 ? 4 : 6;\n"
           f"        int ret = ep_winograd_strips({source}, top_blob, ep_m, opt, [&](const Mat& ep_in, Mat& ep_out) {{\n"
           + "".join(f"            if (prefer_winograd{m})\n                return {call % ('ep_in', 'ep_out')};\n"
                     for m, call in calls)
           + "            return 0; // should never reach here\n        });\n")
    return old, new


_BLOCK_END = ("        if (ret != 0)\n            return ret;\n\n        if (activation)\n        {\n"
              "            activation->forward_inplace(top_blob, opt);\n        }\n        return 0;\n    }\n\n")


def _gemm_call(suffix: str, bias: str, source: str, border_after: bool) -> tuple:
    """The (old, new) text of forward's im2col + GEMM block (suffix "" or Arm's "_fp16sa"), reading ``source``;
    with ``border_after`` the direct kernels after it get the whole bordered map (ep_border_whole)."""
    args = "weight_sgemm_data, %s, kernel_w, kernel_h, dilation_w, dilation_h, stride_w, stride_h, _nT, opt" % bias
    old = f"        int ret = convolution_im2col_gemm{suffix}(bottom_blob_bordered, top_blob, {args});\n" + _BLOCK_END
    new = ("        // edgepack (winograd_strips_patch.py): strips of output rows where the map's im2col is large\n"
           f"        int ret = ep_gemm_strips({source}, top_blob, kernel_w, kernel_h, dilation_w, dilation_h, stride_w, stride_h, "
           "(size_t)num_input * kernel_w * kernel_h, opt, [&](const Mat& ep_in, Mat& ep_out) {\n"
           f"            return convolution_im2col_gemm{suffix}(ep_in, ep_out, {args});\n        }});\n" + _BLOCK_END)
    if border_after:
        new += ("    // edgepack (winograd_strips_patch.py): the direct kernels below read the whole bordered map\n"
                "    if (ep_border_whole() != 0)\n        return -100;\n\n")
    return old, new


_MAKE_PADDING = ("    Mat bottom_blob_bordered;\n    make_padding(bottom_blob, bottom_blob_bordered, opt);\n"
                 "    if (bottom_blob_bordered.empty())\n        return -100;\n\n"
                 "    w = bottom_blob_bordered.w;\n    h = bottom_blob_bordered.h;\n")
_DEFERRED_PADDING = r"""    // edgepack (winograd_strips_patch.py): the Winograd and im2col + GEMM strips border their own rows, so a
    // large map gets no bordered copy; a path that reads the map whole makes it first (ep_border_whole)
    Mat bottom_blob_bordered;
    EpConvInput ep_input;
    const bool ep_deferred = ep_deferred_input(bottom_blob, kernel_extent_w, kernel_extent_h, stride_w, stride_h,
                                               pad_left, pad_right, pad_top, pad_bottom, pad_value, ep_input);
    if (!ep_deferred)
    {
        make_padding(bottom_blob, bottom_blob_bordered, opt);
        if (bottom_blob_bordered.empty())
            return -100;
        ep_input = ep_bordered_input(bottom_blob_bordered);
    }
    auto ep_border_whole = [&]() {
        if (ep_deferred && bottom_blob_bordered.empty())
            make_padding(bottom_blob, bottom_blob_bordered, opt);
        return bottom_blob_bordered.empty() ? -100 : 0;
    };

    w = ep_input.w();
    h = ep_input.h();
"""


def _border_first(call: str) -> tuple:
    """(old, new): ``call`` (a line reading the whole bordered map) made after ep_border_whole()."""
    indent = call[:len(call) - len(call.lstrip())]
    return call, f"{indent}if (ep_border_whole() != 0)\n{indent}    return -100;\n" + call


_FILE_EDITS = (
    ("src/layer/x86/convolution_x86.cpp", (
        _helpers(_X86_ANCHOR, "the strip helpers, at the namespace's start (every ISA's build)"),
        ("forward's make_padding, deferred", "#endif // EP_C3_WHERE\n\n" + _MAKE_PADDING,
         "#endif // EP_C3_WHERE\n\n" + _DEFERRED_PADDING, 1),
        ("forward's dilated path",) + _border_first("            return forwardDilation_x86(bottom_blob_bordered, top_blob, opt);\n") + (1,),
        ("forward's direct kernel",) + _border_first("        int ret = ep_c3_run(bottom_blob_bordered, w, ") + (1,),
        ("forward's Winograd calls",) + _winograd_calls("", "bias_data", "ep_input") + (1,),
        ("forward's im2col + GEMM block",) + _gemm_call("", "bias_data", "ep_input", True) + (1,),
    )),
)

WINOGRAD_STRIPS_PATCH_KEY = file_edits_key(WINOGRAD_STRIPS_PATCH_VERSION, _FILE_EDITS)


# where make_padding sits in Convolution_arm's fp32 forward (its bf16 twin has the same lines after it) and
# in forward_fp16sa (forward_fp16s has the same before it)
_ARM_FP32_HEAD = ("        return forward_bf16s(bottom_blob, top_blob, opt);\n#endif\n\n    int w = bottom_blob.w;\n"
                  "    int h = bottom_blob.h;\n    int channels = bottom_blob.c;\n    size_t elemsize = bottom_blob.elemsize;\n"
                  "    int elempack = bottom_blob.elempack;\n\n    //     NCNN_LOGE(\"Convolution input %d x %d  pad = %d %d  "
                  "ksize=%d %d  stride=%d %d\", w, h, pad_w, pad_h, kernel_w, kernel_h, stride_w, stride_h);\n\n"
                  "    const int kernel_extent_w = dilation_w * (kernel_w - 1) + 1;\n"
                  "    const int kernel_extent_h = dilation_h * (kernel_h - 1) + 1;\n\n")
_ARM_FP16SA_TAIL = ("\n    int outw = (w - kernel_extent_w) / stride_w + 1;\n    int outh = (h - kernel_extent_h) / stride_h + 1;\n"
                    "    int out_elempack = 1;\n    if (opt.use_packing_layout)\n    {\n"
                    "        out_elempack = num_output % 8 == 0 ? 8")

_ARM_FILE_EDITS = (
    ("src/layer/arm/convolution_arm.cpp", (
        _helpers('#if NCNN_GNU_INLINE_ASM\n#include "convolution_1x1.h"'),
        ("the fp32 make_padding, deferred", _ARM_FP32_HEAD + _MAKE_PADDING, _ARM_FP32_HEAD + _DEFERRED_PADDING, 1),
        ("the fp32 dilated path",) + _border_first("            return forwardDilation_arm(bottom_blob_bordered, top_blob, opt);\n") + (1,),
        ("the fp32 Winograd calls",) + _winograd_calls("", "bias_data", "ep_input") + (1,),
        ("the fp32 im2col + GEMM block",) + _gemm_call("", "bias_data", "ep_input", True) + (1,),
    )),
    ("src/layer/arm/convolution_arm_asimdhp.cpp", (
        _helpers('#if __ARM_NEON\n#if __ARM_FEATURE_FP16_VECTOR_ARITHMETIC\n'),
        ("the fp16 arithmetic make_padding, deferred", _MAKE_PADDING + _ARM_FP16SA_TAIL, _DEFERRED_PADDING + _ARM_FP16SA_TAIL, 1),
        ("the fp16 arithmetic Winograd calls",) + _winograd_calls("_fp16sa", "bias_data_fp16", "ep_input") + (1,),
        ("the fp16 arithmetic im2col + GEMM block",) + _gemm_call("_fp16sa", "bias_data_fp16", "ep_input", True) + (1,),
    )),
)
WINOGRAD_STRIPS_ARM_PATCH_VERSION = 3  # 2: the strips border their own rows; 3: pieces of columns
WINOGRAD_STRIPS_ARM_PATCH_KEY = file_edits_key(WINOGRAD_STRIPS_ARM_PATCH_VERSION, _ARM_FILE_EDITS)


def patch_winograd_strips(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place (x86 builds, after direct_conv_patch.py)."""
    apply_file_edits(src, _FILE_EDITS, "winograd_strips_patch.py")


def patch_winograd_strips_arm(src: Path) -> None:
    """Apply the Arm edits to an unpacked ncnn source tree, in place (aarch64 builds)."""
    apply_file_edits(src, _ARM_FILE_EDITS, "winograd_strips_patch.py")
