"""x86_64 latency side by side in one run: TVM untuned / tuned, NCNN, onnxruntime, 1 and 2 threads.

Models: a MobileNetV2-class CNN and a transformer encoder block (tests/models.py). All artifacts are
built here (--fp32 everywhere, so every engine computes in fp32), then measured in interleaved rounds
(each engine once per round, the best round's median is reported) so that load on the machine hits
every column alike. The shipped x86_64 TVM artifact carries kernels for x86-64, -v3 and -v4 and picks
by CPUID; it is measured as it picks and forced to the baseline (EDGEPACK_TVM_ISA=x86-64). Its size
is compared with a bench-only target whose [tvm] isa-levels is [] (baseline kernels only).

Usage: python bench/bench_backends.py [--threads 1,2] [--runs 30] [--rounds 3] [--budget 0|20m]
       [--models mobilenet,transformer] [--out bench/out/backends.json]
"""
from __future__ import annotations

import argparse
import json
import os
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
from corpus import artifact_median  # noqa: E402  (one artifact timing for every bench)

BASE_TARGET = (REPO / "targets" / "x86_64.toml").read_text().replace('name = "x86_64"', 'name = "x86_64-base"')


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", default="0", help="`edgepack tune --budget` per model (0: skip tuning)")
    ap.add_argument("--models", default="mobilenet,transformer")
    ap.add_argument("--engines", default="ncnn,tvm", help="which backends to build (onnxruntime always runs)")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "backends.json")
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    work = Path(tempfile.mkdtemp(prefix="edgepack-bench-"))
    tdir = work / "targets"
    tdir.mkdir()
    (tdir / "x86_64-base.toml").write_text(BASE_TARGET.replace("aliases", "# aliases") + "\n[tvm]\nisa-levels = []\n")
    makers = {"mobilenet": lambda p: mobilenet_v2_like(p, width=1.0, size=224),
              "transformer": lambda p: transformer_block(p, d=256, heads=4, seq=128)}
    report = {"threads": threads, "runs": args.runs, "rounds": args.rounds, "budget": args.budget,
              "cpu": next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?"),
              "models": {}}
    for name in args.models.split(","):
        model = makers[name](work / f"{name}.onnx")
        engines, builds = {}, {}
        for label, target, backend, extra in (
                ("ncnn", "x86_64", "ncnn", ()),
                ("tvm untuned", "x86_64", "tvm", ("--tuning-db", "off")),
                ("tvm untuned, baseline kernels only", "x86_64-base", "tvm", ("--tuning-db", "off"))):
            if backend not in args.engines.split(","):
                continue
            path, secs, res = build(model, work / label.replace(" ", "_").replace(",", ""), target, backend, tdir, *extra)
            engines[label] = (path, None)
            builds[label] = {"build_seconds": round(secs, 1), "size": res["size"], "runtime_bytes": res["runtime_bytes"]}
        if "tvm untuned" in engines:
            engines["tvm untuned, forced to x86-64"] = (engines["tvm untuned"][0], {"EDGEPACK_TVM_ISA": "x86-64"})
        if args.budget not in ("0", "") and "tvm" in args.engines.split(","):
            db = work / f"db-{name}"
            t0 = time.monotonic()
            tuned = json.loads(edgepack("tune", str(model), "--target", "x86_64", "--budget", args.budget,
                                        "--out-db", str(db), "--json").stdout)
            tune_s = time.monotonic() - t0
            label = f"tvm tuned ({args.budget})"
            path, secs, res = build(model, work / "tvm_tuned", "x86_64", "tvm", tdir, "--tuning-db", str(db))
            engines[label] = (path, None)
            builds[label] = {"build_seconds": round(secs, 1), "tune_seconds": round(tune_s, 1), "size": res["size"],
                             "runtime_bytes": res["runtime_bytes"], "tune": tuned}
        report["models"][name] = {"builds": builds, "latency_ms": {}}
        for t in threads:
            rounds: dict[str, list[float]] = {k: [] for k in [*engines, "onnxruntime"]}
            for _ in range(args.rounds):
                for label, (path, env) in engines.items():
                    rounds[label].append(artifact_median(path, args.runs, {**os.environ, **(env or {})}, threads=t, warmup=5))
                rounds["onnxruntime"].append(ort_median_ms(model, t, args.runs))
            best = {k: round(min(v), 3) for k, v in rounds.items()}
            report["models"][name]["latency_ms"][str(t)] = best
            print(f"\n{name} (x86_64, {t} thread(s), median ms, best of {args.rounds} rounds; ratio to onnxruntime)")
            for k, v in best.items():
                b = builds.get(k, {})
                extra = f"  {b['size'] / 1e6:.2f} MB, build {b['build_seconds']} s" if b else ""
                extra += f", tune {b['tune_seconds']} s" if "tune_seconds" in b else ""
                print(f"  {k:36s} {v:9.2f} {v / best['onnxruntime']:6.2f}x{extra}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"\nwritten {args.out}")


if __name__ == "__main__":
    main()
