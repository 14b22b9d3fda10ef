"""Build one artifact from a partition plan: each segment with its backend, both engines linked
into one executable whose runtime (runtimes/common/ep_engine_seq.c) runs the segments in order.

Used by ``--backend auto`` when NCNN cannot take the whole graph: the plan (edgepack/partition.py)
puts NCNN on what it supports and TVM on the rest. The whole artifact is verified end to end
against onnxruntime, like any other build.

Linking two engines: one libncnn, with one layer registry pruned to the union of every NCNN
segment's layers (two pruned registries would define the same symbols); one TVM runtime. One TVM
segment is unprefixed and compiled as usual (x86-64 ISA copies, tuning database); every other TVM
segment gets its own system-lib prefix ``edgepack_seg<k>_`` (its kernels and bytecode register
under it, so two segments' kernels never meet) and no ISA copies (a prefixed ISA copy would fall
back to the unprefixed segment's kernels). TVM 0.27 cannot compile TopK's sort call under any
prefix (its AttachGlobalSymbol pass fails), so a TopK segment takes the unprefixed place, without
ISA copies.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from .backends import CompileRequest, EngineBuild, get_backend
from .bundle import BundleSegment
from .errors import EdgepackError
from .loops import loops_supported
from .onnx_index import constants
from .partition import Plan, PlanError, backend_predicates, plan
from .reference import TOLERANCES
from .targets import Target
from .toolchains import Toolchain

PARTITION_BACKENDS = ("ncnn", "tvm")  # preference order: NCNN is the fast one
PREFIX_UNSAFE_OPS = frozenset({"TopK"})


def plan_for(model, target: Target, force: dict[str, str] | None = None) -> Plan | None:
    """The split plan for ``target``, or None when the graph does not split (one backend takes it
    all, or the target lacks one of the two backends). ``force``: node -> backend (the nodes pnnx
    leaves layers ncnn cannot load for, see partition_probe.py). One NCNN segment is a plan too where
    the model also has inputs no node reads or constant outputs: the whole-graph NCNN build takes
    only float32 inputs and outputs that its graph computes, while the segment runtime skips an
    unread input and fills a constant output (onnx-asr's waveforms_lens and features_lens, int64)."""
    names = tuple(b for b in PARTITION_BACKENDS if b in target.backends)
    try:
        preds = backend_predicates(model, names)
        if len(preds) < 2:
            return None
        if "tvm" in preds and loops_supported(model.proto):  # the runtime steps each Loop (loops.py)
            preds["loop"] = lambda op: op == "Loop"
        if force and not all(preds["tvm"](op) for op in _ops_of(model, force)):
            return None  # a node to cut out that TVM cannot build either
        p = plan(model, preds, tuple(preds), force=force)
    except PlanError:
        return None
    except Exception:  # noqa: BLE001  a graph the planner mis-handles keeps the whole-graph path, never an internal error
        return None
    # a graph that is one Loop and nothing else is a plan too: the runtime steps it (loops.py)
    return p if p.is_split or "loop" in p.backends or _reads_or_writes_less(p.segments[0], model) else None


def _reads_or_writes_less(seg, model) -> bool:
    return seg.backend == "ncnn" and (set(seg.inputs) < {s.name for s in model.inputs}
                                      or set(seg.outputs) < {s.name for s in model.outputs})


def _ops_of(model, nodes: dict[str, str]) -> set[str]:
    from .partition import _named
    return {n.op_type for n in _named(model.proto).graph.node if n.name in nodes}


def leftover_plan(model, target: Target, log) -> tuple[Plan | None, dict[str, str]]:
    """After NCNN's conversion left layers ncnn cannot load: the plan that cuts their nodes out."""
    from .partition_probe import offending_nodes
    if "tvm" not in target.backends or "ncnn" not in target.backends:
        return None, {}
    force = offending_nodes(model, log) or {}
    return (plan_for(model, target, force) if force else None), force


class _SegmentFailed(Exception):
    def __init__(self, index: int, sub, exc: EdgepackError):
        super().__init__(exc.message)
        self.index, self.sub, self.exc = index, sub, exc   # sub: the segment's model, for the probe


class _SegmentsFailed(Exception):
    """Every NCNN segment of one attempt that failed, in plan order (the split moves them all at once)."""
    def __init__(self, failures: list[_SegmentFailed]):
        super().__init__(failures[0].exc.message)
        self.failures = failures


def _nodes_to_move(seg, sub, failed: _SegmentFailed, log) -> dict[str, str]:
    """node -> "tvm" for a failed NCNN segment: only the nodes behind pnnx's leftovers where the
    probe finds them (kaldi's edge Pad that shifts the waveform, amid the power spectrum NCNN runs
    well), else the whole segment. (A node already forced to TVM is never in an NCNN segment, so
    each retry moves something new.)"""
    from .partition_probe import offending_nodes
    found = offending_nodes(sub, lambda m: log(f"segment {failed.index}: {m}")) or {}
    if found and set(found) <= set(seg.nodes):
        log(f"segment {failed.index} (ncnn) failed: {failed.exc.message[:200]}; moving {len(found)} of its "
            f"{len(seg.nodes)} nodes to TVM")
        return found
    log(f"segment {failed.index} (ncnn) failed: {failed.exc.message[:200]}; moving its {len(seg.nodes)} nodes to TVM")
    return {n: "tvm" for n in seg.nodes}


def _compile_tvm_segment(model, target: Target, workdir: Path, prefix: str, tc: Toolchain, log,
                         tuning_db: str | None = None) -> EngineBuild:
    """A TVM segment without ISA copies: under ``prefix`` (kernels and bytecode register under
    it), or unprefixed where the ISA copies cannot be built (TopK, see PREFIX_UNSAFE_OPS)."""
    from .backends.tvm import compile as tc_mod
    from .backends.tvm.runtime_lib import TVM_VERSION, build_runtime
    from .backends.tvm.target_map import target_dict, tvm_target
    from .backends.tvm.tuning import find_database
    from .resources import runtimes_dir
    db, why = find_database(target, tuning_db)
    log(f"tvm: {why}")
    with tc_mod.TVM_LOCK:
        tc_mod.import_tvm()
        tgt = tvm_target(target)
        workdir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        mod = tc_mod.import_onnx(model)
        try:
            mod = tc_mod.fuse(mod, tgt)
        except Exception as exc:
            raise EdgepackError(f"TVM could not compile segment {model.name}: {tc_mod._first_line(exc)}") from exc
        layout = tc_mod.conv_layout(mod)
        ex = tc_mod._build(mod, tgt, db, prefix or None)
        # the bytecode + weights object carries the prefix in its name too
        out = tc_mod._export(ex, workdir, "", {"lib0.o": "lib0.o", f"{prefix}devc.o": "devc.o"})
        out["devc.o"] = out.pop(f"{prefix}devc.o")
    rt = build_runtime(target, tc, log=log)
    from .backends.tvm.index_bounds import guard
    id_options, id_manifest, id_note = guard(model)  # as TvmBackend.compile: ids checked, indices bounded
    options = {"tvm.entry": "main"} | ({"tvm.prefix": prefix} if prefix else {}) | id_options
    return EngineBuild(
        backend="tvm", sources=(runtimes_dir() / "tvm" / "ep_engine_tvm.cc",), include_dirs=rt.include_dirs,
        link_inputs=(out["lib0.o"], out["devc.o"]),
        link_flags=("-Wl,--whole-archive", *(str(a) for a in rt.archives), "-Wl,--no-whole-archive"),
        model_blobs=(), options=options, tolerance=TOLERANCES["fp32"],
        manifest={"apache-tvm": TVM_VERSION, "target": target_dict(target), "prefix": prefix,
                  "isa_levels": [{"level": target_dict(target)["mcpu"], "prefix": prefix}],
                  "tuned": db is not None, "conv_layout": layout,
                  "compile_seconds": round(time.monotonic() - t0, 2), **id_manifest},
        notes=(f"tvm: {why}",) + ((id_note,) if id_note else ()), weight_bytes=tc_mod.data_section_bytes(out["devc.o"]))


_COMPILE_ORDER = {"ncnn": 0, "loop": 1, "tvm": 2}  # NCNN first: its failures re-plan before any TVM compile


def _compile_loop_segment(sub, target: Target, workdir: Path, prefix: str, tc: Toolchain, log,
                          tuning_db: str | None) -> EngineBuild:
    """A Loop stepped by the runtime (loops.py): its body compiled by TVM under its own prefix, the
    loop engine's wiring as options, the constants it starts from as blobs."""
    import numpy as np

    from .bundle import BundleSegment, LoopBody
    from .loops import extract_body
    try:
        body = extract_body(sub)
    except ValueError as exc:
        raise PlanError(f"{sub.path.name}: the runtime cannot step this loop: {exc}") from exc
    ops = {n.op_type for n in body.model.proto.graph.node}
    if ops & PREFIX_UNSAFE_OPS:
        raise PlanError(f"{sub.path.name}: the loop's body holds {sorted(ops & PREFIX_UNSAFE_OPS)[0]}, "
                        "which TVM cannot compile in a loop body")
    log(f"loop body: {len(body.model.proto.graph.node)} nodes on TVM")
    built = _compile_tvm_segment(body.model, target, workdir / "body", prefix, tc, log, tuning_db)
    options, constants = body.options()
    blobs = []
    for i, arr in enumerate(constants):
        path = workdir / f"loop_const{i}.bin"
        path.write_bytes(np.ascontiguousarray(arr).tobytes())
        blobs.append(path)
    seg = BundleSegment("tvm", body.model.inputs, body.model.outputs, dict(built.options), ())
    return EngineBuild(
        backend="loop", sources=(), include_dirs=(), link_inputs=(), model_blobs=tuple(blobs), options=options,
        tolerance=built.tolerance, manifest={"body": built.manifest, "body_nodes": len(body.model.proto.graph.node),
                                             "body_inputs": len(body.model.inputs)},
        notes=built.notes, weight_bytes=built.weight_bytes + sum(p.stat().st_size for p in blobs),
        body=LoopBody(body.model.inputs, body.model.outputs, (seg,)), parts=(built,))


def compile_segments(p: Plan, model, target: Target, precision: str, workdir: Path, tc: Toolchain,
                     log: Callable[[str], None], tuning_db: str | None = None) -> tuple[list[EngineBuild], EngineBuild]:
    """(per-segment builds, the combined build the bundle links). The NCNN segments are built
    first, all of them: when some fail, _SegmentsFailed names every one before any TVM segment
    has been compiled, so the split re-plans once for them all (an unrolled decoder repeats the
    same failing step 18 times; one failure per attempt recompiled the growing TVM part 18 times)."""
    builds: dict[int, EngineBuild] = {}
    tvm_segs = [k for k, s in enumerate(p.segments) if s.backend == "tvm"]
    # TVM 0.27 fails to compile TopK's sort call under a system-lib prefix (AttachGlobalSymbol):
    # such a segment takes the one unprefixed place
    plain = next((k for k in tvm_segs if set(p.segments[k].ops) & PREFIX_UNSAFE_OPS), tvm_segs[0] if tvm_segs else -1)
    failures = []
    order = sorted(range(len(p.segments)), key=lambda k: _COMPILE_ORDER[p.segments[k].backend])
    for k in order:
        seg = p.segments[k]
        if seg.backend != "ncnn" and failures:
            break
        sub = seg.loaded(model, k)
        wd = workdir / f"seg{k}-{seg.backend}"
        seg_log = (lambda k: (lambda m: log(f"segment {k}: {m}")))(k)
        if seg.backend == "loop":
            builds[k] = _compile_loop_segment(sub, target, wd, f"edgepack_seg{k}_body_", tc, seg_log, tuning_db)
        elif seg.backend == "tvm" and k != plain:
            builds[k] = _compile_tvm_segment(sub, target, wd, f"edgepack_seg{k}_", tc, seg_log, tuning_db)
        elif seg.backend == "tvm" and set(seg.ops) & PREFIX_UNSAFE_OPS:
            builds[k] = _compile_tvm_segment(sub, target, wd, "", tc, seg_log, tuning_db)  # no x86-64 ISA copies
        else:
            try:
                builds[k] = get_backend(seg.backend).compile(CompileRequest(sub, target, precision, wd, tc, seg_log,
                                                                            tuning_db))
            except EdgepackError as exc:  # the split backend may move this segment to TVM and re-plan
                failures.append(_SegmentFailed(k, sub, exc))
    if failures:
        raise _SegmentsFailed(failures)
    ordered = [builds[k] for k in range(len(p.segments))]
    return ordered, combine(p, ordered, target, tc, log)


def combine(p: Plan, builds: list[EngineBuild], target: Target, tc: Toolchain, log) -> EngineBuild:
    sources, includes, link_inputs, link_flags, notes = [], [], [], [], []
    ncnn = [b for b in builds if b.backend == "ncnn"]
    tvm = [b for b in builds if b.backend == "tvm"] + [p for b in builds for p in b.parts if p.backend == "tvm"]
    if ncnn:
        from .backends.ncnn.library import build_library
        from .backends.ncnn.prune import pruned_layer_object
        lib = build_library(target, tc, log=log)
        layers = sorted({layer for b in ncnn for layer in b.manifest.get("layers", ())})
        layer_obj, _kept = pruned_layer_object(lib, set(layers), log=log)
        sources += list(ncnn[0].sources)
        includes += list(ncnn[0].include_dirs)
        link_inputs += [layer_obj, lib.lib]
    if tvm:
        first = tvm[0]
        sources += list(first.sources)
        includes += list(first.include_dirs)
        link_flags += list(first.link_flags)
        for b in tvm:
            link_inputs += list(b.link_inputs)
    for k, b in enumerate(builds):
        notes += [f"segment {k} ({b.backend}): {n}" for n in b.notes]
    # the loosest segment's bound (every backend's is the reference policy's today)
    tol = max((b.tolerance for b in builds), key=lambda t: (t.atol, t.rtol))
    segs = [{**s.to_json(), "manifest": b.manifest, "options": dict(b.options)} for s, b in zip(p.segments, builds)]
    return EngineBuild(
        backend=SPLIT, sources=tuple(sources), include_dirs=tuple(includes),
        link_inputs=tuple(link_inputs), link_flags=tuple(link_flags), model_blobs=(), options={},
        tolerance=tol, manifest={"summary": p.describe(), "segments": segs}, notes=tuple(notes),
        weight_bytes=sum(b.weight_bytes for b in builds))


def bundle_segments(p: Plan, model, builds: list[EngineBuild]) -> tuple[BundleSegment, ...]:
    out = []
    for k, (seg, b) in enumerate(zip(p.segments, builds)):
        sub = seg.loaded(model, k)
        out.append(BundleSegment(b.backend, sub.inputs, sub.outputs, dict(b.options), tuple(b.model_blobs), b.body))
    return tuple(out)


SPLIT = "ncnn+tvm"


class SplitBackend:
    """NCNN where it can, TVM for the rest, in one artifact: a backend to the pipeline (so the
    precision ladder, verification on every CPU and the manifest are the same as for any build).
    Not in the registry: `auto` offers it (``with_split``) when NCNN cannot take the whole graph."""
    name = SPLIT
    thread_safe = False

    def precision_ladder(self, target: Target, requested: str) -> list[str]:
        return get_backend("ncnn").precision_ladder(target, requested)

    def unsupported_ops(self, model) -> dict[str, list[str]]:
        ncnn, tvm = get_backend("ncnn").unsupported_ops(model), get_backend("tvm").unsupported_ops(model)
        return {op: nodes for op, nodes in ncnn.items() if op in tvm}

    def missing_tools(self) -> list[str]:
        return get_backend("ncnn").missing_tools() + get_backend("tvm").missing_tools()

    def compile(self, req: CompileRequest) -> EngineBuild:
        force: dict[str, str] = {}
        p = plan_for(req.model, req.target)
        if p is None:
            p, force = leftover_plan(req.model, req.target, req.log)
        if p is None:
            raise PlanError(f"{req.model.path.name}: the graph does not split into NCNN and TVM segments")
        tvm_ok = backend_predicates(req.model, ("tvm",)).get("tvm", lambda op: False)
        # NCNN segments that fail (pnnx leaves a layer in context, ncnn cannot compute it, its
        # conversion check disagrees) move whole to TVM when TVM builds all of them; bounded
        for attempt in range(len(p.segments) + 1):
            req.log(f"partitioned plan: {p.describe()}")
            try:
                builds, engine = compile_segments(p, req.model, req.target, req.precision, req.workdir / f"try{attempt}",
                                                  req.toolchain, req.log, req.tuning_db)
                break
            except _SegmentsFailed as failed:
                for f in failed.failures:
                    seg = p.segments[f.index]
                    if not all(tvm_ok(op) for op in seg.ops):
                        raise f.exc from None
                    force.update(_nodes_to_move(seg, f.sub, f, req.log))
                nxt = plan_for(req.model, req.target, force)
                if nxt is None:  # everything on TVM now: the whole-graph TVM build does that better
                    raise failed.failures[0].exc from None
                p = nxt
        else:
            raise PlanError(f"{req.model.path.name}: no NCNN+TVM plan built")
        ncnn_rungs = {b.manifest.get("precision") for b in builds if b.backend == "ncnn"} - {None}
        manifest = dict(engine.manifest, precision=ncnn_rungs.pop() if len(ncnn_rungs) == 1 else req.precision)
        segments = bundle_segments(p, req.model, builds)
        _check_unwritten_outputs_are_constants(req.model, segments)
        return replace(engine, manifest=manifest, segments=segments)


def _check_unwritten_outputs_are_constants(model, segments: tuple[BundleSegment, ...]) -> None:
    """The bundle fills a model output that no segment writes from the golden run (bundle.constant_outputs):
    right only for a graph constant (onnx-asr's features_lens once shapes are fixed). Anything else would be
    a plan that lost an output, so it fails here, where the graph is known."""
    written = {s.name for s in model.inputs} | {o.name for seg in segments for o in seg.outputs}
    consts = constants(model.proto)
    lost = [o.name for o in model.outputs if o.name not in written and o.name not in consts]
    if lost:
        raise PlanError(f"{model.path.name}: no segment writes output {lost[0]}")


SPLIT_BACKEND = SplitBackend()


def with_split(candidates: list[tuple[str, str | None]], model, target: Target, requested: str):
    """The pipeline's hook: in `auto`, when the first backend (NCNN) cannot take every op and the
    graph splits, the NCNN+TVM artifact is tried right after it, before a whole-graph fallback.
    ``requested`` "ncnn+tvm" (verify-build rebuilding a partitioned artifact) tries only the split."""
    if requested == SPLIT:
        missing = SPLIT_BACKEND.missing_tools()
        why = (f"backend {SPLIT} is not installed ({'; '.join(missing)})" if missing else
               None if plan_for(model, target) is not None else f"{model.path.name} does not split into NCNN and TVM")
        return [(SPLIT, why)]
    if requested != "auto" or not candidates or candidates[0][0] != "ncnn" or SPLIT_BACKEND.missing_tools():
        return candidates
    if candidates[0][1] is None:
        # NCNN's op table takes the graph: the split is tried only if NCNN's build fails, and
        # compiles only if pnnx left layers whose nodes can be cut out (leftover_plan)
        if any(n == "tvm" and why is None for n, why in candidates[1:]) and "tvm" in target.backends:
            return [candidates[0], (SPLIT, None)] + list(candidates[1:])
        return candidates
    if plan_for(model, target) is None:
        return candidates
    return [candidates[0], (SPLIT, None)] + list(candidates[1:])
