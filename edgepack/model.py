"""Stages 1–2: load & check the ONNX model, fix symbolic input dims, simplify with onnxsim."""
from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .errors import ModelError, UnsupportedOpError, UsageError

_ONNX_TO_NP = {
    onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16", onnx.TensorProto.DOUBLE: "float64",
    onnx.TensorProto.INT8: "int8", onnx.TensorProto.UINT8: "uint8", onnx.TensorProto.INT16: "int16",
    onnx.TensorProto.INT32: "int32", onnx.TensorProto.INT64: "int64", onnx.TensorProto.BOOL: "bool",
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple          # ints, or strings for symbolic dims
    dtype: str            # numpy dtype name
    # (axis, tensor): the model cuts this output along axis to the length that tensor holds at run
    # time; shape is then the largest (edgepack/loops.py trim_outputs)
    trim: tuple = ()

    @property
    def is_static(self) -> bool:
        return all(isinstance(d, int) and d > 0 for d in self.shape)

    def to_json(self) -> dict:
        out = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}
        if self.trim:
            out["cut_to_length"] = {"axis": self.trim[0], "length_of": self.trim[1]}
        return out


@dataclass(frozen=True)
class LoadedModel:
    path: Path
    proto: onnx.ModelProto = field(repr=False, compare=False)
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    opset: int
    notes: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.path.stem

    def ops(self) -> dict[str, list[str]]:
        """op_type (with domain prefix when not the default) -> node names, over all subgraphs."""
        found: dict[str, list[str]] = {}

        def walk(graph):
            for i, node in enumerate(graph.node):
                op = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
                found.setdefault(op, []).append(node.name or f"{node.op_type}_{i}")
                for attr in node.attribute:
                    if attr.g is not None and attr.type == onnx.AttributeProto.GRAPH:
                        walk(attr.g)
                    for g in attr.graphs:
                        walk(g)
        walk(self.proto.graph)
        return found


def _value_specs(values, initializer_names: set[str]) -> tuple[TensorSpec, ...]:
    specs = []
    for v in values:
        if v.name in initializer_names:
            continue
        tt = v.type.tensor_type
        dtype = _ONNX_TO_NP.get(tt.elem_type)
        if dtype is None:
            raise ModelError(f"input/output {v.name!r} has an unsupported element type "
                             f"{onnx.TensorProto.DataType.Name(tt.elem_type)}")
        dims = []
        for i, d in enumerate(tt.shape.dim):
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(int(d.dim_value))
            else:
                dims.append(d.dim_param or f"?{i}")
        specs.append(TensorSpec(v.name, tuple(dims), dtype))
    return tuple(specs)


# protobuf cannot parse or write a message above 2 GiB; bigger models keep weights as external data
_PROTOBUF_LIMIT = (2 << 30) - 1
# domains whose ops onnxruntime (the reference) implements
_KNOWN_DOMAINS = {"", "ai.onnx", "ai.onnx.ml", "com.microsoft", "ai.onnx.preview.training", "ai.onnx.preview"}


def load_model(path: Path) -> LoadedModel:
    """Read and check an ONNX file (external data next to it is loaded too)."""
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"{path}: no such file")
    try:
        path.name.encode("utf-8")
    except UnicodeEncodeError:  # the artifact, its C spec and JSON are named after the model
        raise ModelError(f"{ascii(str(path))}: the file name is not valid UTF-8",
                         hint="rename the model file (letters, digits, '-', '_')") from None
    size = path.stat().st_size
    if size > _PROTOBUF_LIMIT:
        raise ModelError(f"{path}: {size / 2**30:.1f} GiB in one file; an ONNX file holds at most 2 GiB",
                         hint="save the weights as external data: onnx.save(model, path, "
                              "save_as_external_data=True)")
    head = path.read_bytes()[:64]
    if not head:
        raise ModelError(f"{path}: file is empty")
    try:
        proto = onnx.load(str(path), load_external_data=True)
    except FileNotFoundError as exc:
        raise ModelError(f"{path}: external data file missing: {exc.filename}",
                         hint="keep the .data file next to the .onnx file") from exc
    except Exception as exc:  # protobuf raises DecodeError and friends
        raise ModelError(f"{path}: not a readable ONNX model ({type(exc).__name__}: {str(exc)[:160]})",
                         hint="the file is truncated or not ONNX; re-export it") from exc
    if not proto.graph.node:
        raise ModelError(f"{path}: not an ONNX model (the graph has no nodes)",
                         hint="the file is truncated or not ONNX; re-export it")
    if not proto.graph.output:
        raise ModelError(f"{path}: the graph has no outputs, so there is nothing to compute",
                         hint="re-export the model with its outputs listed")
    if proto.ByteSize() > _PROTOBUF_LIMIT:
        raise ModelError(f"{path}: the model with its external data is {proto.ByteSize() / 2**30:.1f} GiB; "
                         f"edgepack builds models up to 2 GiB")
    _check_opsets(proto, path)
    _check_names(proto, path)
    try:
        onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0][:200]
        raise ModelError(f"{path}: invalid ONNX model: {first}", hint="re-export the model") from exc
    try:
        proto = onnx.shape_inference.infer_shapes(proto)
    except Exception as exc:
        raise ModelError(f"{path}: shape inference failed: {str(exc).strip().splitlines()[0][:200]}") from exc
    inits = {i.name for i in proto.graph.initializer}
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    return LoadedModel(path, proto, _value_specs(proto.graph.input, inits), _value_specs(proto.graph.output, set()),
                       opset)


def _check_names(proto: onnx.ModelProto, path: Path) -> None:
    """protobuf hands back a name that is not valid UTF-8 as bytes, which breaks everything after."""
    def bad(graph):
        for v in list(graph.input) + list(graph.output) + list(graph.value_info) + list(graph.initializer):
            if not isinstance(v.name, str):
                return "tensor", v.name
        for node in graph.node:
            for n in [node.name, node.op_type, node.domain, *node.input, *node.output]:
                if not isinstance(n, str):
                    return f"node {node.op_type!r}" if isinstance(node.op_type, str) else "node", n
            for attr in node.attribute:
                if not isinstance(attr.name, str):
                    return "attribute", attr.name
                for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                    found = bad(g)
                    if found:
                        return found
        return None
    found = bad(proto.graph)
    if found:
        raise ModelError(f"{path}: a {found[0]} name is not valid UTF-8 ({found[1]!r}); ONNX names are UTF-8 text",
                         hint="re-export the model with UTF-8 names")


def _check_opsets(proto: onnx.ModelProto, path: Path) -> None:
    newest = onnx.defs.onnx_opset_version()
    for o in proto.opset_import:
        if o.domain in ("", "ai.onnx") and not 1 <= o.version <= newest:
            raise ModelError(f"{path}: opset {o.version} of the default ONNX domain does not exist "
                             f"(onnx {onnx.__version__} knows opsets 1..{newest})",
                             hint=f"re-export the model with opset {min(newest, 21)} or lower")
    found = {}

    def walk(graph):
        for node in graph.node:
            if node.domain not in _KNOWN_DOMAINS:
                found.setdefault((node.domain, node.op_type), node.name or node.op_type)
            for attr in node.attribute:
                for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                    walk(g)
    walk(proto.graph)
    local = {f.domain for f in proto.functions}  # model-local functions define their own domains
    found = {k: v for k, v in found.items() if k[0] not in local}
    if found:
        (domain, op), node = next(iter(sorted(found.items())))
        more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
        raise UnsupportedOpError(f"{path}: node {node} uses op {op} of domain {domain!r}{more}, a custom op that "
                                 f"neither onnxruntime (the reference) nor any edgepack backend implements",
                                 hint="see `edgepack inspect MODEL` for op support per backend; replace the "
                                      "custom op with standard ONNX ops when exporting")


_SHAPE_RE = re.compile(r"^(?P<name>[^=]+)=(?P<dims>\d+(?:[x,]\d+)*)$")


def parse_shape_args(args: list[str]) -> dict[str, tuple[int, ...]]:
    """``NAME=1x3x224x224`` (or ``1,3,224,224``) per input."""
    shapes = {}
    for a in args:
        m = _SHAPE_RE.match(a.strip())
        if not m:
            raise UsageError(f"bad --input-shape {a!r}", hint="write NAME=1x3x224x224")
        shapes[m["name"]] = tuple(int(d) for d in re.split(r"[x,]", m["dims"]))
    return shapes


def fix_input_shapes(model: LoadedModel, shapes: dict[str, tuple[int, ...]]) -> LoadedModel:
    """Make every input static: user shapes first; a lone symbolic batch dim defaults to 1."""
    names = {i.name for i in model.inputs}
    unknown = set(shapes) - names
    if unknown:
        raise UsageError(f"--input-shape names unknown input(s) {sorted(unknown)}",
                         hint=f"the model's inputs are {sorted(names)}")
    new_specs, notes = [], list(model.notes)
    for spec in model.inputs:
        if spec.name in shapes:
            want = shapes[spec.name]
            if len(want) != len(spec.shape):
                raise UsageError(f"--input-shape {spec.name}: {len(want)} dims given, the model has "
                                 f"{len(spec.shape)} ({_fmt(spec.shape)})")
            for have, w in zip(spec.shape, want):
                if isinstance(have, int) and have != w:
                    raise UsageError(f"--input-shape {spec.name}: {_fmt(want)} contradicts the model's "
                                     f"fixed shape {_fmt(spec.shape)}")
            new_specs.append(TensorSpec(spec.name, tuple(want), spec.dtype))
            continue
        symbolic = [i for i, d in enumerate(spec.shape) if not isinstance(d, int)]
        if not symbolic:
            new_specs.append(spec)
        elif symbolic == [0]:
            notes.append(f"input {spec.name}: symbolic batch dim {spec.shape[0]!r} fixed to 1")
            new_specs.append(TensorSpec(spec.name, (1,) + tuple(spec.shape[1:]), spec.dtype))
        else:
            dims = ", ".join(str(spec.shape[i]) for i in symbolic)
            raise UsageError(f"input {spec.name} has symbolic dims ({dims}) in shape {_fmt(spec.shape)}",
                             hint=f"state them: --input-shape {spec.name}="
                                  + "x".join(str(d) if isinstance(d, int) else "N" for d in spec.shape))
    if tuple(new_specs) == model.inputs:
        return model
    proto = onnx.ModelProto()
    proto.CopyFrom(model.proto)
    by_name = {s.name: s for s in new_specs}
    for v in proto.graph.input:
        if v.name in by_name:
            dims = v.type.tensor_type.shape.dim
            for d, n in zip(dims, by_name[v.name].shape):
                d.Clear()
                d.dim_value = n
    # Outputs' symbolic dims (and dims written as -1, as PaddlePaddle exports do) are recomputed
    # by shape inference.
    for v in proto.graph.output:
        for d in v.type.tensor_type.shape.dim:
            if not (d.HasField("dim_value") and d.dim_value > 0):
                d.Clear()
    for v in list(proto.graph.value_info):
        proto.graph.value_info.remove(v)
    try:
        proto = onnx.shape_inference.infer_shapes(proto, strict_mode=False)
    except Exception as exc:
        raise ModelError(f"{model.path}: shape inference with the fixed input shapes failed: {exc}") from exc
    inits = {i.name for i in proto.graph.initializer}
    return LoadedModel(model.path, proto, _value_specs(proto.graph.input, inits),
                       _value_specs(proto.graph.output, set()), model.opset, tuple(notes))


def resolve_output_shapes(model: LoadedModel, outputs: dict[str, np.ndarray]) -> LoadedModel:
    """Output shapes from onnxruntime's answer for the (static) inputs: dims that shape inference
    left symbolic or -1 become concrete, since the artifact allocates its outputs up front."""
    specs, changed = [], False
    for spec in model.outputs:
        arr = outputs.get(spec.name)
        if arr is None or spec.trim or spec.is_static and tuple(spec.shape) == tuple(arr.shape):
            specs.append(spec)
            continue
        specs.append(TensorSpec(spec.name, tuple(int(d) for d in arr.shape), spec.dtype))
        changed = True
    if not changed:
        return model
    proto = onnx.ModelProto()
    proto.CopyFrom(model.proto)
    by_name = {s.name: s for s in specs}
    for v in proto.graph.output:
        if v.name not in by_name:  # a trimmed output's length (loops.trim_outputs)
            continue
        shape = v.type.tensor_type.shape
        shape.ClearField("dim")
        for n in by_name[v.name].shape:
            shape.dim.add().dim_value = n
    return LoadedModel(model.path, proto, model.inputs, tuple(specs), model.opset, model.notes)


_STDOUT_LOCK = threading.Lock()


@contextlib.contextmanager
def _stdout_to_stderr():
    """onnxsim's C++ core prints its warnings on file descriptor 1 ("the simplification stopped because
    of timeout", SLANet-plus), which would corrupt `build --json`: stdout is the JSON's alone."""
    with _STDOUT_LOCK:
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            os.dup2(2, 1)
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def simplify(model: LoadedModel) -> LoadedModel:
    """onnxsim with the static shapes; if onnxsim itself fails, keep the graph and say so."""
    with _stdout_to_stderr():
        return _simplify(model)


def _simplify(model: LoadedModel) -> LoadedModel:
    import onnxsim
    try:
        simplified, ok = onnxsim.simplify(model.proto)
        # onnxsim's optimizer fuses attention into onnxruntime-only contrib ops (com.microsoft.
        # Attention) that no edge backend has: then keep to folding and shape inference.
        new_domains = _domains(simplified) - _domains(model.proto)
        extra = ""
        if new_domains:
            simplified, ok = onnxsim.simplify(model.proto, perform_optimization=False)
            extra = f" (optimizer passes off: they introduced {', '.join(sorted(new_domains))} ops)"
    except Exception as exc:  # onnxsim raises plain RuntimeError/ValueError/... from C++
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        return _with(model, model.proto, f"onnxsim failed ({reason}); using the unsimplified graph")
    if not ok:
        return _with(model, model.proto, "onnxsim could not validate its result; using the unsimplified graph")
    before, after = len(model.proto.graph.node), len(simplified.graph.node)
    return _with(model, simplified, f"onnxsim: {before} -> {after} nodes{extra}")


def _domains(proto) -> set[str]:
    return {n.domain for n in proto.graph.node if n.domain not in ("", "ai.onnx")}


def _with(model: LoadedModel, proto, note: str) -> LoadedModel:
    inits = {i.name for i in proto.graph.initializer}
    outputs = _value_specs(proto.graph.output, set())
    return LoadedModel(model.path, proto, _value_specs(proto.graph.input, inits), outputs, model.opset,
                       model.notes + (note,))


def _fmt(shape) -> str:
    return "x".join(str(d) for d in shape)


def model_bytes(model: LoadedModel) -> bytes:
    return model.proto.SerializeToString()
