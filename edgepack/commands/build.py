"""`edgepack build`, `prefetch` and `verify-build`: ONNX model -> verified artifacts, reproducibly."""
from __future__ import annotations

import json
from pathlib import Path

import click
from rich.markup import escape

from .. import __version__
from ..tables import Cell, print_table
from .selection_opts import bench_device, selection_options, timed
from .common import debug_enabled, err_console, log, out_console, target_dirs

BUILD_JSON_SCHEMA_VERSION = 1  # `edgepack build --json`, see docs/build-json.md


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--target", "-t", "target_specs", multiple=True, help="Target name or alias; repeat or comma-separate.")
@click.option("--all", "all_targets", is_flag=True, help="Build for every target in the matrix.")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("dist"), show_default=True,
              help="Folder the artifacts (and their .json manifests) are written to.")
@click.option("--backend", default="auto", show_default=True, help="ncnn, tvm or auto.")
@click.option("--fp16/--fp32", "fp16", default=True, show_default=True,
              help="--fp16: fp16 allowed, the first of fp16 arithmetic / fp16 storage / fp32 that verifies on "
                   "every CPU is kept; --fp32: never fp16.")
@click.option("--input-shape", "input_shapes", multiple=True, metavar="NAME=1x3x224x224",
              help="Fix symbolic input dims.")
@click.option("--targets-dir", multiple=True, type=click.Path(path_type=Path),
              help="Extra folder of target .toml files.")
@click.option("--no-verify", is_flag=True, help="Skip running the artifact against onnxruntime.")
@click.option("--verify-on", "verify_on", default=None, metavar="CPU[,CPU]",
              help="Verify only under these of the targets' verify_cpus (e.g. native: a quick local build, "
                   "where qemu would take minutes per inference of a large model); the manifest records it. "
                   "Default: every CPU each target names.")
@click.option("--no-simplify", is_flag=True, help="Skip onnxsim.")
@click.option("--preprocess", default=None, metavar="SPEC",
              help="Bake input pre-processing into the graph, e.g. image:size=224x224,layout=nhwc,dtype=uint8,...")
@click.option("--postprocess", default=None, metavar="SPEC", help="Bake output post-processing, e.g. softmax,topk=5")
@click.option("--jobs", "-j", type=click.IntRange(0, 64), default=0, show_default=True,
              help="Targets built at once (0: one per core).")
@click.option("--tuning-db", default=None, metavar="PATH|off",
              help="TVM: use this MetaSchedule database (from `edgepack tune --out-db`); 'off' builds untuned "
                   "even when `edgepack tune` left one in the cache. Default: the target's database, if any.")
@click.option("--memory", type=click.Choice(["fast", "lean"]), default="fast", show_default=True,
              help="NCNN: fast keeps ncnn's Winograd kernels everywhere (on x86 at the fp16 rung the F(4,3) ones "
                   "in fp16); lean runs the 3x3 convolutions whose Winograd kernels exceed 1 MiB without them and, "
                   "on x86, every layer the direct kernel can take in it with fp16 weights where exact "
                   "(nudenet_320n: peak RSS 28 MiB fast, 16 MiB lean, 12% slower on 1 thread; docs/backends.md).")
@click.option("--default-threads", "default_threads", default="auto", show_default=True, metavar="auto|all|N",
              help="The artifact's thread count when run without --threads: auto times it at 1, 2, 4... threads "
                   "where it can be timed (this machine's arch, or --bench-on) and caps it at the fewest within 5% "
                   "of the fastest (tiny models run slower on more threads); all: every free core; N: at most N.")
@selection_options
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON on stdout.")
def build(model, target_specs, all_targets, out_dir, backend, fp16, input_shapes, targets_dir, no_verify,
          verify_on, no_simplify, preprocess, postprocess, jobs, tuning_db, default_threads, select, bench_on,
          inventory, memory, as_json):
    """Build MODEL (.onnx) into one verified executable per target.

    \b
    Examples:
      edgepack build model.onnx --target x86_64
      edgepack build model.onnx --target arm64,jetson --input-shape images=1x3x320x320
      edgepack build model.onnx --all --preprocess image:size=224x224 --postprocess softmax,topk=5
      edgepack build model.onnx --target arm64 --bench-on pi-1 -I devices.toml --select all
    """
    from ..model import parse_shape_args
    from ..pipeline import BuildOptions, build as run_build
    from ..targets import TargetMatrix
    from ..thread_policy import parse_option

    if backend != "auto":
        from ..backends import get_backend
        get_backend(backend)  # an unknown name is a usage error before anything is loaded
    matrix = TargetMatrix.load(target_dirs(targets_dir))
    targets = matrix.resolve(list(target_specs), all_targets)
    opts = BuildOptions(backend=backend, precision="fp16" if fp16 else "fp32",
                        input_shapes=parse_shape_args(list(input_shapes)), out_dir=out_dir,
                        verify=not no_verify, simplify=not no_simplify, preprocess=preprocess,
                        postprocess=postprocess, jobs=jobs,
                        tuning_db=tuning_db if tuning_db in (None, "off") else str(Path(tuning_db).resolve()),
                        select=select, bench_on=bench_device(bench_on, inventory), memory=memory,
                        verify_on=tuple(c.strip() for c in (verify_on or "").split(",") if c.strip()),
                        default_threads=parse_option(default_threads))

    debug = debug_enabled()

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
                         Cell("PASS", "green") if r.ok else Cell("FAIL", "red"), timed(r.selection)])
        print_table(out_console, f"edgepack build {model}", ["target", "backend", "precision", "file", "size",
                    "max error", "of scale", "verified on", "verdict", "timed (median)"], rows)
        for r in results:
            if not r.ok:
                err_console.print(f"[red]{escape(r.target)}:[/red] {escape(r.error or '')}", soft_wrap=True)
                if r.hint:
                    err_console.print(f"[yellow]hint:[/yellow] {escape(r.hint)}", soft_wrap=True)
    failed = [r for r in results if not r.ok]
    if failed:
        codes = {r.exit_code for r in failed}
        raise SystemExit(codes.pop() if len(codes) == 1 else 1)
    _cache_hint(target_dirs(targets_dir))


def _cache_hint(extra_dirs: list[Path]) -> None:
    """One line when superseded or unfinished builds take more than 200 MB of the cache."""
    from ..cache_entries import reclaimable_build_bytes
    try:
        stale = reclaimable_build_bytes(extra_dirs)
    except Exception:  # a hint must never fail a build that passed
        return
    if stale > 200e6:
        err_console.print(f"[yellow]hint:[/yellow] the cache holds {stale / 1e6:.0f} MB of superseded builds: "
                          "`edgepack cache prune` frees them", soft_wrap=True)


@click.command()
@click.option("--target", "-t", "target_specs", multiple=True, help="Target name or alias; repeat or comma-separate.")
@click.option("--all", "all_targets", is_flag=True, help="Every target in the matrix.")
@click.option("--targets-dir", multiple=True, type=click.Path(path_type=Path), help="Extra folder of target .toml files.")
def prefetch(target_specs, all_targets, targets_dir):
    """Build the per-architecture libraries for targets now (warms the cache, e.g. on CI runners)."""
    from ..prefetch import prefetch as run_prefetch
    from ..targets import TargetMatrix
    targets = TargetMatrix.load(target_dirs(targets_dir)).resolve(list(target_specs), all_targets)
    run_prefetch(targets, log=log)


@click.command("verify-build")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--clean-cache", is_flag=True, help="Rebuild every library too, in a fresh cache (slow).")
@click.option("--tuning-db", type=click.Path(path_type=Path), default=None,
              help="The TVM tuning database the artifact was built with, when it is no longer where the "
                   "manifest says (its content hash must match).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON on stdout.")
def verify_build_cmd(artifact, model, clean_cache, tuning_db, as_json):
    """Rebuild ARTIFACT from MODEL with the options in its manifest and compare the bytes.

    \b
    Examples:
      edgepack verify-build dist/model-x86_64 model.onnx
      edgepack verify-build dist/model-arm64 model.onnx --clean-cache --json
    """
    from ..reproduce import verify_build
    res = verify_build(artifact, model, clean_cache=clean_cache, tuning_db=tuning_db, log=log)
    if as_json:
        click.echo(json.dumps({"artifact": str(artifact), "identical": res.identical, "sha256": res.original_sha256,
                               "rebuilt_sha256": res.rebuilt_sha256, "rebuilt": str(res.rebuilt_path) if res.rebuilt_path else None}))
    elif res.identical:
        out_console.print(f"[green]IDENTICAL[/green] {escape(str(artifact))} sha256={res.original_sha256}")
    else:
        out_console.print(f"[red]DIFFERENT[/red] {escape(str(artifact))} sha256={res.original_sha256} "
                          f"rebuilt={res.rebuilt_sha256} ({escape(str(res.rebuilt_path))})")
    if not res.identical:
        raise SystemExit(8)


COMMANDS = (build, prefetch, verify_build_cmd)
