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
hold about 1 MiB: Arm cores have 256 KB to 1 MB of L2. ncnn's Arm GEMM tiles K and M without looking at
the pixel count either (convolution_im2col_gemm_get_optimal_tile_mnk and its _fp16sa twin).
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

WINOGRAD_STRIPS_PATCH_VERSION = 2  # 2: im2col + GEMM in strips too
STRIP_BYTES = 2 << 20   # a strip's transformed input or im2col: about the L2 of the cores it was measured on (2 MiB)

_X86_ANCHOR = "// edgepack (direct_conv_patch.py): direct 3x3"  # what follows the namespace's start on x86
_HELPER = r'''// ---- edgepack (winograd_strips_patch.py) ----
// run(in_rows, out_rows) once per strip of strip_rows output rows (the last one partial), through views of
// the blobs; the input view holds the rows the strip's windows read, (rows - 1) x stride + (kernel - 1) x
// dilation + 1 of them (in is padded)
template<class F>
static int ep_run_strips(const Mat& in, Mat& out, int strip_rows, int kernel_h, int dilation_h, int stride_h, F run)
{
    for (int y0 = 0; y0 < out.h; y0 += strip_rows)
    {
        const int rows = std::min(strip_rows, out.h - y0);
        const int in_y0 = y0 * stride_h;
        const int in_rows_n = (rows - 1) * stride_h + (kernel_h - 1) * dilation_h + 1;
        Mat in_rows(in.w, in_rows_n, in.c, (unsigned char*)in.data + (size_t)in_y0 * in.w * in.elemsize, in.elemsize, in.elempack);
        in_rows.cstep = in.cstep;
        Mat out_rows(out.w, rows, out.c, (unsigned char*)out.data + (size_t)y0 * out.w * out.elemsize, out.elemsize, out.elempack);
        out_rows.cstep = out.cstep;
        const int ret = run(in_rows, out_rows);
        if (ret != 0)
            return ret;
    }
    return 0;
}

// run(in, out) on the whole map, or once per strip of output rows (a whole number of m-row tiles) where the
// map's transformed input, (m + 2)^2 values per tile and input channel, exceeds two strips' worth; the input
// strip is its output rows plus the two more a 3x3 window reads (in is padded: in.h == out.h + 2)
template<class F>
static int ep_winograd_strips(const Mat& in, Mat& out, int m, F run)
{
    const size_t tile_values = (size_t)(m + 2) * (m + 2) * in.c * in.elempack;
    const size_t row_bytes = tile_values * ((out.w + m - 1) / m) * sizeof(float); // one row of tiles
    const int h_tiles = (out.h + m - 1) / m;
    const size_t strip = EP_WINOGRAD_STRIP_BYTES;
    if (in.dims != 3 || out.dims != 3 || in.h != out.h + 2 || row_bytes * h_tiles <= 2 * strip)
        return run(in, out);
    const int strip_tiles = std::max(1, (int)(strip / row_bytes));
    return ep_run_strips(in, out, strip_tiles * m, 3, 1, 1, run);
}

// run(in, out) on the whole map, or once per strip of output rows where the map's im2col, k_values floats
// per output pixel (kernel size times input channels), exceeds two strips' worth; a strip reads the input
// rows its output rows need (in is padded: its rows are those the windows read)
template<class F>
static int ep_gemm_strips(const Mat& in, Mat& out, int kernel_h, int dilation_h, int stride_h, size_t k_values, F run)
{
    const size_t row_bytes = k_values * out.w * sizeof(float); // one output row's im2col
    const size_t strip = EP_WINOGRAD_STRIP_BYTES;
    if (in.dims != 3 || out.dims != 3 || row_bytes * out.h <= 2 * strip
            || in.h < (out.h - 1) * stride_h + (kernel_h - 1) * dilation_h + 1)
        return run(in, out);
    return ep_run_strips(in, out, std::max(1, (int)(strip / row_bytes)), kernel_h, dilation_h, stride_h, run);
}
// ---- end edgepack ----

'''


def _helpers(anchor: str, what: str = "the strip helpers, at the namespace's start") -> tuple:
    """Insert the strip helpers at the namespace's start of a file (each is its own translation unit)."""
    head = "namespace ncnn {\n\n"
    return (what, head + anchor,
            head + f"#define EP_WINOGRAD_STRIP_BYTES ((size_t){STRIP_BYTES})\n" + _HELPER + anchor, 1)


def _winograd_calls(suffix: str, bias: str) -> tuple:
    """The (old, new) text of forward's three Winograd calls (suffix "" or Arm's "_fp16sa")."""
    calls = [(m, f"conv3x3s1_winograd{m}{suffix}(%s, %s, weight_winograd{m}_data, {bias}, _nT, opt)") for m in (23, 43, 63)]
    old = ("        int ret = 0;\n"
           + "".join(f"        {'else ' if i else ''}if (prefer_winograd{m})\n        {{\n"
                     f"            ret = {call % ('bottom_blob_bordered', 'top_blob')};\n        }}\n"
                     for i, (m, call) in enumerate(calls))
           + "        else\n        {\n            // should never reach here\n        }\n")
    new = ("        // edgepack (winograd_strips_patch.py): strips of rows where the map's transformed input is large\n"
           "        const int ep_m = prefer_winograd23 ? 2 : prefer_winograd43 ? 4 : 6;\n"
           "        int ret = ep_winograd_strips(bottom_blob_bordered, top_blob, ep_m, [&](const Mat& ep_in, Mat& ep_out) {\n"
           + "".join(f"            if (prefer_winograd{m})\n                return {call % ('ep_in', 'ep_out')};\n"
                     for m, call in calls)
           + "            return 0; // should never reach here\n        });\n")
    return old, new


def _gemm_call(suffix: str, bias: str) -> tuple:
    """The (old, new) text of forward's im2col + GEMM call (suffix "" or Arm's "_fp16sa")."""
    args = "weight_sgemm_data, %s, kernel_w, kernel_h, dilation_w, dilation_h, stride_w, stride_h, _nT, opt" % bias
    old = f"        int ret = convolution_im2col_gemm{suffix}(bottom_blob_bordered, top_blob, {args});\n"
    new = ("        // edgepack (winograd_strips_patch.py): strips of output rows where the map's im2col is large\n"
           "        int ret = ep_gemm_strips(bottom_blob_bordered, top_blob, kernel_h, dilation_h, stride_h, "
           "(size_t)num_input * kernel_w * kernel_h, [&](const Mat& ep_in, Mat& ep_out) {\n"
           f"            return convolution_im2col_gemm{suffix}(ep_in, ep_out, {args});\n        }});\n")
    return old, new


_FILE_EDITS = (
    ("src/layer/x86/convolution_x86.cpp", (
        _helpers(_X86_ANCHOR, "the strip helpers, at the namespace's start (every ISA's build)"),
        ("forward's Winograd calls",) + _winograd_calls("", "bias_data") + (1,),
        ("forward's im2col + GEMM call",) + _gemm_call("", "bias_data") + (1,),
    )),
)

WINOGRAD_STRIPS_PATCH_KEY = file_edits_key(WINOGRAD_STRIPS_PATCH_VERSION, _FILE_EDITS)


_ARM_FILE_EDITS = (
    ("src/layer/arm/convolution_arm.cpp", (
        _helpers('#if NCNN_GNU_INLINE_ASM\n#include "convolution_1x1.h"'),
        ("the fp32 Winograd calls",) + _winograd_calls("", "bias_data") + (1,),
        ("the fp32 im2col + GEMM call",) + _gemm_call("", "bias_data") + (1,),
    )),
    ("src/layer/arm/convolution_arm_asimdhp.cpp", (
        _helpers('#if __ARM_NEON\n#if __ARM_FEATURE_FP16_VECTOR_ARITHMETIC\n'),
        ("the fp16 arithmetic Winograd calls",) + _winograd_calls("_fp16sa", "bias_data_fp16") + (1,),
        ("the fp16 arithmetic im2col + GEMM call",) + _gemm_call("_fp16sa", "bias_data_fp16") + (1,),
    )),
)
WINOGRAD_STRIPS_ARM_PATCH_VERSION = 1
WINOGRAD_STRIPS_ARM_PATCH_KEY = file_edits_key(WINOGRAD_STRIPS_ARM_PATCH_VERSION, _ARM_FILE_EDITS)


def patch_winograd_strips(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place (x86 builds, after direct_conv_patch.py)."""
    apply_file_edits(src, _FILE_EDITS, "winograd_strips_patch.py")


def patch_winograd_strips_arm(src: Path) -> None:
    """Apply the Arm edits to an unpacked ncnn source tree, in place (aarch64 builds)."""
    apply_file_edits(src, _ARM_FILE_EDITS, "winograd_strips_patch.py")
