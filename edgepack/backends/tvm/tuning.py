"""MetaSchedule tuning: one database per TVM target that accumulates across models.

``edgepack tune`` extends ``<cache>/tvm-tuning/<target>-<key>/`` (a JSONDatabase); a workload
(a fused kernel of given shapes) tuned once is skipped by later tunes and applied by every later
build whose model contains it. Builds look there, or where ``--tuning-db`` (BuildOptions.tuning_db,
recorded in the manifest with the database's content hash) says. Measuring a candidate means running it, so targets of another architecture are
tuned here with a proxy target of the host's architecture: the schedules are valid anywhere
(records are keyed by the workload), their speed on the device is unmeasured, and the database's
meta.json says "proxy".

Only the tasks where the model spends its time are searched (tuning_plan.py): every task's
default schedule is timed first, and the fewest tasks that take 90% of the model's time (a few per
budget: 3 minutes each) get the budget. The search is bounded by time (``--budget``): a measure callback terminates every task once the
budget is spent. Settings are sized for a 2-core machine (small populations, short evolution,
small batches): the defaults (population 512, 64 per batch) spent 6 minutes generating the first
batch of one task before measuring anything (issue 10).

Tuning never makes a kernel slower than the build without it: the default schedule of every task
(schedules.py, what a build without records runs) is measured with the same builder and runner
as MetaSchedule's candidates and committed as one more record, so the database's best record per
workload, which builds apply, is a tuned schedule only where one measured faster. (Without this, a
20-minute budget over 29 tasks left most tasks with one batch of random candidates, worse than the
default schedules, and builds applied them.)

The builder trap (shared notes): MetaSchedule's default builder imports tvm.s_tir.tensor_intrin
in every worker (~27 s under load), over its 30 s timeout, and every candidate then fails as
"Build errors" with no message. edgepack's builder function skips that import and gets a
generous timeout.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...cache import cache_root, key_of, lock_file, locked, sha256_bytes
from ...errors import BuildError, UsageError
from ...progress import StepProgress
from ...model import LoadedModel
from ...runner import host_arch
from ...targets import Target
from .runtime_lib import TVM_VERSION
from .target_map import isa_variants, target_dict
from .tuning_defaults import default_records, default_traces, defaults_kept, naive_records
from .tuning_plan import max_tasks_for, ms4, plan as plan_tuning, task_costs, task_rows
from .tuning_runner import THREADS_ENV, measure_threads, run_at_thread_counts, set_threads

DB_FILES = ("database_workload.json", "database_tuning_record.json")
DB_VERSION = 3  # 2: one database per target, accumulating across models; 3: timed at 1 thread and every core
BUILDER_TIMEOUT_S = 600.0
# Search settings for a 2-core machine (see module doc).
TRIALS_PER_BATCH = 16
POPULATION = 64
GENETIC_ITERS = 2
INIT_MIN_UNMEASURED = 16
MAX_TRIALS_PER_TASK = 256


def model_key(model: LoadedModel) -> str:
    return sha256_bytes(model.proto.SerializeToString())


def db_key(target: Target) -> str:
    return key_of({"target": target_dict(target), "tvm": TVM_VERSION, "db": DB_VERSION})


def default_db_dir(target: Target) -> Path:
    return cache_root() / "tvm-tuning" / f"{target.name}-{db_key(target)}"


def is_database(path: Path) -> bool:
    return all((path / f).is_file() for f in DB_FILES)


def find_database(target: Target, choice: str | None = None) -> tuple[Path | None, str]:
    """(database folder or None, why) for a build; ``choice`` is BuildOptions.tuning_db."""
    if choice == "off":
        return None, "tuning database switched off (--tuning-db off): untuned fused pipeline"
    if choice:
        p = Path(choice)
        if not is_database(p):
            raise UsageError(f"tuning database {p} does not exist or is incomplete (needs {' and '.join(DB_FILES)})",
                             hint="run `edgepack tune MODEL --target T --out-db PATH` first")
        return p, f"tuning database {p} (given)"
    p = default_db_dir(target)
    if is_database(p):
        return p, f"tuning database {p.name} (the target's, from `edgepack tune`)"
    return None, "no tuning database for this target: untuned fused pipeline (run `edgepack tune` for speed)"


def database_sha256(path: Path) -> str:
    """The content of a database (its two files), recorded in the manifest so that verify-build
    knows whether the database at hand is the one the artifact was built with."""
    return sha256_bytes(b"".join((path / f).read_bytes() for f in DB_FILES))


def parse_budget(text: str) -> float:
    """'20m', '90s', '1h', '1h30m' or plain seconds -> seconds."""
    t = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", t):
        secs = float(t)
    else:
        parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", t)
        if not parts or "".join(n + u for n, u in parts) != t:
            raise UsageError(f"--budget {text!r}: expected a duration such as 20m, 90s or 1h30m")
        secs = sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)
    if secs < 10:
        raise UsageError(f"--budget {text!r}: at least 10 seconds (one batch of candidates)")
    return secs


def _light_tensor_intrinsics() -> None:
    """MetaSchedule's TuneContext imports tvm.s_tir.tensor_intrin, whose package __init__ also
    registers every CUDA intrinsic: ~100 s on a loaded 2-core machine, for nothing on a CPU.
    Register the package without running its __init__ and import only the CPU intrinsics
    (x86, Arm), ~6 s. Done once per process, before tuning starts."""
    import importlib
    import importlib.util
    import sys
    import types
    name = "tvm.s_tir.tensor_intrin"
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return
    pkg = types.ModuleType(name)
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__package__ = name
    pkg.__spec__ = spec
    sys.modules[name] = pkg
    for sub in ("x86", "arm_cpu"):
        importlib.import_module(f"{name}.{sub}")


def _build_candidate(mod, target, _params):
    """MetaSchedule builder function without the tensor-intrinsics import (see module doc)."""
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock
    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm_build(mod, target=target)


def _host_level() -> str:
    """The best x86-64 level this machine runs (what an x86_64 artifact's kernels use here)."""
    try:
        flags = set(next(ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return "x86-64"
    if {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"} <= flags:
        return "x86-64-v4"
    if {"avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"} <= flags:
        return "x86-64-v3"
    return "x86-64"


def measuring_target(target: Target) -> tuple[dict, bool]:
    """(TVM target dict candidates are measured with, whether it is a host proxy). For x86_64
    the ISA level the artifact picks on this machine, so measured kernels are the ones it runs."""
    d = target_dict(target)
    if target.arch == host_arch():
        if target.arch == "x86_64":
            level = _host_level()
            if any(lv == level for lv, _p, _d in isa_variants(target)):
                d = dict(d, mcpu=level)
        return d, False
    proxy = {"kind": "llvm", "mtriple": f"{host_arch()}-unknown-linux-gnu",
             "mcpu": _host_level() if host_arch() == "x86_64" else "generic", "num-cores": d["num-cores"]}
    return proxy, True


@dataclass(frozen=True)
class TuneResult:
    path: Path
    trials: int              # candidates measured in this run
    tasks: int               # the model's tuning tasks
    tuned_before: int        # of them, searched by an earlier tune (a non-default record in the database)
    tuned_now: int           # of them, with a record after this run (tuned or the timed default)
    records: int             # records in the database (all models)
    seconds: float
    proxy: bool
    budget_s: float | None
    ms_before: float | None  # the model untuned, measured here (TVM in-process), ms
    ms_after: float | None   # with the database
    measured_with: dict = field(default_factory=dict)
    defaults_kept: int = 0   # of the model's tasks, those whose best record is the default schedule
    searched: int = 0        # tasks this run searched (tuning_plan.py: the hot ones)
    hot_share: float = 0.0   # of the model's time on default schedules, what those tasks took
    task_rows: tuple = ()    # per task, where the time goes (tuning_plan.task_rows), hottest first
    measure_threads: tuple = (1,)  # the thread counts each candidate was timed at (tuning_runner.py)


def tune(model: LoadedModel, target: Target, trials: int | None = None, *, budget_s: float | None = None,
         out_dir: Path | None = None, workers: int = 2, measure: bool = True, plan_only: bool = False,
         log=print) -> TuneResult:
    """Extend the target's database with what a search within the budget finds. ``plan_only``:
    time every task's schedule (as a build would run it), report where the time goes and what a
    tune would search first, and leave the database as it was."""
    from .compile import TVM_LOCK, import_tvm
    if trials is None and budget_s is None and not plan_only:
        raise UsageError("give a time budget (--budget 20m) or a trial count (--trials N)")
    if trials is not None and trials < 1:
        raise UsageError("--trials must be at least 1")
    with TVM_LOCK:
        # candidates are timed on 1 thread and on every core (tuning_runner.py): runner workers
        # inherit both variables when they start; TVM's pool is sized by TVM_NUM_THREADS then and
        # resized per measurement
        counts = measure_threads()
        saved = {k: os.environ.get(k) for k in ("TVM_NUM_THREADS", THREADS_ENV)}
        os.environ["TVM_NUM_THREADS"] = str(max(counts))
        os.environ[THREADS_ENV] = ",".join(map(str, counts))
        try:
            import_tvm()
            return _tune(model, target, trials, budget_s, out_dir=out_dir, workers=workers, measure=measure,
                         plan_only=plan_only, log=log)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _has_record(database, task) -> bool:
    mod = task.dispatched[0]
    return bool(database.has_workload(mod) and database.get_top_k(database.commit_workload(mod), 1))


def _budget_builder(inner, deadline: float):
    """``inner`` until the deadline, then a builder that fails every candidate at once. MetaSchedule's
    task scheduler sends every task one batch before it collects any result (and so before the
    measure callback below can stop it): 29 tasks at 1-2.5 min a batch on a loaded 2-core machine ran
    a 20-minute budget past 35 minutes with no result collected. Failing the builds after the deadline
    ends that round in seconds; tasks left without a tuned record keep their default schedule."""
    from tvm.ir.utils import derived_object
    from tvm.s_tir.meta_schedule.builder import BuilderResult, PyBuilder

    @derived_object
    class BudgetBuilder(PyBuilder):
        def build(self, build_inputs):
            if time.monotonic() >= deadline:
                return [BuilderResult(None, "edgepack: time budget spent") for _ in build_inputs]
            return inner.build(build_inputs)

    return BudgetBuilder()


def _deadline_callback(deadline: float, counter: list, log, progress=None, t_start: float = 0.0,
                       budget_s: float | None = None, cap: int = 0):
    from tvm.s_tir.meta_schedule.measure_callback import PyMeasureCallback
    from tvm.ir.utils import derived_object

    @derived_object
    class StopAtDeadline(PyMeasureCallback):
        def apply(self, task_scheduler, task_id, measure_candidates, builder_results, runner_results):
            # candidates built and run: those failed after the budget (_budget_builder) do not count
            counter[0] += sum(1 for b in builder_results if b.error_msg is None)
            if progress is not None:  # by the budget's seconds, or by candidates under a trial cap
                if budget_s:
                    progress.update(min(int(time.monotonic() - t_start), int(budget_s)), int(budget_s))
                elif cap:
                    progress.update(min(counter[0], cap), cap)
            if time.monotonic() < deadline:
                return
            if counter[1] == 0:
                log(f"time budget spent after {counter[0]} candidates: finishing the batches in flight")
            counter[1] += 1
            for i, rec in enumerate(task_scheduler.tasks_):
                if not rec.is_terminated:
                    task_scheduler.terminate_task(i)

    return StopAtDeadline()


def _tune(model, target, trials, budget_s, *, out_dir, workers, measure, plan_only, log) -> TuneResult:
    import tvm
    from tvm.s_tir import meta_schedule as ms
    from tvm.s_tir.meta_schedule.relax_integration import extract_tasks
    from .compile import fuse, import_onnx
    t_start = time.monotonic()
    counts = measure_threads()  # tune() has put them in the environment the runner workers inherit
    dest = Path(out_dir) if out_dir else default_db_dir(target)
    measure_dict, proxy = measuring_target(target)
    tvm_target = tvm.target.Target(measure_dict)
    if proxy:
        log(f"{target.name} is {target.arch}; candidates are measured here on {host_arch()} as a proxy "
            "(schedules stay valid on the device, their speed there is unmeasured)")
    mod = fuse(import_onnx(model), tvm_target)
    if measure:
        log("timing the model untuned (one compile)")
    ms_before = _measure_ms(model, mod, tvm_target, None) if measure else None
    _light_tensor_intrinsics()
    with locked(lock_file("tuning", key_of(str(dest.resolve())))):
        work = dest.with_name(dest.name + ".work")
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
        for f in DB_FILES:  # extend a copy; builds keep reading the old files meanwhile
            if (dest / f).is_file():
                shutil.copyfile(dest / f, work / f)
        database = ms.database.JSONDatabase(work_dir=str(work), module_equality="structural")
        extracted = extract_tasks(mod, tvm_target)
        counter = [0, 0]
        deadline = t_start + budget_s if budget_s else float("inf")
        local = ms.builder.LocalBuilder(max_workers=workers, timeout_sec=BUILDER_TIMEOUT_S, f_build=_build_candidate)
        builder = _budget_builder(local, deadline)
        runner = ms.runner.LocalRunner(f_run_evaluator=run_at_thread_counts,
                                       evaluator_config=ms.runner.EvaluatorConfig(number=3, repeat=1,
                                                                                  min_repeat_ms=0))
        # measured before the search (inside the budget), committed after it: MetaSchedule's search
        # replays database records as seeds and aborts on one its postprocessors reject
        default_schs = default_traces(extracted, tvm_target)
        defaults = default_records(extracted, default_schs, database, tvm_target, local, runner, log)
        costs = task_costs(extracted, database, default_schs, defaults)
        unknown = [c.index for c in costs if c.seconds is None]
        if unknown:  # kernels no rule schedules and no record covers: what they cost as they come
            costs = task_costs(extracted, database, default_schs,
                               {**defaults, **naive_records(extracted, unknown, tvm_target, local, runner)})
        tuned_before = sum(1 for c in costs if c.searched)
        log(f"{len(extracted)} tuning tasks; {tuned_before} searched by earlier tunes (reused)"
            + (f"; budget {budget_s:.0f} s" if budget_s else ""))
        if plan_only:
            first = plan_tuning(costs, max_tasks_for(budget_s))
            shutil.rmtree(work, ignore_errors=True)
            return TuneResult(dest, 0, len(extracted), tuned_before, 0, 0, time.monotonic() - t_start, proxy, budget_s,
                              ms_before, None, measure_dict, 0, 0, first.share, task_rows(costs, first.chosen),
                              counts)
        # waves: the hottest tasks first; when they are done (each at MAX_TRIALS_PER_TASK) and the
        # budget or trial cap allows, the next hottest (an idle 2-core machine measures a batch in
        # ~5 s, a loaded one in 1-2.5 min: the budget, not a guess, decides how far this gets)
        searched: list[int] = []
        hot_share = 0.0
        while counter[1] == 0 and time.monotonic() < deadline and (trials is None or counter[0] < trials):
            left = deadline - time.monotonic() if budget_s else None
            wave = plan_tuning(costs, max_tasks_for(left), exclude=frozenset(searched))
            if not wave.chosen:
                break
            log(wave.describe())
            _search(ms, tvm, [extracted[i] for i in wave.chosen], work, builder, runner, database, counter,
                    deadline, None if trials is None else trials - counter[0], budget_s, t_start, log)
            searched += wave.chosen
            hot_share += wave.share
        for rec in defaults.values():
            database.commit_tuning_record(rec)
        kept = defaults_kept(extracted, default_schs, database)
        if defaults or kept:
            log(f"default schedules measured for {len(defaults)} tasks; {kept} of {len(extracted)} tasks keep "
                "theirs (no tuned candidate measured faster)")
        tuned_now = sum(1 for t in extracted if _has_record(database, t))
        records = len(database.get_all_tuning_records())
        if records == 0:
            raise BuildError("tuning produced no valid schedule", hint=f"raise --budget; logs in {work / 'logs'}")
        log(f"{tuned_now} of {len(extracted)} tasks have a schedule; {records} records in the database")
        if measure:
            log("timing the model with the database (one compile)")
        ms_after = _measure_ms(model, mod, tvm_target, work) if measure else None
        seconds = time.monotonic() - t_start
        meta = _read_meta(dest)
        meta.update({"target": target.name, "target_dict": target_dict(target), "measured_with": measure_dict,
                     "measure_threads": list(counts),
                     "proxy": proxy or meta.get("proxy", False), "tvm": TVM_VERSION, "records": records,
                     "workloads": _lines(work / DB_FILES[0])})
        meta.setdefault("models", []).append({
            "model": model.name, "model_sha256": model_key(model), "tasks": len(extracted),
            "tuned_before": tuned_before, "tuned_now": tuned_now, "trials": counter[0],
            "budget_s": budget_s, "trial_cap": trials, "seconds": round(seconds, 1),
            "ms_before": ms_before, "ms_after": ms_after, "proxy": proxy, "defaults_kept": kept,
            "searched": len(searched), "hot_share": round(hot_share, 3),
            "searched_tasks": [{"task": costs[i].name, "ms": ms4(costs[i].total)} for i in searched]})
        (work / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
        _publish(work, dest)
    return TuneResult(dest, counter[0], len(extracted), tuned_before, tuned_now, records, seconds, proxy,
                      budget_s, ms_before, ms_after, measure_dict, kept, len(searched), hot_share,
                      task_rows(costs, tuple(searched)), counts)


def _search(ms, tvm, todo, work, builder, runner, database, counter, deadline, cap, budget_s, t_start, log) -> None:
    """One MetaSchedule search over `todo` (at most `cap` candidates in all, when given)."""
    from tvm.s_tir.meta_schedule.relax_integration import extracted_tasks_to_tune_contexts
    contexts, weights = extracted_tasks_to_tune_contexts(
        todo, work_dir=str(work), seed=0,
        strategy=ms.search_strategy.EvolutionarySearch(
            population_size=POPULATION, init_min_unmeasured=INIT_MIN_UNMEASURED, genetic_num_iters=GENETIC_ITERS))
    callbacks = list(ms.measure_callback.MeasureCallback.create("default"))
    cap = cap if cap is not None else MAX_TRIALS_PER_TASK * len(todo)
    progress = StepProgress(f"tuning {len(todo)} tasks", log, unit="s of the budget" if budget_s else "candidates")
    callbacks.append(_deadline_callback(deadline, counter, log, progress, t_start, budget_s, cap))
    try:
        with tvm.transform.PassContext(opt_level=3), progress:
            ms.tune.tune_tasks(tasks=contexts, task_weights=weights, work_dir=str(work),
                               max_trials_global=cap, max_trials_per_task=min(cap, MAX_TRIALS_PER_TASK),
                               num_trials_per_iter=min(TRIALS_PER_BATCH, cap), builder=builder,
                               runner=runner, database=database, measure_callbacks=callbacks)
    except Exception as exc:
        # MetaSchedule's gradient scheduler can pick a task, then collect results (our callback
        # ends every task at the deadline) and still hand out the picked one: its check fails.
        # The search is over either way and the records measured so far are in the database.
        if not (counter[1] and "is_terminated" in str(exc)):
            raise BuildError(f"tuning failed: {str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__}",
                             hint=f"logs in {work / 'logs'}") from exc
        log("search stopped at the budget")


def _lines(path: Path) -> int:
    return sum(1 for _ in open(path)) if path.is_file() else 0


def _read_meta(dest: Path) -> dict:
    try:
        return json.loads((dest / "meta.json").read_text())
    except (OSError, ValueError):
        return {}


def _publish(work: Path, dest: Path) -> None:
    """Move the extended copy into place file by file. Both files only grow (records name
    workloads by line number), so a build reading between the two renames still sees a
    consistent database."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in (DB_FILES[0], DB_FILES[1], "meta.json"):
        if (work / f).is_file():
            os.replace(work / f, dest / f)
    if (work / "logs").is_dir():
        shutil.rmtree(dest / "logs", ignore_errors=True)
        os.replace(work / "logs", dest / "logs")
    shutil.rmtree(work, ignore_errors=True)


def _measure_ms(model: LoadedModel, fused, tvm_target, db_dir: Path | None) -> float | None:
    """Median ms of the model built in-process for the measuring target as a build does it: the
    database's records (when given), then the default schedules for what they left."""
    import numpy as np
    import tvm
    from tvm import relax
    from .compile import apply_database, default_schedules_enabled, lower_pipeline
    from .schedules import apply_default_schedules
    from ...reference import random_inputs
    try:
        mod = apply_database(fused, tvm_target, db_dir) if db_dir is not None else fused
        if default_schedules_enabled():
            mod, _used = apply_default_schedules(mod, tvm_target)
        with tvm.transform.PassContext(opt_level=3):
            ex = relax.build(mod, target=tvm_target, relax_pipeline=lower_pipeline(tvm_target))
        dev = tvm.cpu()
        set_threads(1)  # the before/after report is on 1 thread, as `auto` times artifacts
        vm = relax.VirtualMachine(ex, dev)
        args = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in random_inputs(model.inputs, 0).values()]
        vm["main"](*args)  # warm-up
        # each of the 5 repeats runs at least 20 ms (TVM raises `number` until it does): single calls of a
        # 0.09 ms model put 0.087 against 0.133 ms for the same kernels in one suite run
        timer = vm.time_evaluator("main", dev, number=1, repeat=5, min_repeat_ms=20)
        return round(float(np.median(timer(*args).results)) * 1e3, 3)
    except Exception:  # a report, not the result: never fail a tune over it
        return None
