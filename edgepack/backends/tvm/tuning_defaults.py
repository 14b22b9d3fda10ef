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
    """For (workload IRModule, s_tir.Schedule of it) pairs, each built and timed like a MetaSchedule
    candidate: one TuningRecord per pair, in order, None for a schedule that failed to build or run."""
    from tvm.s_tir import meta_schedule as ms
    if not pairs:
        return []
    built = builder.build([ms.builder.BuilderInput(sch.mod, tvm_target) for _mod, sch in pairs])
    args = [ms.arg_info.ArgInfo.from_prim_func(mod["main"]) for mod, _sch in pairs]
    ok = [i for i, b in enumerate(built) if b.error_msg is None and b.artifact_path]
    futures = runner.run([ms.runner.RunnerInput(built[i].artifact_path, "cpu", args[i]) for i in ok])
    records = [None] * len(pairs)
    for i, fut in zip(ok, futures):
        res = fut.result()
        shutil.rmtree(os.path.dirname(built[i].artifact_path), ignore_errors=True)
        if res.error_msg is not None or not res.run_secs:
            continue
        mod, sch = pairs[i]
        records[i] = ms.database.TuningRecord(sch.trace, database.commit_workload(mod),
                                              [float(x) for x in res.run_secs], tvm_target, args[i])
    return records


def naive_records(tasks, indices, tvm_target, builder, runner) -> dict[int, object]:
    """task index -> timed record of the kernel as it comes (no rule schedules it, so a build runs its
    loop nest as is): for where-the-time-goes only, never committed (an empty trace ranks nowhere)."""
    from tvm import s_tir
    from tvm.s_tir import meta_schedule as ms
    indices = list(indices)
    pairs = [(tasks[i].dispatched[0], s_tir.Schedule(tasks[i].dispatched[0])) for i in indices]
    records = timed_records(pairs, ms.database.MemoryDatabase(), tvm_target, builder, runner)
    return {i: rec for i, rec in zip(indices, records) if rec is not None}


def _has_trace(database, mod, trace: str) -> bool:
    return database.has_workload(mod) and any(
        str(r.trace) == trace for r in database.get_top_k(database.commit_workload(mod), 1 << 16))


def default_traces(tasks, tvm_target) -> dict[int, object]:
    """task index -> the s_tir.Schedule of its default schedule (what a build without records runs),
    for the tasks a rule schedules; none with the default schedules switched off."""
    from .compile import default_schedules_enabled
    from .schedules import default_schedule
    if not default_schedules_enabled():
        return {}
    out = {}
    for i, task in enumerate(tasks):
        _name, sch = default_schedule(task.dispatched[0]["main"], tvm_target)
        if sch is not None:
            out[i] = sch
    return out


def default_records(tasks, defaults: dict, database, tvm_target, builder, runner, log) -> dict[int, object]:
    """task index -> timed record of its default schedule (``defaults``, from default_traces), for
    the tasks whose default is not in the database already."""
    todo = [i for i, sch in defaults.items() if not _has_trace(database, tasks[i].dispatched[0], str(sch.trace))]
    if todo:
        log(f"timing the default schedules of {len(todo)} tasks (the records tuning has to beat)")
    records = timed_records([(tasks[i].dispatched[0], defaults[i]) for i in todo], database, tvm_target,
                            builder, runner)
    return {i: rec for i, rec in zip(todo, records) if rec is not None}


def defaults_kept(tasks, defaults: dict, database) -> int:
    """How many of the tasks' best record is their default schedule."""
    kept = 0
    for i, sch in defaults.items():
        mod = tasks[i].dispatched[0]
        if not database.has_workload(mod):
            continue
        top = database.get_top_k(database.commit_workload(mod), 1)
        if top and str(top[0].trace) == str(sch.trace):
            kept += 1
    return kept
