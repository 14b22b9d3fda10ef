"""Find the ONNX nodes behind pnnx's leftovers, so a split can cut them out to TVM.

NCNN's op table accepts a graph, yet pnnx leaves layers ncnn cannot load (a `Tensor.to` from a
Cast to int, a `Tensor.reshape` or `Tensor.slice` across the batch axis) even after the ONNX
rewrites. pnnx renames every tensor, so its leftover layers do not name their ONNX nodes: each
candidate node (those of the ONNX op types a leftover can come from, or every node when the type
says nothing) is converted alone, with its static shapes, and the nodes that leave a layer ncnn
cannot load on their own are the ones to cut out. Bounded: at most MAX_PROBES conversions.

The conversion records what it left (``record``) so the split backend, which runs after NCNN
failed, knows without converting the whole graph again.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import onnx

from .cache import cache_root, sha256_bytes
from .model import LoadedModel, _value_specs

MAX_PROBES = 120
# pnnx layer type -> the ONNX ops it comes from (pnnx converts ONNX through torch-like operators)
SOURCES = {
    "Tensor.to": ("Cast",), "Tensor.reshape": ("Reshape", "Flatten", "Squeeze", "Unsqueeze"),
    "Tensor.view": ("Reshape", "Flatten", "Squeeze", "Unsqueeze"), "Tensor.slice": ("Slice", "Split", "Gather"),
    "Tensor.select": ("Gather", "Slice"), "torch.squeeze": ("Squeeze", "Reshape"),
    "torch.unsqueeze": ("Unsqueeze", "Reshape"), "Tensor.expand": ("Expand",), "torch.flatten": ("Flatten", "Reshape"),
    "torch.permute": ("Transpose",), "Tensor.permute": ("Transpose",), "torch.cat": ("Concat",),
    "Tensor.index": ("Gather",), "torch.gather": ("Gather",),
}


def _record_path(model_bytes: bytes) -> Path:
    return cache_root() / "ncnn-leftovers" / f"{sha256_bytes(model_bytes)[:24]}.json"


def record(model: LoadedModel, layers: list[tuple[str, str]]) -> None:
    """Called by the NCNN conversion when pnnx left ``layers`` (type, name) for this model."""
    path = _record_path(model.proto.SerializeToString())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"layers": [list(x) for x in layers]}))
    tmp.replace(path)


def recorded(model: LoadedModel) -> list[str] | None:
    """The leftover layer types NCNN's conversion recorded for this model, or None."""
    path = _record_path(model.proto.SerializeToString())
    try:
        return sorted({t for t, _ in json.loads(path.read_text())["layers"]})
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _candidates(proto: onnx.ModelProto, types: list[str]) -> list:
    ops: set[str] = set()
    present = {n.op_type.lower(): n.op_type for n in proto.graph.node}
    for t in types:
        if t in SOURCES:
            ops.update(SOURCES[t])
        elif t.split(".")[-1].lower() in present:  # pnnx kept the ONNX op as a layer (Gather, Pad)
            ops.add(present[t.split(".")[-1].lower()])
        else:
            return [n for n in proto.graph.node]  # a layer type we cannot trace: every node is a suspect
    return [n for n in proto.graph.node if n.op_type in ops]


def _alone(named: onnx.ModelProto, node, extractor) -> onnx.ModelProto | None:
    inits = {i.name for i in named.graph.initializer}
    ins = [x for x in node.input if x and x not in inits]
    try:
        return extractor.extract_model(ins, [o for o in node.output if o])
    except Exception:  # noqa: BLE001  a node the extractor cannot isolate is not a suspect we can test
        return None


def _leaves_leftover(sub: onnx.ModelProto, parent: LoadedModel, workdir: Path) -> bool:
    from .backends.ncnn.convert import _leftovers, _loads, _run_pnnx
    from .backends.ncnn.rewrite import rewrite_for_ncnn
    from .errors import EdgepackError
    inits = {i.name for i in sub.graph.initializer}
    inputs = _value_specs(sub.graph.input, inits)
    if any(not s.is_static for s in inputs):
        return False
    m = LoadedModel(parent.path, sub, inputs, _value_specs(sub.graph.output, set()), parent.opset, ())
    try:
        layers = _run_pnnx(m, sub, workdir, "0")
        if not (_leftovers(layers) or not _loads(workdir / "model.ncnn.param")):
            return False
        rewritten, applied = rewrite_for_ncnn(sub)  # what the conversion would retry with
        if applied:
            layers = _run_pnnx(m, rewritten, workdir, "0")
            return bool(_leftovers(layers)) or not _loads(workdir / "model.ncnn.param")
        return True
    except EdgepackError:
        return True  # pnnx cannot convert it alone either
    except Exception:  # noqa: BLE001  a probe must never turn into an internal error
        return False


def offending_nodes(model: LoadedModel, log=lambda m: None) -> dict[str, str] | None:
    """node name (as partition.plan names nodes) -> "tvm" for each node that leaves a layer ncnn
    cannot load; None when the conversion recorded no leftovers or no node shows it alone."""
    from .partition import _named
    types = recorded(model)
    if not types:
        return None
    named = _named(model.proto)
    suspects = _candidates(named, types)
    if not suspects or len(suspects) > MAX_PROBES:
        log(f"pnnx left {', '.join(types)}; {len(suspects)} candidate nodes, not probing")
        return None
    log(f"pnnx left {', '.join(types)}; converting {len(suspects)} candidate node(s) alone to find them")
    extractor = onnx.utils.Extractor(named)
    found = {}
    with tempfile.TemporaryDirectory(prefix="edgepack-probe-") as tmp:
        for k, node in enumerate(suspects):
            sub = _alone(named, node, extractor)
            wd = Path(tmp) / str(k)
            wd.mkdir()
            if sub is not None and _leaves_leftover(sub, model, wd):
                found[node.name] = "tvm"
    if found:
        log(f"cutting out to TVM: {', '.join(sorted(found))[:300]}")
    return found or None
