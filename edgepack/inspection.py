"""`edgepack inspect`: a model's inputs, outputs and ops x backends with the verdict per target, or,
for an artifact, what its manifest says (named ``inspection`` so it does not shadow the standard
``inspect`` module)."""
from __future__ import annotations

import json
from pathlib import Path

from .errors import ArtifactError

from .backends import all_backends
from .model import fix_input_shapes, load_model, parse_shape_args
from .loops import loops_supported
from .pipeline import lowered_for_backends, prepared_loops
from .targets import TargetMatrix


def is_artifact(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def inspect_artifact_manifest(path: Path) -> dict:
    """The manifest an artifact carries (its `info`, run here or under qemu)."""
    from .runner import run_artifact
    proc = run_artifact(Path(path), ["info", "--json"], timeout=120)
    try:
        manifest = json.loads(proc.stdout)
    except ValueError:
        raise ArtifactError(f"{path} is an executable but not an edgepack artifact (its `info` printed no manifest)",
                            hint="inspect takes an .onnx model or an artifact from dist/") from None
    return manifest


def inspect_model(path: Path, shape_args: list[str]) -> dict:
    model = load_model(Path(path))
    model = lowered_for_backends(fix_input_shapes(model, parse_shape_args(shape_args)))  # as a build prepares it
    model = prepared_loops(model)
    backends = all_backends()
    unsupported = {name: b.unsupported_ops(model) for name, b in backends.items()}
    ops = [{"op": op, "count": len(nodes),
            "support": {name: op not in unsupported[name] for name in backends}}
           for op, nodes in sorted(model.ops().items())]
    # the NCNN/TVM split `--backend auto` tries when NCNN cannot take every op (partition.py)
    from .partition import PlanError, plan
    split = None
    preds = {b: (lambda bad: (lambda op: op not in bad))(set(unsupported[b])) for b in ("ncnn", "tvm") if b in backends}
    if len(preds) == 2 and loops_supported(model.proto):  # each Loop a segment the runtime steps
        preds["loop"] = lambda op: op == "Loop"
    if len(preds) >= 2 and unsupported["ncnn"]:
        try:
            p = plan(model, preds, tuple(preds))
            split = p if p.is_split or "loop" in p.backends else None
        except PlanError:
            split = None
    verdicts = {}
    for name in TargetMatrix.load().names():
        target = TargetMatrix.load().get(name)
        usable = [b for b in target.backends if b in backends and not unsupported[b]]
        splits = split is not None and {"ncnn", "tvm"} <= set(target.backends) and "ncnn" not in usable[:1]
        verdicts[name] = (f"builds partitioned: {split.describe()}" if splits else
                          f"builds with {usable[0]}" if usable else
                          "no backend supports every op: " + ", ".join(
                              f"{b} lacks {', '.join(sorted(unsupported[b]))}" for b in target.backends if b in backends))
    return {"model": str(path), "inputs": [s.to_json() for s in model.inputs],
            "outputs": [s.to_json() for s in model.outputs], "backends": sorted(backends), "ops": ops,
            "targets": verdicts, "notes": list(model.notes),
            "plan": split.to_json() if split is not None else None}
