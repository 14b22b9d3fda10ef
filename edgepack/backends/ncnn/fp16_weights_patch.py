"""x86 InnerProduct layers, and Gemm layers with a large constant B, keep fp16 weights in fp16 until they
are packed (src/modelbin.{h,cpp}, src/layer/x86/innerproduct_x86.{h,cpp}, src/layer/x86/gemm_x86.{h,cpp}).

ncnn widens every fp16 weight of a .bin to an fp32 Mat as it loads it, then packs that copy: back into
fp16 for InnerProduct's fp16-storage kernels, into its fp32 tile layout for Gemm. A large layer held its
fp16 read buffer, an fp32 copy and its packed kernel at once. Measured peaks, before -> after: a test
model of four InnerProduct heads (512 x 14214 fp16 weights) 37.1 -> 23.4 MiB; two sequence classifiers
(Gemm, 512 x 11210) 40.1 -> 32.2 MiB; ddddocr_old_int8, whose 1024 x 8210 classifier is such a Gemm,
85.7 -> 70.2 MiB (issue 10 item 5).

Now InnerProduct_x86::load_model asks the ModelBin for the weights as they are stored
(``ep_load_fp16``: fp16 stays an elemsize-2 Mat over the read buffer; every other storage loads as
before), and create_pipeline:
- fp16 storage on an F16C CPU: packs a few rows at a time (widened to fp32 in a chunk of at most 256
  rows, packed by ncnn's own transform, copied into place). Chunks of c or 15c rows, c the largest of
  16/8/4 dividing the output count, get the same packing ncnn picks for the whole matrix on every ISA
  build. When that packing is 1 (an output count not divisible by 4, or no packing layout), ncnn's
  kernel is the fp16 weights row by row: the loaded Mat is used as it is (an fp16 -> fp32 -> fp16
  round trip is exact, so this is the same kernel, bit for bit);
- any other path (fp32, bf16, a CPU without F16C): widens the whole weight first, as ncnn did.
Layers with int8 scales load as before (ncnn quantises their fp32 weights at load). The shared-kernel
key (shared_weights_patch.py) hashes the bytes as loaded, so layers with equal fp16 weights still share.
Gemm_x86: a constant B of at least EP_GEMM_KEEP_FP16_MIN elements, transposed (transB=1, the layout pnnx
writes) and not quantised, is loaded through a ModelBin wrapper that asks for that one load as stored;
create_pipeline widens each tile's block of it (a few KiB) just before ncnn's own pack_B_tile. Its bf16
path widens B whole first. Smaller or other B load as before.
x86 builds only; Arm keeps widening (its InnerProduct and Gemm transforms differ).
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key
from .winograd_fp16_patch import F16C_HELPERS

FP16_WEIGHTS_PATCH_VERSION = 4  # 2: Gemm_x86's large constant B too; 3: its tiles widened with F16C;
#                                 4: F16C by CPUID in every ISA's build (F16C_HELPERS)

_MB_BASE_DECL_OLD = "    // load vec\n    virtual Mat load(int w, int type) const;\n"
_MB_BASE_DECL_NEW = _MB_BASE_DECL_OLD + (
    "    // edgepack (fp16_weights_patch.py): a weight vector as stored when that is fp16 (an elemsize-2\n"
    "    // Mat the caller packs itself), else as load(w, 0)\n"
    "    virtual Mat ep_load_fp16(int w) const;\n")
_MB_READER_DECL_OLD = "    virtual ~ModelBinFromDataReader();\n\n    virtual Mat load(int w, int type) const;\n"
_MB_READER_DECL_NEW = _MB_READER_DECL_OLD + "    virtual Mat ep_load_fp16(int w) const;\n"

_MB_BASE_DEF_OLD = "Mat ModelBin::load(int w, int h, int type) const\n"
_MB_BASE_DEF_NEW = '''// edgepack (fp16_weights_patch.py)
Mat ModelBin::ep_load_fp16(int w) const
{
    return load(w, 0);
}

''' + _MB_BASE_DEF_OLD

_MB_PRIV_OLD = '''    ModelBinFromDataReaderPrivate(const DataReader& _dr)
        : dr(_dr)
    {
    }
    const DataReader& dr;
'''
_MB_PRIV_NEW = '''    ModelBinFromDataReaderPrivate(const DataReader& _dr)
        : dr(_dr), ep_keep_fp16(0)
    {
    }
    const DataReader& dr;
    int ep_keep_fp16; // edgepack (fp16_weights_patch.py): set by ep_load_fp16 for one load
'''

_MB_READER_DEF_OLD = "Mat ModelBinFromDataReader::load(int w, int type) const\n"
_MB_READER_DEF_NEW = '''// edgepack (fp16_weights_patch.py)
Mat ModelBinFromDataReader::ep_load_fp16(int w) const
{
    d->ep_keep_fp16 = 1;
    Mat m = load(w, 0);
    d->ep_keep_fp16 = 0;
    return m;
}

''' + _MB_READER_DEF_OLD

# the read path as load_reuse_patch.py leaves it (float16_buf is that patch's buffer)
_MB_WIDEN_OLD = "                m = Mat::from_float16(&float16_weights[0], w);\n"
_MB_WIDEN_NEW = '''                if (d->ep_keep_fp16)
                {
                    // edgepack (fp16_weights_patch.py): the read buffer itself, as w fp16 values
                    m = float16_buf;
                    m.w = w;
                    m.elemsize = 2u;
                    m.cstep = (size_t)w;
                }
                else
                    m = Mat::from_float16(&float16_weights[0], w);
'''

_IP_DECL_OLD = "    virtual int create_pipeline(const Option& opt);\n    virtual int destroy_pipeline(const Option& opt);\n"
_IP_DECL_NEW = "    virtual int load_model(const ModelBin& mb);\n" + _IP_DECL_OLD

_IP_LOAD_OLD = "int InnerProduct_x86::create_pipeline(const Option& opt)\n{\n"
_IP_LOAD_NEW = '''// edgepack (fp16_weights_patch.py): fp16 weights stay fp16 until create_pipeline packs them
int InnerProduct_x86::load_model(const ModelBin& mb)
{
    if (int8_scale_term)
        return InnerProduct::load_model(mb);

    weight_data = mb.ep_load_fp16(weight_data_size);
    if (weight_data.empty())
        return -100;

    if (bias_term)
    {
        bias_data = mb.load(num_output, 1);
        if (bias_data.empty())
            return -100;
    }

    return 0;
}

// the paths that transform fp32 weights get them widened whole, as ncnn's own load did
static int ep_widen_fp16(Mat& weight_data, const Option& opt)
{
    if (weight_data.elemsize != 2u)
        return 0;
    Option o = opt;
    o.blob_allocator = 0; // the weights outlive the net's pools
    Mat w32;
    cast_float16_to_float32(weight_data, w32, o);
    if (w32.empty())
        return -100;
    weight_data = w32;
    return 0;
}

''' + _IP_LOAD_OLD

_IP_FP32_OLD = "    const EpKernelKey ep_key = ep_kernel_key(weight_data, num_output, 1 * 2 + (opt.use_packing_layout ? 1 : 0));\n"
_IP_FP32_NEW = "    if (ep_widen_fp16(weight_data, opt) != 0)\n        return -100;\n\n" + _IP_FP32_OLD

_IP_BF16_OLD = "int InnerProduct_x86::create_pipeline_bf16s(const Option& opt)\n{\n"
_IP_BF16_NEW = _IP_BF16_OLD + "    if (ep_widen_fp16(weight_data, opt) != 0)\n        return -100;\n\n"

_IP_CHUNKED_OLD = "int InnerProduct_x86::create_pipeline_fp16s(const Option& opt)\n{\n"
_IP_CHUNKED_NEW = '''// edgepack (fp16_weights_patch.py): fp16 weights packed a few rows at a time, never widened whole
static int ep_transform_fp16s_chunked(const Mat& weight_fp16, Mat& weight_data_tm, int num_input, int num_output, const Option& opt)
{
    // c: the largest of 16/8/4 dividing num_output. A chunk of c or 15c rows gets the packing the
    // whole matrix gets on this build (the transform picks the largest of 16/8/4 its row count
    // divides by, capped by the ISA, and 15c is divisible by no larger one of them)
    const int c = num_output % 16 == 0 ? 16 : num_output % 8 == 0 ? 8 : num_output % 4 == 0 ? 4 : 1;
    if (c == 1 || !opt.use_packing_layout)
    {
        // packing 1: the kernel is the weights in fp16, row by row
        weight_data_tm = weight_fp16.reshape(num_input, num_output);
        return weight_data_tm.empty() ? -100 : 0;
    }
    const int big = c == 16 ? 16 * 16 : c * 15;
    Option o = opt;
    o.blob_allocator = 0;
    o.workspace_allocator = 0;
    const unsigned short* src = (const unsigned short*)weight_fp16.data;
    Mat w32;
    Mat tm;
    weight_data_tm.release();
    for (int q = 0; q < num_output;)
    {
        const int rows = num_output - q >= big ? big : c;
        Mat view((int)((size_t)rows * num_input), (void*)(src + (size_t)q * num_input), (size_t)2u);
        cast_float16_to_float32(view, w32, o);
        if (w32.empty())
            return -100;
        innerproduct_transform_kernel_fp16s(w32, tm, num_input, rows, o);
        if (tm.empty() || tm.w != num_input || tm.h * tm.elempack != rows)
            return -100;
        if (weight_data_tm.empty())
        {
            weight_data_tm.create(num_input, num_output / tm.elempack, tm.elemsize, tm.elempack);
            if (weight_data_tm.empty())
                return -100;
        }
        if (tm.elempack != weight_data_tm.elempack)
            return -100;
        memcpy(weight_data_tm.row<unsigned char>(q / tm.elempack), tm.data, (size_t)tm.w * tm.h * tm.elemsize);
        q += rows;
    }
    return 0;
}

''' + _IP_CHUNKED_OLD

_IP_FP16S_OLD = "        innerproduct_transform_kernel_fp16s(weight_data, weight_data_tm, num_input, num_output, opt);\n"
_IP_FP16S_NEW = '''        if (weight_data.elemsize == 2u)
        {
            if (ep_transform_fp16s_chunked(weight_data, weight_data_tm, num_input, num_output, opt) != 0)
                return -100;
        }
        else
            innerproduct_transform_kernel_fp16s(weight_data, weight_data_tm, num_input, num_output, opt);
'''

_GEMM_DECL_OLD = "    Gemm_x86();\n\n    virtual int create_pipeline(const Option& opt);\n"
_GEMM_DECL_NEW = "    Gemm_x86();\n\n    virtual int load_model(const ModelBin& mb);\n    virtual int create_pipeline(const Option& opt);\n"

_GEMM_LOAD_OLD = "Gemm_x86::Gemm_x86()\n{\n"
_GEMM_LOAD_NEW = """// edgepack (fp16_weights_patch.py): a large constant B stored in fp16 stays fp16 until
// create_pipeline packs it, tile by tile, into ncnn's fp32 layout (widened whole it was the load peak)
#define EP_GEMM_KEEP_FP16_MIN (1 << 19) // elements of B: 1 MiB of fp16 and up; smaller ones load as before

namespace {

// forwards every load to the net's ModelBin; the load numbered `keep` comes back as stored when fp16
class EpKeepFp16ModelBin : public ModelBin
{
public:
    EpKeepFp16ModelBin(const ModelBin& _mb, int _keep)
        : mb(_mb), keep(_keep), calls(0)
    {
    }
    using ModelBin::load;
    virtual Mat load(int w, int type) const
    {
        return calls++ == keep && type == 0 ? mb.ep_load_fp16(w) : mb.load(w, type);
    }
    virtual Mat ep_load_fp16(int w) const
    {
        calls++;
        return mb.ep_load_fp16(w);
    }

private:
    const ModelBin& mb;
    const int keep;
    mutable int calls;
};

""" + F16C_HELPERS + r"""
// rows [r0, r0 + rows) x columns [c0, c0 + cols) of an fp16 matrix `width` wide, as fp32
static void ep_widen_fp16_block(const Mat& B16, int width, int r0, int rows, int c0, int cols, Mat& out)
{
    out.create(cols, rows, (size_t)4u, (Allocator*)0);
    for (int r = 0; r < rows; r++)
    {
        // F16C by CPUID, in every ISA's build (gemm_fp16_b_patch.py includes immintrin.h): the scalar loop alone
        // added ~40 ms to the start of a model with a 8210 x 512 classifier (ddddocr_crnn); both conversions are exact
        ep_fp16_widen_any((const unsigned short*)B16.data + (size_t)(r0 + r) * width + c0, out.row(r), cols);
    }
}

} // namespace

int Gemm_x86::load_model(const ModelBin& mb)
{
    // (pnnx writes a constant B transposed, transB=1: the only layout taken here)
    if (constantB != 1 || transB != 1 || weight_block_quantize || quantize_term
            || (size_t)constantK * (size_t)constantN < (size_t)EP_GEMM_KEEP_FP16_MIN)
        return Gemm::load_model(mb);

    // Gemm::load_model loads A (when constant) first, then B
    EpKeepFp16ModelBin keep_b(mb, constantA == 1 ? 1 : 0);
    return Gemm::load_model(keep_b);
}

""" + _GEMM_LOAD_OLD

_GEMM_BF16_OLD = "int Gemm_x86::create_pipeline_bf16s(const Option& opt)\n{\n"
_GEMM_BF16_NEW = _GEMM_BF16_OLD + """    if (B_data.elemsize == 2u)
    {
        // edgepack (fp16_weights_patch.py): this path casts B whole; give it fp32
        Mat B32;
        Option o = opt;
        o.blob_allocator = 0;
        cast_float16_to_float32(B_data, B32, o);
        if (B32.empty())
            return -100;
        B_data = B32;
    }

"""

_GEMM_PACK_OLD = """            if (transB)
            {
                pack_B_tile(B_data, BT_tile, j, max_jj, k, max_kk);
            }
            else
            {
                transpose_pack_B_tile(B_data, BT_tile, j, max_jj, k, max_kk);
            }
"""
_GEMM_PACK_NEW = """            if (B_data.elemsize == 2u)
            {
                // edgepack (fp16_weights_patch.py): widen only this tile's block of the fp16 B (N x K)
                Mat block;
                ep_widen_fp16_block(B_data, K, j, max_jj, k, max_kk, block);
                pack_B_tile(block, BT_tile, 0, max_jj, 0, max_kk);
            }
            else if (transB)
            {
                pack_B_tile(B_data, BT_tile, j, max_jj, k, max_kk);
            }
            else
            {
                transpose_pack_B_tile(B_data, BT_tile, j, max_jj, k, max_kk);
            }
"""

_FILE_EDITS = (
    ("src/modelbin.h", (
        ("ModelBin's load(w, type)", _MB_BASE_DECL_OLD, _MB_BASE_DECL_NEW, 1),
        ("ModelBinFromDataReader's load(w, type)", _MB_READER_DECL_OLD, _MB_READER_DECL_NEW, 1),
    )),
    ("src/modelbin.cpp", (
        ("ModelBin::load(w, h, type)", _MB_BASE_DEF_OLD, _MB_BASE_DEF_NEW, 1),
        ("the reader's private data", _MB_PRIV_OLD, _MB_PRIV_NEW, 1),
        ("ModelBinFromDataReader::load", _MB_READER_DEF_OLD, _MB_READER_DEF_NEW, 1),
        ("the fp16 widening of a read (after load_reuse_patch.py)", _MB_WIDEN_OLD, _MB_WIDEN_NEW, 1),
    )),
    ("src/layer/x86/innerproduct_x86.h", (("the pipeline declarations", _IP_DECL_OLD, _IP_DECL_NEW, 1),)),
    ("src/layer/x86/innerproduct_x86.cpp", (
        ("create_pipeline", _IP_LOAD_OLD, _IP_LOAD_NEW, 1),
        ("the fp32 transform's shared key (after shared_weights_patch.py)", _IP_FP32_OLD, _IP_FP32_NEW, 1),
        ("create_pipeline_bf16s", _IP_BF16_OLD, _IP_BF16_NEW, 1),
        ("create_pipeline_fp16s", _IP_CHUNKED_OLD, _IP_CHUNKED_NEW, 1),
        ("the fp16 transform", _IP_FP16S_OLD, _IP_FP16S_NEW, 1),
    )),
    ("src/layer/x86/gemm_x86.h", (("Gemm_x86's declarations", _GEMM_DECL_OLD, _GEMM_DECL_NEW, 1),)),
    ("src/layer/x86/gemm_x86.cpp", (
        ("Gemm_x86's constructor", _GEMM_LOAD_OLD, _GEMM_LOAD_NEW, 1),
        ("create_pipeline_bf16s", _GEMM_BF16_OLD, _GEMM_BF16_NEW, 1),
        ("the fp32 packing of a constant B", _GEMM_PACK_OLD, _GEMM_PACK_NEW, 1),
    )),
)

FP16_WEIGHTS_PATCH_KEY = file_edits_key(FP16_WEIGHTS_PATCH_VERSION, _FILE_EDITS)


def patch_fp16_weights(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place (x86 builds, after load_reuse_patch.py
    and shared_weights_patch.py, whose text two of the edits extend)."""
    apply_file_edits(src, _FILE_EDITS, "fp16_weights_patch.py")
