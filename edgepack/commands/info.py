"""`edgepack targets`, `doctor` and `inspect`: what the matrix, the machine and a model look like."""
from __future__ import annotations

import json
from pathlib import Path

import click

from ..tables import Cell, print_table
from .common import out_console, target_dirs


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the matrix as JSON on stdout.")
@click.option("--targets-dir", multiple=True, type=click.Path(path_type=Path), help="Extra folder of target .toml files.")
def targets(as_json, targets_dir):
    """Print the target matrix (a TSV table when stdout is not a terminal).

    \b
    Examples:
      edgepack targets
      edgepack targets --targets-dir my-targets/ --json
    """
    from ..targets import TargetMatrix
    matrix = TargetMatrix.load(target_dirs(targets_dir))
    rows = [matrix.targets[n].summary() for n in matrix.names()]
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    print_table(out_console, "edgepack targets",
                ["name", "triple", "cpu", "link", "page", "verified under", "backends", "aliases"],
                [[r["name"], r["triple"], r["cpu"], r["link"], r["page_size"], _verified_under(r),
                  ",".join(r["backends"]), ",".join(r["aliases"])] for r in rows])


def _verified_under(summary: dict) -> str:
    cpus = summary.get("verify_cpus") or ([summary["qemu_cpu"]] if summary.get("qemu_cpu") else [])
    return ",".join(str(c) for c in cpus) or "native"


@click.command()
def doctor():
    """List the tools edgepack needs, found or missing, and how to install them (exit 6 if any is missing).

    \b
    Examples:
      edgepack doctor
      edgepack doctor | grep missing
    """
    from ..doctor import checks
    found = checks()
    bad = sum(not c.ok for c in found)
    print_table(out_console, "edgepack doctor", ["tool", "status", "detail / fix"],
                [[c.name, Cell("found", "green") if c.ok else Cell("missing", "red"), c.detail] for c in found])
    if bad:
        raise SystemExit(6)


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--input-shape", "input_shapes", multiple=True, metavar="NAME=1x3x224x224",
              help="Fix symbolic input dims before the op and target checks.")
@click.option("--json", "as_json", is_flag=True, help="Print the report (or the artifact's manifest) as JSON.")
def inspect(model, input_shapes, as_json):
    """MODEL (.onnx): inputs, outputs, ops x backends and the verdict per target. ARTIFACT: its manifest.

    \b
    Examples:
      edgepack inspect model.onnx --input-shape images=1x3x320x320
      edgepack inspect dist/model-arm64 --json
    """
    from ..inspection import inspect_artifact_manifest, inspect_model, is_artifact
    if is_artifact(model):
        manifest = inspect_artifact_manifest(model)
        if as_json:
            click.echo(json.dumps(manifest, indent=1))
            return
        _print_artifact_summary(model, manifest)
        return
    report = inspect_model(model, list(input_shapes))
    if as_json:
        click.echo(json.dumps(report, indent=1))
        return
    _print_io(report["inputs"], report["outputs"])
    names = report["backends"]
    print_table(out_console, f"ops in {model}", ["op", "nodes"] + names,
                [[op["op"], op["count"], *(Cell("yes", "green") if op["support"][b] else Cell("no", "red")
                                           for b in names)] for op in report["ops"]])
    for t, verdict in report["targets"].items():
        click.echo(f"{t}: {verdict}")
    for k, seg in enumerate(report.get("plan") or []):  # the NCNN/TVM split, when there is one
        click.echo(f"plan segment {k}: {seg['backend']} <- {', '.join(seg['ops'])} ({seg['nodes']} nodes)")
    for note in report["notes"]:
        click.echo(f"note: {note}")


def _print_io(inputs: list[dict], outputs: list[dict]) -> None:
    for kind, specs in (("input", inputs), ("output", outputs)):
        for s in specs:
            shape = "x".join(str(d) for d in s.get("shape", []))
            click.echo(f"{kind} {s.get('name')}: {s.get('dtype')} [{shape}]")


def _print_artifact_summary(path: Path, m: dict) -> None:
    t, b = m.get("target") or {}, m.get("backend") or {}
    click.echo(f"artifact {path}: model {(m.get('model') or {}).get('name')}, target {t.get('name')} "
               f"({t.get('triple')}), backend {b.get('name')}, precision {m.get('precision')}")
    _print_io(m.get("inputs") or [], m.get("outputs") or [])


COMMANDS = (targets, doctor, inspect)
