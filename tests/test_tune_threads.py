"""`edgepack tune` times every candidate on 1 thread and on every core (tuning_runner.py).

The runner's evaluator resizes TVM's real thread pool per measurement. The check that it does: a
kernel whose only loop is parallel (128 independent rows of exp/sqrt, ~50-150 ms on one core) must
run clearly faster at 2 threads than at 1 when timed through run_at_thread_counts, and the cost for
"1,2" must lie between the two. Runs in a child process, as MetaSchedule's runner workers do: TVM's
pool is sized from TVM_NUM_THREADS when it starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent('''
    import os, json, numpy as np, tvm
    from tvm.script import tirx as T
    from tvm.s_tir.meta_schedule.runner import EvaluatorConfig
    from edgepack.backends.tvm.tuning_runner import THREADS_ENV, run_at_thread_counts

    @T.prim_func(s_tir=True)
    def rows(A: T.Buffer((128, 262144), "float32"), B: T.Buffer((128, 262144), "float32")):
        for i in T.parallel(128):
            for j in range(262144):
                with T.sblock("b"):
                    vi, vj = T.axis.remap("SS", [i, j])
                    B[vi, vj] = T.sqrt(A[vi, vj]) + T.exp(A[vi, vj])

    lib = tvm.compile(rows, target=tvm.target.Target({"kind": "llvm"})).mod
    lib.entry_name = "rows"
    dev = tvm.cpu()
    args = [[tvm.runtime.tensor(np.random.rand(128, 262144).astype("float32")),
             tvm.runtime.tensor(np.zeros((128, 262144), "float32"))]]
    cfg = EvaluatorConfig(number=3, repeat=1, min_repeat_ms=0)
    out = {}
    for counts in ("1", "2", "1,2", "1", "2"):
        os.environ[THREADS_ENV] = counts
        out.setdefault(counts, []).append(run_at_thread_counts(lib, dev, cfg, args)[0])
    print(json.dumps({k: min(v) for k, v in out.items()}))
''')


@pytest.mark.exclusive_cpu  # compares timings (tests/conftest.py)
def test_candidates_are_timed_at_each_thread_count(tmp_path):
    assert (os.cpu_count() or 1) >= 2, "the build machine has two cores; one cannot tell 1 thread from 2"
    env = {**os.environ, "TVM_NUM_THREADS": "2"}
    child = tmp_path / "child.py"  # TVMScript parses the function's source: a file, not -c
    child.write_text(CHILD)
    proc = subprocess.run([sys.executable, str(child)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    t = json.loads(proc.stdout.strip().splitlines()[-1])
    assert t["1"] > 1.25 * t["2"], t           # the pool really was resized
    assert t["2"] * 0.9 < t["1,2"] < t["1"] * 1.1, t   # the geometric mean of the two
