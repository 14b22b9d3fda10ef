"""TVM artifacts per target: size, runtime bytes (artifact minus weights) and build time, without and
with a tuning database (x86_64). Goal from the issue: runtime bytes <= 3 MB on arm64.

Usage: python bench/bench_tvm_sizes.py [--model PATH] [--targets all|x86_64,arm64,...] [--trials 8]
(default model: examples/tiny_cnn.onnx; runtime builds are cached, the first run per arch takes minutes)
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


def edgepack(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "edgepack", *args], capture_output=True, text=True)
    return proc, time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "examples" / "tiny_cnn.onnx")
    ap.add_argument("--targets", default="x86_64,arm64,jetson-orin,jetson-xavier,android-arm64")
    ap.add_argument("--trials", type=int, default=8, help="trials for the with-database build (0: skip)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="edgepack-sizes-"))
    rows = []
    for target in args.targets.split(","):
        proc, secs = edgepack("build", str(args.model), "--target", target, "--backend", "tvm", "--tuning-db", "off",
                              "--out", str(work / "untuned"), "--json")
        res = json.loads(proc.stdout)["results"][0]
        rows.append({"target": target, "db": False, "ok": res["ok"], "size": res["size"],
                     "runtime_bytes": res["runtime_bytes"], "weight_bytes": res["size"] - (res["runtime_bytes"] or 0),
                     "build_seconds": round(secs, 1), "error": res["error"]})
    if args.trials:
        db = work / "db"
        proc, tune_s = edgepack("tune", str(args.model), "--target", "x86_64", "--trials", str(args.trials),
                                "--out-db", str(db))
        if proc.returncode == 0:
            proc, secs = edgepack("build", str(args.model), "--target", "x86_64", "--backend", "tvm", "--tuning-db",
                                  str(db), "--out", str(work / "tuned"), "--json")
            res = json.loads(proc.stdout)["results"][0]
            rows.append({"target": "x86_64", "db": True, "ok": res["ok"], "size": res["size"],
                         "runtime_bytes": res["runtime_bytes"], "build_seconds": round(secs, 1),
                         "tune_seconds": round(tune_s, 1), "trials": args.trials, "error": res["error"]})
        else:
            print(f"tune failed: {proc.stderr[-500:]}")
    print(f"{'target':15s} {'db':3s} {'size':>10s} {'runtime':>10s} {'build s':>8s}")
    for r in rows:
        print(f"{r['target']:15s} {'yes' if r['db'] else 'no':3s} {r['size'] or 0:10d} {r['runtime_bytes'] or 0:10d} "
              f"{r['build_seconds']:8.1f}" + (f"  (tune {r['tune_seconds']} s)" if r.get("tune_seconds") else "")
              + (f"  FAILED: {r['error']}" if not r["ok"] else ""))
    out = REPO / "bench" / "out" / "tvm_sizes.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    print(f"written {out}")


if __name__ == "__main__":
    main()
