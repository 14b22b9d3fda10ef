"""Where the x86 direct convolution kernel (direct_conv_patch.py) beats ncnn's own kernels, layer by layer.

For each convolution shape, a one-layer model is built (fp32, NCNN) and its artifact timed with
EDGEPACK_NCNN_OPTIONS=direct=0 (ncnn's GEMM / Winograd) and direct=2 (the direct kernel), rounds
alternating, same threads; `isa=` caps the CPU (isa=avx2 times the 8-lane kernel on an AVX-512 host).
Prints ms for both, their ratio, and the ms of the shipped break-even (direct=1).

Usage: python3 bench/bench_direct_conv.py [--shapes 192x384x6x80,...] [--threads 1] [--rounds 5] [--isa avx2]
A shape is CIN x COUT x H x W [x K [x STRIDE]] (K 1 by default).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from clirun import run_edgepack  # noqa: E402
from corpus import artifact_median  # noqa: E402

# the 1x1 layers of the PP-OCRv6 and PP-OCRv4 models, at their sizes
DEFAULT_SHAPES = ("48x96x80x80,96x48x80x80,96x192x40x40,192x96x40x40,192x384x20x20,384x192x20x20,"
                  "384x768x10x10,768x384x10x10,96x192x12x80,192x96x12x80,192x384x6x80,384x192x6x80,"
                  "384x384x3x80,384x768x3x80,768x384x3x80")


def conv_model(path: Path, cin: int, cout: int, h: int, w: int, k: int = 1, stride: int = 1) -> Path:
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
    pad = k // 2
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[k, k], strides=[stride, stride],
                            pads=[pad] * 4)
    f = TensorProto.FLOAT
    oh, ow = (h + 2 * pad - k) // stride + 1, (w + 2 * pad - k) // stride + 1
    graph = helper.make_graph([node], "conv", [helper.make_tensor_value_info("x", f, [1, cin, h, w])],
                              [helper.make_tensor_value_info("y", f, [1, cout, oh, ow])],
                              [numpy_helper.from_array(weight, "w"),
                               numpy_helper.from_array(rng.standard_normal(cout).astype(np.float32), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def build(model: Path, out: Path) -> Path:
    proc = run_edgepack("build", str(model), "--target", "x86_64", "--backend", "ncnn", "--fp32",
                        "--verify-on", "native", "--out", str(out))
    if proc.returncode != 0:
        raise SystemExit(f"{model.name}: build failed: {proc.stderr.strip()[-400:]}")
    return out / f"{model.stem}-x86_64"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--isa", default="", help="avx2 or sse: cap the CPU (EDGEPACK_NCNN_OPTIONS=isa=...)")
    args = ap.parse_args(argv)
    cap = f",isa={args.isa}" if args.isa else ""
    print(f"{'shape':>22} {'ncnn ms':>9} {'direct ms':>9} {'direct/ncnn':>11} {'shipped ms':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        for spec in args.shapes.split(","):
            dims = [int(v) for v in spec.split("x")]
            model = conv_model(Path(tmp) / f"c{spec}.onnx", *dims)
            art = build(model, Path(tmp) / "out")
            times: dict[str, list[float]] = {"0": [], "2": [], "1": []}
            for _ in range(args.rounds):
                for mode in times:
                    env = {**os.environ, "EDGEPACK_NCNN_OPTIONS": f"direct={mode}{cap}"}
                    times[mode].append(artifact_median(art, args.runs, env=env, threads=args.threads))
            ncnn, direct, shipped = (min(times[m]) for m in ("0", "2", "1"))
            print(f"{spec:>22} {ncnn:9.3f} {direct:9.3f} {direct / ncnn:11.2f} {shipped:10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
