"""`edgepack run`: run an artifact (natively or under qemu) or an ONNX file (onnxruntime) on files."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click
import numpy as np

from ..errors import ArtifactError, EdgepackError, InputError, ModelError, UsageError


def _answer(model, result: dict) -> dict:
    if "detections" in result:  # Model.detect()'s answer: boxes in image pixels (baked detection)
        return result
    out = {}
    if model.prepost.get("postprocess"):
        out["top"] = model.top(result)
    out["outputs"] = {k: {"dtype": str(v.dtype), "shape": list(v.shape),
                          "values": [None if isinstance(x, float) and not np.isfinite(x) else x
                                     for x in v.reshape(-1).tolist()]} for k, v in result.items()}
    return out


def _predict(model):
    """detect() for a model with baked detection (its answer is boxes), else predict()."""
    return model.detect if (model.prepost.get("postprocess") or {}).get("detect") else model.predict


def _csv_rows(path: Path) -> np.ndarray:
    rows = []
    for i, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            rows.append([float(x) for x in line.replace(";", ",").replace("\t", ",").split(",")])
        except ValueError:
            if rows or i > 0:
                raise UsageError(f"{path} line {i + 1}: a field is not a number") from None
    if not rows or len({len(r) for r in rows}) != 1:
        raise UsageError(f"{path}: no numeric rows, or rows of different lengths")
    return np.array(rows)


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--input", "-i", "inputs", multiple=True, metavar="[NAME=]FILE",
              help="image (baked preprocessing), .npy, JSON tensor or CSV rows")
@click.option("--input-dir", type=click.Path(path_type=Path), help="every file in DIR; one JSON line each")
@click.option("--output", "-o", type=click.Path(path_type=Path), help="results file (.jsonl, or .csv for CSV in)")
@click.option("--threads", type=click.IntRange(1, 256), default=1, show_default=True,
              help="Threads of the inference engine.")
def run(model, inputs, input_dir, output, threads):
    """Run MODEL (an artifact or an .onnx file) on input files and print JSON.

    Exits like the artifact's own `run`, whichever MODEL is: 2 usage, 3 bad input, 4 model, 5 I/O.

    \b
    Examples:
      edgepack run dist/model-x86_64 --input cat.png
      edgepack run model.onnx --input image=x.npy --output out.jsonl
      edgepack run dist/model-arm64 --input-dir photos/ --output results.jsonl
    """
    try:
        _run(model, inputs, input_dir, output, threads)
    except EdgepackError as exc:
        exc.exit_code = _artifact_exit_code(exc)  # one exit-code table for ONNX and artifacts
        raise


class _MissingInput(UsageError):
    """An input file or folder that does not exist: I/O (5) in the artifact's table."""


def _artifact_exit_code(exc: EdgepackError) -> int:
    if isinstance(exc, (InputError, ArtifactError)) and not isinstance(exc, ModelError):
        return 3 if isinstance(exc, InputError) else 4
    if isinstance(exc, ModelError):
        return 4
    if isinstance(exc, _MissingInput):
        return 5
    return 2 if isinstance(exc, UsageError) else exc.exit_code


def _run(model, inputs, input_dir, output, threads):
    from .. import sdk
    if not model.is_file():
        raise UsageError(f"{model}: no such file")
    if not inputs and not input_dir:
        raise UsageError("give --input FILE or --input-dir DIR")
    if model.read_bytes()[:4] == b"\x7fELF":
        art = sdk.ArtifactModel(model, threads=threads).artifact
        args = ["run", "--threads", str(threads)]
        for i in inputs:
            args += ["--input", i]
        if input_dir:
            args += ["--input-dir", str(input_dir)]
        if output:
            args += ["--output", str(output)]
        proc = art.run(args, check=False, capture=False)  # its own output and exit code, as if run directly
        if proc.returncode:
            raise SystemExit(proc.returncode)
        return
    m = sdk.load(model)
    names = {s.name for s in m.inputs}
    feeds = {}
    for a in inputs:  # NAME=FILE only where NAME is an input: /data/a=b/x.npy stays a path
        name, f = next(((a[:i], a[i + 1:]) for i, ch in enumerate(a) if ch == "=" and a[:i] in names), (None, a))
        if name is None and len(m.inputs) != 1:
            raise UsageError(f"--input {a}: the model has {len(m.inputs)} inputs, write NAME=FILE "
                             f"(its inputs: {', '.join(sorted(names))})")
        if not Path(f).is_file():
            raise _MissingInput(f"{f}: no such file")
        feeds[name or m.inputs[0].name] = f
    if input_dir and not Path(input_dir).is_dir():
        raise _MissingInput(f"--input-dir {input_dir}: no such folder")
    if output:
        _check_output(output, list(feeds.values()), input_dir)
    failed = total = 0
    with _Results(output) as out:
        if input_dir:
            for p in sorted(q for q in Path(input_dir).iterdir() if q.is_file() and not q.name.startswith(".")):
                total += 1
                try:
                    line = {"file": p.name, **_answer(m, _predict(m)(p))}
                except Exception as exc:  # one bad file is an error line, not a stop
                    failed += 1
                    line = {"file": p.name, "error": str(exc)}
                out.write(json.dumps(line) + "\n")
        elif len(feeds) == 1 and next(iter(feeds.values())).lower().endswith(".csv"):
            rows = _csv_rows(Path(next(iter(feeds.values()))))
            for r, row in enumerate(rows):
                out.write(json.dumps({"row": r, **_answer(m, _predict(m)(row))}) + "\n")
        elif len(m.inputs) == 1:
            out.write(json.dumps(_answer(m, _predict(m)(feeds[m.inputs[0].name]))) + "\n")
        else:
            res = _predict(m)({k: np.load(v, allow_pickle=False) for k, v in feeds.items()})
            out.write(json.dumps(_answer(m, res)) + "\n")
    if failed:
        print(f"{total} files: {total - failed} ok, {failed} failed", file=sys.stderr)
        raise InputError(f"{failed} of {total} files failed (their error lines are in {output or 'the output'})")


def _check_output(output: Path, inputs: list, input_dir) -> None:
    """Results never overwrite an input (also through links) nor land in the input folder."""
    for f in inputs:
        if output.exists() and Path(f).exists() and output.samefile(f):
            raise UsageError(f"--output {output} is the input {f}: write the results to another file")
    if input_dir and output.resolve().parent == Path(input_dir).resolve():
        raise UsageError(f"--output {output} is inside --input-dir {input_dir}: write the results elsewhere")


class _Results:
    """stdout, or a temporary file next to OUTPUT renamed over it only when complete."""

    def __init__(self, output):
        self.output, self.tmp, self.f = output, None, sys.stdout

    def __enter__(self):
        if self.output:
            import tempfile
            fd, self.tmp = tempfile.mkstemp(prefix=".edgepack-", dir=Path(self.output).resolve().parent)
            self.f = os.fdopen(fd, "w")
        return self.f

    def __exit__(self, exc_type, exc, tb):
        if not self.tmp:
            return
        self.f.close()
        if exc_type is None:
            os.chmod(self.tmp, 0o666 & ~_umask())
            os.replace(self.tmp, self.output)
        else:
            os.unlink(self.tmp)


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


COMMANDS = (run,)
