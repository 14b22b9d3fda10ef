"""The build pipeline: load -> prepare (shapes, simplify) -> compile -> bundle -> verify -> write.

Each stage is a function from typed inputs to outputs; the CLI only parses options and calls
``build``. One failing target does not stop the others.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
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


from . import __version__
from .backends import CompileRequest, EngineBuild, all_backends, get_backend
from .batch_items import batch_size, per_item_model
from .bundle import BundleRequest, Bundled, bundle
from .cache import sha256_bytes, sha256_file
from .control_flow import lower_if
from .errors import ArtifactError, EdgepackError, InputError, ToolMissingError, UnsupportedOpError, VerificationError
from .cut_outputs import trim_outputs
from .isa_coverage import kernels_not_run, not_run_line
from .loops import explicit_conditions, hoist_invariants, loop_refusal, static_loops
from .model import LoadedModel, fix_input_shapes, load_model, resolve_output_shapes, simplify
from .prepost import bake_prepost, prepost_config_exists, prepost_manifest, prepost_of
from .quantized import lower_quantized
from .scan_framing import lower_framing_scans
from .signal_lowering import lower_dft, lower_stft
from .spelled_out import fold_spelled_out
from .reference import (POLICY, Comparison, Tolerance, check_input_sizes, compare, output_scale, random_inputs,
                        realistic_inputs, run_onnxruntime, uninformative_outputs)
from .progress import StepProgress
from .runner import NATIVE, Artifact, host_arch
from .targets import Target, verify_only_on
from .toolchains import Toolchain

GOLDEN_SEED = 20261130
_COMPILE_LOCKS: dict[str, threading.Lock] = collections.defaultdict(threading.Lock)
VERIFY_SEED = 7


@dataclass(frozen=True)
class BuildOptions:
    backend: str = "auto"
    precision: str = "fp16"          # fp16: fp16 allowed (ladder down to fp32); fp32: never fp16; or one rung
    input_shapes: dict = field(default_factory=dict)
    out_dir: Path = Path("dist")
    verify: bool = True
    simplify: bool = True
    jobs: int = 0                    # targets built at once (0: one per core)
    preprocess: str | None = None    # e.g. "image:size=224x224,layout=nhwc,dtype=uint8,mean=...,std=..."
    postprocess: str | None = None   # e.g. "softmax,topk=5,labels=labels.txt"
    tuning_db: str | None = None     # TVM MetaSchedule database: None the target's (if any), "off", or a folder
    select: str = "fastest"          # auto: fastest | all | first (edgepack/selection.py)
    bench_on: object = None          # selection.BenchDevice: time the candidates on this device over SSH
    memory: str = "fast"             # ncnn: fast (its defaults) | lean (backends/ncnn/memory.py)
    verify_on: tuple = ()            # verify only on these of the targets' verify_cpus (empty: on all)
    default_threads: str = "auto"    # auto (timed where possible) | all | N: the artifact's thread cap (thread_policy.py)
    arena_plan: bytes | None = None  # ncnn: None records one here; b"" pins none, else this blob (verify-build)


@dataclass(frozen=True)
class PreparedModel:
    model: LoadedModel
    source_sha256: str
    golden_inputs: dict
    golden_outputs: dict
    per_item: LoadedModel | None = None  # the model at batch 1 where it takes a batch of N > 1 (batch_items.py)

    @functools.cached_property
    def verify_cases(self) -> dict[str, tuple[dict, dict]]:
        """The inputs every target is verified on, with onnxruntime's answers: a fresh seeded random
        one, and one in the range real data has (a synthetic scene for image inputs). Computed once
        per model, not once per target (and not at all with --no-verify)."""
        fresh = random_inputs(self.model.inputs, VERIFY_SEED)
        real = realistic_inputs(self.model.inputs, VERIFY_SEED, prepost_of(self.model.proto))
        return {"random": (fresh, run_onnxruntime(self.model, fresh, "seeded random")),
                "realistic": (real, run_onnxruntime(self.model, real, "realistic (synthetic)"))}


@dataclass(frozen=True)
class Check:
    """One run of the artifact: one verification CPU, one input."""
    cpu: str
    input: str
    comparisons: tuple[Comparison, ...]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.comparisons)

    def worst(self) -> Comparison:
        return max(self.comparisons, key=_badness)

    def to_json(self) -> dict:
        return {"cpu": self.cpu, "input": self.input, "ok": self.ok,
                "outputs": [{"name": c.name, "max_abs_err": _num(c.max_abs_err), "bound": c.bound,
                             "rel_err": _num(c.rel_err), "cosine": c.cosine, "ok": c.ok} for c in self.comparisons]}


_LOOPS = ("Loop", "Scan")
_CONTROL_FLOW = _LOOPS + ("If",)  # named first in a refusal, in this order: their bodies hold the others


def _badness(c: Comparison) -> float:
    """How close to failing: error over bound, and cosine shortfall on the same scale."""
    if not c.shape_ok:
        return float("inf")
    r = c.max_abs_err / c.bound if c.bound else (float("inf") if c.max_abs_err else 0.0)
    if c.cosine is not None and c.min_cosine < 1:
        r = max(r, (1 - c.cosine) / (1 - c.min_cosine))
    return r


def _num(x: float) -> float | None:
    """JSON has no inf/nan: an output that is missing or non-finite reports null."""
    return x if x == x and x not in (float("inf"), float("-inf")) else None


@dataclass(frozen=True)
class Verification:
    checks: tuple[Check, ...]
    selftests: dict            # cpu -> the selftest line

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def selftest(self) -> str:
        return next(iter(self.selftests.values()), "")

    def worst(self) -> Comparison:
        return max((c.worst() for c in self.checks), key=_badness)

    @property
    def max_abs_err(self) -> float:
        return self.worst().max_abs_err

    @property
    def bound(self) -> float:
        return self.worst().bound

    @property
    def rel_err(self) -> float:
        return max(c.rel_err for ch in self.checks for c in ch.comparisons)

    @property
    def min_cosine(self) -> float | None:
        cos = [c.cosine for ch in self.checks for c in ch.comparisons if c.cosine is not None]
        return min(cos) if cos else None

    def per_cpu(self) -> dict:
        out = {}
        for cpu in dict.fromkeys(ch.cpu for ch in self.checks):
            comps = [c for ch in self.checks if ch.cpu == cpu for c in ch.comparisons]
            cos = [c.cosine for c in comps if c.cosine is not None]
            out[cpu] = {"max_abs_err": _num(max(c.max_abs_err for c in comps)),
                        "rel_err": _num(max(c.rel_err for c in comps)), "min_cosine": min(cos) if cos else None,
                        "ok": all(c.ok for c in comps)}
        return out


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
    precision: str | None = None        # the rung kept: fp16-arith, fp16-storage or fp32
    rel_err: float | None = None        # worst max|a-b| / max|ref| over CPUs, inputs and outputs
    min_cosine: float | None = None
    per_cpu: dict = field(default_factory=dict)
    rejected: tuple[dict, ...] = ()     # precision rungs tried and rejected, with their errors
    selection: dict = field(default_factory=dict)  # auto's timed candidates and the one kept (selection.py)
    default_threads: dict = field(default_factory=dict)  # the thread cap written in and why (thread_policy.py)

    def to_json(self) -> dict:
        return {"target": self.target, "ok": self.ok, "backend": self.backend,
                "file": str(self.path) if self.path else None, "size": self.size,
                "runtime_bytes": self.size - self.weight_bytes if self.size else None,
                "max_abs_err": self.max_abs_err, "bound": self.bound, "precision": self.precision,
                "rel_err": self.rel_err, "min_cosine": self.min_cosine, "per_cpu": self.per_cpu,
                "precision_rejected": list(self.rejected), "seconds": round(self.seconds, 2),
                "error": self.error, "hint": self.hint, "exit_code": self.exit_code, "notes": list(self.notes),
                "selection": self.selection or None,
                "default_threads": self.default_threads or None,
                "sha256": sha256_file(self.path) if self.ok and self.path and Path(self.path).is_file() else None}


# ---- stages --------------------------------------------------------------------------------

def lowered_for_backends(model: LoadedModel, simplify_graph: bool = True) -> LoadedModel:
    """The graph every backend is given (and `edgepack inspect` shows): onnxruntime's dynamic-int8 ops
    as float ops, simplified, then the Ifs decided by data as Where (control_flow.py), STFTs as
    convolutions and DFTs as MatMuls (signal_lowering.py), framing Scans as Gathers (scan_framing.py),
    one-hot products as Gathers and written-out softmaxes as Softmax (spelled_out.py)."""
    model = explicit_conditions(lower_quantized(model))  # before onnxsim, which would unroll such loops
    if simplify_graph:
        model = simplify(model)      # folds the Ifs whose condition is a constant
    # the others, where both branches are safe to compute; STFT as Conv, framing Scans as Gather, DFT as MatMul
    lowered = fold_spelled_out(lower_dft(lower_framing_scans(lower_stft(lower_if(model)))))
    if lowered is model:
        return model
    return simplify(lowered) if simplify_graph else lowered


def prepared_loops(model: LoadedModel) -> LoadedModel:
    """The Loops the runtime steps, as the plan takes them (loops.py): what every step computes alike
    moved in front, outputs at the body's static shapes, and a decoder's outputs up to the step it stopped
    at computed whole and cut at run time (cut_outputs.py). After baking pre/post-processing, which
    re-reads the graph's outputs."""
    return trim_outputs(static_loops(hoist_invariants(model)))


def _prepared_graph(path: Path, opts: BuildOptions, shapes: dict) -> tuple[LoadedModel, LoadedModel, bool]:
    """(the model with its input shapes fixed, the graph the backends get, whether pre/post-processing
    was baked in)."""
    model = load_model(path)
    model = fix_input_shapes(model, shapes)
    check_input_sizes(model.inputs, model.path.name)
    given = model
    model = lowered_for_backends(model, opts.simplify)
    baked = bool(opts.preprocess or opts.postprocess or prepost_config_exists(path))
    if baked:
        # Graph surgery before compilation, so every backend gets the same pre/post-processing.
        model = bake_prepost(model, path, opts.preprocess, opts.postprocess)
        check_input_sizes(model.inputs, model.path.name)
    return given, prepared_loops(model), baked


def prepare(path: Path, opts: BuildOptions) -> PreparedModel:
    given, model, baked = _prepared_graph(path, opts, opts.input_shapes)
    # The selftest's golden input is a realistic one (a synthetic scene for image inputs): on
    # noise a detector answers ~0 and the selftest's bound would measure nothing.
    golden_in = realistic_inputs(model.inputs, GOLDEN_SEED, prepost_of(model.proto))
    golden_out = run_onnxruntime(model, golden_in, "realistic (synthetic)")
    if not baked:
        model = _checked_against(given, model, golden_in, golden_out)
    # outputs written with -1 or symbolic dims: onnxruntime's answer for the static inputs says
    model = resolve_output_shapes(model, golden_out)
    # a batch of N > 1: the same model at batch 1 too, for backends that run a batch item by item
    item = per_item_model(model, given, lambda shapes: _prepared_graph(path, opts, shapes)[1])
    return PreparedModel(model, sha256_file(path), golden_in, golden_out, item)


def _checked_against(given: LoadedModel, prepared: LoadedModel, inputs: dict, answer: dict) -> LoadedModel:
    """Every build is verified against the prepared graph (simplified, lowered); this says, in the build's
    notes, where that graph answers the golden input otherwise than the model itself does beyond the
    verification bound (onnxsim or a lowering changed it: then the artifact is right about the wrong
    graph). A note, not an error: onnxruntime's int8 kernels round otherwise than exact float ops do."""
    try:
        own = run_onnxruntime(given, inputs, "realistic (synthetic)")
    except EdgepackError:
        return prepared  # the model itself does not run as given (what a lowering is for)
    off = [c for c in compare(answer, {k: v for k, v in own.items() if k in answer}, POLICY) if not c.ok]
    if not off:
        return prepared
    worst = max(off, key=_badness)
    note = (f"warning: the prepared graph answers output {worst.name} of the golden input otherwise than the "
            f"model itself ({worst.why()}); builds are verified against the prepared graph: compare with "
            f"--no-simplify")
    return dataclasses.replace(prepared, notes=prepared.notes + (note,))


def precision_ladder(backend, target: Target, requested: str) -> list[str]:
    """The precisions to try on ``backend``, best first: a backend with several (NCNN) says which
    for this target; --fp32 (or a pinned rung, as verify-build passes) allows only that one."""
    ladder = getattr(backend, "precision_ladder", None)
    return list(ladder(target, requested)) if ladder else [requested]


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
            # a loop, then a branch, first: the ops inside their bodies are refused only for being there
            op, nodes = min(unsupported.items(), key=lambda kv: (_CONTROL_FLOW.index(kv[0]) if kv[0] in _CONTROL_FLOW else len(_CONTROL_FLOW), kv[0]))
            more = f" (+{len(unsupported) - 1} more op types)" if len(unsupported) > 1 else ""
            out.append((name, f"{name} cannot build op {op} (node {nodes[0]}){more}"))
        else:
            out.append((name, None))
    return out


def manifest_for(prep: PreparedModel, target: Target, engine: EngineBuild, tc: Toolchain, opts: BuildOptions,
                 rung: str | None = None) -> dict:
    precision = rung or opts.precision
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
        # "fp16" or "fp32" (what older readers expect); the exact rung in precision_rung
        "precision": "fp32" if precision == "fp32" else "fp16",
        "precision_rung": precision,
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
                  "tuning_db": opts.tuning_db,
                  "memory": opts.memory,
                  # this target's share of --verify-on (its narrowed verify_cpus): what verify-build, which
                  # rebuilds one target, must pass again; the whole list could name another target's CPU
                  "verify_on": list(target.verify_cpus) if opts.verify_on else None,
                  "target_file_sha256": sha256_file(Path(target.source)) if target.source else None,
                  "options": {k: v for k, v in sorted(engine.options.items())}},
    }


# Keys whose values are measured, not determined by the build's inputs (how long TVM took to compile):
# they go in the sidecar .json only, so that the executable's bytes are the same on every rebuild.
# The arena plan's sizes (first fit against planned) are measured too; the plan itself is a model blob.
MEASURED_KEYS = frozenset({"compile_seconds", "arena_plan"})


def without_measurements(obj):
    """``obj`` (the manifest, or a part of it) with every MEASURED_KEYS entry removed, at any depth."""
    if isinstance(obj, dict):
        return {k: without_measurements(v) for k, v in obj.items() if k not in MEASURED_KEYS}
    if isinstance(obj, list):
        return [without_measurements(v) for v in obj]
    return obj


def verify(path: Path, target: Target, prep: PreparedModel, tol: Tolerance, workdir: Path,
           log: Callable[[str], None] = lambda m: None) -> Verification:
    """Run the artifact on every CPU the target may meet (qemu models, or this machine), on each
    verification input and on its own selftest; stop at the first disagreement. Under qemu each run
    takes seconds to minutes: a progress bar on a terminal counts them."""
    vdir = workdir / "verify"
    vdir.mkdir(parents=True, exist_ok=True)
    # each output's scale: the largest it shows on any input we know the answer for
    scales = {}
    for ref in [r for _, r in prep.verify_cases.values()] + [prep.golden_outputs]:
        for name, arr in ref.items():
            scales[name] = max(scales.get(name, 0.0), output_scale(arr))
    for name in uninformative_outputs([r for _, r in prep.verify_cases.values()] + [prep.golden_outputs]):
        log(f"warning: output {name} is 0 on every verification input, so its check cannot fail; if the model "
            f"masks by a length or threshold input, see that the verification inputs reach real data")
    steps = sum(len(_cases_on(cpu, prep)) + 1 for cpu in target.verify_cpus)  # the runs, one selftest per CPU
    with StepProgress(f"[{target.name}] verifying on {len(target.verify_cpus)} CPU(s)", lambda m: None) as progress:
        return _verify_runs(path, target, prep, tol, vdir, scales, lambda: progress.advance(steps),
                            log)


def _cases_on(cpu: str, prep: PreparedModel) -> dict[str, tuple[dict, dict]]:
    """The verification inputs run on ``cpu``: all of them natively; under qemu, where one inference of a
    real model costs minutes (ddddocr_det: about 9 under Haswell), the realistic one only, because the
    selftest that follows on every CPU checks a seeded random input (the golden one) against the same
    policy, so a second random input there would repeat its check at the cost of another inference."""
    cases = prep.verify_cases
    return cases if cpu == NATIVE else {k: v for k, v in cases.items() if k == "realistic"}


def _verify_runs(path: Path, target: Target, prep: PreparedModel, tol: Tolerance, vdir: Path, scales: dict,
                 step_done: Callable[[], None], log) -> Verification:
    """Each verification CPU's runs, one CPU per free core at a time: under qemu one inference of a real
    model costs minutes (YOLO11s-seg: ~3.5 under each of arm64's two CPU models), and one CPU's runs
    do not wait for another's. A CPU that rejects the build stops the others at their next run."""
    cpus = list(target.verify_cpus)
    stop, lock = threading.Event(), threading.Lock()

    def done() -> None:
        with lock:
            step_done()

    with ThreadPoolExecutor(max_workers=max(1, min(len(cpus), len(os.sched_getaffinity(0))))) as pool:
        results = list(pool.map(lambda cpu: _verify_on(cpu, path, prep, tol, vdir, scales, done, log, stop), cpus))
    checks = [c for runs, _, _ in results for c in runs]
    for _, _, error in results:  # the first CPU's rejection, in the target's order
        if error:
            raise _rejected(error, checks)
    # baked detection: the artifact's boxes on test-made images vs the numpy reference (issue 13)
    from .prepost.verify import check_detections
    check_detections(path, prep.model, target.verify_cpus, vdir / "detect", prep.verify_cases["realistic"][0], log,
                     tuple(checks))
    return Verification(tuple(checks), {cpu: selftest for cpu, (_, selftest, _) in zip(cpus, results)})


def _verify_on(cpu: str, path: Path, prep: PreparedModel, tol: Tolerance, vdir: Path, scales: dict,
               step_done: Callable[[], None], log, stop: threading.Event) -> tuple[list, str, str | None]:
    """One CPU's runs: (its checks, its selftest's answer, why it rejects the build or None). Sets
    ``stop`` on a rejection, and runs nothing more once it is set."""
    art, checks = Artifact(path, cpu=cpu), []

    def rejects(why: str) -> tuple[list, str, str]:
        stop.set()
        return checks, "", why

    for label, (inputs, ref) in _cases_on(cpu, prep).items():
        if stop.is_set():
            return checks, "", None
        try:
            got = art.predict({s.name: inputs[s.name] for s in prep.model.inputs}, vdir / f"{cpu}-{label}")
        except (ArtifactError, InputError) as exc:
            return rejects(f"run failed on CPU {cpu}: {exc.message}")
        check = Check(cpu, label, tuple(compare(got, ref, tol, scales)))
        checks.append(check)
        step_done()
        w = check.worst()
        log(f"{_runner(cpu)}, {label} input: {w.name} max error {w.max_abs_err:.2e} "
            f"({w.rel_err:.2%} of scale), cosine {w.cosine if w.cosine is not None else '-'}")
        if not check.ok:
            return rejects(f"{path.name} disagrees with onnxruntime on output {w.name} ({_runner(cpu)}, "
                           f"{label} input): {w.why()}")
    if stop.is_set():
        return checks, "", None
    # one inference is enough to check the golden output (under qemu each costs seconds). The cases
    # above ran on 1 thread; a device runs on its free cores, so under qemu the selftest runs on 2 and
    # each CPU's kernels are also checked split between threads (natively, the thread-cap timing
    # selftests every count it times: thread_policy.py)
    threads = "1" if cpu == NATIVE else "2"
    st = art.run(["selftest", "--threads", threads, "--runs", "1", "--warmup", "0"], check=False)
    step_done()
    if st.returncode != 0:
        stop.set()
        return checks, st.stdout.strip(), f"{path.name} selftest failed on CPU {cpu}: {st.stdout.strip() or _tail(st.stderr)}"
    return checks, st.stdout.strip(), None


def _rejected(message: str, checks: list) -> VerificationError:
    exc = VerificationError(message, hint="edgepack tried every precision that --fp16/--fp32 allowed on this "
                                          "backend; try another --backend")
    exc.checks = tuple(checks)  # the measured errors, for the manifest's record of rejected rungs
    return exc


def _runner(cpu: str) -> str:
    return "native" if cpu == NATIVE else f"qemu -cpu {cpu}"


def _tail(text: str) -> str:
    lines = [l for l in (text or "").strip().splitlines() if not l.startswith("qemu-")]  # TCG feature warnings
    return " ".join(lines)[-300:]


def build_target(prep: PreparedModel, target: Target, opts: BuildOptions, tc: Toolchain,
                 log: Callable[[str], None]) -> TargetResult:
    t0 = time.monotonic()
    model = prep.model
    reasons, rejected = [], []
    candidates = backend_candidates(model, target, opts.backend)
    # issue 9 item 4: NCNN on what it can take + TVM for the rest, before a whole-graph fallback
    from .partition_build import with_split
    candidates = with_split(candidates, model, target, opts.backend)
    # issue 10 item 4: where the candidates can be timed, every one that verifies is built (into a
    # staging folder) and the fastest kept; elsewhere the first that verifies
    from . import selection
    timing = selection.where_to_time(target, opts.select, opts.bench_on) \
        if opts.backend == "auto" and opts.verify else None
    verified, not_built = [], []
    stage = tempfile.TemporaryDirectory(prefix=f"edgepack-select-{target.name}-") if timing else None
    try:
        res = _build_candidates(prep, target, opts, tc, log, candidates, reasons, rejected, t0, timing,
                                verified, not_built, stage)
    finally:
        if stage:
            stage.cleanup()
    return res


def with_thread_cap(res: TargetResult, target: Target, opts: BuildOptions, log: Callable[[str], None]) -> TargetResult:
    """The kept artifact's default thread count, timed where it can be (a verified artifact only).
    build() calls it once every target is built, so that no other target's build shares the CPUs."""
    from . import selection, thread_policy
    t0 = time.monotonic()
    timing = selection.where_to_time(target, "fastest", opts.bench_on) if opts.verify else None
    res = thread_policy.apply(res, opts.default_threads, timing, opts.bench_on, opts.verify,
                              lambda m: log(f"[{target.name}] {m}"))
    return dataclasses.replace(res, seconds=res.seconds + time.monotonic() - t0)


def _build_candidates(prep, target, opts, tc, log, candidates, reasons, rejected, t0, timing, verified,
                      not_built, stage) -> TargetResult:
    from . import selection
    last: EdgepackError | None = None
    for name, why_not in candidates:
        if why_not:
            reasons.append(why_not)
            log(f"[{target.name}] skip {why_not}")
            continue
        if timing and (why_not := selection.skip_reason(name, verified, target, opts.tuning_db, opts.select)):
            not_built.append(why_not)
            log(f"[{target.name}] {why_not}")
            continue
        backend = get_backend(name)
        rungs = precision_ladder(backend, target, opts.precision)
        for rung in rungs:
            try:
                if not timing:
                    return _attempt(prep, target, opts, tc, log, name, backend, rung, reasons, rejected, t0)
                staged = dataclasses.replace(opts, out_dir=Path(stage.name) / f"c{len(verified)}")
                verified.append(_attempt(prep, target, staged, tc, log, name, backend, rung, reasons, rejected, t0))
                break
            except VerificationError as exc:
                # the artifact is wrong at this precision: the next rung down, then the next backend
                checks = getattr(exc, "checks", ())
                worst = max((c.worst() for c in checks), key=_badness) if checks else None
                rejected.append({"backend": name, "precision": rung, "error": exc.message,
                                 "rel_err": _num(worst.rel_err) if worst else None,
                                 "checks": [c.to_json() for c in checks]})
                log(f"[{target.name}] {name} {rung} rejected: {exc.message}")
                last = exc
                if rung == rungs[-1]:
                    reasons.append(f"{name}: {exc.message}")
            except EdgepackError as exc:
                reasons.append(f"{name}: {exc.message}")
                log(f"[{target.name}] {name} failed: {exc.message}")
                last = exc
                break
        if opts.backend != "auto" and last is not None:
            return TargetResult(target.name, False, name, seconds=time.monotonic() - t0, error=last.message,
                                hint=last.hint, exit_code=last.exit_code, rejected=tuple(rejected))
    if verified:
        return selection.keep_fastest(verified, timing, opts, tuple(not_built), tuple(reasons), t0,
                                      lambda m: log(f"[{target.name}] {m}"))
    if not reasons:
        reasons.append("no backend configured")
    msg = "; ".join(reasons)
    # The op-support hint only where op support is the cause: every backend refused an op.
    op_refusals = [r for _, r in candidates if r is not None and " cannot build op " in r]
    if last is None and op_refusals and len(op_refusals) == len(candidates) or isinstance(last, UnsupportedOpError):
        code, hint = UnsupportedOpError.exit_code, "see `edgepack inspect MODEL` for op support per backend"
        if any(f" cannot build op {op} " in r for r in op_refusals for op in _LOOPS):
            why = loop_refusal(prep.model.proto) or "a Scan, which the runtime does not step"
            hint = (f"the artifact steps a Loop itself only when its body has no scan outputs, reads no computed "
                    f"value from outside and keeps its sizes; here {why}: export the loop's body as its own model "
                    f"and step it from your code, or export with a fixed number of steps; " + hint)
    elif last is not None:
        code, hint = last.exit_code, last.hint
    else:
        code, hint = ToolMissingError.exit_code, "run `edgepack doctor`"
    return TargetResult(target.name, False, None, seconds=time.monotonic() - t0, error=msg, hint=hint,
                        exit_code=code, rejected=tuple(rejected))


def _attempt(prep: PreparedModel, target: Target, opts: BuildOptions, tc: Toolchain, log, name: str, backend,
             rung: str, reasons: list, rejected: list, t0: float) -> TargetResult:
    """Compile, bundle and verify one (backend, precision); the artifact is moved to the output
    folder only when verified. Raises VerificationError when its numbers are off."""
    model = prep.model
    with tempfile.TemporaryDirectory(prefix=f"edgepack-{target.name}-") as tmp:
        workdir = Path(tmp)
        t_stage = time.monotonic()
        # Targets build in threads; a backend whose compiler keeps global state (TVM's
        # importer does) compiles one target at a time.
        # a backend without a batch axis runs a batch of N one item at a time, on the batch-1 graph
        items = batch_size(model) if prep.per_item is not None and getattr(backend, "runs_items", False) else 1
        with contextlib.nullcontext() if getattr(backend, "thread_safe", False) else _COMPILE_LOCKS[name]:
            engine = backend.compile(CompileRequest(prep.per_item if items > 1 else model, target, rung,
                                                    workdir / "compile", tc, lambda m: log(f"[{target.name}] {m}"),
                                                    opts.tuning_db, items))
        from .backends.ncnn.memory import apply_memory_mode
        engine = apply_memory_mode(engine, opts.memory, workdir / "memory", target.arch)
        # one bound policy for every backend and precision, in the verification and the selftest alike
        engine = dataclasses.replace(engine, tolerance=POLICY)
        kept = engine.manifest.get("precision") or engine.manifest.get("compute_precision") or rung
        log(f"[{target.name}] {name} {kept}: compiled in {time.monotonic() - t_stage:.1f} s")
        t_stage = time.monotonic()
        manifest = manifest_for(prep, target, engine, tc, opts, kept)
        out_path = Path(opts.out_dir) / f"{model.name}-{target.name}"
        staged = workdir / "artifact"

        def bundled(built_engine: EngineBuild, its_manifest: dict, folder: str) -> Bundled:
            return bundle(BundleRequest(
                model.name, target, built_engine, model.inputs, model.outputs, prep.golden_inputs,
                prep.golden_outputs, without_measurements(its_manifest), workdir / folder, staged, tc))
        built = bundled(engine, manifest, "bundle")
        log(f"[{target.name}] bundled {built.size / 1e6:.2f} MB in {time.monotonic() - t_stage:.1f} s")
        # offsets for the arena's tensors (backends/ncnn/arena_plan.py): planned from runs on this machine,
        # or (verify-build) the plan the artifact carries, which needs no run here
        records = NATIVE in target.verify_cpus and target.arch == host_arch()
        if engine.backend == "ncnn" and (records or opts.arena_plan is not None):
            from .backends.ncnn.arena_plan import plan_arena
            t_stage = time.monotonic()
            planned = plan_arena(engine, staged, workdir / "arena", log=lambda m: log(f"[{target.name}] {m}"),
                                 pinned=opts.arena_plan)
            if planned is not engine:
                engine, manifest = planned, manifest_for(prep, target, planned, tc, opts, kept)
                built = bundled(engine, manifest, "bundle-planned")
                log(f"[{target.name}] planned and bundled again in {time.monotonic() - t_stage:.1f} s")
        t_stage = time.monotonic()
        verification = None
        if opts.verify:
            log(f"[{target.name}] verifying {kept} against onnxruntime on CPUs "
                + ", ".join(_runner(c) for c in target.verify_cpus))
            verification = verify(staged, target, prep, engine.tolerance, workdir,
                                  log=lambda m: log(f"[{target.name}]   {m}"))
            log(f"[{target.name}] verified in {time.monotonic() - t_stage:.1f} s: max error "
                f"{verification.max_abs_err:.2e} (bound {verification.bound:.2e}, "
                f"{verification.rel_err:.3%} of scale)")
            if not_run := kernels_not_run(target):
                log(not_run_line(target, not_run))
        out_path.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(staged, out_path)
        full = dict(manifest)
        full["artifact"] = {"file": out_path.name, "size": built.size, "sha256": sha256_file(out_path),
                            "weight_bytes": engine.weight_bytes,
                            "runtime_bytes": built.size - engine.weight_bytes}
        if verification:
            full["verification"] = {
                "max_abs_err": verification.max_abs_err, "bound": verification.bound,
                "rel_err": verification.rel_err, "min_cosine": verification.min_cosine,
                "policy": engine.tolerance.to_json(), "per_cpu": verification.per_cpu(),
                "checks": [c.to_json() for c in verification.checks],
                "selftest": next(iter(verification.selftests.values()), ""),
                "selftests": verification.selftests,
                "runner": ", ".join(_runner(c) for c in target.verify_cpus),
                "not_run": list(kernels_not_run(target))}
        full["backend_choice"] = {"used": name, "skipped": list(reasons)}
        full["precision_choice"] = {
            "allowed": opts.precision, "kept": kept, "rejected": list(rejected),
            "why": (f"{kept}: the first precision that verified on every CPU"
                    + (f" ({len(rejected)} rejected before it)" if rejected else "")) if verification
            else f"{kept}: not verified (--no-verify)"}
        out_path.with_name(out_path.name + ".json").write_text(json.dumps(full, indent=1, sort_keys=True))
        notes = tuple(model.notes) + tuple(engine.notes) + tuple(f"skipped: {r}" for r in reasons)
        notes += tuple(f"rejected {r['backend']} {r['precision']}: {r['error']}" for r in rejected)
        v = verification
        return TargetResult(target.name, True, name, out_path, built.size, engine.weight_bytes,
                            v.max_abs_err if v else None, v.bound if v else None, time.monotonic() - t0,
                            notes=notes, precision=kept, rel_err=_num(v.rel_err) if v else None,
                            min_cosine=v.min_cosine if v else None, per_cpu=v.per_cpu() if v else {},
                            rejected=tuple(rejected))


def build(model_path: Path, targets: list[Target], opts: BuildOptions, log: Callable[[str], None] = print,
          on_result: Callable[[TargetResult], None] | None = None) -> list[TargetResult]:
    # each target names its toolchain (targets/*.toml `toolchain`, a toolchains/<name>.toml)
    # narrowed here, before anything is built: the manifest's target records where it was verified
    targets = verify_only_on(targets, tuple(opts.verify_on))
    toolchains = {name: Toolchain.load(name) for name in sorted({t.toolchain for t in targets})}
    for tc in toolchains.values():
        tc.check()
    prep = prepare(Path(model_path), opts)
    for note in prep.model.notes:
        log(note)
    def guarded(target: Target, step: Callable[[], TargetResult]) -> TargetResult:
        try:
            return step()
        except EdgepackError as exc:
            return TargetResult(target.name, False, error=exc.message, hint=exc.hint, exit_code=exc.exit_code)
        except Exception as exc:  # a bug must not stop the other targets; report it fully
            return TargetResult(target.name, False, error=f"internal error: {type(exc).__name__}: {exc}",
                                hint="please report this with --debug output", exit_code=70,
                                notes=(traceback.format_exc(),))

    def one(target: Target) -> TargetResult:
        res = guarded(target, lambda: build_target(prep, target, opts, toolchains[target.toolchain], log))
        if on_result and not res.ok:
            on_result(res)
        return res

    # Targets build side by side: most of a target's time is spent waiting on zig and on qemu
    # verification, and shared heavy steps (libncnn, conversion) are serialised by cache locks.
    jobs = max(1, min(opts.jobs or os.cpu_count() or 1, len(targets)))
    if jobs == 1:
        built = [one(t) for t in targets]
    else:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            built = list(pool.map(one, targets))
    # then each kept artifact's thread count, timed one target at a time on an otherwise idle build
    results = []
    for target, res in zip(targets, built):
        if res.ok:
            res = guarded(target, lambda: with_thread_cap(res, target, opts, log))
            if on_result:
                on_result(res)
        results.append(res)
    return results
