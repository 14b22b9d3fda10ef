"""ncnn's batch-aware Reshape copies whole rows, not one element at a time (every arch).

When a Reshape moves pnnx's batch axis (the pair of Reshapes pnnx writes around an F.linear on a 3-D
tensor, for one), ncnn copies the tensor in `Reshape::copy_batch_reshape`: for every element it maps the
element's index to a source and a destination offset through the full shape arithmetic, and again for
the element before it and for every element of the run after it, to find contiguous runs. About six
offset computations per element: 21% of openWakeWord's log-mel front end after its STFT became a
convolution (0.02 of 0.1 ms, one 8 x 32 tensor), and the reason a MatMul form of that STFT lost.

Where neither side's batch axis is its innermost logical axis, consecutive elements of a side's innermost
logical row sit one fixed step apart in memory: one value, or one whole pack where a blob of 2 or more
dimensions is packed (its lanes are the outermost axis). So copy in runs: from index i, as far as the end
of the current input row or output row, whichever comes first, with one pair of offset computations per
run (a memcpy where both steps are one value, else value by value). A batch axis innermost keeps ncnn's
loop. The bytes copied are the same.
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

BATCH_RESHAPE_PATCH_VERSION = 1  # part of every arch's libncnn cache key (library.py)

_ORIGINAL_HEAD = '''    const unsigned char* ptr = (const unsigned char*)bottom_blob;
    unsigned char* outptr = (unsigned char*)top_blob;
    const size_t block = (size_t)1 << 30;
'''

_RUNS = '''    const unsigned char* ptr = (const unsigned char*)bottom_blob;
    unsigned char* outptr = (unsigned char*)top_blob;
    // edgepack (batch_reshape_patch.py): where no batch axis is innermost, consecutive elements of a
    // side's innermost logical row sit one step apart (a value; a whole pack where a 2-D or higher blob is
    // packed): walk runs up to the nearer row end with two offset computations each, not six per element
    const int ep_in_dims = input_shape.dims + (input_axis != 233 ? 1 : 0);
    const int ep_out_dims = output_shape.dims + (output_axis != 233 ? 1 : 0);
    if (input_axis != ep_in_dims - 1 && output_axis != ep_out_dims - 1 && input_shape.w > 0 && output_shape.w > 0)
    {
        const size_t in_w = (size_t)input_shape.w;
        const size_t out_w = (size_t)output_shape.w;
        const size_t in_step = bottom_blob.dims == 1 ? scalar_elemsize : bottom_blob.elemsize;
        const size_t out_step = top_blob.dims == 1 ? scalar_elemsize : top_blob.elemsize;
        size_t i = 0;
        while (i < total)
        {
            const size_t in_left = in_w - i % in_w;
            const size_t out_left = out_w - i % out_w;
            size_t run = in_left < out_left ? in_left : out_left;
            if (run > total - i)
                run = total - i;
            const size_t srcoff = get_batch_reshape_offset(bottom_blob, input_shape, input_axis, i, scalar_elemsize);
            const size_t dstoff = get_batch_reshape_offset(top_blob, output_shape, output_axis, i, scalar_elemsize);
            if (in_step == scalar_elemsize && out_step == scalar_elemsize)
                memcpy(outptr + dstoff, ptr + srcoff, run * scalar_elemsize);
            else
                for (size_t k = 0; k < run; k++)
                    memcpy(outptr + dstoff + k * out_step, ptr + srcoff + k * in_step, scalar_elemsize);
            i += run;
        }
        return;
    }
    const size_t block = (size_t)1 << 30;
'''

_FILE_EDITS = (("src/layer/reshape.cpp", (("copy_batch_reshape: runs of whole rows", _ORIGINAL_HEAD, _RUNS, 1),)),)
BATCH_RESHAPE_PATCH_KEY = file_edits_key(BATCH_RESHAPE_PATCH_VERSION, _FILE_EDITS)


def patch_batch_reshape(src: Path) -> None:
    """Apply the edit to an unpacked ncnn source tree, in place (every arch)."""
    apply_file_edits(src, _FILE_EDITS, "batch_reshape_patch.py")
