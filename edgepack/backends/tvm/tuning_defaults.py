"""The default schedules as tuning records (tuning.py): tuning never makes a kernel slower.

A build applies, per kernel, the database's best record, and schedules.py's default schedule only
where the database has none. A short budget leaves many tasks with one batch of random-ish
MetaSchedule candidates, slower than the default schedule, and the build would apply them. So
``edgepack tune`` times each task's default schedule with the same builder and runner as the
candidates and commits it as one more record: the best record is then a tuned one only where one
measured faster, and the default schedule otherwise.
"""
from __future__ import annotations

import os
import shutil


def timed_records(pairs, database, tvm_target, builder, runner) -> list:
    """TuningRecords for (workload IRModule, s_tir.Schedule of it) pairs, each built and timed like a
    MetaSchedule candidate; a schedule that fails to build or run gets none."""
    from tvm.s_tir import meta_schedule as ms
    if not pairs:
        return []
    built = builder.build([ms.builder.BuilderInput(sch.mod, tvm_target) for _mod, sch in pairs])
    args = [ms.arg_info.ArgInfo.from_prim_func(mod["main"]) for mod, _sch in pairs]
    ok = [i for i, b in enumerate(built) if b.error_msg is None and b.artifact_path]
    futures = runner.run([ms.runner.RunnerInput(built[i].artifact_path, "cpu", args[i]) for i in ok])
    records = []
    for i, fut in zip(ok, futures):
        res = fut.result()
        shutil.rmtree(os.path.dirname(built[i].artifact_path), ignore_errors=True)
        if res.error_msg is not None or not res.run_secs:
            continue
        mod, sch = pairs[i]
        records.append(ms.database.TuningRecord(sch.trace, database.commit_workload(mod),
                                                [float(x) for x in res.run_secs], tvm_target, args[i]))
    return records


def _has_trace(database, mod, trace: str) -> bool:
    return database.has_workload(mod) and any(
        str(r.trace) == trace for r in database.get_top_k(database.commit_workload(mod), 1 << 16))


def default_records(tasks, database, tvm_target, builder, runner, log) -> list:
    """Timed records of the tasks' default schedules; none for a task whose default is in the
    database already, that no rule schedules, or with the default schedules switched off."""
    from .compile import default_schedules_enabled
    from .schedules import default_schedule
    if not default_schedules_enabled():
        return []
    pairs = []
    for task in tasks:
        mod = task.dispatched[0]
        _name, sch = default_schedule(mod["main"], tvm_target)
        if sch is not None and not _has_trace(database, mod, str(sch.trace)):
            pairs.append((mod, sch))
    if pairs:
        log(f"timing the default schedules of {len(pairs)} tasks (the records tuning has to beat)")
    return timed_records(pairs, database, tvm_target, builder, runner)


def defaults_kept(tasks, database, tvm_target) -> int:
    """How many of the tasks' best record is their default schedule."""
    from .schedules import default_schedule
    kept = 0
    for task in tasks:
        mod = task.dispatched[0]
        if not database.has_workload(mod):
            continue
        top = database.get_top_k(database.commit_workload(mod), 1)
        _name, sch = default_schedule(mod["main"], tvm_target)
        if top and sch is not None and str(top[0].trace) == str(sch.trace):
            kept += 1
    return kept
