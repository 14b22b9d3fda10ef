"""NCNN artifacts vs onnxruntime, side by side in one run, same thread count.

Prints, per model: x86_64 median latency of the artifact (its own `bench`) and of onnxruntime
(InferenceSession, same input, same threads), their ratio, and artifact/runtime bytes for each
target built. Usage: python bench/bench_ncnn.py [--threads 1] [--runs 50] [--targets x86_64,arm64]

``--options``: instead, which of ncnn's x86 switches (packing layout, winograd, sgemm, fp16 storage)
is fastest: the pnnx-converted model run by the ncnn Python wheel with each switch off in turn,
rounds alternating so machine load hits every variant alike, printed against ncnn's defaults.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from models import mobilenet_v2_like, transformer_block  # noqa: E402
from corpus import ort_median  # noqa: E402  (one timing loop for every bench)

REPO = Path(__file__).resolve().parent.parent


def ort_median_ms(model: Path, threads: int, runs: int, warmup: int = 5) -> float:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
    feeds = {}
    for i in sess.get_inputs():
        shape = [d if isinstance(d, int) else 1 for d in i.shape]
        feeds[i.name] = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    return ort_median(sess, feeds, runs, warmup)


OPTION_VARIANTS = {
    "defaults": {},
    "no packing": {"use_packing_layout": False},
    "no winograd": {"use_winograd_convolution": False},
    "no sgemm": {"use_sgemm_convolution": False},
    "no fp16 storage": {"use_fp16_storage": False, "use_fp16_packed": False, "use_fp16_arithmetic": False},
}


def bench_options(models: dict[str, Path], threads: int, runs: int, rounds: int = 5) -> None:
    import ncnn
    sys.path.insert(0, str(REPO))
    from edgepack.backends.ncnn.convert import convert
    from edgepack.model import fix_input_shapes, load_model
    print(f"ncnn {ncnn.__version__} (Python wheel), {threads} thread(s), median ms of {rounds} rounds x {runs // rounds} runs")
    print(f"{'model':20} " + " ".join(f"{k:>16}" for k in OPTION_VARIANTS))
    for name, path in models.items():
        m = load_model(path)
        m = fix_input_shapes(m, {i.name: tuple(int(d) if str(d).isdigit() else 1 for d in i.shape) for i in m.inputs})
        conv = convert(m, "fp16", log=lambda *_: None)
        nets = {}
        for label, flags in OPTION_VARIANTS.items():
            net = ncnn.Net()
            net.opt.num_threads = threads
            for k, v in flags.items():
                setattr(net.opt, k, v)
            net.load_param(str(conv.param))
            net.load_model(str(conv.bin))
            nets[label] = net
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        feeds = {i.name: np.random.default_rng(0).standard_normal([d if isinstance(d, int) else 1 for d in i.shape])
                 .astype(np.float32) for i in sess.get_inputs()}
        arrays = [feeds[i.name][0] if b == "0" else feeds[i.name] for i, b in zip(sess.get_inputs(), conv.input_batch)]
        times = {k: [] for k in nets}

        def once(net):
            ex = net.create_extractor()
            for blob, a in zip(conv.input_blobs, arrays):
                ex.input(blob, ncnn.Mat(np.ascontiguousarray(a)))
            for blob in conv.output_blobs:
                ex.extract(blob)

        for net in nets.values():
            for _ in range(3):
                once(net)
        for _ in range(rounds):
            for label, net in nets.items():
                for _ in range(max(1, runs // rounds)):
                    t0 = time.perf_counter()
                    once(net)
                    times[label].append((time.perf_counter() - t0) * 1e3)
        print(f"{name:20} " + " ".join(f"{statistics.median(times[k]):16.3f}" for k in OPTION_VARIANTS))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--targets", default="x86_64,arm64")
    ap.add_argument("--options", action="store_true", help="compare ncnn's x86 switches instead")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-ncnn-"))
    models = {
        "tiny_cnn": REPO / "examples" / "tiny_cnn.onnx",
        "mobilenet_v2_like": mobilenet_v2_like(work / "mobilenet_v2_like.onnx", width=1.0, size=224),
        "encoder": transformer_block(work / "encoder.onnx", d=256, heads=4, seq=128),
    }
    if args.options:
        bench_options(models, args.threads, args.runs)
        return
    print(f"{'model':20} {'target':14} {'size MB':>8} {'runtime MB':>10} {'build s':>8}")
    rows = []
    for name, path in models.items():
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "edgepack", "build", str(path), "--target", args.targets,
                               "--backend", "ncnn", "--out", str(work / "dist"), "--json"],
                              capture_output=True, text=True)
        build_s = time.monotonic() - t0
        if proc.returncode != 0:
            print(f"{name}: build failed:\n{proc.stderr[-2000:]}")
            continue
        for r in json.loads(proc.stdout)["results"]:
            print(f"{name:20} {r['target']:14} {r['size'] / 1e6:8.2f} {r['runtime_bytes'] / 1e6:10.2f} {build_s:8.1f}")
        art = work / "dist" / f"{name}-x86_64"
        if art.exists():
            b = json.loads(subprocess.run([str(art), "bench", "--runs", str(args.runs), "--warmup", "5", "--threads",
                                           str(args.threads), "--json"], capture_output=True, text=True,
                                          check=True).stdout)
            o = ort_median_ms(path, args.threads, args.runs)
            rows.append((name, b["median_ms"], o))
    print(f"\nx86_64 latency, {args.threads} thread(s), medians of {args.runs} runs, measured side by side")
    print(f"{'model':20} {'edgepack ms':>12} {'onnxruntime ms':>15} {'ratio':>7}")
    for name, e, o in rows:
        print(f"{name:20} {e:12.3f} {o:15.3f} {e / o:7.2f}x")


if __name__ == "__main__":
    main()
