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
region waited a scheduler slice for the descheduled thread while its partner spun). So the spin time
adapts, and a spin that times out is read by whether the machine is busy: whether the waiting thread
spent over 1/8 of its last window (20 ms or more) waiting for a core (its run-queue wait, from
/proc/thread-self/schedstat). On a busy machine a timeout halves the spin (down to none); on an
idle one a timeout only means the regions are imbalanced and the partner is still working, so the
spin doubles back towards its 200 us cap. Version 2 halved on every timeout: YOLOX's Focus (four
3-channel depthwise convolutions, imbalanced on 2 threads) drove it to none on an idle machine, and
ddddocr_det paid a futex wake-up per region for the rest of the inference, 2 threads no faster than 1
(49.8 ms; 35.8 ms with the spin kept). A spin that succeeds doubles it, and every 64th wait probes
with the full 200 us, so a machine that becomes idle again gets its spinning back.

Applied as exact text substitutions that must each match: a new ncnn pin whose simpleomp changed
fails the libncnn build with a clear error instead of building something else.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from ...errors import BuildError

PATCH_VERSION = 4  # part of the libncnn cache key (library.py); 2: adaptive spin, 200 us cap; 3: halve only when busy; 4: an unreadable schedstat is not retried

_HELPERS = r'''#include <stdarg.h>
#include <stdlib.h>
#include <time.h>
#if defined(__linux__)
#include <fcntl.h>
#include <unistd.h>
#endif

// edgepack: bounded, adaptive spinning before simpleomp's condition-variable waits (source_patch.py)
static int g_ep_blocktime_ms = 0;
static const long EP_SPIN_CAP_NS = 200000L;        // longest spin: 200 us
static long g_ep_spin_ns = EP_SPIN_CAP_NS;         // current spin
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

// Busy = more runnable threads than cores, read from the time this thread spent waiting for a core
// (the run-queue wait in /proc/thread-self/schedstat) over windows of at least 20 ms, looked at only
// when a spin times out: busy while that wait was over 1/8 of its last window (2026-12-01, 2-core
// x86_64, artifacts on 2 threads: idle 0.5-2%, three busy processes 45-60%). Preemption counts
// (getrusage) do not tell the two apart: threads that sleep at every hand-off are seldom preempted
// even when they wait long for a core, and an idle machine preempted spinning threads 10-190 times a
// second. Where schedstat cannot be read, every timeout counts as busy (version 2's policy).
static const long EP_WINDOW_NS = 20000000L;
static __thread long t_ep_window_ns = 0;    // when this thread's window began (0: not yet)
static __thread long t_ep_window_wait = 0;  // its run-queue wait then, ns
static __thread bool t_ep_busy = false;     // the verdict of its last window

static long ep_read_runqueue_wait_ns()
{
#if defined(__linux__)
    int fd = open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    char buf[96];
    ssize_t got = read(fd, buf, sizeof(buf) - 1);
    close(fd);
    if (got <= 0)
        return -1;
    buf[got] = 0;
    char* end = 0;
    strtoull(buf, &end, 10);  // time on the cpu, then time waiting on a run queue
    if (end == buf)
        return -1;
    char* end2 = 0;
    unsigned long long wait = strtoull(end, &end2, 10);
    return end2 == end ? -1 : (long)wait;
#else
    return -1;
#endif
}

// A /proc/thread-self/schedstat that cannot be read (not Linux, a kernel without schedstats, a
// locked-down /proc) stays unreadable: remembered process-wide, so timeouts stop paying a failed open().
static int g_ep_no_schedstat = 0;

static long ep_runqueue_wait_ns()
{
    if (__atomic_load_n(&g_ep_no_schedstat, __ATOMIC_RELAXED))
        return -1;
    long wait = ep_read_runqueue_wait_ns();
    if (wait < 0)
        __atomic_store_n(&g_ep_no_schedstat, 1, __ATOMIC_RELAXED);
    return wait;
}

static bool ep_machine_busy(long now)
{
    long span = now - t_ep_window_ns;
    if (t_ep_window_ns == 0 || span >= EP_WINDOW_NS)
    {
        long wait = ep_runqueue_wait_ns();
        if (wait < 0)
            return true;
        t_ep_busy = t_ep_window_ns != 0 && (wait - t_ep_window_wait) * 8 > span;
        t_ep_window_ns = now;
        t_ep_window_wait = wait;
    }
    return t_ep_busy;
}

static inline void ep_set_spin(long ns)
{
    __atomic_store_n(&g_ep_spin_ns, ns < 1000 ? 0 : (ns < EP_SPIN_CAP_NS ? ns : EP_SPIN_CAP_NS), __ATOMIC_RELAXED);
}

// true as soon as ready() holds; false once the spin time has passed (the caller then sleeps).
// A timeout on a busy machine halves the spin time (down to none), so an oversubscribed machine pays
// ~nothing for spinning; a timeout on an idle machine (imbalanced work, the partner still running) and a
// spin that succeeds double it, up to the cap; every 64th wait probes with the full cap.
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
                ep_set_spin(cur * 2 + 1000);
            return true;
        }
        if (budget <= 0)
            return false;
        ep_cpu_relax();
        long now;
        if ((i & 63u) == 63u && (now = ep_now_ns()) - start > budget)
        {
            ep_set_spin(ep_machine_busy(now) ? budget / 2 : budget * 2 + 1000);
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


def edits_digest(*edit_lists) -> str:
    """A digest of the edits' text: part of the libncnn cache key next to the version number, so an
    edited patch can never reuse a library built from the old one (a version left unbumped did)."""
    h = hashlib.sha256()
    for edits in edit_lists:
        for edit in edits:
            for part in edit:
                h.update(str(part).encode() + b"\0")
    return h.hexdigest()[:16]


PATCH_KEY = f"{PATCH_VERSION}-{edits_digest(_EDITS)}"


def patch_source(src: Path) -> None:
    """Apply the edits to an unpacked ncnn source tree (src/simpleomp.cpp), in place."""
    apply_edits(src / "src" / "simpleomp.cpp", _EDITS, "source_patch.py")


def file_edits_key(version: int, file_edits) -> str:
    """The cache-key part of a patch given as one table of (file, edits): the edits of a list that
    several files share count once."""
    return f"{version}-{edits_digest(*dict.fromkeys(edits for _, edits in file_edits))}"


def apply_file_edits(src: Path, file_edits, module: str) -> None:
    """Apply a table of (file under src, edits) to an unpacked ncnn source tree, in place."""
    for name, edits in file_edits:
        apply_edits(src / name, edits, module)


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
