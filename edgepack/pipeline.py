"""The build pipeline: load -> prepare (shapes, simplify) -> compile -> bundle -> verify -> write.

Each stage is a function from typed inputs to outputs; the CLI only parses options and calls
``build``. One failing target does not stop the others.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import threading
import shutil
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from . import __version__
from .backends import CompileRequest, EngineBuild, all_backends, get_backend
from .bundle import BundleRequest, Bundled, bundle
from .cache import sha256_bytes, sha256_file
from .errors import EdgepackError, ToolMissingError, UnsupportedOpError, VerificationError
from .model import LoadedModel, fix_input_shapes, load_model, simplify
from .prepost import bake_prepost, prepost_config_exists, prepost_manifest
from .reference import Tolerance, compare, random_inputs, run_onnxruntime
from .runner import run_artifact
from .targets import Target
from .toolchains import Toolchain

GOLDEN_SEED = 20261130
_COMPILE_LOCKS: dict[str, threading.Lock] = collections.defaultdict(threading.Lock)
VERIFY_SEED = 7


@dataclass(frozen=True)
class BuildOptions:
    backend: str = "auto"
    precision: str = "fp16"
    input_shapes: dict = field(default_factory=dict)
    out_dir: Path = Path("dist")
    verify: bool = True
    simplify: bool = True
    jobs: int = 0                    # targets built at once (0: one per core)
    preprocess: str | None = None    # e.g. "image:size=224x224,layout=nhwc,dtype=uint8,mean=...,std=..."
    postprocess: str | None = None   # e.g. "softmax,topk=5,labels=labels.txt"


@dataclass(frozen=True)
class PreparedModel:
    model: LoadedModel
    source_sha256: str
    golden_inputs: dict
    golden_outputs: dict

    @functools.cached_property
    def verify_case(self) -> tuple[dict, dict]:
        """The fresh input every target is verified on, and onnxruntime's answer: computed once
        per model, not once per target (and not at all with --no-verify)."""
        fresh = random_inputs(self.model.inputs, VERIFY_SEED)
        return fresh, run_onnxruntime(self.model, fresh)


@dataclass(frozen=True)
class Verification:
    max_abs_err: float
    bound: float
    selftest: str
    ok: bool


@dataclass(frozen=True)
class TargetResult:
    target: str
    ok: bool
    backend: str | None = None
    path: Path | None = None
    size: int = 0
    weight_bytes: int = 0
    max_abs_err: float | None = None
    bound: float | None = None
    seconds: float = 0.0
    error: str | None = None
    hint: str | None = None
    exit_code: int = 0
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"target": self.target, "ok": self.ok, "backend": self.backend,
                "file": str(self.path) if self.path else None, "size": self.size,
                "runtime_bytes": self.size - self.weight_bytes if self.size else None,
                "max_abs_err": self.max_abs_err, "bound": self.bound, "seconds": round(self.seconds, 2),
                "error": self.error, "hint": self.hint, "exit_code": self.exit_code, "notes": list(self.notes),
                "sha256": sha256_file(self.path) if self.ok and self.path and Path(self.path).is_file() else None}


# ---- stages --------------------------------------------------------------------------------

def prepare(path: Path, opts: BuildOptions) -> PreparedModel:
    model = load_model(path)
    model = fix_input_shapes(model, opts.input_shapes)
    if opts.simplify:
        model = simplify(model)
    if opts.preprocess or opts.postprocess or prepost_config_exists(path):
        # Graph surgery before compilation, so every backend gets the same pre/post-processing.
        model = bake_prepost(model, path, opts.preprocess, opts.postprocess)
    golden_in = random_inputs(model.inputs, GOLDEN_SEED)
    golden_out = run_onnxruntime(model, golden_in)
    return PreparedModel(model, sha256_file(path), golden_in, golden_out)


def backend_candidates(model: LoadedModel, target: Target, requested: str) -> list[tuple[str, str | None]]:
    """(backend name, reason it cannot be used or None) in the order to try."""
    registered = all_backends()
    names = list(target.backends) if requested == "auto" else [requested]
    if requested != "auto":
        get_backend(requested)  # unknown name -> clear error
    out = []
    for name in names:
        if name not in registered:
            out.append((name, f"backend {name} is not available in this installation"))
            continue
        missing = registered[name].missing_tools()
        if missing:
            if requested != "auto":
                raise ToolMissingError(f"backend {name} cannot run here: missing {'; '.join(missing)}",
                                       hint="run `edgepack doctor`")
            out.append((name, f"backend {name} is not installed ({'; '.join(missing)})"))
            continue
        unsupported = registered[name].unsupported_ops(model)
        if unsupported:
            op, nodes = next(iter(sorted(unsupported.items())))
            more = f" (+{len(unsupported) - 1} more op types)" if len(unsupported) > 1 else ""
            out.append((name, f"{name} cannot build op {op} (node {nodes[0]}){more}"))
        else:
            out.append((name, None))
    return out


def manifest_for(prep: PreparedModel, target: Target, engine: EngineBuild, tc: Toolchain, opts: BuildOptions) -> dict:
    precision = opts.precision
    model = prep.model
    return {
        "schema": 1,
        "edgepack": __version__,
        "model": {"name": model.name, "file": model.path.name, "sha256": prep.source_sha256,
                  "prepared_sha256": sha256_bytes(model.proto.SerializeToString()), "opset": model.opset,
                  "notes": list(model.notes)},
        "target": target.summary() | {"source": Path(target.source).name},
        "backend": {"name": engine.backend, **engine.manifest},
        "model_blobs_sha256": [sha256_file(p) for p in engine.model_blobs],
        "precision": precision,
        "inputs": [s.to_json() for s in model.inputs],
        "outputs": [s.to_json() for s in model.outputs],
        "tolerance": engine.tolerance.to_json(),
        "toolchain": {"name": tc.name, "package": tc.package, "version": tc.version},
        "golden_seed": GOLDEN_SEED,
        **prepost_manifest(model),  # baked pre/post-processing: read by the runtime
        # everything else that determines the bytes (verify-build rebuilds from this)
        "build": {"backend": engine.backend, "precision": precision,
                  "input_shapes": {k: list(v) for k, v in sorted(opts.input_shapes.items())},
                  "simplify": opts.simplify, "preprocess": opts.preprocess, "postprocess": opts.postprocess,
                  "target_file_sha256": sha256_file(Path(target.source)) if target.source else None,
                  "options": {k: v for k, v in sorted(engine.options.items())}},
    }


def verify(path: Path, target: Target, prep: PreparedModel, tol: Tolerance, workdir: Path) -> Verification:
    """Run the artifact here (qemu for Arm) on a fresh input and on its own selftest."""
    model = prep.model
    fresh, ref = prep.verify_case
    vdir = workdir / "verify"
    vdir.mkdir(parents=True, exist_ok=True)
    args = ["run", "--threads", "1", "--output", str(vdir / "out")]
    for i, s in enumerate(model.inputs):
        np.save(vdir / f"in{i}.npy", fresh[s.name])
        args += ["--input", f"{s.name}={vdir / f'in{i}.npy'}"]
    proc = run_artifact(path, args, qemu_cpu=target.qemu_cpu)
    if proc.returncode != 0:
        raise VerificationError(f"{path.name} run failed under verification (exit {proc.returncode}): "
                                f"{(proc.stderr or proc.stdout).strip()[:300]}")
    report = json.loads(proc.stdout)
    got = {name: np.load(info["file"]) for name, info in report["outputs"].items()}
    results = compare(got, ref, tol)
    worst = max(results, key=lambda r: (r.max_abs_err / r.bound) if r.bound else r.max_abs_err)
    # one inference is enough to check the golden output (under qemu each costs seconds)
    st = run_artifact(path, ["selftest", "--threads", "1", "--runs", "1", "--warmup", "0"], qemu_cpu=target.qemu_cpu)
    selftest = st.stdout.strip()
    if not all(r.ok for r in results):
        raise VerificationError(f"{path.name} disagrees with onnxruntime on output {worst.name}: max abs error "
                                f"{worst.max_abs_err:.3g} > bound {worst.bound:.3g}",
                                hint="try --fp32, or another --backend")
    if st.returncode != 0:
        raise VerificationError(f"{path.name} selftest failed: {selftest or st.stderr.strip()[:300]}")
    return Verification(worst.max_abs_err, worst.bound, selftest, True)


def build_target(prep: PreparedModel, target: Target, opts: BuildOptions, tc: Toolchain,
                 log: Callable[[str], None]) -> TargetResult:
    t0 = time.monotonic()
    model = prep.model
    reasons = []
    candidates = backend_candidates(model, target, opts.backend)
    # issue 9 item 4: NCNN on what it can take + TVM for the rest, before a whole-graph fallback
    from .partition_build import with_split
    candidates = with_split(candidates, model, target, opts.backend)
    for name, why_not in candidates:
        if why_not:
            reasons.append(why_not)
            log(f"[{target.name}] skip {why_not}")
            continue
        backend = get_backend(name)
        with tempfile.TemporaryDirectory(prefix=f"edgepack-{target.name}-") as tmp:
            workdir = Path(tmp)
            try:
                t_stage = time.monotonic()
                # Targets build in threads; a backend whose compiler keeps global state (TVM's
                # importer does) compiles one target at a time.
                with contextlib.nullcontext() if getattr(backend, "thread_safe", False) else _COMPILE_LOCKS[name]:
                    engine = backend.compile(CompileRequest(model, target, opts.precision, workdir / "compile", tc,
                                                            lambda m: log(f"[{target.name}] {m}")))
                log(f"[{target.name}] {name}: compiled in {time.monotonic() - t_stage:.1f} s")
                t_stage = time.monotonic()
                manifest = manifest_for(prep, target, engine, tc, opts)
                out_path = Path(opts.out_dir) / f"{model.name}-{target.name}"
                staged = workdir / "artifact"
                built: Bundled = bundle(BundleRequest(
                    model.name, target, engine, model.inputs, model.outputs, prep.golden_inputs,
                    prep.golden_outputs, manifest, workdir / "bundle", staged, tc))
                log(f"[{target.name}] bundled {built.size / 1e6:.2f} MB in {time.monotonic() - t_stage:.1f} s")
                t_stage = time.monotonic()
                verification = None
                if opts.verify:
                    log(f"[{target.name}] verifying against onnxruntime"
                        + (f" under qemu (-cpu {target.qemu_cpu})" if target.needs_qemu else ""))
                    verification = verify(staged, target, prep, engine.tolerance, workdir)
                    log(f"[{target.name}] verified in {time.monotonic() - t_stage:.1f} s: max error "
                        f"{verification.max_abs_err:.2e} (bound {verification.bound:.2e})")
                out_path.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(staged, out_path)
                full = dict(manifest)
                full["artifact"] = {"file": out_path.name, "size": built.size, "sha256": sha256_file(out_path),
                                    "weight_bytes": engine.weight_bytes,
                                    "runtime_bytes": built.size - engine.weight_bytes}
                if verification:
                    full["verification"] = {"max_abs_err": verification.max_abs_err, "bound": verification.bound,
                                            "selftest": verification.selftest,
                                            "runner": "native" if not target.needs_qemu else
                                            f"qemu -cpu {target.qemu_cpu}"}
                full["backend_choice"] = {"used": name, "skipped": reasons}
                out_path.with_name(out_path.name + ".json").write_text(json.dumps(full, indent=1, sort_keys=True))
                notes = tuple(model.notes) + tuple(engine.notes) + tuple(f"skipped: {r}" for r in reasons)
                return TargetResult(target.name, True, name, out_path, built.size, engine.weight_bytes,
                                    verification.max_abs_err if verification else None,
                                    verification.bound if verification else None,
                                    time.monotonic() - t0, notes=notes)
            except EdgepackError as exc:
                reasons.append(f"{name}: {exc.message}")
                log(f"[{target.name}] {name} failed: {exc.message}")
                last = exc
                if opts.backend != "auto":
                    return TargetResult(target.name, False, name, seconds=time.monotonic() - t0,
                                        error=exc.message, hint=exc.hint, exit_code=exc.exit_code)
    if not reasons:
        reasons.append("no backend configured")
    msg = "; ".join(reasons)
    unsupported = all(r is not None for _, r in candidates)
    code = UnsupportedOpError.exit_code if unsupported else locals().get("last", EdgepackError("")).exit_code
    return TargetResult(target.name, False, None, seconds=time.monotonic() - t0, error=msg,
                        hint="see `edgepack inspect MODEL` for op support per backend", exit_code=code)


def build(model_path: Path, targets: list[Target], opts: BuildOptions, log: Callable[[str], None] = print,
          on_result: Callable[[TargetResult], None] | None = None) -> list[TargetResult]:
    tc = Toolchain.load()
    tc.check()
    prep = prepare(Path(model_path), opts)
    for note in prep.model.notes:
        log(note)
    def one(target: Target) -> TargetResult:
        try:
            res = build_target(prep, target, opts, tc, log)
        except EdgepackError as exc:
            res = TargetResult(target.name, False, error=exc.message, hint=exc.hint, exit_code=exc.exit_code)
        except Exception as exc:  # a bug must not stop the other targets; report it fully
            res = TargetResult(target.name, False, error=f"internal error: {type(exc).__name__}: {exc}",
                               hint="please report this with --debug output", exit_code=70,
                               notes=(traceback.format_exc(),))
        if on_result:
            on_result(res)
        return res

    # Targets build side by side: most of a target's time is spent waiting on zig and on qemu
    # verification, and shared heavy steps (libncnn, conversion) are serialised by cache locks.
    jobs = max(1, min(opts.jobs or os.cpu_count() or 1, len(targets)))
    if jobs == 1:
        return [one(t) for t in targets]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, targets))
