"""Transposed convolutions (Deconvolution) over strips of input rows, so the GEMM's output stays small.

ncnn's x86 and Arm Deconvolution run a GEMM over the whole input map first (the sgemm path, ncnn's
default): one column per input pixel and one row per output channel and kernel tap, kernel size times
output channels times input pixels in all, and only then scatter-add it into the output (col2im). For a
2 x 2 stride-2 upsampler that buffer is as large as the output itself: YOLO11s-seg's mask branch (128 ->
128 channels, 80 x 80 -> 160 x 160) held its 3.3 MB input, the GEMM's 13.1 MB of columns, its 3.3 MB
packed copy of the input and the 13.1 MB output at once, the model's largest moment (34.1 MB of tensors,
arena held-peak with EDGEPACK_NCNN_TRACE=1; found by tracing the arena's allocations).

Here the GEMM runs once per strip of input rows, on a view of those rows (the same blob, no copy), and
each strip's columns are scattered into the output rows they reach before the next strip's GEMM: a
strip's columns are about STRIP_BYTES (winograd_strips_patch.py's size, 4 bytes a value on every path).
col2im's first strip fills the whole output with the bias, as before, and every strip adds to it, so a
kernel wider than its stride (outputs reached from two strips) is summed in the same places. The scatter
sees the strip's rows as the whole map (its h and the output's rows from the strip's first one), so its
loops are ncnn's own. Maps whose columns are at most twice a strip run whole, as before.

Where each output is reached from one input pixel (stride = kernel, the usual upsampler) the values are
those of the whole map, up to the GEMM's blocking over the strip's pixel count; where the kernel is
wider than its stride, the sums from two strips meet in another order (a float rounding, as between
thread counts).

x86 builds (DECONV_STRIPS_PATCH_KEY) patch Deconvolution_x86::forward; Arm builds
(DECONV_STRIPS_ARM_PATCH_KEY) the fp32 forward and forward_fp16sa (fp16 arithmetic: A55/A76/A78, Orin).
Arm's fp16 storage without fp16 arithmetic (forward_fp16s) has no GEMM path.
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key
from .winograd_strips_patch import STRIP_BYTES

DECONV_STRIPS_PATCH_VERSION = 1

_HELPER = r'''// ---- edgepack (deconv_strips_patch.py) ----
// input rows per strip of a Deconvolution's GEMM: its columns (col_values a pixel: kernel size times output
// channels) plus its packed input (in_values a pixel) for a strip of rows stay about EP_DECONV_STRIP_BYTES;
// the whole map where all of it is at most twice that
static int ep_deconv_strip_rows(const Mat& bottom_blob, size_t col_values, size_t in_values)
{
    const size_t row_bytes = (col_values + in_values) * bottom_blob.w * sizeof(float);
    if (bottom_blob.dims != 3 || row_bytes * bottom_blob.h <= 2 * EP_DECONV_STRIP_BYTES)
        return bottom_blob.h;
    return std::max(1, (int)(EP_DECONV_STRIP_BYTES / row_bytes));
}

// rows [y0, h) of one channel (a 2-D view of it, or the channel itself from row 0)
static Mat ep_rows_from(const Mat& m, int y0)
{
    if (y0 == 0)
        return m;
    return Mat(m.w, m.h - y0, (unsigned char*)m.data + (size_t)y0 * m.w * m.elemsize, m.elemsize, m.elempack);
}
// ---- end edgepack ----

'''

_GEMM_WHOLE = ("        // sgemm\n        Mat bottom_blob_2 = bottom_blob;\n        {\n"
               "            bottom_blob_2.w = bottom_blob.w * bottom_blob.h;\n            bottom_blob_2.h = 1;\n        }\n"
               "        Mat top_col2im;\n        Option opt_b = opt;\n        opt_b.blob_allocator = top_blob_bordered.allocator;\n"
               "        int ret = gemm->forward(bottom_blob_2, top_col2im, opt_b);\n        if (ret != 0)\n            return ret;\n")
_GEMM_STRIPS = r"""        // sgemm; edgepack (deconv_strips_patch.py): once per strip of input rows, each scattered before the
        // next; in the strip, h and outh are its rows and the rows from its first output row on
        const int ep_strip_rows = ep_deconv_strip_rows(bottom_blob, (size_t)maxk * num_output, (size_t)bottom_blob.c * bottom_blob.elempack);
        const int ep_h = h, ep_outh = outh;
        for (int ep_i0 = 0; ep_i0 < ep_h; ep_i0 += ep_strip_rows)
        {
        const int h = std::min(ep_strip_rows, ep_h - ep_i0);
        const int outh = ep_i0 + h == ep_h ? ep_outh - ep_i0 * stride_h : h * stride_h;
        Mat bottom_blob_2(w * h, 1, bottom_blob.c, (unsigned char*)bottom_blob.data + (size_t)ep_i0 * w * bottom_blob.elemsize,
                          bottom_blob.elemsize, bottom_blob.elempack);
        bottom_blob_2.cstep = bottom_blob.cstep;
        Mat top_col2im;
        Option opt_b = opt;
        opt_b.blob_allocator = top_blob_bordered.allocator;
        int ret = gemm->forward(bottom_blob_2, top_col2im, opt_b);
        if (ret != 0)
            return ret;
"""
_ACTIVATION = "        if (activation)\n        {\n            activation->forward_inplace(top_blob_bordered, opt);\n        }\n"
_STRIPS_END = "        } // edgepack: the strips\n\n"
_OUT_ROWS = ("Mat outm = top_blob_bordered.channel(p);", "Mat outm = ep_rows_from(top_blob_bordered.channel(p), ep_i0 * stride_h);")
_FILL_ONCE = ("outm.fill(", "if (ep_i0 == 0) outm.fill(")  # col2im: the bias once, from the first strip (its view is the whole channel)


def _edits(anchor: str, outm: int, fills: int) -> tuple:
    """The edits of one file: the helpers after its namespace's start (``anchor`` follows it), the strip
    loop around the GEMM and its scatter, which reads the strip's output rows (``outm`` places) and fills
    the bias once (``fills`` places)."""
    head = "namespace ncnn {\n\n"
    return (
        ("the strip helpers, at the namespace's start", head + anchor,
         head + f"#define EP_DECONV_STRIP_BYTES ((size_t){STRIP_BYTES})\n" + _HELPER + anchor, 1),
        ("the GEMM over the whole map", _GEMM_WHOLE, _GEMM_STRIPS, 1),
        ("the activation after the scatter", _ACTIVATION, _STRIPS_END + _ACTIVATION, 1),
        ("the scatter's output channel",) + _OUT_ROWS + (outm,),
        ("col2im's bias fill",) + _FILL_ONCE + (fills,),
    )


_FILE_EDITS = (
    ("src/layer/x86/deconvolution_x86.cpp", _edits('#include "deconvolution_packed.h"', 5, 7)),
)
_ARM_FILE_EDITS = (
    ("src/layer/arm/deconvolution_arm.cpp", _edits('#include "deconvolution_3x3.h"', 2, 3)),
    ("src/layer/arm/deconvolution_arm_asimdhp.cpp", _edits("#if __ARM_FEATURE_FP16_VECTOR_ARITHMETIC\n", 3, 5)),
)

DECONV_STRIPS_PATCH_KEY = file_edits_key(DECONV_STRIPS_PATCH_VERSION, _FILE_EDITS)
DECONV_STRIPS_ARM_PATCH_VERSION = 1
DECONV_STRIPS_ARM_PATCH_KEY = file_edits_key(DECONV_STRIPS_ARM_PATCH_VERSION, _ARM_FILE_EDITS)


def patch_deconv_strips(src: Path) -> None:
    """Apply the x86 edits to an unpacked ncnn source tree, in place."""
    apply_file_edits(src, _FILE_EDITS, "deconv_strips_patch.py")


def patch_deconv_strips_arm(src: Path) -> None:
    """Apply the Arm edits to an unpacked ncnn source tree, in place (aarch64 builds)."""
    apply_file_edits(src, _ARM_FILE_EDITS, "deconv_strips_patch.py")
