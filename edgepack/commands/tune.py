"""`edgepack tune`: TVM MetaSchedule tuning of a model's kernels for a target, within a time budget."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click
from rich.markup import escape

from .common import err_console, out_console


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--target", "-t", "target_spec", required=True, help="Target name or alias.")
@click.option("--budget", default="20m", show_default=True, metavar="DURATION",
              help="Search time (20m, 90s, 1h30m); tuning stops after the batch that crosses it.")
@click.option("--trials", type=click.IntRange(min=1), default=None,
              help="Also stop after this many measured candidates over all tasks (a smoke test: 2).")
@click.option("--out-db", type=click.Path(path_type=Path), default=None,
              help="Extend this database instead of the target's own in the cache (builds use the cache's "
                   "by target; pass --tuning-db PATH for another).")
@click.option("--no-measure", is_flag=True, help="Skip timing the model before/after (saves two compiles).")
@click.option("--input-shape", "input_shapes", multiple=True, metavar="NAME=1x3x224x224",
              help="Fix symbolic input dims (must match the build's).")
@click.option("--targets-dir", multiple=True, type=click.Path(path_type=Path), help="Extra folder of target .toml files.")
@click.option("--no-simplify", is_flag=True, help="Skip onnxsim (must match the build's setting).")
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True,
              help="Parallel candidate builds.")
@click.option("--plan", "plan_only", is_flag=True,
              help="Only time each kernel as a build would run it and print where the time goes and what a tune "
                   "would search first; the database is left as it is.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON on stdout.")
def tune(model, target_spec, budget, trials, out_db, no_measure, input_shapes, targets_dir, no_simplify, workers,
         plan_only, as_json):
    """Tune MODEL's kernels for a target (TVM MetaSchedule) within a time budget.

    The target's database accumulates: kernels another model already tuned are reused, and every
    later build for the target applies what is there.

    \b
    Examples:
      edgepack tune model.onnx --target x86_64 --budget 20m
      edgepack tune model.onnx --target arm64 --budget 5m --out-db tuning/arm64 --json
      edgepack tune model.onnx --target x86_64 --plan     # where the time goes, per kernel
      edgepack build model.onnx --target arm64 --backend tvm --tuning-db tuning/arm64
    """
    from ..backends.tvm.tuning import parse_budget
    from ..backends.tvm.tuning import tune as run_tune
    from ..model import parse_shape_args
    from ..pipeline import BuildOptions, prepare
    from ..targets import TargetMatrix

    budget_s = parse_budget(budget)  # before any slow step: a typo fails at once
    target = TargetMatrix.load([Path(d) for d in targets_dir]).get(target_spec)
    if "tvm" not in target.backends:
        err_console.print(f"[yellow]note:[/yellow] target {target.name} does not list tvm among its backends")
    opts = BuildOptions(backend="tvm", input_shapes=parse_shape_args(list(input_shapes)), simplify=not no_simplify)
    prep = prepare(Path(model), opts)

    def log(msg):
        err_console.print(f"[dim]{escape(msg)}[/dim]")

    log(f"tuning {prep.model.name} for {target.name} (MetaSchedule): budget {budget_s:.0f} s"
        + (f", at most {trials} trials" if trials else ""))
    # MetaSchedule and its worker processes print progress on stdout (from C++ too): send fd 1 to
    # stderr while tuning so that stdout carries only the summary (--json stays parseable).
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        res = run_tune(prep.model, target, trials, budget_s=budget_s, out_dir=out_db, workers=workers,
                       measure=not no_measure, plan_only=plan_only, log=log)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    label = "proxy-tuned (measured on this machine, not the device)" if res.proxy else "tuned"
    summary = {"model": str(model), "target": target.name, "database": str(res.path), "trials": res.trials,
               "tasks": res.tasks, "tasks_reused": res.tuned_before, "tasks_tuned": res.tuned_now,
               "records": res.records, "seconds": round(res.seconds, 1), "budget_s": res.budget_s,
               "proxy": res.proxy, "label": label, "measured_with": res.measured_with,
               "ms_untuned": res.ms_before, "ms_tuned": res.ms_after, "tasks_default_kept": res.defaults_kept,
               "tasks_searched": res.searched, "hot_share": round(res.hot_share, 3), "task_table": list(res.task_rows),
               "measure_threads": list(res.measure_threads)}
    if plan_only:
        _print_plan(summary, res, as_json)
    elif as_json:
        click.echo(json.dumps(summary, indent=1))
    else:
        out_console.print(f"tuning database: {escape(str(res.path))} ({res.records} records; {label})")
        out_console.print(f"tasks: {res.tasks}; searched now: {res.searched} (the hottest, {100 * res.hot_share:.0f}% of "
                          f"the model's time); {res.tuned_before} searched by earlier tunes; "
                          f"{res.trials} candidates measured in {res.seconds:.0f} s; "
                          f"{res.defaults_kept} keep their default schedule (nothing tuned measured faster)")
        if res.ms_before is not None and res.ms_after is not None:
            where = "this machine as a proxy" if res.proxy else "this machine"
            out_console.print(f"what it bought: {res.ms_before:.2f} ms untuned (default schedules) -> {res.ms_after:.2f} ms tuned "
                              f"({res.ms_before / max(res.ms_after, 1e-9):.1f}x, TVM in-process on {where}, "
                              f"mcpu {res.measured_with.get('mcpu')})")
        if out_db:
            out_console.print(f"use it with: edgepack build {escape(str(model))} --target {target.name} "
                              f"--backend tvm --tuning-db {escape(str(res.path))}")
        else:
            out_console.print(f"later `edgepack build` runs for {target.name} (any model) use it automatically")


def _print_plan(summary: dict, res, as_json: bool) -> None:
    """`tune --plan`: the per-kernel table and the model's own time, nothing tuned."""
    plan = {k: summary[k] for k in ("model", "target", "database", "tasks", "tasks_reused", "proxy", "measured_with",
                                    "measure_threads", "ms_untuned", "hot_share", "task_table")}
    if as_json:
        click.echo(json.dumps(plan, indent=1))
        return
    from rich.table import Table
    threads = " and ".join(map(str, summary["measure_threads"]))
    table = Table(title=f"where {Path(summary['model']).name} spends its time on {summary['target']} "
                        f"(each kernel timed alone: geometric mean over {threads} thread(s); searched: by an "
                        "earlier tune; next: what a tune searches first)")
    table.add_column("kernel", overflow="fold")
    for col in ("calls", "ms/call", "ms", "share", "searched", "next"):
        table.add_column(col, justify="right")
    def fmt(v, spec):
        return "?" if v is None else format(v, spec)
    for r in res.task_rows:
        table.add_row(escape(r["task"]), str(r["calls"]), fmt(r["ms_per_call"], ".4f"), fmt(r["ms"], ".4f"),
                      "?" if r["share"] is None else f"{100 * r['share']:.1f}%", "yes" if r["searched_before"] else "",
                      "yes" if r["chosen"] else "")
    out_console.print(table)
    kernels = sum(r["ms"] or 0.0 for r in res.task_rows)
    line = f"kernels in all: {kernels:.3f} ms"
    if res.ms_before is not None:
        line += (f"; the whole model as a build runs it: {res.ms_before:.3f} ms (TVM in-process; the difference is "
                 "the VM's calls, copies and the kernels MetaSchedule does not extract)")
    out_console.print(line)


COMMANDS = (tune,)
