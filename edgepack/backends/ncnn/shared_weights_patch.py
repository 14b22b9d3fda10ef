"""InnerProduct layers with the same weights share one transformed kernel (x86: src/layer/x86/innerproduct_x86.cpp;
Arm: its fp32 transform in src/layer/arm/innerproduct_arm.cpp).

An unrolled recurrence multiplies by the same weight at every step, and pnnx writes one InnerProduct
per step, each with its own copy (ONNX shares one initializer; pnnx folds every use into its layer).
ddddocr_old_int8's quantised LSTM cannot stay one ncnn layer (H is quantised at every step), so its 38
recurrent steps each packed their own 2 MiB (fp16) or 4 MiB (fp32) kernel: 80-160 MB of RSS, and
every step streamed its copy from memory where one copy per direction would stay in cache.

At create_pipeline a layer hashes its loaded weights (128 bits over the bytes, with the output count
and the kind of transform: fp32 or fp16 storage) and takes the transformed kernel of an earlier layer
with the same key instead of transforming its own; a Mat is reference-counted, so the kernel lives as
long as a layer using it. The table drops an entry once only the table holds it (its layers were
destroyed), and a mutex guards it (nets may be created on several threads). Only kernels from the
default allocator are shared: ncnn's fp16 cast of an unpacked kernel takes the net's blob allocator, a
pool that dies with the net (sharing one crashed the artifact at exit, freeing into the gone pool).
int8 and bf16 kernels are not shared. A hash match is taken as equality: a model whose layers collide on 128 bits by design
could only corrupt its own outputs, and the artifact's verification would see it.
x86 builds carry SHARED_WEIGHTS_PATCH_KEY in their cache key, Arm builds SHARED_WEIGHTS_ARM_PATCH_KEY.
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

# 2: no start-up constructors (the AVX-512 build's trapped on SSE CPUs); 3: default-allocator kernels only
SHARED_WEIGHTS_PATCH_VERSION = 3

IP_FILE = "src/layer/x86/innerproduct_x86.cpp"

_TABLE = r'''namespace ncnn {

// edgepack (shared_weights_patch.py): one transformed kernel per distinct weight, shared by layers
namespace {

struct EpKernelKey
{
    uint64_t h[2];
    size_t bytes;
    int num_output;
    int kind; // 2 or 3: fp32 transform, 4 or 5: fp16 storage transform (+1: packing layout)
};

struct EpSharedKernel
{
    EpKernelKey key;
    Mat kernel;
};

// Function-local statics, built on first use: a namespace-scope object with a constructor would run
// it at start-up in every ISA build of this file, and the AVX-512 build's code traps on older CPUs.
static std::vector<EpSharedKernel>& ep_kernels()
{
    static std::vector<EpSharedKernel> table;
    return table;
}

static Mutex& ep_kernels_lock()
{
    static Mutex lock;
    return lock;
}

static EpKernelKey ep_kernel_key(const Mat& w, int num_output, int kind)
{
    EpKernelKey k;
    k.bytes = w.total() * w.elemsize;
    k.num_output = num_output;
    k.kind = kind;
    // four independent multiply-xorshift lanes over 8-byte words, folded into 128 bits
    uint64_t lane[4] = {0x9E3779B97F4A7C15ull, 0xC2B2AE3D27D4EB4Full, 0x165667B19E3779F9ull, 0xD6E8FEB86659FD93ull};
    const unsigned char* p = (const unsigned char*)w.data;
    size_t i = 0;
    for (; i + 32 <= k.bytes; i += 32)
    {
        for (int l = 0; l < 4; l++)
        {
            uint64_t v;
            memcpy(&v, p + i + 8 * l, 8);
            lane[l] = (lane[l] ^ v) * 0xFF51AFD7ED558CCDull;
            lane[l] ^= lane[l] >> 31;
        }
    }
    for (; i < k.bytes; i++)
        lane[i & 3] = (lane[i & 3] ^ p[i]) * 0x100000001B3ull;
    k.h[0] = (lane[0] ^ (lane[1] >> 7)) * 0xC4CEB9FE1A85EC53ull ^ (uint64_t)k.bytes;
    k.h[1] = (lane[2] ^ (lane[3] >> 11)) * 0x9FB21C651E98DF25ull ^ lane[1];
    return k;
}

static bool ep_same_key(const EpKernelKey& a, const EpKernelKey& b)
{
    return a.h[0] == b.h[0] && a.h[1] == b.h[1] && a.bytes == b.bytes && a.num_output == b.num_output && a.kind == b.kind;
}

// entries only the table still holds: their layers are gone (caller holds the lock)
static void ep_drop_unused()
{
    std::vector<EpSharedKernel>& table = ep_kernels();
    for (size_t i = 0; i < table.size();)
    {
        const Mat& m = table[i].kernel;
        if (m.refcount && *m.refcount == 1)
            table.erase(table.begin() + i);
        else
            i++;
    }
}

// the kernel of an earlier layer with these weights into `kernel`; false if there is none
static bool ep_take_shared(const EpKernelKey& key, Mat& kernel)
{
    MutexLockGuard guard(ep_kernels_lock());
    ep_drop_unused();
    const std::vector<EpSharedKernel>& table = ep_kernels();
    for (size_t i = 0; i < table.size(); i++)
    {
        if (ep_same_key(table[i].key, key))
        {
            kernel = table[i].kernel;
            return true;
        }
    }
    return false;
}

static void ep_share(const EpKernelKey& key, const Mat& kernel)
{
    // only kernels from the default allocator: one from the net's blob allocator (ncnn's fp16 cast
    // takes opt.blob_allocator) dies with that net's pool, and a later net, or the exit, would free
    // a shared copy into a pool that is gone
    if (kernel.empty() || kernel.allocator)
        return;
    MutexLockGuard guard(ep_kernels_lock());
    EpSharedKernel e;
    e.key = key;
    e.kernel = kernel;
    ep_kernels().push_back(e);
}

} // namespace
'''


# both arches: the table goes in at the start of the file's namespace
_TABLE_EDIT = ("the table, at the namespace", "namespace ncnn {\n",
               "#include <stdint.h>\n#include <string.h>\n#include <vector>\n\n" + _TABLE, 1)


def _shared(call: str, kind: int) -> str:
    # the layout a transform writes follows opt.use_packing_layout: part of the kind
    return (f"    const EpKernelKey ep_key = ep_kernel_key(weight_data, num_output, {kind} * 2 + (opt.use_packing_layout ? 1 : 0));\n"
            f"    if (!ep_take_shared(ep_key, weight_data_tm))\n"
            f"    {{\n"
            f"        {call}\n"
            f"        ep_share(ep_key, weight_data_tm);\n"
            f"    }}\n")


_FP32 = "    innerproduct_transform_kernel(weight_data, weight_data_tm, num_input, num_output, opt);\n"
_FP16 = "    innerproduct_transform_kernel_fp16s(weight_data, weight_data_tm, num_input, num_output, opt);\n"

_IP_EDITS = (
    _TABLE_EDIT,
    ("the fp32 transform", _FP32, _shared(_FP32.strip(), 1), 1),
    ("the fp16 storage transform", _FP16, _shared(_FP16.strip(), 2), 1),
)

_FILE_EDITS = ((IP_FILE, _IP_EDITS),)

SHARED_WEIGHTS_PATCH_KEY = file_edits_key(SHARED_WEIGHTS_PATCH_VERSION, _FILE_EDITS)

# Arm: the fp32 transform (the only precision a quantised graph verifies in there; Arm's fp16 and
# bf16 transforms live in other files and keep a kernel per layer). It is written inline in
# create_pipeline, so the lookup returns early and the share follows the transform.
ARM_IP_FILE = "src/layer/arm/innerproduct_arm.cpp"
SHARED_WEIGHTS_ARM_PATCH_VERSION = 2  # 2: default-allocator kernels only

_ARM_LOOKUP = """    const EpKernelKey ep_key = ep_kernel_key(weight_data, num_output, 2 + (opt.use_packing_layout ? 1 : 0));
    if (ep_take_shared(ep_key, weight_data_tm))
    {
        if (opt.lightmode)
            weight_data.release();
        return 0;
    }

"""
_ARM_TRANSFORM = "    if (out_elempack == 4)\n    {\n        // src = inch-outch\n        // dst = pb-inch-outch/pb\n"
_ARM_PLAIN = "        weight_data_tm = weight_data;\n    }\n"

_ARM_IP_EDITS = (
    _TABLE_EDIT,
    ("the fp32 transform's start", _ARM_TRANSFORM, _ARM_LOOKUP + _ARM_TRANSFORM, 1),
    ("the fp32 transform's end", _ARM_PLAIN, _ARM_PLAIN + "    ep_share(ep_key, weight_data_tm);\n", 1),
)

_ARM_FILE_EDITS = ((ARM_IP_FILE, _ARM_IP_EDITS),)

SHARED_WEIGHTS_ARM_PATCH_KEY = file_edits_key(SHARED_WEIGHTS_ARM_PATCH_VERSION, _ARM_FILE_EDITS)


def patch_shared_weights(src: Path) -> None:
    """Apply the x86 edits to an unpacked ncnn source tree, in place."""
    apply_file_edits(src, _FILE_EDITS, "shared_weights_patch.py")


def patch_shared_weights_arm(src: Path) -> None:
    """Apply the Arm edits to an unpacked ncnn source tree, in place."""
    apply_file_edits(src, _ARM_FILE_EDITS, "shared_weights_patch.py")
