"""The one change edgepack makes to the pinned ncnn source before building it: spin before sleeping
in simpleomp, ncnn's own OpenMP runtime (zig ships none, so the artifact uses it).

simpleomp hands every parallel region to its workers through a mutex + condition variable and the
caller waits for them the same way, and its kmp_set_blocktime ignores ncnn's `openmp_blocktime`
("always passive"). Every region then pays two futex wake-ups: orientation (PP-LCNet, ~100 regions
per inference) ran 1.9 ms on 1 thread and 2.3-5.0 ms on 2 (2026-12-01, idle 2-core x86_64), where
onnxruntime goes 1.85 -> 1.02 ms. libgomp and libomp spin for a while before they sleep; this
patch does the same while ncnn's blocktime is set (Option::openmp_blocktime, 20 ms by default,
set by the Extractor for the duration of a run; 0 outside it: nothing spins then): a worker or the
caller spins on the queue size / the count of unfinished workers for at most EP_SPIN_CAP_NS, then
falls back to simpleomp's own locked wait, which stays the only place the result is decided.

Spinning must not cost where threads outnumber free cores: a first version spun up to 2 ms per wait
and nudenet_320n on 2 threads next to two busy processes took 1168 ms instead of 15-33 ms (each
region waited a scheduler slice for the descheduled thread while its partner spun). The spin time
now adapts: it halves on every spin that times out (down to none), doubles on every spin that
succeeds, and every 64th wait probes with the full 200 us, so a machine that becomes idle again
gets its spinning back.

Applied as exact text substitutions that must each match: a new ncnn pin whose simpleomp changed
fails the libncnn build with a clear error instead of building something else.
"""
from __future__ import annotations

from pathlib import Path

from ...errors import BuildError

PATCH_VERSION = 2  # part of the libncnn cache key (library.py); 2: adaptive spin, 200 us cap

_HELPERS = r'''#include <stdarg.h>
#include <time.h>

// edgepack: bounded, adaptive spinning before simpleomp's condition-variable waits (source_patch.py)
static int g_ep_blocktime_ms = 0;
static const long EP_SPIN_CAP_NS = 200000L;  // longest spin: 200 us
static long g_ep_spin_ns = EP_SPIN_CAP_NS;   // current spin: halves on every spin that times out
static unsigned g_ep_waits = 0;

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

// true as soon as ready() holds; false once the spin time has passed (the caller then sleeps).
// Spins that time out mean the other side is not running (more threads than free cores): the spin
// time halves each time, down to none, so an oversubscribed machine pays ~nothing for spinning;
// every 64th wait probes with the full spin again, and a spin that succeeds doubles it back.
template<typename F>
static bool ep_spin(F ready)
{
    if (__atomic_load_n(&g_ep_blocktime_ms, __ATOMIC_RELAXED) <= 0)
        return ready();
    unsigned n = __atomic_add_fetch(&g_ep_waits, 1u, __ATOMIC_RELAXED);
    long budget = (n & 63u) == 0 ? EP_SPIN_CAP_NS : __atomic_load_n(&g_ep_spin_ns, __ATOMIC_RELAXED);
    long start = ep_now_ns();
    for (unsigned i = 0;; i++)
    {
        if (ready())
        {
            long cur = __atomic_load_n(&g_ep_spin_ns, __ATOMIC_RELAXED);
            if (cur < EP_SPIN_CAP_NS)
                __atomic_store_n(&g_ep_spin_ns, cur * 2 + 1000 < EP_SPIN_CAP_NS ? cur * 2 + 1000 : EP_SPIN_CAP_NS, __ATOMIC_RELAXED);
            return true;
        }
        if (budget <= 0)
            return false;
        ep_cpu_relax();
        if ((i & 63u) == 63u && ep_now_ns() - start > budget)
        {
            __atomic_store_n(&g_ep_spin_ns, budget / 2 > 1000 ? budget / 2 : 0, __ATOMIC_RELAXED);
            return false;
        }
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
    apply_edits(src / "src" / "simpleomp.cpp", _EDITS, "source_patch.py")


def apply_edits(path: Path, edits, module: str) -> None:
    """Each (what, old, new, count) edit: ``old`` must occur exactly ``count`` times, else nothing is built."""
    text = path.read_text()
    for what, old, new, count in edits:
        found = text.count(old)
        if found != count:
            raise BuildError(f"{path}: expected {count} copy(ies) of {what} to patch, found {found}",
                             hint=f"the pinned ncnn source changed: update edgepack/backends/ncnn/{module}")
        text = text.replace(old, new)
    path.write_text(text)
