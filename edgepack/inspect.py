"""`edgepack inspect`: which backend supports each op, and the verdict per target."""
from __future__ import annotations

from pathlib import Path

from .backends import all_backends
from .model import fix_input_shapes, load_model, parse_shape_args, simplify
from .targets import TargetMatrix


def inspect_model(path: Path, shape_args: list[str]) -> dict:
    model = load_model(Path(path))
    model = simplify(fix_input_shapes(model, parse_shape_args(shape_args)))
    backends = all_backends()
    unsupported = {name: b.unsupported_ops(model) for name, b in backends.items()}
    ops = [{"op": op, "count": len(nodes),
            "support": {name: op not in unsupported[name] for name in backends}}
           for op, nodes in sorted(model.ops().items())]
    verdicts = {}
    for name in TargetMatrix.load().names():
        target = TargetMatrix.load().get(name)
        usable = [b for b in target.backends if b in backends and not unsupported[b]]
        verdicts[name] = (f"builds with {usable[0]}" if usable else
                          "no backend supports every op: " + ", ".join(
                              f"{b} lacks {', '.join(sorted(unsupported[b]))}" for b in target.backends if b in backends))
    return {"model": str(path), "backends": sorted(backends), "ops": ops, "targets": verdicts,
            "notes": list(model.notes)}
