"""Let an x86 artifact run as a CPU with fewer extensions: `ep_ncnn_cap_x86_isa` (src/cpu.cpp).

ncnn reads CPUID once into its cpu_support_x86_* flags and picks every layer's ISA build from them
(AVX-512, AVX with FMA/AVX2 helpers, or SSE2). Clearing the flags above a level before the net is
created makes this machine run the kernels an AVX2 or SSE CPU would, at native speed: benchmarks can
time the AVX2 path on an AVX-512 build host (qemu's CPU models check correctness but their timings
mean nothing), and a test can check that path without qemu. A cap never adds what the CPU lacks.

The engine calls it for `EDGEPACK_NCNN_OPTIONS=isa=avx2` or `isa=sse` (ep_ncnn_switches.h). The same
file holds the switch `direct=0|1|2|3` sets (`ep_ncnn_x86_direct_conv`): no direct kernel, the measured
break-even, or every layer the kernel can run, so its break-even can be measured on any host, layer by
layer, against ncnn's own kernels; `direct=3` is the break-even with fp32 weights on every layer. Only x86 builds compile it, so only their cache key carries
ISA_CAP_PATCH_KEY.
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

ISA_CAP_PATCH_VERSION = 3  # 3: direct=3

CPU_FILE = "src/cpu.cpp"

_CAP = r'''
// edgepack (isa_cap_patch.py): run as a CPU with fewer x86 extensions. level 2: no AVX-512 (ncnn's
// AVX layers with their FMA/AVX2 helpers); 1: no AVX either (SSE2 layers); 3 or more: as detected.
// Call before any net is created: layers take their ISA build when they are created.
extern "C" int ep_ncnn_cap_x86_isa(int level)
{
    ncnn::cpu_support_x86_avx(); // reads CPUID first, so it cannot overwrite the cap later
    if (level < 3)
    {
        g_cpu_support_x86_avx512 = 0;
        g_cpu_support_x86_avx512_vnni = 0;
        g_cpu_support_x86_avx512_bf16 = 0;
        g_cpu_support_x86_avx512_fp16 = 0;
    }
    if (level < 2)
    {
        g_cpu_support_x86_avx = 0;
        g_cpu_support_x86_fma = 0;
        g_cpu_support_x86_fma4 = 0;
        g_cpu_support_x86_xop = 0;
        g_cpu_support_x86_f16c = 0;
        g_cpu_support_x86_avx2 = 0;
        g_cpu_support_x86_avx_vnni = 0;
        g_cpu_support_x86_avx_vnni_int8 = 0;
        g_cpu_support_x86_avx_vnni_int16 = 0;
        g_cpu_support_x86_avx_ne_convert = 0;
    }
    return 0;
}

// edgepack (isa_cap_patch.py): which x86 convolutions the direct kernel of direct_conv_patch.py
// takes. 0: none (ncnn's kernels); 1: those its measured break-even gives it (the default); 2: every
// layer it can run; 3: as 1, with fp32 weights on the large layers 1 gives fp16 ones (direct_conv_patch.py).
// A measuring aid, like the cap: call before any net is created.
namespace ncnn {
int g_ep_direct_conv = 1;
} // namespace ncnn

extern "C" int ep_ncnn_x86_direct_conv(int mode)
{
    ncnn::g_ep_direct_conv = mode;
    return 0;
}
'''

_END = "} // namespace ncnn\n"

_CPU_EDITS = (
    ("the cap, after the namespace", _END, _END + _CAP, 1),
)

_FILE_EDITS = ((CPU_FILE, _CPU_EDITS),)

ISA_CAP_PATCH_KEY = file_edits_key(ISA_CAP_PATCH_VERSION, _FILE_EDITS)


def patch_isa_cap(src: Path) -> None:
    """Apply the edit to an unpacked ncnn source tree, in place."""
    apply_file_edits(src, _FILE_EDITS, "isa_cap_patch.py")
