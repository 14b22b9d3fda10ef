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
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

WINOGRAD_STRIPS_PATCH_VERSION = 2  # 2: im2col + GEMM in strips too
STRIP_BYTES = 2 << 20   # a strip's transformed input or im2col: about the L2 of the cores it was measured on (2 MiB)

_CALLS_OLD = """        int ret = 0;
        if (prefer_winograd23)
        {
            ret = conv3x3s1_winograd23(bottom_blob_bordered, top_blob, weight_winograd23_data, bias_data, _nT, opt);
        }
        else if (prefer_winograd43)
        {
            ret = conv3x3s1_winograd43(bottom_blob_bordered, top_blob, weight_winograd43_data, bias_data, _nT, opt);
        }
        else if (prefer_winograd63)
        {
            ret = conv3x3s1_winograd63(bottom_blob_bordered, top_blob, weight_winograd63_data, bias_data, _nT, opt);
        }
        else
        {
            // should never reach here
        }
"""
_CALLS_NEW = """        // edgepack (winograd_strips_patch.py): strips of rows where the map's transformed input is large
        const int ep_m = prefer_winograd23 ? 2 : prefer_winograd43 ? 4 : 6;
        int ret = ep_winograd_strips(bottom_blob_bordered, top_blob, ep_m, [&](const Mat& ep_in, Mat& ep_out) {
            if (prefer_winograd23)
                return conv3x3s1_winograd23(ep_in, ep_out, weight_winograd23_data, bias_data, _nT, opt);
            if (prefer_winograd43)
                return conv3x3s1_winograd43(ep_in, ep_out, weight_winograd43_data, bias_data, _nT, opt);
            if (prefer_winograd63)
                return conv3x3s1_winograd63(ep_in, ep_out, weight_winograd63_data, bias_data, _nT, opt);
            return 0; // should never reach here
        });
"""

_HELPER_ANCHOR = "namespace ncnn {\n\n// edgepack (direct_conv_patch.py): direct 3x3"
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

_GEMM_CALL_OLD = ("        int ret = convolution_im2col_gemm(bottom_blob_bordered, top_blob, weight_sgemm_data, bias_data, "
                  "kernel_w, kernel_h, dilation_w, dilation_h, stride_w, stride_h, _nT, opt);\n")
_GEMM_CALL_NEW = """        // edgepack (winograd_strips_patch.py): strips of output rows where the map's im2col is large
        int ret = ep_gemm_strips(bottom_blob_bordered, top_blob, kernel_h, dilation_h, stride_h, (size_t)num_input * kernel_w * kernel_h, [&](const Mat& ep_in, Mat& ep_out) {
            return convolution_im2col_gemm(ep_in, ep_out, weight_sgemm_data, bias_data, kernel_w, kernel_h, dilation_w, dilation_h, stride_w, stride_h, _nT, opt);
        });
"""

_FILE_EDITS = (
    ("src/layer/x86/convolution_x86.cpp", (
        ("the strip helpers, at the namespace's start (every ISA's build)", _HELPER_ANCHOR,
         "namespace ncnn {\n\n" + f"#define EP_WINOGRAD_STRIP_BYTES ((size_t){STRIP_BYTES})\n" + _HELPER
         + _HELPER_ANCHOR[len("namespace ncnn {\n\n"):], 1),
        ("forward's Winograd calls", _CALLS_OLD, _CALLS_NEW, 1),
        ("forward's im2col + GEMM call", _GEMM_CALL_OLD, _GEMM_CALL_NEW, 1),
    )),
)

WINOGRAD_STRIPS_PATCH_KEY = file_edits_key(WINOGRAD_STRIPS_PATCH_VERSION, _FILE_EDITS)


def patch_winograd_strips(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place (x86 builds, after direct_conv_patch.py)."""
    apply_file_edits(src, _FILE_EDITS, "winograd_strips_patch.py")
