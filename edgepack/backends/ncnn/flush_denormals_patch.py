"""Denormals flushed to zero on x86, as ncnn means to (src/cpu.cpp, src/simpleomp.cpp).

ncnn's Option.flush_denormals defaults to 3 (denormal inputs read as zero, denormal results written as
zero) and each extract sets it on the calling thread, but its set_flush_denormals is compiled only
where __SSE3__ is defined: edgepack builds cpu.cpp for the x86-64 baseline (SSE2), so it did nothing,
and every multiply that met a denormal took the CPU's microcode assist (~100 cycles). PP-OCRv6 small's
detector carries 256k denormal weights (two 768 -> 384 pointwise convolutions: 70k and 185k of their
295k): onnxruntime, which does not flush either, spends 57 of its 87 ms in those two layers.

MXCSR's DAZ and FTZ bits are SSE-era (every x86-64 CPU has them): the edit builds ncnn's own code on any
x86-64, and simpleomp's workers take the forking thread's two bits before each task (ncnn sets them on
the caller only, so a second thread ran its half of a layer without them). Flushing changes a result
only where a denormal (below 1.2e-38) took part: the artifact is verified against onnxruntime as
before. Arm is left as it is (its cores handle denormals in hardware; ncnn sets nothing there either).
Only x86 builds carry these edits, so only their cache key has FLUSH_DENORMALS_PATCH_KEY.
"""
from __future__ import annotations

from pathlib import Path

from .source_patch import apply_file_edits, file_edits_key

FLUSH_DENORMALS_PATCH_VERSION = 1

_GUARD_OLD = "#if defined(__SSE3__)\n"
_GUARD_NEW = "#if defined(__SSE3__) || defined(__x86_64__) // edgepack (flush_denormals_patch.py): MXCSR is SSE's\n"

_OMP_GLOBAL_ANCHOR = "static void* kmp_threadfunc(void* args)\n{\n"
_OMP_GLOBAL = """#if defined(__x86_64__)
#include <xmmintrin.h>
// edgepack (flush_denormals_patch.py): the forking thread's DAZ and FTZ bits, for its workers
static volatile unsigned int ep_fork_csr_bits = 0;
static const unsigned int EP_CSR_DAZ_FTZ = 0x8040;
#endif

"""
_WORKER_OLD = "        kmp_invoke_microtask(task->fn, task->thread_num, tid, task->argc, task->argv);\n"
_WORKER_NEW = """#if defined(__x86_64__)
        _mm_setcsr((_mm_getcsr() & ~EP_CSR_DAZ_FTZ) | ep_fork_csr_bits);
#endif
""" + _WORKER_OLD
_FORK_OLD = "    g_kmp_global.kmp_task_queue->dispatch(tasks, num_threads - 1);\n"
_FORK_NEW = """#if defined(__x86_64__)
    ep_fork_csr_bits = _mm_getcsr() & EP_CSR_DAZ_FTZ;
#endif
""" + _FORK_OLD

_FILE_EDITS = (
    ("src/cpu.cpp", (("the SSE3 guards of the include and of get/set_flush_denormals", _GUARD_OLD, _GUARD_NEW, 3),)),
    ("src/simpleomp.cpp", (("the fork's bits", _OMP_GLOBAL_ANCHOR, _OMP_GLOBAL + _OMP_GLOBAL_ANCHOR, 1),
                           ("workers take them", _WORKER_OLD, _WORKER_NEW, 1),
                           ("forks record them", _FORK_OLD, _FORK_NEW, 2))),
)

FLUSH_DENORMALS_PATCH_KEY = file_edits_key(FLUSH_DENORMALS_PATCH_VERSION, _FILE_EDITS)


def patch_flush_denormals(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree, in place (x86 builds)."""
    apply_file_edits(src, _FILE_EDITS, "flush_denormals_patch.py")
