#!/usr/bin/env python3
"""Push / pull time of a ~10 MB multi-arch model through a real registry (docker-registry on 127.0.0.1).

    python bench/bench_oci.py [--dist DIR] [--mb 10] [--rounds 3]

Without --dist it builds a model whose weights are one ~MB-sized fp32 constant (MatMul N x N) for x86_64
and arm64 (--fp32, so the weights stay that size in the artifact), then per round, against a fresh
registry: push (cold), push again (everything already there: HEAD requests only), and pull of each
platform into an empty folder. Prints the median of each and the bytes moved, as a markdown table.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from oci_registry import Registry  # noqa: E402

from edgepack.oci import parse_platform, pull, push  # noqa: E402


def make_model(path: Path, mb: float) -> None:
    """x[1,N] @ W[N,N] + Relu: W holds ``mb`` MB of random fp32 weights (incompressible, like real ones)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    n = int((mb * 1e6 / 4) ** 0.5)
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((n, n)).astype(np.float32) * 0.02, "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
                              "big_dense", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)


def build(tmp: Path, mb: float) -> Path:
    onnx_path, dist = tmp / "big_dense.onnx", tmp / "dist"
    make_model(onnx_path, mb)
    p = subprocess.run([sys.executable, "-m", "edgepack", "build", str(onnx_path), "--target", "x86_64,arm64",
                        "--backend", "ncnn", "--fp32", "--out", str(dist)], capture_output=True, text=True,
                       timeout=3600)
    if p.returncode != 0:
        sys.exit(f"build failed:\n{p.stderr[-3000:]}")
    return dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dist", type=Path, help="a dist/ folder of one model's artifacts (default: build one)")
    ap.add_argument("--mb", type=float, default=10.0, help="weights of the built model, in MB")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-oci-") as t:
        tmp = Path(t)
        dist = args.dist or build(tmp, args.mb)
        files = sorted(f for f in dist.iterdir() if f.is_file())
        total = sum(f.stat().st_size for f in files)
        times: dict[str, list[float]] = {"push (cold)": [], "push again": [], "pull linux/amd64": [],
                                         "pull linux/arm64": []}
        moved: dict[str, int] = {}
        for i in range(args.rounds):
            reg = Registry(tmp / f"registry{i}")
            try:
                ref = f"{reg.host}/bench/model:{i}"
                t0 = time.monotonic()
                first = push([dist], ref, insecure=True)
                times["push (cold)"].append(time.monotonic() - t0)
                moved["push (cold)"] = first.stats.uploaded_bytes
                t0 = time.monotonic()
                again = push([dist], ref, insecure=True)
                times["push again"].append(time.monotonic() - t0)
                moved["push again"] = again.stats.uploaded_bytes
                for plat in ("linux/amd64", "linux/arm64"):
                    t0 = time.monotonic()
                    got = pull(ref, tmp / f"pull{i}-{plat.replace('/', '_')}", platform=parse_platform(plat),
                               insecure=True)
                    times[f"pull {plat}"].append(time.monotonic() - t0)
                    moved[f"pull {plat}"] = got.stats.downloaded_bytes
            finally:
                reg.close()
        print(f"model: {', '.join(f'{f.name} ({f.stat().st_size / 1e6:.1f} MB)' for f in files)}; "
              f"{total / 1e6:.1f} MB in all; {args.rounds} rounds, fresh registry each\n")
        print("| step | median s | min s | bytes moved |\n|---|---|---|---|")
        for k, v in times.items():
            print(f"| {k} | {statistics.median(v):.3f} | {min(v):.3f} | {moved[k]} |")


if __name__ == "__main__":
    main()
