"""The one change edgepack makes to the pinned ncnn source before building it: spin before sleeping
in simpleomp, ncnn's own OpenMP runtime (zig ships none, so the artifact uses it).

simpleomp hands every parallel region to its workers through a mutex + condition variable and the
caller waits for them the same way, and its kmp_set_blocktime ignores ncnn's `openmp_blocktime`
("always passive"). Every region then pays two futex wake-ups: orientation (PP-LCNet, ~100 regions
per inference) ran 1.9 ms on 1 thread and 2.3-5.0 ms on 2 (2026-12-01, idle 2-core x86_64), where
onnxruntime goes 1.85 -> 1.02 ms. libgomp and libomp spin for a while before they sleep; this
patch does the same, bounded by ncnn's blocktime (Option::openmp_blocktime, 20 ms by default,
set by the Extractor for the duration of a run) and by EP_SPIN_CAP_NS: a worker or the caller
spins on the queue size / the count of unfinished workers, then falls back to simpleomp's own
locked wait, which stays the only place the result is decided. Outside a run blocktime is 0 and
nothing spins.

Applied as exact text substitutions that must each match: a new ncnn pin whose simpleomp changed
fails the libncnn build with a clear error instead of building something else.
"""
from __future__ import annotations

from pathlib import Path

from ...errors import BuildError

PATCH_VERSION = 1  # part of the libncnn cache key (library.py)

_HELPERS = r'''#include <stdarg.h>
#include <time.h>

// edgepack: bounded spinning before simpleomp's condition-variable waits (see source_patch.py)
static int g_ep_blocktime_ms = 0;
static const long EP_SPIN_CAP_NS = 2000000L;

static inline void ep_cpu_relax()
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__) || defined(__arm__)
    __asm__ __volatile__("yield" ::: "memory");
#endif
}

static inline long ep_now_ns()
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long)ts.tv_sec * 1000000000L + ts.tv_nsec;
}

// true as soon as ready() holds; false once the block time (capped) has passed
template<typename F>
static bool ep_spin(F ready)
{
    long budget = (long)__atomic_load_n(&g_ep_blocktime_ms, __ATOMIC_RELAXED) * 1000000L;
    if (budget > EP_SPIN_CAP_NS)
        budget = EP_SPIN_CAP_NS;
    if (budget <= 0)
        return ready();
    long start = ep_now_ns();
    for (unsigned i = 0;; i++)
    {
        if (ready())
            return true;
        ep_cpu_relax();
        if ((i & 255u) == 255u && ep_now_ns() - start > budget)
            return false;
    }
}
'''

# (what, old text, new text, how many times it must occur)
_EDITS = (
    ("the spin helpers", "#include <stdarg.h>\n", _HELPERS, 1),
    ("the worker's wait for a task",
     "    void get(KMPTask*& v)\n    {\n        lock.lock();\n",
     "    void get(KMPTask*& v)\n    {\n"
     "        ep_spin([this] { return __atomic_load_n(&size, __ATOMIC_ACQUIRE) != 0; });\n"
     "        lock.lock();\n", 1),
    ("the caller's wait for its workers",
     "    // wait for finished\n    {\n        finish_lock.lock();\n",
     "    // wait for finished\n    {\n"
     "        ep_spin([&] { return __atomic_load_n(&num_threads_to_wait, __ATOMIC_ACQUIRE) == 0; });\n"
     "        finish_lock.lock();\n", 2),
    ("the worker's count-down",
     "            *task->num_threads_to_wait = *task->num_threads_to_wait - 1;\n",
     "            __atomic_store_n(task->num_threads_to_wait, *task->num_threads_to_wait - 1, __ATOMIC_RELEASE);\n", 1),
    ("kmp_get_blocktime", "int kmp_get_blocktime()\n{\n    return 0;\n}\n",
     "int kmp_get_blocktime()\n{\n    return __atomic_load_n(&g_ep_blocktime_ms, __ATOMIC_RELAXED);\n}\n", 1),
    ("kmp_set_blocktime", "void kmp_set_blocktime(int /*blocktime*/)\n{\n    // always passive, ignore\n}\n",
     "void kmp_set_blocktime(int blocktime)\n{\n"
     "    __atomic_store_n(&g_ep_blocktime_ms, blocktime > 0 ? blocktime : 0, __ATOMIC_RELAXED);\n}\n", 1),
)


def patch_source(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree (src/simpleomp.cpp), in place."""
    path = src / "src" / "simpleomp.cpp"
    text = path.read_text()
    for what, old, new, count in _EDITS:
        found = text.count(old)
        if found != count:
            raise BuildError(f"{path}: expected {count} copy(ies) of {what} to patch, found {found}",
                             hint="the pinned ncnn source changed: update edgepack/backends/ncnn/source_patch.py")
        text = text.replace(old, new)
    path.write_text(text)
