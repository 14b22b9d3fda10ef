"""TVM commands (edgepack tune) register on the main group here.

Also adds ``--tuning-db PATH`` to ``edgepack build``: the TVM backend reads the database folder
from ``EDGEPACK_TUNING_DB``, which the option sets for the duration of the build.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click
from rich.markup import escape

from .cli import cli, err_console, out_console


@cli.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--target", "-t", "target_spec", required=True, help="Target name or alias.")
@click.option("--trials", type=click.IntRange(min=1), default=256, show_default=True,
              help="MetaSchedule trials over all tasks (tens for a smoke test, hundreds+ for speed).")
@click.option("--out-db", type=click.Path(path_type=Path), default=None,
              help="Write the database here (default: the cache, where builds find it by model+target).")
@click.option("--input-shape", "input_shapes", multiple=True, metavar="NAME=1x3x224x224")
@click.option("--targets-dir", multiple=True, type=click.Path(path_type=Path))
@click.option("--no-simplify", is_flag=True, help="Skip onnxsim (must match the build's setting).")
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True,
              help="Parallel candidate builds.")
@click.option("--json", "as_json", is_flag=True)
def tune(model, target_spec, trials, out_db, input_shapes, targets_dir, no_simplify, workers, as_json):
    """Tune MODEL's kernels for a target (TVM MetaSchedule); later builds use the result."""
    from .backends.tvm.tuning import tune as run_tune
    from .model import parse_shape_args
    from .pipeline import BuildOptions, prepare
    from .targets import TargetMatrix

    target = TargetMatrix.load([Path(d) for d in targets_dir]).get(target_spec)
    if "tvm" not in target.backends:
        err_console.print(f"[yellow]note:[/yellow] target {target.name} does not list tvm among its backends")
    opts = BuildOptions(backend="tvm", input_shapes=parse_shape_args(list(input_shapes)), simplify=not no_simplify)
    prep = prepare(Path(model), opts)

    def log(msg):
        err_console.print(f"[dim]{escape(msg)}[/dim]")

    log(f"tuning {prep.model.name} for {target.name}: {trials} trials (MetaSchedule)")
    # MetaSchedule and its worker processes print progress on stdout (from C++ too): send fd 1 to
    # stderr while tuning so that stdout carries only the summary (--json stays parseable).
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        res = run_tune(prep.model, target, trials, out_dir=out_db, workers=workers, log=log)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    summary = {"model": str(model), "target": target.name, "database": str(res.path), "trials": res.trials,
               "tasks": res.tasks, "records": res.records, "seconds": round(res.seconds, 1), "proxy": res.proxy}
    if as_json:
        click.echo(json.dumps(summary, indent=1))
    else:
        out_console.print(f"tuning database: {escape(str(res.path))} ({res.records} records for {res.tasks} "
                          f"workloads, {res.seconds:.0f} s)")
        if out_db:
            out_console.print(f"use it with: edgepack build {escape(str(model))} --target {target.name} "
                              f"--backend tvm --tuning-db {escape(str(res.path))}")
        else:
            out_console.print("later `edgepack build` runs for this model and target use it automatically")


def _add_tuning_db_option() -> None:
    build = cli.commands.get("build")
    if build is None or any(p.name == "tuning_db" for p in build.params):
        return
    build.params.append(click.Option(["--tuning-db", "tuning_db"], default=None, metavar="PATH|off",
                                     help="TVM: use this MetaSchedule database (from `edgepack tune --out-db`); "
                                          "'off' builds untuned even when `edgepack tune` left one in the cache."))
    inner = build.callback

    def callback(*args, tuning_db=None, **kwargs):
        if tuning_db is None:
            return inner(*args, **kwargs)
        old = os.environ.get("EDGEPACK_TUNING_DB")
        os.environ["EDGEPACK_TUNING_DB"] = tuning_db if tuning_db == "off" else str(Path(tuning_db).resolve())
        try:
            return inner(*args, **kwargs)
        finally:
            if old is None:
                os.environ.pop("EDGEPACK_TUNING_DB", None)
            else:
                os.environ["EDGEPACK_TUNING_DB"] = old

    build.callback = callback


_add_tuning_db_option()
