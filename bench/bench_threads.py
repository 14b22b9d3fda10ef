"""Artifacts at 1..N threads against onnxruntime at the same thread counts, side by side in one run.

    python3 bench/bench_threads.py --model MODEL.onnx [--shape x=1x3x224x224] [--threads 1,2]
           [--runs 30] [--rounds 3] [--ncnn-options LABEL=LIST ...] LABEL=ARTIFACT [LABEL=ARTIFACT ...]

Every round runs each artifact's own `bench --threads T` and an onnxruntime session with
intra_op_num_threads=T on the same seeded input, alternating, so load on the machine hits every
column alike; the best round's median is printed per thread count, with each artifact's ratio to
onnxruntime and its speed-up from 1 thread. Written for ncnn's OpenMP emulation (simpleomp), whose
condition-variable hand-offs made 2 threads slower than 1 (edgepack/backends/ncnn/source_patch.py):
label an artifact built before and one after a change, and compare.

`--ncnn-options LABEL=LIST` runs that label's artifact with EDGEPACK_NCNN_OPTIONS=LIST, e.g.
`--ncnn-options avx2=isa=avx2 avx512=A avx2=A`: one artifact as an AVX-512 and as an AVX2 CPU runs it
(isa_cap_patch.py). onnxruntime has no such cap and always runs with what the machine has.

`--busy N` starts N busy-loop processes first and stops them at the end (always): the oversubscribed
case the spin policy must not stall in (three on a 2-core machine: more runnable threads than cores).
Under load the best round says little, so every round's median is printed as a range too.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from corpus import artifact_median, ort_median, ort_session  # noqa: E402  (one timing loop for every bench)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifacts", nargs="+", metavar="LABEL=ARTIFACT")
    ap.add_argument("--model", type=Path, required=True, help="the ONNX model the artifacts were built from")
    ap.add_argument("--shape", action="append", default=[], help="NAME=1x3x224x224, as for edgepack build")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--busy", type=int, default=0, metavar="N", help="N busy-loop processes run meanwhile")
    ap.add_argument("--ncnn-options", action="append", default=[], metavar="LABEL=LIST",
                    help="run LABEL's artifact with EDGEPACK_NCNN_OPTIONS=LIST (e.g. isa=avx2)")
    a = ap.parse_args(argv)
    with busy_processes(a.busy):
        return _measure(a)


@contextlib.contextmanager
def busy_processes(n: int):
    """n processes spinning on a core each until the block ends (killed even when it raises)."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(n):
            procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait(timeout=10)


def _measure(a) -> int:
    from edgepack.model import fix_input_shapes, load_model, parse_shape_args
    from edgepack.reference import random_inputs
    arts = dict(s.split("=", 1) for s in a.artifacts)
    envs = {label: {**os.environ, "EDGEPACK_NCNN_OPTIONS": opts}
            for label, opts in (s.split("=", 1) for s in a.ncnn_options)}
    if set(envs) - set(arts):
        raise SystemExit(f"--ncnn-options for unknown labels: {sorted(set(envs) - set(arts))}")
    feeds = random_inputs(fix_input_shapes(load_model(a.model), parse_shape_args(a.shape)).inputs, seed=0)
    report: dict = {"model": str(a.model), "runs": a.runs, "rounds": a.rounds, "busy": a.busy, "ms": {},
                    "round_medians_ms": {}, "ncnn_options": {k: v["EDGEPACK_NCNN_OPTIONS"] for k, v in envs.items()}}
    for t in (int(x) for x in a.threads.split(",")):
        sess = ort_session(a.model, t)
        got: dict[str, list[float]] = {k: [] for k in [*arts, "onnxruntime"]}
        for _ in range(a.rounds):
            for label, path in arts.items():
                got[label].append(artifact_median(Path(path), a.runs, env=envs.get(label), threads=t, warmup=5))
            got["onnxruntime"].append(ort_median(sess, feeds, a.runs))
        best = {k: round(min(v), 3) for k, v in got.items()}
        report["ms"][str(t)] = best
        report["round_medians_ms"][str(t)] = {k: [round(x, 3) for x in v] for k, v in got.items()}
        one = report["ms"].get("1", {})
        print(f"{a.model.stem}, {t} thread(s): " + ", ".join(
            f"{k} {v:.2f} ms" + (f" ({v / best['onnxruntime']:.2f}x ort" + (f", {one[k] / v:.2f}x its 1-thread" if k in one and t > 1 else "") + ")" if k != "onnxruntime" else "")
            for k, v in best.items()), flush=True)
        if a.busy:
            print(f"  with {a.busy} busy processes, medians per round: " + ", ".join(
                f"{k} {min(v):.2f}-{max(v):.2f} ms" for k, v in got.items()), flush=True)
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
