"""ONNX Loops that decide on data, run by the artifact's runtime: the body is compiled as a model of its
own and the loop segment (runtimes/common/ep_engine_loop.c) steps it while the condition holds.

Neither backend takes Loop (ncnn has no layer; TVM 0.27's relax importer has no converter), and an
autoregressive decoder cannot be unrolled: it stops when it emits its end token (SLANet-plus's table
decoder: up to 501 steps, 7 to 160 on real pages). The partition plan (partition.py) gives each Loop
node a segment of backend "loop"; its body becomes a model whose inputs are the iteration number, the
condition and the carried values, and whose outputs are the next condition and the carried values that
change. A carried value the body passes through unchanged is an invariant: a constant one (the
decoder's weights) becomes a weight of the body, a computed one (the encoder's features) is read from
its slot at every step without a copy.

What qualifies (``unsupported_reason``): no scan outputs, no reads of outer values from the body other
than constants, no loop inside the body, and carried values of one size at every step (the body's
static shapes: a loop that grows a tensor by concatenation has none). The rest stays refused by name.

The data-dependent length of the decoder's outputs (a Slice up to the step count, after the loop) is
cut_outputs.py's; fixed-length slices of a computed start inside the body are loop_lengths.py's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .model import LoadedModel, _value_specs



# ---- what qualifies ----------------------------------------------------------------------------------

def _outer_reads(graph: onnx.GraphProto) -> set[str]:
    """Names a (sub)graph reads that it does not define itself, nested subgraphs included."""
    local = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    reads: set[str] = set()
    for n in graph.node:
        for x in n.input:
            if x and x not in local:
                reads.add(x)
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                reads |= _outer_reads(a.g) - local
        local |= set(n.output)
    return reads


def _ops(graph: onnx.GraphProto) -> set[str]:
    ops = set()
    for n in graph.node:
        ops.add(n.op_type)
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                ops |= _ops(a.g)
    return ops


def unsupported_reason(node: onnx.NodeProto, outer_constants: set[str]) -> str | None:
    """Why the runtime cannot step this Loop, or None when it can."""
    body = next((a.g for a in node.attribute if a.name == "body"), None)
    if body is None:
        return "it has no body"
    n_carried = len(body.input) - 2
    if n_carried < 0 or len(body.output) != n_carried + 1:
        return "it has scan outputs (values stacked over the steps)"
    if {"Loop", "Scan"} & _ops(body):
        return "its body holds another loop"
    computed = _outer_reads(body) - outer_constants
    if computed:
        return f"its body reads {sorted(computed)[0]!r} from outside it"
    return None


def loops_supported(model: onnx.ModelProto) -> bool:
    """Every Loop of the main graph qualifies (and there is one)."""
    return any(n.op_type == "Loop" for n in model.graph.node) and loop_refusal(model) is None


def loop_refusal(model: onnx.ModelProto) -> str | None:
    """Why the runtime cannot step the first Loop it cannot (naming the node), or None."""
    from .onnx_index import constants
    consts = set(constants(model))
    for n in model.graph.node:
        if n.op_type == "Loop" and (why := unsupported_reason(n, consts)):
            return f"Loop {n.name or n.output[0]!r}: {why}"
    return None


# ---- the body as a model --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Source:
    """Where a value the loop reads comes from: input ``index`` of the loop segment, or constant bytes."""
    input_index: int | None = None
    constant: np.ndarray | None = None

    def option(self, blobs: list[np.ndarray]) -> str:
        if self.input_index is not None:
            return f"i{self.input_index}"
        if self.constant is None:  # a value nothing reads: its first value does not matter
            return "none"
        blobs.append(self.constant)
        return f"b{len(blobs) - 1}"


@dataclass(frozen=True)
class LoopBody:
    model: LoadedModel                 # inputs: iteration, condition, carried; outputs: condition, changed values
    max_steps: Source | None           # None: no trip count (the condition alone stops it)
    condition: Source | None           # None: true
    sources: tuple[Source, ...]        # per body input from the third on: its first (or only) value
    next_output: tuple[int, ...]       # per body input from the third on: the body output replacing it, -1 none
    results: tuple[int, ...]           # per loop segment output: the body input whose last value it is

    def options(self) -> tuple[dict[str, str], list[np.ndarray]]:
        """The loop engine's wiring (ep_engine_loop.c) and the constant values it reads from blobs."""
        from .loop_lengths import GUARD
        blobs: list[np.ndarray] = []
        opts = {"loop.max": self.max_steps.option(blobs) if self.max_steps else "none",
                "loop.cond": self.condition.option(blobs) if self.condition else "none"}
        names = [o.name for o in self.model.outputs]
        if GUARD in names:  # the fixed lengths the body was compiled for (loop_lengths.py)
            opts["loop.guard"] = str(names.index(GUARD))
        for j, (src, nxt) in enumerate(zip(self.sources, self.next_output), start=2):
            opts[f"loop.in.{j}"] = src.option(blobs)
            if nxt >= 0:
                opts[f"loop.next.{j}"] = str(nxt)
        for r, j in enumerate(self.results):
            opts[f"loop.out.{r}"] = str(j)
        return opts, blobs


def _shape_of(info: onnx.ValueInfoProto) -> tuple | None:
    dims = info.type.tensor_type.shape.dim
    if not info.type.tensor_type.HasField("shape") or any(not d.HasField("dim_value") for d in dims):
        return None
    return tuple(int(d.dim_value) for d in dims)


def set_static_shape(info: onnx.ValueInfoProto, shape: tuple) -> None:
    t = info.type.tensor_type
    t.ClearField("shape")
    t.shape.SetInParent()
    for d in shape:
        t.shape.dim.add().dim_value = int(d)


@dataclass(frozen=True)
class _Body:
    model: LoadedModel
    kept: tuple[int, ...]        # carried indices that are body inputs (the others became its weights)
    varying: tuple[int, ...]     # carried indices the body changes (its outputs from the second on)
    unread: frozenset            # carried indices whose body input nothing reads (only the last value counts)
    guaranteed: bool             # the body runs at least once whatever the input


def _parts(loop: onnx.NodeProto) -> tuple[onnx.GraphProto, list[str]]:
    """The Loop's body, and its inputs with the absent trailing ones as "" (one per body input)."""
    body = next(a.g for a in loop.attribute if a.name == "body")
    return body, list(loop.input) + [""] * (len(body.input) - len(loop.input))


def _static_shapes(model: onnx.ModelProto, consts: dict):
    """name -> its static shape (a constant's, or the inferred one); ValueError where there is none."""
    from .onnx_index import tensor_infos
    infos = tensor_infos(model)

    def shape(name: str) -> tuple:
        if name in consts:
            return tuple(consts[name].shape)
        info = infos.get(name)
        if info is None or info.static is None:
            raise ValueError(f"the loop's input {name!r} has no static shape")
        return info.static
    return shape


def _guaranteed_step(loop: onnx.NodeProto, consts: dict) -> bool:
    """The loop runs its body at least once whatever the input: trip count and condition constant (or absent)."""
    m = loop.input[0] if len(loop.input) > 0 else ""
    c = loop.input[1] if len(loop.input) > 1 else ""
    m_ok = not m or m in consts and int(np.asarray(consts[m]).reshape(-1)[0]) >= 1
    c_ok = not c or c in consts and bool(np.asarray(consts[c]).reshape(-1)[0])
    return m_ok and c_ok


def _body(loop: onnx.NodeProto, outer: onnx.ModelProto, consts: dict, outer_shape, read_after: set[str],
          path: Path, opset: int) -> _Body:
    """The body of ``loop`` as a model with static shapes. ``outer_shape(name)``: the static shape of a
    value the loop reads; ``read_after``: the loop outputs something after the loop reads."""
    why = unsupported_reason(loop, set(consts))
    if why:
        raise ValueError(why)
    body_in, loop_in = _parts(loop)
    carried = list(body_in.input[2:])
    invariant = [body_in.output[1 + c].name == carried[c].name for c in range(len(carried))]
    reads = _outer_reads(body_in) | {x for n in body_in.node for x in n.input}
    unread = frozenset(c for c in range(len(carried)) if carried[c].name not in reads and not invariant[c])
    # constant invariants become weights of the body (unless something after the loop reads their last value)
    folded = [invariant[c] and loop_in[2 + c] in consts and loop.output[c] not in read_after
              for c in range(len(carried))]
    m = onnx.ModelProto()
    m.CopyFrom(outer)
    bg = m.graph
    for field in ("node", "input", "output", "initializer", "value_info"):
        bg.ClearField(field)
    bg.name = "loop_body"
    bg.node.extend(body_in.node)
    bg.initializer.extend(body_in.initializer)
    for name in sorted(_outer_reads(body_in)):  # constants of the outer graph the body reads by name
        bg.initializer.append(numpy_helper.from_array(np.ascontiguousarray(consts[name]), name))
    iteration, condition = onnx.ValueInfoProto(), onnx.ValueInfoProto()
    iteration.CopyFrom(body_in.input[0])
    condition.CopyFrom(body_in.input[1])
    # ONNX lets a body declare them as scalars or one-element vectors; onnxruntime feeds the declared rank
    set_static_shape(iteration, (1,) * min(1, len(iteration.type.tensor_type.shape.dim)))
    iteration.type.tensor_type.elem_type = onnx.TensorProto.INT64
    set_static_shape(condition, (1,) * min(1, len(condition.type.tensor_type.shape.dim)))
    condition.type.tensor_type.elem_type = onnx.TensorProto.BOOL
    bg.input.extend([iteration, condition])
    kept = []
    for c, info in enumerate(carried):
        if folded[c]:
            bg.initializer.append(numpy_helper.from_array(np.ascontiguousarray(consts[loop_in[2 + c]]), info.name))
            continue
        v = onnx.ValueInfoProto()
        v.CopyFrom(info)
        set_static_shape(v, outer_shape(loop_in[2 + c]))
        bg.input.append(v)
        kept.append(c)
    varying = [c for c in kept if not invariant[c]]
    bg.output.append(body_in.output[0])
    bg.output.extend(body_in.output[1 + c] for c in varying)
    guaranteed = _guaranteed_step(loop, consts)
    model = _static_body(LoadedModel(path, m, _value_specs(bg.input, set()), (), opset, ()), varying, carried,
                         unread, guaranteed)
    return _Body(model, tuple(kept), tuple(varying), unread, guaranteed)


def extract_body(segment: LoadedModel) -> LoopBody:
    """The one Loop node of ``segment`` (a loop segment cut out by the plan) as a body model with static
    shapes, and the wiring of its values. Raises ValueError when the body does not qualify."""
    from .onnx_index import constants
    loop = next(n for n in segment.proto.graph.node if n.op_type == "Loop")
    consts = constants(segment.proto)
    outer_shape = _static_shapes(segment.proto, consts)
    seg_inputs = [s.name for s in segment.inputs]

    def source(name: str) -> Source | None:
        if not name:
            return None
        if name in consts:
            return Source(constant=np.ascontiguousarray(consts[name]))
        return Source(input_index=seg_inputs.index(name))

    read_after = {o.name for o in segment.proto.graph.output}
    b = _body(loop, segment.proto, consts, outer_shape, read_after,
              segment.path.with_name(f"{segment.path.stem}.body.onnx"), segment.opset)
    loop_in = _parts(loop)[1]
    by_body_out = {c: 1 + b.varying.index(c) for c in b.varying}
    # a value the body never reads needs no first value where the loop surely runs once; else (no step
    # at all) its first value is the loop's answer
    sources = tuple(Source() if c in b.unread and b.guaranteed else source(loop_in[2 + c]) for c in b.kept)
    nexts = tuple(by_body_out.get(c, -1) for c in b.kept)
    results = []
    for o in segment.outputs:
        c = list(loop.output).index(o.name)
        results.append(2 + b.kept.index(c))
    return LoopBody(b.model, source(loop_in[0]), source(loop_in[1]), sources, nexts, tuple(results))


def _static_body(body: LoadedModel, varying: list[int], carried: list, unread: frozenset,
                 guaranteed: bool) -> LoadedModel:
    """The body simplified with its static input shapes. Each value it changes keeps its size from one
    step to the next (a one-element value may change rank: bodies return [1] for a [] input); one it
    never reads takes the shape the body gives it, where the body surely runs (else the loop's result
    would have the first value's shape when it does not)."""
    from .control_flow import lower_if
    from .loop_lengths import specialise_lengths
    from .model import _with, simplify
    simplified = simplify(lower_if(simplify(body)))  # the body's Ifs as Where, as the main graph's
    proto, rewritten = specialise_lengths(simplified.proto)
    if rewritten:  # the shapes those fixed lengths decided fold now
        simplified = simplify(_with(body, proto, f"{rewritten} computed-start slices of fixed length"))
    proto = onnx.shape_inference.infer_shapes(simplified.proto, strict_mode=False)
    ins = {i.name: i for i in proto.graph.input}
    for k, c in enumerate(varying):
        shape = _shape_of(proto.graph.output[1 + k])
        want = _shape_of(ins[carried[c].name])
        if shape is not None and c in unread and guaranteed:
            set_static_shape(ins[carried[c].name], shape)
            continue
        if shape is None or want is None or int(np.prod(shape)) != int(np.prod(want)):
            raise ValueError(f"the loop's carried value {carried[c].name!r} changes size from step to step "
                             f"({want} -> {shape})")
    cond = _shape_of(proto.graph.output[0])
    if cond is None or int(np.prod(cond)) != 1:
        raise ValueError("the loop's condition is not one value")
    inits = {i.name for i in proto.graph.initializer}
    model = _with(body, proto, "loop body: static shapes")
    return replace(model, inputs=_value_specs(proto.graph.input, inits), outputs=_value_specs(proto.graph.output, set()))


def explicit_conditions(model: LoadedModel) -> LoadedModel:
    """Each Loop with a trip count but no condition input given a constant true one. ONNX then ignores
    the body's condition and onnxsim unrolls such a loop over its whole trip count; onnxruntime, the
    reference every build is checked against, stops where the body's condition says (and so does the loop
    engine). With the condition explicit all three agree, and onnxsim leaves the loop alone."""
    proto = model.proto
    bare = [n for n in proto.graph.node if n.op_type == "Loop" and len(n.input) > 1 and n.input[0] and not n.input[1]]
    if not bare:
        return model
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    name = "edgepack_loop_condition_true"
    m.graph.initializer.append(numpy_helper.from_array(np.asarray(True), name))
    for n in m.graph.node:
        if n.op_type == "Loop" and len(n.input) > 1 and n.input[0] and not n.input[1]:
            n.input[1] = name
    return LoadedModel(model.path, m, model.inputs, model.outputs, model.opset,
                       model.notes + (f"{len(bare)} Loop(s) without a condition input given a true one, as "
                                      "onnxruntime runs them (the body's condition decides)",))


_NOT_HOISTED = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                          "Bernoulli", "Dropout"})


def hoist_invariants(model: LoadedModel) -> LoadedModel:
    """Each qualifying Loop with the body's nodes that read only values the same at every step (the
    invariants, constants, and what such nodes compute) moved in front of the loop and computed once;
    their results enter the body as new invariants. SLANet-plus's attention projects the encoder's
    features at every step ([256, 96] x [96, 256], 0.84 of the body's ~1 ms); once is enough. Nodes with
    subgraphs or randomness stay."""
    from .onnx_index import constants
    proto = model.proto
    if not loops_supported(proto):
        return model
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    moved = 0
    for k, loop in enumerate([n for n in m.graph.node if n.op_type == "Loop"]):
        moved += _hoist(m, loop, constants(m), f"{loop.name or f'loop{k}'}/hoisted/")
    if not moved:
        return model
    return LoadedModel(model.path, onnx.shape_inference.infer_shapes(m, strict_mode=False), model.inputs,
                       model.outputs, model.opset,
                       model.notes + (f"loop bodies: {moved} node(s) that give the same value at every step "
                                      "computed once, before the loop",))


def _hoist(m: onnx.ModelProto, loop: onnx.NodeProto, outer_consts: dict, prefix: str) -> int:
    from .onnx_index import _subgraph_reads, constants
    body, loop_in = _parts(loop)
    n_carried = len(body.input) - 2
    outer_name = {body.input[2 + c].name: loop_in[2 + c] for c in range(n_carried)
                  if body.output[1 + c].name == body.input[2 + c].name and loop_in[2 + c]}
    computed = {b for b, o in outer_name.items() if o not in outer_consts}  # not a constant passed through
    body_consts = constants(onnx.helper.make_model(body))
    hoisted, made = [], {}
    for n in body.node:
        if n.op_type == "Constant" or n.op_type in _NOT_HOISTED or \
                any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in n.attribute):
            continue
        # on a computed invariant (a node of constants only is folded in the body anyway)
        if all(not x or x in outer_name or x in body_consts or x in made for x in n.input) and \
                any(x in computed or x in made for x in n.input):
            hoisted.append(n)
            made.update({o: f"{prefix}{o}" for o in n.output if o})
    if not hoisted:
        return 0
    # only what the remaining body reads needs to enter it; the other hoisted values only feed those
    kept = [n for n in body.node if n not in hoisted]
    read = {x for n in kept for x in n.input} | {o.name for o in body.output}
    read |= set().union(*(_subgraph_reads(n) for n in kept))
    needed = [o for o in made if o in read]
    outer_nodes = []
    for n in hoisted:
        c = onnx.NodeProto()
        c.CopyFrom(n)
        c.name = f"{prefix}{n.name or n.output[0]}"
        for i, x in enumerate(c.input):
            if x in made:
                c.input[i] = made[x]
            elif x in outer_name:
                c.input[i] = outer_name[x]
            elif x:
                c.input[i] = f"{prefix}{x}"
                if c.input[i] not in {t.name for t in m.graph.initializer}:
                    m.graph.initializer.append(numpy_helper.from_array(np.asarray(body_consts[x]), c.input[i]))
        for i, o in enumerate(c.output):
            if o:
                c.output[i] = made[o]
        outer_nodes.append(c)
    at = list(m.graph.node).index(loop)
    nodes = list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend(nodes[:at] + outer_nodes + nodes[at:])
    types = {v.name: v for v in onnx.shape_inference.infer_shapes(m, strict_mode=False).graph.value_info}
    if any(made[name] not in types for name in needed):  # a body input needs its type: leave this loop be
        del m.graph.node[:]
        m.graph.node.extend(nodes)
        return 0
    # extend() copied the nodes in: the Loop and its body are the graph's new copies now
    loop = m.graph.node[at + len(outer_nodes)]
    body = next(a.g for a in loop.attribute if a.name == "body")
    keep = [n for n in body.node if n.output[0] not in made]
    del body.node[:]
    body.node.extend(keep)
    for name in needed:
        info = onnx.ValueInfoProto()
        info.CopyFrom(types[made[name]])
        info.name = name
        body.input.append(info)
        body.output.append(info)
        loop.input.append(made[name])
        loop.output.append(f"{made[name]}/unused")
    return len(hoisted)


def static_loops(model: LoadedModel) -> LoadedModel:
    """The model with each qualifying Loop's outputs at the static shapes its body gives them: a carried
    value the body never reads starts from zeros of its final shape (Paddle's exporter starts them as
    scalars), and the outer graph's shapes are inferred again from the body's. Unchanged when a Loop
    does not qualify (the backends then refuse it by name)."""
    from .onnx_index import constants
    proto = model.proto
    if not loops_supported(proto):
        return model
    m = onnx.ModelProto()
    m.CopyFrom(proto)
    loop_shapes: dict[str, tuple] = {}
    for loop in [n for n in m.graph.node if n.op_type == "Loop"]:
        consts = constants(m)
        try:
            b = _body(loop, m, consts, _static_shapes(m, consts), set(loop.output), model.path, model.opset)
        except ValueError:
            return model
        body_graph = next(a.g for a in loop.attribute if a.name == "body")
        shapes = {s.name: s.shape for s in b.model.inputs + b.model.outputs}
        for c in range(len(body_graph.input) - 2):
            name = body_graph.input[2 + c].name
            if c in b.unread and b.guaranteed and name in shapes:  # else its first value may be the answer
                zero = np.zeros(shapes[name], dtype=_np_dtype(body_graph.input[2 + c]))
                init = f"{loop.output[c]}__first"
                m.graph.initializer.append(numpy_helper.from_array(zero, init))
                loop.input[2 + c] = init
        # the body's declared shapes, and the loop's outputs at them (onnx's inference leaves those unknown)
        for v in list(body_graph.input[2:]) + list(body_graph.output[1:]):
            if v.name in shapes:
                set_static_shape(v, shapes[v.name])
        for c, out in enumerate(loop.output[:len(body_graph.input) - 2]):
            src = body_graph.output[1 + c]
            shape = shapes.get(src.name, shapes.get(body_graph.input[2 + c].name))
            if shape is not None:
                loop_shapes[out] = (src.type.tensor_type.elem_type, shape)
    # what onnx inferred after the loop came from the unknown shapes: inferred again from these
    m.graph.ClearField("value_info")
    m.graph.value_info.extend(helper.make_tensor_value_info(name, t, shape) for name, (t, shape) in loop_shapes.items())
    m = onnx.shape_inference.infer_shapes(m, strict_mode=False)
    return LoadedModel(model.path, m, model.inputs, model.outputs, model.opset,
                       model.notes + ("loop outputs at the static shapes of the loop's body",))


def _np_dtype(info: onnx.ValueInfoProto):
    return onnx.helper.tensor_dtype_to_np_dtype(info.type.tensor_type.elem_type)
