"""x86_64 latency side by side in one run, same threads: TVM untuned, TVM tuned, NCNN, onnxruntime.

Models: a MobileNetV2-class CNN and a transformer encoder block (tests/models.py). All artifacts are
built here (--fp32 everywhere, so every engine computes in fp32), then measured in interleaved rounds
(each engine once per round, the median of each engine's best round is reported) so that load on the
machine hits every column alike. TVM is measured twice per state: as the shipped x86_64 target builds
it (kernels for the x86-64 baseline) and with a bench-only target whose [tvm] mcpu is x86-64-v3
(AVX2/FMA, what NCNN and onnxruntime dispatch to at run time on this CPU).

Usage: python bench/bench_backends.py [--threads 2] [--runs 30] [--rounds 3] [--trials 64]
       [--models mobilenet,transformer] [--out bench/out/backends.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from models import mobilenet_v2_like, transformer_block  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_ncnn import ort_median_ms  # noqa: E402  (one onnxruntime timing for every bench)

V3_TARGET = (REPO / "targets" / "x86_64.toml").read_text().replace('name = "x86_64"', 'name = "x86_64-v3"')


def edgepack(*args: str, env=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "edgepack", *args], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"edgepack {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc


def build(model: Path, out: Path, target: str, backend: str, tdir: Path, *extra: str) -> tuple[Path, float, dict]:
    t0 = time.monotonic()
    proc = edgepack("build", str(model), "--target", target, "--backend", backend, "--fp32", "--out", str(out),
                    "--targets-dir", str(tdir), "--json", *extra)
    seconds = time.monotonic() - t0
    res = json.loads(proc.stdout)["results"][0]
    return Path(res["file"]), seconds, res


def artifact_median(path: Path, threads: int, runs: int) -> float:
    proc = subprocess.run([str(path), "bench", "--runs", str(runs), "--warmup", "5", "--threads", str(threads),
                           "--json"], capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)["median_ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trials", type=int, default=64, help="MetaSchedule trials per model (0: skip tuning)")
    ap.add_argument("--models", default="mobilenet,transformer")
    ap.add_argument("--tune-baseline", action="store_true",
                    help="also tune for the shipped x86-64-baseline target (default: only x86-64-v3)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "backends.json")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="edgepack-bench-"))
    tdir = work / "targets"
    tdir.mkdir()
    (tdir / "x86_64-v3.toml").write_text(V3_TARGET.replace("aliases", "# aliases") + "\n[tvm]\nmcpu = \"x86-64-v3\"\n")
    makers = {"mobilenet": lambda p: mobilenet_v2_like(p, width=1.0, size=224),
              "transformer": lambda p: transformer_block(p, d=256, heads=4, seq=128)}
    report = {"threads": args.threads, "runs": args.runs, "rounds": args.rounds, "trials": args.trials,
              "host": subprocess.run(["uname", "-m"], capture_output=True, text=True).stdout.strip(), "models": {}}
    for name in args.models.split(","):
        model = makers[name](work / f"{name}.onnx")
        engines, builds = {}, {}
        for label, target, backend, extra in (
                ("ncnn", "x86_64", "ncnn", ()),
                ("tvm untuned (x86-64)", "x86_64", "tvm", ("--tuning-db", "off")),
                ("tvm untuned (x86-64-v3)", "x86_64-v3", "tvm", ("--tuning-db", "off"))):
            path, secs, res = build(model, work / label.replace(" ", "_"), target, backend, tdir, *extra)
            engines[label] = path
            builds[label] = {"build_seconds": round(secs, 1), "size": res["size"], "runtime_bytes": res["runtime_bytes"]}
        if args.trials:
            for target in (("x86_64", "x86_64-v3") if args.tune_baseline else ("x86_64-v3",)):
                db = work / f"db-{name}-{target}"
                t0 = time.monotonic()
                edgepack("tune", str(model), "--target", target, "--trials", str(args.trials), "--out-db", str(db),
                         "--targets-dir", str(tdir))
                tune_s = time.monotonic() - t0
                label = f"tvm tuned {args.trials} trials ({'x86-64' if target == 'x86_64' else 'x86-64-v3'})"
                path, secs, res = build(model, work / label.replace(" ", "_"), target, "tvm", tdir, "--tuning-db",
                                        str(db))
                engines[label] = path
                builds[label] = {"build_seconds": round(secs, 1), "tune_seconds": round(tune_s, 1),
                                 "size": res["size"], "runtime_bytes": res["runtime_bytes"]}
        rounds: dict[str, list[float]] = {k: [] for k in [*engines, "onnxruntime"]}
        for _ in range(args.rounds):
            for label, path in engines.items():
                rounds[label].append(artifact_median(path, args.threads, args.runs))
            rounds["onnxruntime"].append(ort_median_ms(model, args.threads, args.runs))
        report["models"][name] = {"latency_ms": {k: round(min(v), 3) for k, v in rounds.items()},
                                  "rounds_ms": rounds, "builds": builds}
        print(f"\n{name} (x86_64, {args.threads} threads, median ms, best of {args.rounds} rounds)")
        for k, v in report["models"][name]["latency_ms"].items():
            b = builds.get(k, {})
            extra = f"  build {b['build_seconds']} s" if b else ""
            extra += f", tune {b['tune_seconds']} s" if "tune_seconds" in b else ""
            print(f"  {k:34s} {v:9.2f}{extra}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"\nwritten {args.out}")


if __name__ == "__main__":
    main()
