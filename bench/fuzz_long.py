"""Long fuzzing runs of the artifact's untrusted-input parsers under ASan + UBSan (issue #11).

    python bench/fuzz_long.py --minutes 10 [--only image,http,npy] [--out fuzz-results]

Builds each fuzz target of tests/fuzz/ with gcc -fsanitize=address,undefined, then runs it for
--minutes in rounds of about a minute, each round with a fresh mutation stream (EP_FUZZ_SEED for
the targets on tests/fuzz/fuzz_driver.h; for npy_fuzz, whose stream is fixed, freshly mutated seed
files). A round that ends non-zero is a crash: its sanitizer report and (where the driver could
save it) the input go to --out. Prints one JSON object: per fuzzer, minutes, executions, crashes.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from fuzz_targets import build_fuzzer, write_seeds  # noqa: E402  (tests/fuzz_targets.py)

LONG = ("image", "http", "npy")  # the parsers of outside input; detect/ncnn_options fuzz in the tests only


def seeds(name: str, d: Path) -> list[Path]:
    if name == "image":
        from test_fuzz_image import image_seeds
        return image_seeds(d)
    if name == "http":
        from test_fuzz_http import SEEDS
        return write_seeds(d, SEEDS.items())
    import io
    import numpy as np
    from test_fuzz_npy import npy_seeds
    b = io.BytesIO()
    np.save(b, np.ones((3,), np.float16))
    return write_seeds(d, [*npy_seeds(), ("seed_f16.npy", b.getvalue())])


def remix(paths: list[Path], d: Path, rnd: random.Random) -> list[Path]:
    """Seed files with a few random byte changes: a new starting point for a fixed-stream driver."""
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for p in paths:
        b = bytearray(p.read_bytes())
        for _ in range(rnd.randint(0, 3)):
            if b:
                b[rnd.randrange(len(b))] = rnd.randrange(256)
        q = d / p.name
        q.write_bytes(bytes(b))
        out.append(q)
    return out


def run_one(name: str, minutes: float, work: Path, out: Path, round_s: float = 60.0) -> dict:
    exe = build_fuzzer(name, work)
    base = seeds(name, work / f"{name}-seeds")
    rnd = random.Random(11)
    execs = crashes = rounds = 0
    t_end = time.monotonic() + minutes * 60
    t0 = time.monotonic()
    while time.monotonic() < t_end:
        left = t_end - time.monotonic()
        env = dict(os.environ, EP_FUZZ_SEED=str(rounds), EP_FUZZ_CRASH_DIR=str(out))
        if name == "npy":  # fixed stream: fresh seed files, and iterations in place of seconds
            files = base + remix(base, work / f"{name}-r{rounds}", rnd)
            amount = "3000"
        else:
            files = base
            amount = f"{max(1, int(min(round_s, left)))}s"
        proc = subprocess.run([str(exe), amount, *map(str, files)], capture_output=True, text=True,
                              env=env, timeout=max(round_s, left) + 300)
        rounds += 1
        if proc.returncode == 0 and "fuzzed " in proc.stdout:
            execs += int(proc.stdout.split("fuzzed ")[1].split()[0])
        else:
            crashes += 1
            (out / f"{name}-round{rounds}.log").write_text(proc.stderr[-20000:])
    return {"minutes": round((time.monotonic() - t0) / 60, 2), "rounds": rounds, "executions": execs,
            "crashes": crashes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="per fuzzer")
    ap.add_argument("--only", default=",".join(LONG), help=f"any of {', '.join(LONG)}")
    ap.add_argument("--out", type=Path, default=Path("fuzz-results"))
    a = ap.parse_args(argv)
    unknown = set(a.only.split(",")) - set(LONG)
    if unknown:
        ap.error(f"--only: unknown fuzzer(s) {', '.join(sorted(unknown))}; known: {', '.join(LONG)}")
    a.out.mkdir(parents=True, exist_ok=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="edgepack-fuzz-") as tmp:
        for name in a.only.split(","):
            results[name] = run_one(name, a.minutes, Path(tmp), a.out.resolve())
            print(f"{name}: {results[name]}", file=sys.stderr)
    print(json.dumps({"fuzzers": results, "crash_dir": str(a.out)}))
    return 1 if any(r["crashes"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
