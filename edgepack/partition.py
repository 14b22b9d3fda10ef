"""Plan segments of a prepared ONNX graph (static shapes, simplified) across backends.

Each node gets the first backend, in preference order (NCNN first: it is the fast one), that can
build its op; nodes are ordered topologically, preferring to continue the current backend, so
contiguous runs merge; each run becomes a segment cut out with onnx's own
``onnx.utils.Extractor``. A segment's inputs are the tensors that cross into it (model inputs or
earlier segments' outputs); its outputs are those a later segment or the model reads. Weights
(initializers) stay with the segment whose nodes read them.

Cost rule (keeps segments few): every cut costs a copy of the tensors crossing it and a second
engine's fixed overhead per run, and TVM untuned is slow mainly on heavy ops. So an NCNN run
with no heavy op (convolution, matrix product, recurrent cell) is handed to its TVM neighbour
when TVM supports all of it: it saves nothing worth a cut. A heavy NCNN run stays NCNN.

Constraints of the engines: an NCNN segment reads and writes float32 tensors only (its engine
takes float32); a segment that breaks this is moved to TVM when TVM can build it. A graph whose
nodes some backend cannot place at all has no plan (PlanError).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from .errors import UnsupportedOpError
from .model import LoadedModel, _value_specs
from .partition_lift import PIN

HEAVY_OPS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "Einsum", "LSTM", "GRU", "RNN"})
# what a segment's boundary tensors may be, per backend (None: any dtype)
BOUNDARY_DTYPES = {"ncnn": frozenset({onnx.TensorProto.FLOAT})}


class PlanError(UnsupportedOpError):
    """No partition of the graph over the available backends."""


@dataclass(frozen=True)
class Segment:
    backend: str
    nodes: tuple[str, ...]            # node names, in run order
    ops: tuple[str, ...]              # op types, sorted, unique
    inputs: tuple[str, ...]           # tensor names crossing into the segment
    outputs: tuple[str, ...]          # tensor names it hands on (to later segments or the model)
    model: onnx.ModelProto = field(repr=False, compare=False)

    def loaded(self, parent: LoadedModel, index: int) -> LoadedModel:
        """The segment as a LoadedModel the backends' compile() takes (static shapes)."""
        inits = {i.name for i in self.model.graph.initializer}
        path = parent.path.with_name(f"{parent.path.stem}.seg{index}-{self.backend}.onnx")
        return LoadedModel(path, self.model, _value_specs(self.model.graph.input, inits),
                           _value_specs(self.model.graph.output, set()), parent.opset,
                           (f"segment {index} of {parent.name} ({self.backend})",))

    def to_json(self) -> dict:
        return {"backend": self.backend, "ops": list(self.ops), "nodes": len(self.nodes),
                "inputs": list(self.inputs), "outputs": list(self.outputs)}


@dataclass(frozen=True)
class Plan:
    segments: tuple[Segment, ...]

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(s.backend for s in self.segments)

    @property
    def is_split(self) -> bool:
        return len({s.backend for s in self.segments}) > 1

    def to_json(self) -> list[dict]:
        return [s.to_json() for s in self.segments]

    def describe(self) -> str:
        return " -> ".join(f"{s.backend}[{','.join(s.ops)}]" for s in self.segments)


def _plan_rewrites(m: onnx.ModelProto) -> None:
    """Exact ONNX rewrites that replace an op NCNN lacks by ones it has, before the plan assigns
    backends (so that op does not force a cut): stack + ReduceMax -> Max (AttaCut); ReduceMax over
    trailing axes -> GlobalMaxPool (log-mel front ends, reduce_max.py); a batch-N text
    model lifted to batch 1 after its embedding lookups (DeepCut, partition_lift.py); N signal
    chunks lifted to batch 1 up to the LSTM that runs over them (Silero VAD's sequence model,
    partition_lift_signal.py)."""
    from .backends.ncnn.reduce_max import max_rewrites
    from .backends.ncnn.rewrite import remove_dead_nodes
    from .partition_lift import lift_batch
    from .partition_lift_signal import lift_signal
    for rewrite in (*max_rewrites(), lift_batch, lift_signal):
        try:
            if rewrite(m):
                remove_dead_nodes(m)
        except Exception:  # noqa: BLE001  a graph the rewrite mis-reads is planned as it is
            pass


def _named(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose nodes all have unique names (the plan refers to nodes by name) and whose
    Constant nodes are initializers (so constants never cross a cut), with value_info for every
    tensor (the extractor needs shapes at the cuts)."""
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    _plan_rewrites(m)
    g = m.graph
    seen: set[str] = set()
    keep = []
    for i, node in enumerate(g.node):
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.attribute) == 1 \
                and node.attribute[0].name == "value":
            t = onnx.TensorProto()
            t.CopyFrom(node.attribute[0].t)
            t.name = node.output[0]
            g.initializer.append(t)
            continue
        name = node.name or f"{node.op_type}_{i}"
        while name in seen:
            name = f"{name}_{i}"
        seen.add(name)
        node.name = name
        keep.append(node)
    del g.node[:]
    g.node.extend(keep)
    return onnx.shape_inference.infer_shapes(m, strict_mode=False)


def _order(nodes: list, assign: dict[str, str]) -> list:
    """Topological order that keeps the current backend as long as one of its nodes is ready
    (Kahn's algorithm; ties broken by the original position, so a one-backend graph keeps its order)."""
    producer = {o: i for i, n in enumerate(nodes) for o in n.output if o}
    deps = [{producer[x] for x in n.input if x in producer and producer[x] != i} for i, n in enumerate(nodes)]
    users: list[list[int]] = [[] for _ in nodes]
    for i, d in enumerate(deps):
        for j in d:
            users[j].append(i)
    waiting = [len(d) for d in deps]
    ready: dict[str, list[int]] = {}
    for i, w in enumerate(waiting):
        if w == 0:
            heapq.heappush(ready.setdefault(assign[nodes[i].name], []), i)
    out, current = [], None
    while len(out) < len(nodes):
        if current not in ready or not ready[current]:
            # the backend whose earliest ready node comes first
            current = min((q[0], b) for b, q in ready.items() if q)[1]
        i = heapq.heappop(ready[current])
        out.append(nodes[i])
        for u in users[i]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready.setdefault(assign[nodes[u].name], []), u)
    return out


def _runs(order: list, assign: dict[str, str]) -> list[tuple[str, list]]:
    runs: list[tuple[str, list]] = []
    for n in order:
        b = assign[n.name]
        if runs and runs[-1][0] == b and b != "loop":  # each Loop is a segment of its own (loops.py)
            runs[-1][1].append(n)
        else:
            runs.append((b, [n]))
    return runs


def _boundaries(runs, graph) -> list[tuple[list[str], list[str]]]:
    """(inputs, outputs) tensor names per run."""
    inits = {i.name for i in graph.initializer}
    model_out = [o.name for o in graph.output]
    produced_by: dict[str, int] = {}
    for k, (_, nodes) in enumerate(runs):
        for n in nodes:
            for o in n.output:
                if o:
                    produced_by[o] = k
    ins: list[list[str]] = [[] for _ in runs]
    outs: list[list[str]] = [[] for _ in runs]
    for k, (_, nodes) in enumerate(runs):
        for n in nodes:
            for x in n.input:
                if not x or x in inits or produced_by.get(x) == k or x in ins[k]:
                    continue
                ins[k].append(x)
                p = produced_by.get(x)
                if p is not None and x not in outs[p]:
                    outs[p].append(x)
    for name in model_out:
        p = produced_by.get(name)
        if p is not None and name not in outs[p]:
            outs[p].append(name)
    return list(zip(ins, outs))


def _dtype_of(graph) -> dict[str, int]:
    return {v.name: v.type.tensor_type.elem_type for v in list(graph.input) + list(graph.value_info)
            + list(graph.output)}


def plan(model: LoadedModel, supported: dict[str, callable], preference: tuple[str, ...] = ("ncnn", "tvm"),
         force: dict[str, str] | None = None) -> Plan:
    """``supported``: backend -> predicate on an op type; ``force``: node name -> backend."""
    proto = _named(model.proto)
    g = proto.graph
    nodes = list(g.node)
    backends = [b for b in preference if b in supported]
    assign: dict[str, str] = {}
    for n in nodes:
        op = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}"
        if force and n.name in force:
            assign[n.name] = force[n.name]
            continue
        if n.name.endswith(PIN) and "tvm" in backends:  # the lift's boundary nodes (partition_lift.py)
            assign[n.name] = "tvm"
            continue
        b = next((b for b in backends if supported[b](op)), None)
        if b is None:
            raise PlanError(f"{model.path.name}: no backend builds op {op} (node {n.name})",
                            hint="see `edgepack inspect MODEL` for op support per backend")
        assign[n.name] = b

    def can(b: str, run_nodes) -> bool:
        return b in supported and all(supported[b](x.op_type) for x in run_nodes)

    dtypes = _dtype_of(g)
    # bounded: every pass moves at least one node to a later-preferred backend, or stops
    for _ in range(len(nodes) * len(backends) + 1):
        runs = _runs(_order(nodes, assign), assign)
        bounds = _boundaries(runs, g)
        moved = False
        for k, (b, run_nodes) in enumerate(runs):
            others = [runs[j][0] for j in (k - 1, k + 1) if 0 <= j < len(runs)]
            ok = BOUNDARY_DTYPES.get(b)
            bad_io = ok is not None and any(dtypes.get(t, onnx.TensorProto.FLOAT) not in ok
                                            for t in bounds[k][0] + bounds[k][1])
            light = b == "ncnn" and len(runs) > 1 and not any(n.op_type in HEAVY_OPS for n in run_nodes)
            if not (bad_io or light):
                continue
            if bad_io and not light:
                # only the nodes at the non-float crossings move (an int64 token-id Gather in front of
                # convolutions); moving the whole run would put the heavy ops on TVM
                bad = {t for t in bounds[k][0] + bounds[k][1] if dtypes.get(t, onnx.TensorProto.FLOAT) not in ok}
                edge = [n for n in run_nodes if bad & (set(n.input) | set(n.output))]
                alt = next((o for o in backends if o != b and can(o, edge)), None)
                if edge and len(edge) < len(run_nodes) and alt is not None:
                    for n in edge:
                        assign[n.name] = alt
                    moved = True
                    break
            target = next((o for o in others if o != b and can(o, run_nodes)), None)
            if target is None:
                target = next((o for o in backends if o != b and can(o, run_nodes)), None)
            if target is None:
                if bad_io:
                    raise PlanError(f"{model.path.name}: segment of {', '.join(sorted({x.op_type for x in run_nodes}))}"
                                    f" on {b} would exchange non-float32 tensors and no other backend builds it")
                continue
            for n in run_nodes:
                assign[n.name] = target
            moved = True
            break
        if not moved:
            break
    runs = _runs(_order(nodes, assign), assign)
    bounds = _boundaries(runs, g)
    extractor = onnx.utils.Extractor(proto)
    segments = []
    for (b, run_nodes), (ins, outs) in zip(runs, bounds):
        sub = extractor.extract_model(ins, outs)
        segments.append(Segment(b, tuple(n.name for n in run_nodes), tuple(sorted({n.op_type for n in run_nodes})),
                                tuple(ins), tuple(outs), sub))
    return Plan(tuple(segments))


def backend_predicates(model: LoadedModel, names: tuple[str, ...]) -> dict[str, callable]:
    """backend -> op predicate, from each registered, installed backend's unsupported_ops."""
    from .backends import all_backends
    registered = all_backends()
    out = {}
    for name in names:
        b = registered.get(name)
        if b is None or b.missing_tools():
            continue
        bad = set(b.unsupported_ops(model))
        out[name] = (lambda bad_ops: (lambda op: op not in bad_ops))(bad)
    return out


def save_segments(p: Plan, folder: Path) -> list[Path]:
    """Each segment as an .onnx file (for reports and debugging)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, s in enumerate(p.segments):
        path = folder / f"seg{k}-{s.backend}.onnx"
        onnx.save(s.model, str(path))
        paths.append(path)
    return paths

