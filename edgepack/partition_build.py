"""Build one artifact from a partition plan: each segment with its backend, both engines linked
into one executable whose runtime (runtimes/common/ep_engine_seq.c) runs the segments in order.

Used by ``--backend auto`` when NCNN cannot take the whole graph: the plan (edgepack/partition.py)
puts NCNN on what it supports and TVM on the rest. The whole artifact is verified end to end
against onnxruntime, like any other build.

Linking two engines: one libncnn, with one layer registry pruned to the union of every NCNN
segment's layers (two pruned registries would define the same symbols); one TVM runtime. The
first TVM segment is compiled as usual (ISA copies, tuning database); any later TVM segment gets
its own system-lib prefix ``edgepack_seg<k>_`` (its kernels and bytecode register under it, so two
segments' kernels never meet) and no ISA copies (a prefixed ISA copy would fall back to the first
segment's unprefixed kernels).
"""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from .backends import CompileRequest, EngineBuild, get_backend
from .bundle import BundleRequest, BundleSegment, bundle
from .cache import sha256_file
from .errors import EdgepackError
from .partition import Plan, PlanError, backend_predicates, plan
from .reference import TOLERANCES
from .targets import Target
from .toolchains import Toolchain

PARTITION_BACKENDS = ("ncnn", "tvm")  # preference order: NCNN is the fast one


def plan_for(model, target: Target) -> Plan | None:
    """The split plan for ``target``, or None when the graph does not split (one backend takes it
    all, or the target lacks one of the two backends)."""
    names = tuple(b for b in PARTITION_BACKENDS if b in target.backends)
    preds = backend_predicates(model, names)
    if len(preds) < 2:
        return None
    try:
        p = plan(model, preds, tuple(preds))
    except PlanError:
        return None
    return p if p.is_split else None


def _compile_tvm_prefixed(model, target: Target, workdir: Path, prefix: str, log) -> EngineBuild:
    """A TVM segment after the first: kernels + bytecode under ``prefix``, no ISA copies."""
    from .backends.tvm import compile as tc_mod
    from .backends.tvm.runtime_lib import TVM_VERSION
    from .backends.tvm.target_map import target_dict, tvm_target
    from .backends.tvm.tuning import find_database
    db, why = find_database(model, target)
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
        ex = tc_mod._build(mod, tgt, db, prefix)
        out = tc_mod._export(ex, workdir, "", {"lib0.o": "lib0.o", "devc.o": "devc.o"})
    return EngineBuild(
        backend="tvm", sources=(), include_dirs=(), link_inputs=(out["lib0.o"], out["devc.o"]), model_blobs=(),
        options={"tvm.entry": "main", "tvm.prefix": prefix}, tolerance=TOLERANCES["fp32"],
        manifest={"apache-tvm": TVM_VERSION, "target": target_dict(target), "prefix": prefix,
                  "tuned": db is not None, "compile_seconds": round(time.monotonic() - t0, 2)},
        weight_bytes=tc_mod.data_section_bytes(out["devc.o"]))


def compile_segments(p: Plan, model, target: Target, precision: str, workdir: Path, tc: Toolchain,
                     log: Callable[[str], None]) -> tuple[list[EngineBuild], EngineBuild]:
    """(per-segment builds, the combined build the bundle links)."""
    builds: list[EngineBuild] = []
    tvm_seen = 0
    for k, seg in enumerate(p.segments):
        sub = seg.loaded(model, k)
        wd = workdir / f"seg{k}-{seg.backend}"
        seg_log = (lambda k: (lambda m: log(f"segment {k}: {m}")))(k)
        if seg.backend == "tvm" and tvm_seen:
            builds.append(_compile_tvm_prefixed(sub, target, wd, f"edgepack_seg{k}_", seg_log))
        else:
            builds.append(get_backend(seg.backend).compile(CompileRequest(sub, target, precision, wd, tc, seg_log)))
        tvm_seen += seg.backend == "tvm"
    return builds, combine(p, builds, target, tc, log)


def combine(p: Plan, builds: list[EngineBuild], target: Target, tc: Toolchain, log) -> EngineBuild:
    sources, includes, link_inputs, link_flags, notes = [], [], [], [], []
    ncnn = [b for b in builds if b.backend == "ncnn"]
    tvm = [b for b in builds if b.backend == "tvm"]
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
        first = next(b for b in tvm if b.sources)
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
        backend="+".join(dict.fromkeys(p.backends)), sources=tuple(sources), include_dirs=tuple(includes),
        link_inputs=tuple(link_inputs), link_flags=tuple(link_flags), model_blobs=(), options={},
        tolerance=tol, manifest={"plan": p.describe(), "segments": segs}, notes=tuple(notes),
        weight_bytes=sum(b.weight_bytes for b in builds))


def bundle_segments(p: Plan, model, builds: list[EngineBuild]) -> tuple[BundleSegment, ...]:
    out = []
    for k, (seg, b) in enumerate(zip(p.segments, builds)):
        sub = seg.loaded(model, k)
        out.append(BundleSegment(b.backend, sub.inputs, sub.outputs, dict(b.options), tuple(b.model_blobs)))
    return tuple(out)


def try_partitioned(prep, target: Target, opts, tc: Toolchain, log: Callable[[str], None], reasons: list[str],
                    t0: float):
    """The pipeline's hook: a verified partitioned artifact (a TargetResult), or None when the
    graph does not split or the partitioned build failed (the reason is appended to ``reasons``)."""
    from . import pipeline
    model = prep.model
    p = plan_for(model, target)
    if p is None:
        return None
    tag = f"[{target.name}]"
    log(f"{tag} partitioned plan: {p.describe()}")
    with tempfile.TemporaryDirectory(prefix=f"edgepack-{target.name}-split-") as tmp:
        workdir = Path(tmp)
        try:
            t_stage = time.monotonic()
            builds, engine = compile_segments(p, model, target, opts.precision, workdir / "compile", tc,
                                              lambda m: log(f"{tag} {m}"))
            log(f"{tag} {engine.backend}: {len(p.segments)} segments compiled in {time.monotonic() - t_stage:.1f} s")
            manifest = pipeline.manifest_for(prep, target, engine, tc, opts)
            manifest["plan"] = p.to_json()
            manifest["build"] = dict(manifest["build"], backend="auto")
            staged = workdir / "artifact"
            built = bundle(BundleRequest(model.name, target, engine, model.inputs, model.outputs, prep.golden_inputs,
                                         prep.golden_outputs, manifest, workdir / "bundle", staged, tc,
                                         segments=bundle_segments(p, model, builds)))
            log(f"{tag} bundled {built.size / 1e6:.2f} MB")
            verification = None
            if opts.verify:
                verification = pipeline.verify(staged, target, prep, engine.tolerance, workdir)
                log(f"{tag} verified: max error {verification.max_abs_err:.2e} (bound {verification.bound:.2e})")
        except EdgepackError as exc:
            reasons.append(f"partitioned {p.describe()}: {exc.message}")
            log(f"{tag} partitioned build failed: {exc.message}")
            return None
        out_path = Path(opts.out_dir) / f"{model.name}-{target.name}"
        out_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(staged, out_path)
    full = dict(manifest)
    full["artifact"] = {"file": out_path.name, "size": built.size, "sha256": sha256_file(out_path),
                        "weight_bytes": engine.weight_bytes, "runtime_bytes": built.size - engine.weight_bytes}
    if verification:
        full["verification"] = {"max_abs_err": verification.max_abs_err, "bound": verification.bound,
                                "selftest": verification.selftest,
                                "runner": "native" if not target.needs_qemu else f"qemu -cpu {target.qemu_cpu}"}
    full["backend_choice"] = {"used": engine.backend, "skipped": list(reasons)}
    out_path.with_name(out_path.name + ".json").write_text(json.dumps(full, indent=1, sort_keys=True))
    notes = (tuple(model.notes) + (f"partitioned: {p.describe()}",) + tuple(engine.notes)
             + tuple(f"skipped: {r}" for r in reasons))
    return pipeline.TargetResult(target.name, True, engine.backend, out_path, built.size, engine.weight_bytes,
                                 verification.max_abs_err if verification else None,
                                 verification.bound if verification else None, time.monotonic() - t0, notes=notes)

