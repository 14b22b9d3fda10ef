"""Convolutions that sum integers take Winograd F(2,3) on x86 (src/layer/x86/convolution_x86.cpp).

A lowered dynamic-int8 graph's convolutions (ConvInteger, QLinearConv: quantized.py) sum integers, which
onnxruntime adds exactly. ncnn's Winograd F(6,3) and F(4,3) transforms hold fractions (1/6, 1/24...), and
their rounding moved ddddocr_old_int8's output 1.3%, so memory.integer_convolutions masks Winograd on
them (featmask bit 6) and x86 ran them on the direct kernel in fp32. F(2,3)'s transforms are sums,
differences and halves: every transformed value is an integer or a multiple of 1/4, every product and
sum of them exact in fp32 while it stays under 2^22, so F(2,3) keeps the integer sums exact where the
direct kernel does. Measured with the ncnn Python wheel on ddddocr_old_int8's converted graph (fp32,
Winograd limited to F(2,3)): its output bit for bit the output without Winograd, where F(6,3)/F(4,3)
moved it by 0.097 of 15.9.

memory.integer_convolutions therefore also sets featmask bit 8 (memory.INTEGER_SUMS, no meaning to ncnn) on those
layers; on x86 the layer then reads its options with Winograd back on but only as F(2,3), in
create_pipeline and in forward, and the direct kernel keeps the layers its break-even gives it (3x3
stride 1 below 16 input channels). Arm ignores the bit and keeps Winograd masked. `--memory lean`
clears the bit on the layers it masks.

EDGEPACK_NCNN_TRACE=1 says which 3x3 layers were allowed F(2,3) when the net loads.

Applied as exact text edits that must each match (source_patch.py). Only x86 builds compile this
file, so only their cache key carries INTEGER_WINOGRAD_PATCH_KEY.
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

INTEGER_WINOGRAD_PATCH_VERSION = 1  # part of the x86 libncnn cache key (library.py)

_HELPER = r'''
// edgepack (integer_winograd_patch.py): a layer that sums integers (featmask bit 8) may take Winograd,
// as F(2,3) only, whose transforms keep integer sums exact; bit 6 (set with it, for Arm) is overridden
static Option ep_integer_sums_option(const Option& opt, int featmask)
{
    Option opt1 = opt;
    if (featmask & (1 << 8))
    {
        opt1.use_winograd_convolution = true;
        opt1.use_winograd23_convolution = true;
        opt1.use_winograd43_convolution = false;
        opt1.use_winograd63_convolution = false;
    }
    return opt1;
}

int Convolution_x86::create_pipeline(const Option& ep_opt)
{
    const Option opt = ep_integer_sums_option(ep_opt, featmask);
    if ((featmask & (1 << 8)) && kernel_w == 3 && kernel_h == 3 && getenv("EDGEPACK_NCNN_TRACE"))
        NCNN_LOGE("edgepack integer convolution: %d -> %d 3x3, Winograd F(2,3) allowed", num_output ? weight_data_size / 9 / num_output : 0, num_output);
'''

_FORWARD = r'''int Convolution_x86::forward(const Mat& bottom_blob, Mat& top_blob, const Option& ep_opt) const
{
    const Option opt = ep_integer_sums_option(ep_opt, featmask);
'''

_EDITS = (
    ("create_pipeline's opening", "\nint Convolution_x86::create_pipeline(const Option& opt)\n{\n", _HELPER, 1),
    ("forward's opening", "int Convolution_x86::forward(const Mat& bottom_blob, Mat& top_blob, const Option& opt) const\n{\n",
     _FORWARD, 1),
)

CONV_FILE = Path("src") / "layer" / "x86" / "convolution_x86.cpp"
_FILE_EDITS = ((CONV_FILE, _EDITS),)

INTEGER_WINOGRAD_PATCH_KEY = file_edits_key(INTEGER_WINOGRAD_PATCH_VERSION, _FILE_EDITS)


def patch_integer_winograd(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place."""
    apply_file_edits(src, _FILE_EDITS, "integer_winograd_patch.py")
