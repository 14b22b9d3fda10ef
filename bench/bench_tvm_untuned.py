"""Untuned TVM on real models, before/after the default schedules (and tuned), against onnxruntime (x86_64).

For each corpus model (bench/corpus.toml, from the corpus cache): `edgepack build --backend tvm
--target x86_64 --tuning-db off` twice, with EDGEPACK_TVM_SCHEDULES=off (the naive loop nests,
"before") and with the default schedules ("after"); then, for each thread count, interleaved
rounds of both artifacts' own `bench` and an onnxruntime session with the same thread count on
the same seeded inputs (best round's median each), so load on the machine hits every column alike.
``--ncnn`` adds a whole-graph NCNN build (`--backend ncnn`, its default precision, as `auto` builds
it) to the same rounds: the numbers behind selection.py's rule for whole-graph TVM. ``--no-before``
skips the naive build; ``--nchw`` adds untuned TVM with convolutions left in NCHW (the default
builds move them to NHWC, backends/tvm/layout.py). ``--tune 20m`` adds a "tuned" column: `edgepack tune --budget 20m` into a
fresh database of this run (never the user's), then a TVM build with it, timed in the same rounds;
the tune's own report (tasks searched, share of the time they took, seconds) goes into the JSON.

Usage: python3 bench/bench_tvm_untuned.py [--models ppocr_cls,orientation,...] [--threads 1,2]
       [--runs 20] [--rounds 3] [--ncnn] [--no-before] [--tune 20m] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from corpus import (artifact_median, build, fetch, load_table, ort_inputs, ort_median,  # noqa: E402
                    ort_session)  # (one corpus, one timing)

DEFAULT_MODELS = "ppocr_cls,orientation,silero_vad,ddddocr_crnn,ppocr_v4_rec,attacut"


def build_tvm(entry, model: Path, out: Path, schedules: bool, layout: str = "nhwc") -> tuple[Path | None, float, str]:
    """(artifact, build seconds, error) of one x86_64 TVM build; ``layout``: what its convolutions
    compute in (EDGEPACK_TVM_LAYOUT)."""
    wanted = {"EDGEPACK_TVM_SCHEDULES": "on" if schedules else "off", "EDGEPACK_TVM_LAYOUT": layout}
    env_before = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        doc, seconds = build(entry, model, "x86_64", out, ("--backend", "tvm", "--tuning-db", "off"))
    finally:
        for k, v in env_before.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
    res = (doc.get("results") or [{}])[0]
    if not res.get("file"):
        return None, seconds, str(doc.get("error") or res.get("error") or "no artifact")[:300]
    return Path(res["file"]), seconds, ""


def tune_and_build(entry, model: Path, out: Path, budget: str) -> tuple[Path | None, float, str, dict]:
    """(artifact, seconds of tune + build, error, tune's --json report): a fresh database under out."""
    db = out / "tuning-db"
    cmd = [sys.executable, "-m", "edgepack", "tune", str(model), "--target", "x86_64", "--budget", budget,
           "--out-db", str(db), "--json", *(a for s in entry.shapes for a in ("--input-shape", s))]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=4 * 3600)
    (out / "tune.log").write_text(proc.stderr)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return None, time.monotonic() - t0, f"tune exit {proc.returncode}: {tail[:300]}", {}
    tuned = json.loads(proc.stdout)
    doc, seconds = build(entry, model, "x86_64", out, ("--backend", "tvm", "--tuning-db", str(db)))
    res = (doc.get("results") or [{}])[0]
    if not res.get("file"):
        return None, time.monotonic() - t0, str(doc.get("error") or res.get("error") or "no artifact")[:300], tuned
    return Path(res["file"]), time.monotonic() - t0, "", tuned


def build_ncnn(entry, model: Path, out: Path) -> tuple[Path | None, float, str]:
    """(artifact, build seconds, error) of one x86_64 whole-graph NCNN build."""
    doc, seconds = build(entry, model, "x86_64", out, ("--backend", "ncnn"))
    res = (doc.get("results") or [{}])[0]
    if not res.get("file"):
        return None, seconds, str(doc.get("error") or res.get("error") or "no artifact")[:300]
    return Path(res["file"]), seconds, ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=DEFAULT_MODELS, help="corpus model names, comma-separated")
    ap.add_argument("--threads", default="1,2", help="thread counts to measure, comma-separated")
    ap.add_argument("--runs", type=int, default=20, help="runs per median")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the best median counts)")
    ap.add_argument("--ncnn", action="store_true", help="also build and time whole-graph NCNN")
    ap.add_argument("--no-before", action="store_true", help="skip the naive (EDGEPACK_TVM_SCHEDULES=off) build")
    ap.add_argument("--nchw", action="store_true", help="also build untuned TVM with convolutions in ONNX's NCHW "
                    "(EDGEPACK_TVM_LAYOUT=nchw; the default builds are NHWC)")
    ap.add_argument("--tune", metavar="BUDGET", help="also tune (edgepack tune --budget BUDGET) and time the tuned build")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    entries = {e.name: e for e in load_table()}
    threads = [int(t) for t in args.threads.split(",")]
    work = Path(tempfile.mkdtemp(prefix="edgepack-tvm-untuned-"))
    report = {"threads": threads, "runs": args.runs, "rounds": args.rounds, "models": {}}
    for name in args.models.split(","):
        entry = entries[name]
        model = fetch(entry, offline=True)
        row: dict = {"build_s": {}, "ms": {}, "ratio": {}}
        arts = {}
        labels = [("after", True)] if args.no_before else [("before", False), ("after", True)]
        labels += [("nchw", True)] if args.nchw else []
        for label, sched in labels + ([("ncnn", None)] if args.ncnn else []) + ([("tuned", None)] if args.tune else []):
            out = work / f"{name}-{label}"
            out.mkdir()
            if label == "tuned":
                art, secs, err, row["tune"] = tune_and_build(entry, model, out, args.tune)
            elif sched is None:
                art, secs, err = build_ncnn(entry, model, out)
            else:
                art, secs, err = build_tvm(entry, model, out, sched, "nchw" if label == "nchw" else "nhwc")
            row["build_s"][label] = round(secs, 1)
            if art is None:
                row.setdefault("errors", {})[label] = err
                print(f"{name}: {label} build failed: {err}", flush=True)
                continue
            arts[label] = art
        feeds = ort_inputs(entry, model)
        for t in threads:
            sess = ort_session(model, t)
            got: dict[str, list[float]] = {k: [] for k in [*arts, "onnxruntime"]}
            for _ in range(args.rounds):
                for label, art in arts.items():
                    got[label].append(artifact_median(art, args.runs, threads=t))
                got["onnxruntime"].append(ort_median(sess, feeds, args.runs))
            best = {k: round(min(v), 3) for k, v in got.items()}
            row["ms"][str(t)] = best
            row["ratio"][str(t)] = {k: round(best[k] / best["onnxruntime"], 2) for k in arts}
            if "ncnn" in best and "after" in best:  # untuned TVM against NCNN, the rule's number
                row["ratio"][str(t)]["after/ncnn"] = round(best["after"] / best["ncnn"], 2)
            if "tuned" in best and "after" in best:  # what tuning bought, side by side
                row["ratio"][str(t)]["after/tuned"] = round(best["after"] / best["tuned"], 2)
            print(f"{name} {t} thread(s): " + ", ".join(f"{k} {v:.2f} ms" for k, v in best.items())
                  + "  |  " + ", ".join(f"{k} {r:.2f}x" for k, r in row["ratio"][str(t)].items())
                  + f"  |  build s {row['build_s']}", flush=True)
        report["models"][name] = row
        if args.json:  # after every model: a long run cut short still leaves its rows
            args.json.write_text(json.dumps(report, indent=1))
    for t in threads:
        for label in ("before", "nchw", "after", "ncnn", "tuned", "after/ncnn", "after/tuned"):
            rs = [m["ratio"][str(t)][label] for m in report["models"].values() if label in m["ratio"].get(str(t), {})]
            if rs:
                g = math.exp(sum(math.log(r) for r in rs) / len(rs))
                report.setdefault("geomean", {}).setdefault(str(t), {})[label] = round(g, 2)
                print(f"geomean {label}, {t} thread(s): {g:.2f}x {label.split('/')[1] if '/' in label else 'onnxruntime'} over {len(rs)} models")
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
