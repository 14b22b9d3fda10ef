"""The ``edgepack`` command line: parses options and calls the library, nothing more."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from . import __version__
from .errors import EdgepackError
from .tables import Cell, print_table

BUILD_JSON_SCHEMA_VERSION = 1  # `edgepack build --json`, see docs/build-json.md

err_console = Console(stderr=True, highlight=False)
out_console = Console(highlight=False)


class Context:
    def __init__(self, debug: bool):
        self.debug = debug


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="edgepack")
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.pass_context
def cli(ctx, debug):
    """Build one verified, self-contained executable per edge target from an ONNX model."""
    ctx.obj = Context(debug)


def _target_dirs(dirs):
    return [Path(d) for d in dirs]


@cli.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--target", "-t", "target_specs", multiple=True, help="Target name or alias; repeat or comma-separate.")
@click.option("--all", "all_targets", is_flag=True, help="Build for every target in the matrix.")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("dist"), show_default=True)
@click.option("--backend", default="auto", show_default=True, help="ncnn, tvm or auto.")
@click.option("--fp16/--fp32", "fp16", default=True, show_default=True,
              help="--fp16: fp16 allowed, the first of fp16 arithmetic / fp16 storage / fp32 that verifies on "
                   "every CPU is kept; --fp32: never fp16.")
@click.option("--input-shape", "input_shapes", multiple=True, metavar="NAME=1x3x224x224",
              help="Fix symbolic input dims.")
@click.option("--targets-dir", multiple=True, type=click.Path(path_type=Path),
              help="Extra folder of target .toml files.")
@click.option("--no-verify", is_flag=True, help="Skip running the artifact against onnxruntime.")
@click.option("--no-simplify", is_flag=True, help="Skip onnxsim.")
@click.option("--preprocess", default=None, metavar="SPEC",
              help="Bake input pre-processing into the graph, e.g. image:size=224x224,layout=nhwc,dtype=uint8,...")
@click.option("--postprocess", default=None, metavar="SPEC", help="Bake output post-processing, e.g. softmax,topk=5")
@click.option("--jobs", "-j", type=click.IntRange(0, 64), default=0, show_default=True,
              help="Targets built at once (0: one per core).")
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout.")
def build(model, target_specs, all_targets, out_dir, backend, fp16, input_shapes, targets_dir, no_verify,
          no_simplify, preprocess, postprocess, jobs, as_json):
    """Build MODEL (.onnx) into one executable per target."""
    from .model import parse_shape_args
    from .pipeline import BuildOptions, build as run_build
    from .targets import TargetMatrix

    if backend != "auto":
        from .backends import get_backend
        get_backend(backend)  # an unknown name is a usage error before anything is loaded
    matrix = TargetMatrix.load(_target_dirs(targets_dir))
    targets = matrix.resolve(list(target_specs), all_targets)
    opts = BuildOptions(backend=backend, precision="fp16" if fp16 else "fp32",
                        input_shapes=parse_shape_args(list(input_shapes)), out_dir=out_dir,
                        verify=not no_verify, simplify=not no_simplify, preprocess=preprocess,
                        postprocess=postprocess, jobs=jobs)

    def log(msg):
        err_console.print(f"[dim]{escape(msg)}[/dim]")

    debug = bool(getattr(click.get_current_context().find_root().obj, "debug", False))

    def on_result(res):
        if res.ok:
            err = (f"{res.max_abs_err:.2e} = {res.rel_err:.2%} of scale" if res.rel_err is not None
                   else f"{res.max_abs_err:.2e}" if res.max_abs_err is not None else "not verified")
            err_console.print(f"[green]✓[/green] {escape(res.target)}: {escape(str(res.path))} "
                              f"({res.size / 1e6:.2f} MB, {res.backend} {res.precision or ''}, max error {err})")
        else:
            err_console.print(f"[red]✗[/red] {escape(res.target)}: {escape(res.error or '')}")
            if debug and res.exit_code == 70:  # the internal error's traceback, as its hint asks for
                for note in res.notes:
                    err_console.print(escape(note), soft_wrap=True)

    results = run_build(model, targets, opts, log=log, on_result=on_result)
    if as_json:
        # Schema: docs/build-result.schema.json (bump BUILD_JSON_SCHEMA_VERSION on incompatible changes)
        click.echo(json.dumps({"schema_version": BUILD_JSON_SCHEMA_VERSION, "edgepack_version": __version__,
                               "model": str(model), "results": [r.to_json() for r in results],
                               "ok": all(r.ok for r in results)}, indent=1))
    else:
        rows = []
        for r in results:
            err = f"{r.max_abs_err:.2e} ≤ {r.bound:.1e}" if r.max_abs_err is not None else "-"
            rejected = f" ({len(r.rejected)} rejected)" if r.rejected and r.ok else ""
            rows.append([r.target, r.backend or "-", (r.precision or "-") + rejected, str(r.path) if r.path else "-",
                         f"{r.size / 1e6:.2f} MB" if r.size else "-", err,
                         f"{r.rel_err:.3%}" if r.rel_err is not None else "-", ", ".join(r.per_cpu) or "-",
                         Cell("PASS", "green") if r.ok else Cell("FAIL", "red")])
        print_table(out_console, f"edgepack build {model}", ["target", "backend", "precision", "file", "size",
                    "max error", "of scale", "verified on", "verdict"], rows)
        for r in results:
            if not r.ok:
                err_console.print(f"[red]{escape(r.target)}:[/red] {escape(r.error or '')}", soft_wrap=True)
                if r.hint:
                    err_console.print(f"[yellow]hint:[/yellow] {escape(r.hint)}", soft_wrap=True)
    failed = [r for r in results if not r.ok]
    if failed:
        codes = {r.exit_code for r in failed}
        raise SystemExit(codes.pop() if len(codes) == 1 else 1)


@cli.command()
@click.option("--target", "-t", "target_specs", multiple=True, help="Target name or alias; repeat or comma-separate.")
@click.option("--all", "all_targets", is_flag=True)
@click.option("--targets-dir", multiple=True, type=click.Path(path_type=Path))
def prefetch(target_specs, all_targets, targets_dir):
    """Build the per-architecture libraries for targets now (warms the cache, e.g. on CI runners)."""
    from .prefetch import prefetch as run_prefetch
    from .targets import TargetMatrix
    targets = TargetMatrix.load(_target_dirs(targets_dir)).resolve(list(target_specs), all_targets)
    run_prefetch(targets, log=lambda m: err_console.print(f"[dim]{escape(m)}[/dim]"))


@cli.command("verify-build")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--clean-cache", is_flag=True, help="Rebuild every library too, in a fresh cache (slow).")
@click.option("--json", "as_json", is_flag=True)
def verify_build_cmd(artifact, model, clean_cache, as_json):
    """Rebuild ARTIFACT from MODEL with the options in its manifest and compare the bytes."""
    from .reproduce import verify_build
    res = verify_build(artifact, model, clean_cache=clean_cache, log=lambda m: err_console.print(f"[dim]{escape(m)}[/dim]"))
    if as_json:
        click.echo(json.dumps({"artifact": str(artifact), "identical": res.identical, "sha256": res.original_sha256,
                               "rebuilt_sha256": res.rebuilt_sha256, "rebuilt": str(res.rebuilt_path)}))
    elif res.identical:
        out_console.print(f"[green]IDENTICAL[/green] {escape(str(artifact))} sha256={res.original_sha256}")
    else:
        out_console.print(f"[red]DIFFERENT[/red] {escape(str(artifact))} sha256={res.original_sha256} "
                          f"rebuilt={res.rebuilt_sha256} ({escape(str(res.rebuilt_path))})")
    if not res.identical:
        raise SystemExit(8)


@cli.command()
@click.option("--json", "as_json", is_flag=True)
@click.option("--targets-dir", multiple=True, type=click.Path(path_type=Path))
def targets(as_json, targets_dir):
    """Print the target matrix."""
    from .targets import TargetMatrix
    matrix = TargetMatrix.load(_target_dirs(targets_dir))
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


@cli.command()
def doctor():
    """List the tools edgepack needs, found or missing, and how to install them."""
    from .doctor import checks
    found = checks()
    bad = sum(not c.ok for c in found)
    print_table(out_console, "edgepack doctor", ["tool", "status", "detail / fix"],
                [[c.name, Cell("found", "green") if c.ok else Cell("missing", "red"), c.detail] for c in found])
    if bad:
        raise SystemExit(6)


@cli.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--input-shape", "input_shapes", multiple=True, metavar="NAME=1x3x224x224")
@click.option("--json", "as_json", is_flag=True)
def inspect(model, input_shapes, as_json):
    """MODEL (.onnx): inputs, outputs, ops x backends and the verdict per target. ARTIFACT: its manifest.

    \b
    Examples:
      edgepack inspect model.onnx --input-shape images=1x3x320x320
      edgepack inspect dist/model-arm64 --json
    """
    from .inspection import inspect_artifact_manifest, inspect_model, is_artifact
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


# Command groups kept in their own modules register themselves on `cli`.
from . import cli_deploy  # noqa: E402,F401
from . import cli_tvm  # noqa: E402,F401
from . import cli_serve  # noqa: E402,F401


def _hoist_global_flags(argv: list[str]) -> list[str]:
    """`--debug` is a global flag, but people type it where they think of it (`edgepack build m.onnx
    --debug`): move it in front of the subcommand (never past a `--`)."""
    end = argv.index("--") if "--" in argv else len(argv)
    head, tail = argv[:end], argv[end:]
    if "--debug" not in head:
        return argv
    return ["--debug"] + [a for a in head if a != "--debug"] + tail


def main(argv=None):
    argv = _hoist_global_flags(list(argv if argv is not None else sys.argv[1:]))
    debug = "--debug" in argv
    try:
        cli.main(args=argv, prog_name="edgepack", standalone_mode=False)
    except EdgepackError as exc:
        if debug:
            raise
        err_console.print(f"[red]error:[/red] {escape(exc.message)}", soft_wrap=True)
        if exc.hint:
            err_console.print(f"[yellow]hint:[/yellow] {escape(exc.hint)}", soft_wrap=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        err_console.print("aborted")
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(2)
    except SystemExit:
        raise
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # a bug: one line and exit 70; --debug shows the traceback
        if debug:
            raise
        err_console.print(f"[red]error:[/red] internal error: {escape(type(exc).__name__)}: {escape(str(exc)[:300])}",
                          soft_wrap=True)
        err_console.print("[yellow]hint:[/yellow] please report this with the output of the same command "
                          "with --debug", soft_wrap=True)
        sys.exit(70)
    sys.exit(0)


if __name__ == "__main__":
    main()
