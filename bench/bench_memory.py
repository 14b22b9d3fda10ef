"""Cold start and peak memory, whole process: an artifact against Python + onnxruntime (issue 10 item 5).

Cold start is exec -> answer written: the artifact's `run --input x.npy --output DIR` against a fresh
`python3 -c` that imports onnxruntime, opens a session on the .onnx and writes the same outputs as
.npy. Peak RSS is the child's ru_maxrss from wait4 (what `/usr/bin/time -v` prints). Both on one
thread, the same seeded input, alternating, median of --runs processes (timed by /usr/bin/time, whose
own start-up, ~1 ms, is included). The model's need is
weights + 2 x largest activation + 8 MB (weights: the bytes embedded in the artifact; activation: the
largest tensor onnxruntime makes for the same input, counted at 4 bytes a value); the report divides
peak RSS by it (goal <= 1.0).
Latency, side by side: the artifact's own `bench` (1 thread) against an onnxruntime session in this
process on the same input, alternating rounds, best round's median of each.

--switches runs the artifact with EDGEPACK_NCNN_OPTIONS set (the NCNN engine's measuring switches,
runtimes/ncnn/ep_engine_ncnn.c), e.g. `pool=local` for ncnn's own pools, `winograd=0`.

Usage: python3 bench/bench_memory.py ARTIFACT MODEL.onnx [--input-shape NAME=1x3x320x320] [--runs 5] [--json FILE]
       python3 bench/bench_memory.py --corpus nudenet_320n,ppocr_cls [--out DIR]   (builds them first)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TIME = "/usr/bin/time"  # GNU time (Debian package `time`)
sys.path.insert(0, str(REPO))

ORT_SCRIPT = """
import sys, numpy as np, onnxruntime as ort
o = ort.SessionOptions(); o.intra_op_num_threads = 1; o.inter_op_num_threads = 1; o.log_severity_level = 3
s = ort.InferenceSession(sys.argv[1], o, providers=["CPUExecutionProvider"])
feeds = {i.name: np.load(p) for i, p in zip(s.get_inputs(), sys.argv[3:])}
for out, v in zip(s.get_outputs(), s.run(None, feeds)):
    np.save(f"{sys.argv[2]}/{out.name.replace('/', '_')}.npy", v)
"""


def measure(cmd: list[str], env: dict | None = None) -> tuple[float, int]:
    """(wall ms from exec to exit, peak RSS in KiB) of one process, through /usr/bin/time: the rusage of
    a child that Python starts itself is no good, as Linux carries the launcher's (Python's ~120 MB)
    peak over exec into the child's ru_maxrss; time(1) is a small process, so its child's figure is
    the program's own."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as rep:
        t0 = time.perf_counter()
        proc = subprocess.run([TIME, "-f", "%e %M", "-o", rep.name, *cmd], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, env=env)
        ms = (time.perf_counter() - t0) * 1e3  # time(1)'s own %e has 10 ms steps
        if proc.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed (exit {proc.returncode}): {proc.stderr[-300:]}")
        kb = rep.read().split()[-1]
    return ms, int(kb)


def need_bytes(model_path: Path, shapes: dict, weight_bytes: int) -> tuple[int, int]:
    """(the model's need in bytes, its largest activation in bytes). An activation is counted at 4 bytes
    a value, at the size onnxruntime gives it for the bench's own input: shape inference leaves dims it
    cannot work out (a Pad whose amounts come from Shape: Whisper's log-mel front end) unknown, and the
    first version of this count skipped those tensors, missing that model's 4.8 MB STFT for its 1.9 MB
    input."""
    import onnx
    import onnxruntime as ort
    from edgepack.model import fix_input_shapes, load_model
    from edgepack.reference import random_inputs
    m = fix_input_shapes(load_model(model_path), shapes)
    graph = onnx.ModelProto()
    graph.CopyFrom(m.proto)
    named = {o.name for o in graph.graph.output}
    for node in graph.graph.node:  # every node's output becomes a graph output, so the run reports its size
        graph.graph.output.extend(onnx.ValueInfoProto(name=t) for t in node.output if t and t not in named)
        named.update(node.output)
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(graph.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    feeds = random_inputs(m.inputs, seed=0)
    largest = max(v.size * 4 for v in [*feeds.values(), *sess.run(None, feeds)])
    return weight_bytes + 2 * largest + 8 * 2**20, largest


def latency(artifact: Path, model: Path, feeds: dict, env: dict | None, rounds: int = 3,
            runs: int = 20) -> tuple[float, float]:
    """(artifact's median ms, onnxruntime's median ms), best of `rounds` alternating rounds, 1 thread."""
    from corpus import artifact_median, ort_median, ort_session  # one timing loop for every bench
    sess = ort_session(model)
    ours, theirs = [], []
    for _ in range(rounds):
        ours.append(artifact_median(artifact, runs, env))
        theirs.append(ort_median(sess, feeds, runs))
    return min(ours), min(theirs)


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def side_by_side(artifact: Path, model: Path, shapes: dict, runs: int, switches: str = "") -> dict:
    import numpy as np
    from edgepack.model import fix_input_shapes, load_model
    from edgepack.reference import random_inputs
    loaded = fix_input_shapes(load_model(model), shapes)
    manifest = json.loads(subprocess.run([str(artifact), "info", "--json"], capture_output=True, text=True,
                                         check=True).stdout)
    weight_bytes = json.loads(Path(str(artifact) + ".json").read_text())["artifact"]["weight_bytes"] \
        if Path(str(artifact) + ".json").is_file() else 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        inputs = random_inputs(loaded.inputs, seed=0)
        files = []
        for i, spec in enumerate(loaded.inputs):
            f = tmp / f"in{i}.npy"
            np.save(f, inputs[spec.name])
            files.append((spec.name, f))
        ours = [str(artifact), "run", "--threads", "1", "--output", str(tmp / "ep")]
        for name, f in files:
            ours += ["--input", f"{name}={f}"]
        (tmp / "ort").mkdir()
        theirs = [sys.executable, "-c", ORT_SCRIPT, str(model), str(tmp / "ort"), *[str(f) for _, f in files]]
        env = dict(os.environ, EDGEPACK_NCNN_OPTIONS=switches) if switches else None
        # The artifact's pages leave the page cache first, so they come back by plain readahead: a file
        # just written (a fresh build) can sit in large folios, which map more of it at once and showed
        # up to 3.7 MB more peak RSS for the same executable (docs/benchmarks.md, twelfth session).
        drop_page_cache(artifact)
        measure(ours, env), measure(theirs)  # page cache warm for both: cold start of the process, not the disk
        a, b = [], []
        for _ in range(runs):
            a.append(measure(ours, env))
            b.append(measure(theirs))
        ms, ort_ms = latency(artifact, model, inputs, env)
    need, act = need_bytes(model, shapes, weight_bytes)
    rss = statistics.median(r for _, r in a) * 1024
    return {"artifact": artifact.name, "backend": manifest.get("backend", {}).get("name"),
            "precision": manifest.get("precision_rung"), "weight_bytes": weight_bytes, "largest_activation": act,
            "need_bytes": need, "cold_start_ms": round(statistics.median(t for t, _ in a), 1),
            "peak_rss_mib": round(rss / 2**20, 1), "rss_over_need": round(rss / need, 2),
            "onnxruntime_cold_start_ms": round(statistics.median(t for t, _ in b), 1),
            "onnxruntime_peak_rss_mib": round(statistics.median(r for _, r in b) / 1024, 1),
            "switches": switches, "latency_ms": round(ms, 2), "onnxruntime_latency_ms": round(ort_ms, 2)}


def corpus_rows(names: list[str], out: Path, runs: int, switches: str = "") -> list[dict]:
    sys.path.insert(0, str(REPO / "bench"))
    import corpus
    entries = {e.name: e for e in corpus.load_table()}
    rows = []
    for name in names:
        e = entries[name]
        model = corpus.fetch(e, offline=True)
        artifact = out / f"{model.stem}-x86_64"
        if artifact.is_file():  # said aloud: an artifact left by an older tree measures the older code
            print(f"{name}: measuring the artifact already in {out} (delete it to rebuild)", file=sys.stderr, flush=True)
        else:
            doc, _ = corpus.build(e, model, "x86_64", out)
            if not doc.get("results") or not doc["results"][0]["ok"]:
                rows.append({"artifact": name, "error": str(doc)[:300]})
                continue
        from edgepack.model import parse_shape_args
        rows.append({"model": name} | side_by_side(artifact, model, parse_shape_args(list(e.shapes)), runs, switches))
        print(format_row(rows[-1]), flush=True)
    return rows


HEAD = (f"{'model':<16} {'backend':<9} {'weights MB':>10} {'act MB':>7} {'start ms':>9} {'ort ms':>8} "
        f"{'RSS MiB':>8} {'ort MiB':>8} {'RSS/need':>9} {'run ms':>7} {'ort run':>7}")


def format_row(r: dict) -> str:
    if "error" in r:
        return f"{r['artifact']:<16} error: {r['error']}"
    return (f"{r.get('model', r['artifact']):<16} {r['backend'] or '-':<9} {r['weight_bytes'] / 1e6:>10.2f} "
            f"{r['largest_activation'] / 1e6:>7.2f} {r['cold_start_ms']:>9.1f} {r['onnxruntime_cold_start_ms']:>8.1f} "
            f"{r['peak_rss_mib']:>8.1f} {r['onnxruntime_peak_rss_mib']:>8.1f} {r['rss_over_need']:>9.2f} "
            f"{r['latency_ms']:>7.1f} {r['onnxruntime_latency_ms']:>7.1f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", nargs="?", type=Path)
    ap.add_argument("model", nargs="?", type=Path)
    ap.add_argument("--input-shape", action="append", default=[], metavar="NAME=1x3x224x224")
    ap.add_argument("--corpus", default="", help="comma-separated corpus models (built for x86_64 into --out)")
    ap.add_argument("--out", type=Path, default=None, help="artifact folder for --corpus (default: temporary)")
    ap.add_argument("--runs", type=int, default=5, help="processes per side (median)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    ap.add_argument("--switches", default="", metavar="K=V,...",
                    help="run the artifact with EDGEPACK_NCNN_OPTIONS=K=V,... (e.g. pool=local: ncnn's own pools)")
    a = ap.parse_args(argv)
    from edgepack.model import parse_shape_args
    print(HEAD, flush=True)
    if a.corpus:
        with tempfile.TemporaryDirectory() as tmp:
            rows = corpus_rows([n for n in a.corpus.split(",") if n], a.out or Path(tmp), a.runs, a.switches)
    elif a.artifact and a.model:
        rows = [side_by_side(a.artifact, a.model, parse_shape_args(a.input_shape), a.runs, a.switches)]
        print(format_row(rows[0]))
    else:
        ap.error("give ARTIFACT MODEL or --corpus")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
