"""How `edgepack tune` times a candidate: on 1 thread and on every core, scored by their geometric mean.

An artifact runs on all free cores by default, and `auto` times candidates on 1 thread. Timed on 1
thread only, the search is blind to what parallel loops cost: orientation, tuned 20 minutes, ran 1.42x
onnxruntime on 1 thread but 1.62x on 2 (each tiny parallel region pays a fork/join). Timed on every
core only, it picked parallel schedules that ran slower on 1 thread (13.6 -> 18.5 ms). The geometric
mean of the two weighs a 10% loss at either count the same.

This module is imported by MetaSchedule's runner workers (fresh processes): it must stay importable
on its own and cheap. The thread counts travel in an environment variable the workers inherit.
"""
from __future__ import annotations

import math
import os

THREADS_ENV = "EDGEPACK_TUNE_THREADS"


def measure_threads() -> tuple[int, ...]:
    """The thread counts candidates are timed at: 1 and every core of this machine, or the
    comma-separated counts in $EDGEPACK_TUNE_THREADS (a measuring knob: `1` times as before)."""
    given = os.environ.get(THREADS_ENV, "")
    try:
        counts = tuple(sorted({int(c) for c in given.split(",") if c.strip()}))
    except ValueError:
        counts = ()
    if counts and all(c >= 1 for c in counts):
        return counts
    cores = os.cpu_count() or 1
    return (1,) if cores == 1 else (1, cores)


def set_threads(n: int) -> None:
    """Resize TVM's thread pool in this process (up to TVM_NUM_THREADS when the pool started)."""
    import tvm
    tvm.get_global_func("runtime.config_threadpool")(1, n)  # 1: TVM's default mode (no core binding)


def run_at_thread_counts(rt_mod, device, evaluator_config, repeated_args) -> list[float]:
    """MetaSchedule's f_run_evaluator: one cost per argument set, the geometric mean of the
    candidate's time at each of measure_threads() (tune() sets $EDGEPACK_TUNE_THREADS for the workers)."""
    from tvm.s_tir.meta_schedule.runner.utils import run_evaluator_common
    per_count = []
    for n in measure_threads():
        set_threads(n)
        per_count.append(run_evaluator_common(rt_mod, device, evaluator_config, repeated_args))
    return [math.exp(sum(math.log(max(c[i], 1e-12)) for c in per_count) / len(per_count))
            for i in range(len(per_count[0]))]
