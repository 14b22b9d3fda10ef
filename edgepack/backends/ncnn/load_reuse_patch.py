"""While a net loads its weights, ncnn's large freed buffers are kept for the next layer (every arch).

Loading a layer allocates its weights (an fp16 .bin's are widened to an fp32 Mat), transforms them
into a packed kernel, and in light mode frees the loaded copy. musl maps every block over 128 KiB on
its own and unmaps it on free, so the next layer faults the same amount of fresh zeroed pages in
again: ddddocr_old_int8 (38 recurrent steps of a 4 MiB weight, widened to 8 MiB each) took 114k page
faults, 445 MiB, and 360 ms of CPU to start, most of it in the kernel clearing pages. (ncnn also read
each fp16 weight into a zero-filled vector of twice its size; it now reads into a Mat of its size.)

This keeps up to EP_REUSE_SLOTS freed blocks of at least 1 MiB (EP_REUSE_CAP bytes in all) while the
runtime says a load is in progress (`ep_ncnn_load_reuse(1)` … `(0)`, runtimes/ncnn/ep_engine_ncnn.c),
and hands one back to the next fastMalloc it fits (at most a quarter larger than asked); a large
fastMalloc that none fits frees them all first, so they never sit beside a fresh block. Off, the
slots are freed and fastMalloc/fastFree do exactly what they did: inference never sees it. The slots
are a function-local static under ncnn's Mutex: no constructor runs at start-up.
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

LOAD_REUSE_PATCH_VERSION = 1

_HEADER_DECLS = r'''namespace ncnn {

// edgepack (load_reuse_patch.py): large freed blocks are reused while a net loads its weights
#define EP_REUSE_MIN ((size_t)1 << 20) // blocks from this size up are kept and handed back
extern int g_ep_load_reuse;
NCNN_EXPORT void* ep_reuse_take(size_t size);
NCNN_EXPORT int ep_reuse_keep(void* ptr);
'''

_MALLOC_OLD = '''    void* ptr = 0;
    if (posix_memalign(&ptr, NCNN_MALLOC_ALIGN, size + NCNN_MALLOC_OVERREAD))
        ptr = 0;
    return ptr;
'''
_MALLOC_NEW = '''    void* ptr = 0;
    if (g_ep_load_reuse && size >= EP_REUSE_MIN && (ptr = ep_reuse_take(size + NCNN_MALLOC_OVERREAD)) != 0)
        return ptr;
    if (posix_memalign(&ptr, NCNN_MALLOC_ALIGN, size + NCNN_MALLOC_OVERREAD))
        ptr = 0;
    return ptr;
'''
_FREE_OLD = '''#elif ((defined(__unix__) || defined(__APPLE__)) && !defined(__ANDROID__)) || (__ANDROID__ && __ANDROID_API__ >= 17)
        free(ptr);
'''
_FREE_NEW = '''#elif ((defined(__unix__) || defined(__APPLE__)) && !defined(__ANDROID__)) || (__ANDROID__ && __ANDROID_API__ >= 17)
        if (!g_ep_load_reuse || !ep_reuse_keep(ptr))
            free(ptr);
'''

_SOURCE_DEFS = r'''namespace ncnn {

// edgepack (load_reuse_patch.py)
#define EP_REUSE_SLOTS 4
#define EP_REUSE_CAP ((size_t)64 << 20)

int g_ep_load_reuse = 0;

struct EpReuseSlots
{
    Mutex lock;
    void* ptr[EP_REUSE_SLOTS];
    size_t size[EP_REUSE_SLOTS];
    size_t total;
};

static EpReuseSlots& ep_reuse_slots()
{
    static EpReuseSlots s; // built on first use, never at start-up
    return s;
}

// frees every kept block; the caller holds s.lock
static void ep_reuse_drain(EpReuseSlots& s)
{
    for (int i = 0; i < EP_REUSE_SLOTS; i++)
    {
        free(s.ptr[i]);
        s.ptr[i] = 0;
        s.size[i] = 0;
    }
    s.total = 0;
}

static size_t ep_usable_size(void* ptr)
{
#if defined(__APPLE__)
    return malloc_size(ptr);
#else
    return malloc_usable_size(ptr);
#endif
}

void* ep_reuse_take(size_t size)
{
    EpReuseSlots& s = ep_reuse_slots();
    s.lock.lock();
    int best = -1;
    for (int i = 0; i < EP_REUSE_SLOTS; i++)
    {
        if (s.ptr[i] && s.size[i] >= size && s.size[i] - size <= size / 4 && (best < 0 || s.size[i] < s.size[best]))
            best = i;
    }
    void* ptr = 0;
    if (best >= 0)
    {
        ptr = s.ptr[best];
        s.total -= s.size[best];
        s.ptr[best] = 0;
        s.size[best] = 0;
    }
    else
    {
        // none fits: the kept blocks are of sizes this load has moved past; holding them while a
        // fresh block is mapped would only raise the peak
        ep_reuse_drain(s);
    }
    s.lock.unlock();
    return ptr;
}

int ep_reuse_keep(void* ptr)
{
    size_t size = ep_usable_size(ptr);
    if (size < EP_REUSE_MIN || size > EP_REUSE_CAP)
        return 0;
    EpReuseSlots& s = ep_reuse_slots();
    int kept = 0;
    s.lock.lock();
    for (int i = 0; g_ep_load_reuse && i < EP_REUSE_SLOTS && !kept; i++)
    {
        if (!s.ptr[i] && s.total + size <= EP_REUSE_CAP)
        {
            s.ptr[i] = ptr;
            s.size[i] = size;
            s.total += size;
            kept = 1;
        }
    }
    s.lock.unlock();
    return kept;
}

} // namespace ncnn

// Called by the runtime around a net's load: 1 keeps large freed blocks for reuse, 0 frees them and
// stops keeping (fastMalloc and fastFree are then what they were).
extern "C" NCNN_EXPORT void ep_ncnn_load_reuse(int on)
{
    ncnn::EpReuseSlots& s = ncnn::ep_reuse_slots();
    s.lock.lock();
    ncnn::g_ep_load_reuse = on ? 1 : 0;
    if (!on)
        ncnn::ep_reuse_drain(s);
    s.lock.unlock();
}

namespace ncnn {

Allocator::~Allocator()'''

_FP16_READ_OLD = '''                std::vector<unsigned short> float16_weights;
                float16_weights.resize(align_data_size);
                nread = d->dr.read(&float16_weights[0], align_data_size);
'''
_FP16_READ_NEW = '''                // edgepack (load_reuse_patch.py): read into a buffer fastMalloc may reuse (this was a
                // vector of align_data_size shorts: twice the bytes, every one zeroed first)
                Mat float16_buf;
                float16_buf.create((int)((align_data_size + 3) / 4), (size_t)4u);
                if (float16_buf.empty())
                    return Mat();
                unsigned short* float16_weights = (unsigned short*)float16_buf.data;
                nread = d->dr.read(float16_weights, align_data_size);
'''

_FILE_EDITS = (
    ("src/allocator.h", (
        ("the declarations, at the namespace's start", "namespace ncnn {\n", _HEADER_DECLS, 1),
        ("fastMalloc's posix_memalign", _MALLOC_OLD, _MALLOC_NEW, 1),
        ("fastFree's free", _FREE_OLD, _FREE_NEW, 1),
    )),
    ("src/allocator.cpp", (
        ("the includes", '#include "pipeline.h"\n',
         '#include "pipeline.h"\n\n#if defined(__APPLE__)\n#include <malloc/malloc.h>\n#else\n#include <malloc.h>\n#endif\n', 1),
        ("the definitions, before the first", "namespace ncnn {\n\nAllocator::~Allocator()", _SOURCE_DEFS, 1),
    )),
    ("src/modelbin.cpp", (("the fp16 read buffer", _FP16_READ_OLD, _FP16_READ_NEW, 1),)),
)

LOAD_REUSE_PATCH_KEY = file_edits_key(LOAD_REUSE_PATCH_VERSION, _FILE_EDITS)


def patch_load_reuse(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place (every arch)."""
    apply_file_edits(src, _FILE_EDITS, "load_reuse_patch.py")
