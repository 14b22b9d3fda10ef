"""ONNX's node conformance suite as a peer test: every case through each backend, classified.

onnx generates the suite (`onnx.backend.test.loader.load_node_model_tests()`: 1884 one-node models with
inputs and expected outputs). Each case goes through edgepack's own `prepare` (load, simplify, onnxruntime
reference) and then, per backend, the fast path a build takes without zig:
  ncnn  pnnx conversion + its check (`convert`), then the ncnn Python wheel on the verification inputs
        (the build's bound, POLICY) and on the case's inputs;
  tvm   from_onnx -> the fused CPU pipeline -> relax VM on this host, same checks;
and `--artifacts N` builds N sampled cases as full x86_64 artifacts (`edgepack build --fp32`) and runs them
on the case's inputs. Outcomes:
  pass     the case's expected outputs, within the build's bound (0.5% of scale + cosine)
  refused  a clean EdgepackError (unsupported op, reference cannot run it, verification rejected it)
  wrong    verification let it through, yet it disagrees with the expected outputs (a bug)
  crash    an internal error (traceback), a signal, or a timeout
`wrong` cases where onnxruntime itself disagrees with the expected outputs are reported as `ref-differs`
(the build's reference is onnxruntime; such a case says nothing about the backend).

Usage: python3 bench/node_suite.py [--sample N --seed S] [--cases a,b] [--float32] [--backends ncnn,tvm]
       [--artifacts N] [--json FILE] [--markdown FILE] [--timeout 300]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
RESULTS = Path(__file__).resolve().parent / "results"
OUTCOMES = ("pass", "refused", "wrong", "ref-differs", "crash")


def load_cases(names: list[str] | None = None, float32: bool = False) -> list:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generators' own overflow warnings (Cast cases)
        cases = [c for c in (_generate_only(names) if names else None) or _generate_all() if c.data_sets]
    if names:
        unknown = sorted(set(names) - {c.name for c in cases})
        if unknown:
            raise SystemExit(f"error: unknown node case(s) {unknown}")
        cases = [c for c in cases if c.name in names]
    if float32:
        cases = [c for c in cases if all(np.asarray(a).dtype == np.float32 for a in c.data_sets[0][0])]
    return cases


def _generate_all() -> list:
    from onnx.backend.test.loader import load_node_model_tests
    return load_node_model_tests()


def _generate_only(names: list[str]) -> list | None:
    """Generate only the cases' own op modules (onnx.backend.test.case.node.<op>: importing one runs
    its generators) instead of all 1884 (~40 s on a busy machine). None when a module is not found."""
    import importlib
    import onnx.backend.test.case.node as node
    for name in names:
        parts = name.removeprefix("test_").split("_")
        for n in range(len(parts), 0, -1):
            mod = "_".join(parts[:n])
            try:
                importlib.import_module(f"onnx.backend.test.case.node.{mod}")
                break
            except ModuleNotFoundError:
                try:
                    importlib.import_module(f"onnx.backend.test.case.node.{mod}_")  # and_, or_, not_
                    break
                except ModuleNotFoundError:
                    continue
        else:
            return None
    found = {c.name for c in node._NodeTestCases}
    return list(node._NodeTestCases) if set(names) <= found else None


def _graph_inputs(proto) -> list[str]:
    inits = {i.name for i in proto.graph.initializer}
    return [i.name for i in proto.graph.input if i.name not in inits]


def _value(v):
    """A case's data: numpy arrays, or TensorProtos (the Cast cases), or lists (sequences: kept)."""
    from onnx import TensorProto, numpy_helper
    if isinstance(v, TensorProto):
        return numpy_helper.to_array(v)
    return np.asarray(v) if isinstance(v, (np.ndarray, np.generic)) else v


def case_io(case) -> tuple[dict, dict]:
    ins, outs = case.data_sets[0]
    in_names = _graph_inputs(case.model)
    out_names = [o.name for o in case.model.graph.output]
    return dict(zip(in_names, map(_value, ins))), dict(zip(out_names, map(_value, outs)))


def _tensors_only(*dicts) -> bool:
    return all(isinstance(v, np.ndarray) for d in dicts for v in d.values())


def judge(got: dict, expected: dict, rtol: float, atol: float) -> tuple[bool, bool, str]:
    """(within POLICY, within the case's own rtol/atol, worst line). Values compare as float64:
    an NCNN artifact returns float32 for an int or bool output."""
    from edgepack.reference import POLICY, compare
    g = {k: np.asarray(v).astype(np.float64) for k, v in got.items()}
    e = {k: np.asarray(v).astype(np.float64) for k, v in expected.items()}
    comps = compare(g, e, POLICY)
    bad = [c for c in comps if not c.ok]
    strict = all(k in g and g[k].shape == v.shape and np.allclose(g[k], v, rtol=rtol, atol=atol, equal_nan=True)
                 for k, v in e.items())
    worst = max(comps, key=lambda c: c.rel_err if c.shape_ok else float("inf"))
    return not bad, strict, (f"{bad[0].name}: {bad[0].why()}" if bad else f"rel err {worst.rel_err:.1e}")


def _verify_like_build(model, run, prep) -> None:
    """The build's verification on the fast path: both verification inputs, the one bound."""
    from edgepack.errors import VerificationError
    from edgepack.reference import POLICY, compare, output_scale
    scales = {}
    for _, ref in prep.verify_cases.values():
        for k, v in ref.items():
            scales[k] = max(scales.get(k, 0.0), output_scale(v))
    for label, (inputs, ref) in prep.verify_cases.items():
        got = run(inputs)
        for c in compare(got, ref, POLICY, scales):
            if not c.ok:
                raise VerificationError(f"verification ({label} input) rejects output {c.name}: {c.why()}")


def _ncnn_runner(prep):
    from edgepack.backends import get_backend
    from edgepack.backends.ncnn.convert import convert, run_python_ncnn
    from edgepack.errors import UnsupportedOpError
    model = prep.model
    uns = get_backend("ncnn").unsupported_ops(model)
    if uns:
        raise UnsupportedOpError(f"ncnn cannot build op {sorted(uns)[0]}")
    conv = convert(model, "fp32", log=lambda m: None)
    return lambda inputs: run_python_ncnn(model, conv, inputs)


def _tvm_runner(prep):
    from edgepack.backends import get_backend
    from edgepack.backends.tvm.compile import fuse, import_onnx, lower_pipeline
    from edgepack.errors import BuildError, UnsupportedOpError
    import tvm
    from tvm import relax
    model = prep.model
    uns = get_backend("tvm").unsupported_ops(model)
    if uns:
        raise UnsupportedOpError(f"tvm cannot build op {sorted(uns)[0]}")
    tgt = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "x86-64"})
    mod = import_onnx(model)
    try:
        with tvm.transform.PassContext(opt_level=3):
            ex = relax.build(fuse(mod, tgt), target=tgt, relax_pipeline=lower_pipeline(tgt))
    except Exception as exc:
        raise BuildError(f"TVM could not compile: {str(exc).strip().splitlines()[-1][:200]}") from exc
    vm = relax.VirtualMachine(ex, tvm.cpu())
    names = [s.name for s in model.outputs]

    def run(inputs):
        out = vm["main"](*[tvm.runtime.tensor(np.array(inputs[s.name], order="C")) for s in model.inputs])
        outs = list(out) if isinstance(out, (list, tuple)) or type(out).__name__ == "Array" else [out]
        return {n: o.numpy() for n, o in zip(names, outs)}
    return run


RUNNERS = {"ncnn": _ncnn_runner, "tvm": _tvm_runner}


def fast_case(case, backends: list[str], workdir: Path) -> dict:
    """One case on the fast path of every backend (runs in a forked child)."""
    from edgepack.errors import EdgepackError
    from edgepack.pipeline import BuildOptions, prepare
    from edgepack.reference import run_onnxruntime
    path = workdir / f"{case.name}.onnx"
    path.write_bytes(case.model.SerializeToString())
    inputs, expected = case_io(case)
    res = {"case": case.name, "ops": sorted({n.op_type for n in case.model.graph.node})}
    try:
        prep = prepare(path, BuildOptions(precision="fp32"))
    except EdgepackError as exc:
        return res | {b: {"outcome": "refused", "detail": f"prepare: {exc.message}"} for b in backends}
    except Exception as exc:
        return res | {b: {"outcome": "crash", "detail": f"prepare: {type(exc).__name__}: {exc}"[:300]}
                      for b in backends}
    if not _tensors_only(inputs, expected):  # edgepack builds take and give tensors only
        return res | {b: {"outcome": "refused", "detail": "not run: the case's data are sequences or optionals, "
                                                          "not tensors"} for b in backends}
    declared = {sp.name: tuple(int(d) for d in sp.shape) for sp in prep.model.inputs}
    odd = [k for k, v in inputs.items() if k in declared and v.shape != declared[k]]
    if odd:  # as an artifact does (exit 3): the data must have the declared shape
        return res | {b: {"outcome": "refused", "detail": f"input {odd[0]}: shape {list(inputs[odd[0]].shape)}, "
                                                          f"the model declares {list(declared[odd[0]])}"} for b in backends}
    ref_ok = None
    for b in backends:
        try:
            run = RUNNERS[b](prep)
            _verify_like_build(prep.model, run, prep)
            ok, strict, detail = judge(run(inputs), expected, case.rtol, case.atol)
            if ok:
                res[b] = {"outcome": "pass", "strict": strict, "detail": detail}
                continue
            if ref_ok is None:
                ref_ok = judge(run_onnxruntime(prep.model, inputs, "case"), expected, case.rtol, case.atol)[0]
            res[b] = {"outcome": "wrong" if ref_ok else "ref-differs", "detail": detail}
        except EdgepackError as exc:
            res[b] = {"outcome": "refused", "detail": f"{type(exc).__name__}: {exc.message}"[:300]}
        except Exception as exc:
            tb = traceback.format_exc().strip().splitlines()
            res[b] = {"outcome": "crash", "detail": f"{type(exc).__name__}: {exc}"[:200] + " @ " + tb[-3][:120]}
    return res


def artifact_case(case, workdir: Path, timeout: float) -> dict:
    """The case as a user would: `edgepack build --target x86_64 --fp32`, then `run` on its inputs."""
    path = workdir / f"{case.name}.onnx"
    path.write_bytes(case.model.SerializeToString())
    inputs, expected = case_io(case)
    cmd = [sys.executable, "-m", "edgepack", "build", str(path), "--target", "x86_64", "--fp32", "--json",
           "--jobs", "1", "--out", str(workdir / "dist")]
    if not _tensors_only(inputs, expected):
        return {"outcome": "refused", "detail": "not run: the case's data are sequences or optionals, not tensors"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=workdir)
    # an internal error exits 70 (its traceback only with --debug); TVM's C++ warnings are not crashes
    if p.returncode == 70 or p.returncode < 0 or "Traceback (most recent call last)" in p.stderr:
        return {"outcome": "crash", "detail": (p.stderr.strip().splitlines() or ["?"])[-1][:300]}
    try:
        r = json.loads(p.stdout)["results"][0]
    except (ValueError, KeyError, IndexError):
        err = [ln for ln in p.stderr.splitlines() if ln.startswith(("error:", "✗"))]
        clean = bool(err) or 2 <= p.returncode <= 11  # edgepack's own exit codes (README)
        return {"outcome": "refused" if clean else "crash", "detail": (err or [p.stderr[-300:]])[0][:300],
                "exit": p.returncode}
    if not r["ok"]:
        return {"outcome": "crash" if r.get("exit_code") == 70 else "refused", "detail": (r.get("error") or "")[:300],
                "exit": r.get("exit_code")}
    args = [r["file"], "run", "--threads", "1", "--output", str(workdir / "out")]
    for i, (name, arr) in enumerate(inputs.items()):
        np.save(workdir / f"in{i}.npy", arr)
        args += ["--input", f"{name}={workdir / f'in{i}.npy'}"]
    q = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if q.returncode != 0:
        return {"outcome": "crash" if q.returncode < 0 or q.returncode == 4 else "refused",
                "detail": f"run exit {q.returncode}: {q.stderr.strip()[-200:]}", "backend": r.get("backend")}
    got = {k: np.load(v["file"]) for k, v in json.loads(q.stdout)["outputs"].items()}
    ok, strict, detail = judge(got, expected, case.rtol, case.atol)
    return {"outcome": "pass" if ok else "wrong", "strict": strict, "detail": detail, "backend": r.get("backend")}


def isolated(fn, args, timeout: float) -> dict:
    """fn(*args) in a forked child: a segfault in pnnx's wheel or TVM stays one case's crash."""
    from edgepack import proc
    kind, got = proc.run_forked(fn, args, timeout)
    if kind == "ok":
        return got
    if kind == "died":
        return {"__crash__": got if got.startswith("timed out") else f"died ({got})"}
    cls, message, _ = got  # the parent classifies; never lose the answer
    return {"__crash__": message if cls is None else f"{cls.__name__}: {message}"[:300]}


def _preload(backends: list[str]) -> None:
    """Import the heavy modules once in the parent: each forked child then starts warm (TVM alone
    takes ~10 s to import on a busy machine)."""
    import onnxruntime  # noqa: F401
    import onnxsim  # noqa: F401
    from edgepack import pipeline  # noqa: F401
    from edgepack.backends import all_backends
    all_backends()
    if "ncnn" in backends:
        import ncnn  # noqa: F401
    if "tvm" in backends:
        from tvm import relax  # noqa: F401
        from tvm.relax.frontend import onnx as _  # noqa: F401


def run_suite(cases: list, backends: list[str], artifacts: list, timeout: float, log=print,
              progress: Path | None = None) -> list[dict]:
    """Every case; with ``progress``, the rows so far are rewritten there after each case."""
    _preload(backends)
    rows = []
    with tempfile.TemporaryDirectory(prefix="edgepack-node-") as tmp:
        for i, case in enumerate(cases):
            d = Path(tmp) / case.name
            d.mkdir()
            t0 = time.monotonic()
            res = {"case": case.name}
            for b in backends:  # one child per backend: a segfault is charged to the one that had it
                one = isolated(fast_case, (case, [b], d), timeout)
                res[b] = {"outcome": "crash", "detail": one["__crash__"]} if "__crash__" in one else one[b]
                res.setdefault("ops", one.get("ops"))
            if case in artifacts:
                a = isolated(artifact_case, (case, d, timeout), timeout + 30)
                res["artifact"] = {"outcome": "crash", "detail": a["__crash__"]} if "__crash__" in a else a
            res["seconds"] = round(time.monotonic() - t0, 1)
            rows.append(res)
            if progress:
                progress.write_text(json.dumps({"partial": True, "rows": rows}, indent=1))
            log(f"[{i + 1}/{len(cases)}] {case.name}: " + ", ".join(
                f"{k} {res[k]['outcome']}" for k in (*backends, "artifact") if k in res) + f" ({res['seconds']} s)")
    return rows


def counts(rows: list[dict], key: str) -> dict:
    c = {o: 0 for o in OUTCOMES}
    for r in rows:
        if key in r:
            c[r[key]["outcome"]] += 1
    return c


def markdown(rows: list[dict], keys: list[str], header: str) -> str:
    out = [header, "", "| backend | cases | pass | refused | wrong | ref-differs | crash |", "|---|---|---|---|---|---|---|"]
    for k in keys:
        c = counts(rows, k)
        out.append(f"| {k} | {sum(c.values())} | " + " | ".join(str(c[o]) for o in OUTCOMES) + " |")
    for k in keys:
        bad = [r for r in rows if k in r and r[k]["outcome"] in ("wrong", "crash", "ref-differs")]
        if bad:
            out += ["", f"{k}: not pass and not a clean refusal:", ""]
            out += [f"- `{r['case']}` {r[k]['outcome']}: {r[k]['detail']}".replace("|", "/") for r in bad]
        reasons: dict[str, int] = {}
        for r in rows:
            if k in r and r[k]["outcome"] == "refused":
                # the reason without the case's file name, numbers and op-specific tails
                why = re.sub(r"test_\w+\.onnx:?\s*", "", r[k]["detail"].splitlines()[0] if r[k]["detail"] else "")
                why = re.split(r"[\d(\[]", why)[0].strip()[:80]
                reasons[why] = reasons.get(why, 0) + 1
        if reasons:
            out += ["", f"{k}: refusals by first reason (top 8):", ""]
            out += [f"- {n} × {w}".replace("|", "/") for w, n in sorted(reasons.items(), key=lambda x: -x[1])[:8]]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sample", type=int, default=0, help="run N cases drawn with --seed (default: all)")
    ap.add_argument("--seed", type=int, default=0, help="seed of --sample and --artifacts")
    ap.add_argument("--cases", default="", help="comma-separated case names (e.g. test_gemm_default_scalar_bias)")
    ap.add_argument("--float32", action="store_true", help="only cases whose inputs are all float32")
    ap.add_argument("--backends", default="ncnn,tvm", help="fast paths to run ('' for none)")
    ap.add_argument("--artifacts", type=int, default=0, help="also build N of the cases as x86_64 artifacts (-1: all)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per case and path")
    ap.add_argument("--json", type=Path, default=None, help="write every case's result here")
    ap.add_argument("--markdown", type=Path, default=None, help="write the summary table here")
    ap.add_argument("--report", type=Path, default=None,
                    help="print the summary of an existing --json (also a partial one), run nothing")
    args = ap.parse_args(argv)
    if args.report:
        doc = json.loads(args.report.read_text())
        rows = doc["rows"]
        keys = [k for k in ("ncnn", "tvm", "artifact") if any(k in r for r in rows)]
        what = doc.get("what") or f"the first {len(rows)} cases of a run (partial)"
        text = markdown(rows, keys, f"Node suite: {what}; artifacts built for {sum('artifact' in r for r in rows)}.")
        print(text)
        if args.markdown:
            args.markdown.write_text(text + "\n")
        return 0
    cases = load_cases([n for n in args.cases.split(",") if n] or None, args.float32)
    rng = random.Random(args.seed)
    if args.sample and args.sample < len(cases):
        cases = rng.sample(cases, args.sample)
    n_art = len(cases) if args.artifacts < 0 else min(args.artifacts, len(cases))
    artifacts = rng.sample(cases, n_art) if n_art < len(cases) else list(cases)
    backends = [b for b in args.backends.split(",") if b]
    os.environ.setdefault("ORT_LOG_LEVEL", "4")
    rows = run_suite(cases, backends, artifacts, args.timeout, log=lambda m: print(m, file=sys.stderr, flush=True),
                     progress=args.json)
    keys = backends + (["artifact"] if artifacts else [])
    what = (f"{len(cases)} cases" + (f" (sample {args.sample}, seed {args.seed})" if args.sample else "")
            + (", float32 inputs only" if args.float32 else ""))
    text = markdown(rows, keys, f"Node suite: {what}; artifacts built for {len(artifacts)}.")
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"what": what, "rows": rows}, indent=1))
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0 if all(counts(rows, k)["wrong"] == 0 and counts(rows, k)["crash"] == 0 for k in keys) else 1


if __name__ == "__main__":
    raise SystemExit(main())
