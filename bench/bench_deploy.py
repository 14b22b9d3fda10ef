#!/usr/bin/env python3
"""Deploy + smoke time for 1 device vs N devices in parallel, on the sshd device lab (tests/lab).

    python bench/bench_deploy.py [--artifact dist/tiny_cnn-x86_64] [--devices 8] [--kind x86_64] [--rounds 3]

Every round deploys a new version (so nothing is "no change") and then re-runs the selftest (smoke) on
every device, through the same engine as `edgepack deploy` / `edgepack smoke`. Goal: N devices take at
most 2x the time of one. Needs root (the lab's namespaces), like the deploy tests.
"""
from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from lab.lab import Lab  # noqa: E402
from lab.standin import make_standin  # noqa: E402

from edgepack.deploy.artifact import inspect_artifact  # noqa: E402
from edgepack.deploy.engine import Options, deploy_one, run_all, smoke_one  # noqa: E402
from edgepack.deploy.inventory import load_inventory  # noqa: E402
from edgepack.deploy.ssh import SSHOptions  # noqa: E402


def variant(base: Path | None, folder: Path, i: int, kind: str) -> Path:
    """Round i's artifact: the real one with i trailing bytes (a new sha, same behaviour), or a stand-in."""
    if base is None:
        return make_standin(folder / f"v{i}", "x86_64" if kind == "x86_64" else "arm64", version=str(i),
                            pad_kb=2048)
    out = folder / f"v{i}" / base.name
    out.parent.mkdir(parents=True)
    shutil.copy2(base, out)
    with open(out, "ab") as fh:
        fh.write(b"\0" * (i + 1))  # ELF loaders ignore bytes after the last segment
    side = Path(str(base) + ".json")
    if side.exists():
        shutil.copy2(side, Path(str(out) + ".json"))
    return out


def one_round(devices, art, opts) -> tuple[float, list]:
    t0 = time.monotonic()
    deployed = run_all(devices, lambda d: deploy_one(d, art, opts), opts.parallel)
    t_deploy = time.monotonic() - t0
    smoked = run_all(devices, lambda d: smoke_one(d, opts), opts.parallel)
    elapsed = time.monotonic() - t0
    bad = [r for r in deployed + smoked if not r.ok]
    if bad:
        raise SystemExit(f"bench round failed: {[(r.device, r.status, r.message) for r in bad]}")
    return t_deploy, elapsed, deployed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", type=Path, help="a real artifact (default: a 2 MB stand-in script)")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--kind", default="x86_64", choices=["x86_64", "arm64", "jetson"])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-deploy-"))
    lab = Lab(tmp / "lab")
    try:
        devs = [lab.add(f"d{i}", args.kind) for i in range(args.devices)]
        inv = load_inventory(lab.write_inventory(devs))
        all_devices = [inv.devices[d.name] for d in devs]
        times: dict[int, list[float]] = {1: [], args.devices: []}
        deploy_times: dict[int, list[float]] = {1: [], args.devices: []}
        latencies = []
        version = 0
        for _ in range(args.rounds):
            for n in (1, args.devices):
                version += 1
                art = inspect_artifact(variant(args.artifact, tmp, version, args.kind))
                opts = Options(ssh=SSHOptions(connect_timeout=10), parallel=n)
                t_deploy, elapsed, deployed = one_round(all_devices[:n], art, opts)
                times[n].append(elapsed)
                deploy_times[n].append(t_deploy)
                latencies += [r.latency_ms for r in deployed if r.latency_ms is not None]
        one, many = statistics.median(times[1]), statistics.median(times[args.devices])
        size = art.size
        what = "real artifact" if args.artifact else "stand-in script"
        print(f"artifact: {art.name} ({what}, {size / 1e6:.2f} MB), devices: {args.kind}, rounds: {args.rounds}")
        print(f"deploy+smoke, 1 device             : {one:6.2f} s  (runs: {', '.join(f'{t:.2f}' for t in times[1])})")
        print(f"deploy+smoke, {args.devices} devices, -j {args.devices:<4}: {many:6.2f} s  "
              f"(runs: {', '.join(f'{t:.2f}' for t in times[args.devices])})")
        d1, dn = statistics.median(deploy_times[1]), statistics.median(deploy_times[args.devices])
        print(f"  of which deploy (upload, verify, switch, on-device selftest): 1 device {d1:.2f} s, "
              f"{args.devices} devices {dn:.2f} s ({dn / d1:.2f}x); the rest is `smoke` (a new session per device)")
        ratio = many / one
        print(f"ratio {args.devices}/1: {ratio:.2f}x  (goal <= 2.00x: {'met' if ratio <= 2 else 'NOT met'})")
        if latencies:
            print(f"on-device selftest latency: median {statistics.median(latencies):.2f} ms")
        return 0
    finally:
        lab.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
