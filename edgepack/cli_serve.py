"""`edgepack run`: run an artifact (natively or under qemu) or an ONNX file (onnxruntime) on files."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import click
import numpy as np

from .cli import cli
from .errors import UsageError


def _answer(model, result: dict) -> dict:
    out = {}
    if model.prepost.get("postprocess"):
        out["top"] = model.top(result)
    out["outputs"] = {k: {"dtype": str(v.dtype), "shape": list(v.shape),
                          "values": [None if isinstance(x, float) and not np.isfinite(x) else x
                                     for x in v.reshape(-1).tolist()]} for k, v in result.items()}
    return out


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


@cli.command(context_settings={"ignore_unknown_options": True})
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--input", "-i", "inputs", multiple=True, metavar="[NAME=]FILE",
              help="image (baked preprocessing), .npy, JSON tensor or CSV rows")
@click.option("--input-dir", type=click.Path(path_type=Path), help="every file in DIR; one JSON line each")
@click.option("--output", "-o", type=click.Path(path_type=Path), help="results file (.jsonl, or .csv for CSV in)")
@click.option("--threads", type=int, default=1, show_default=True)
def run(model, inputs, input_dir, output, threads):
    """Run MODEL (an artifact or an .onnx file) on input files and print JSON."""
    from . import sdk
    if not model.is_file():
        raise UsageError(f"{model}: no such file")
    if not inputs and not input_dir:
        raise UsageError("give --input FILE or --input-dir DIR")
    if model.read_bytes()[:4] == b"\x7fELF":
        from .runner import command_for
        art = sdk.ArtifactModel(model, threads=threads)
        args = ["run", "--threads", str(threads)]
        for i in inputs:
            args += ["--input", i]
        if input_dir:
            args += ["--input-dir", str(input_dir)]
        if output:
            args += ["--output", str(output)]
        proc = subprocess.run(art._cmd + args)
        if proc.returncode:
            raise SystemExit(proc.returncode)
        return
    m = sdk.load(model)
    out = open(output, "w") if output else sys.stdout
    try:
        if input_dir:
            for p in sorted(q for q in Path(input_dir).iterdir() if q.is_file() and not q.name.startswith(".")):
                try:
                    line = {"file": p.name, **_answer(m, m.predict(p))}
                except Exception as exc:  # one bad file is an error line, not a stop
                    line = {"file": p.name, "error": str(exc)}
                out.write(json.dumps(line) + "\n")
        elif len(inputs) == 1 and inputs[0].lower().endswith(".csv"):
            rows = _csv_rows(Path(inputs[0]))
            for r, row in enumerate(rows):
                out.write(json.dumps({"row": r, **_answer(m, m.predict(row))}) + "\n")
        else:
            feeds = {}
            for a in inputs:
                name, eq, f = a.partition("=")
                if not eq:
                    name, f = None, a
                if not Path(f).is_file():
                    raise UsageError(f"{f}: no such file")
                feeds[name] = f
            if list(feeds) == [None]:
                res = m.predict(feeds[None])
            else:
                res = m.predict({k: np.load(v, allow_pickle=False) for k, v in feeds.items()})
            out.write(json.dumps(_answer(m, res)) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
