#!/usr/bin/env python3
"""Deploy wall time for 1, 8 and 32 devices of the sshd device lab (tests/lab), through edgepack's own SSH
path (paramiko) and through Ansible (the exported playbook run by ansible-runner), side by side.

    python bench/bench_deploy.py [--devices 1,8,32] [--via ssh|ansible|both] [--rounds 2]
                                 [--artifact dist/tiny_cnn-x86_64] [--kind x86_64] [--jobs N]

Every round deploys a new version to each group (so nothing is "no change"); the SSH path then re-runs
the selftest (smoke) on every device, as the first version of this benchmark did. The Ansible path runs
one batch with as many forks as devices (no canary: this measures fan-out). Goal: 32 devices take at
most 3x the time of one. Needs root (the lab's namespaces), like the deploy tests.
"""
from __future__ import annotations

import argparse
import os
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


def _check(results, what: str) -> None:
    bad = [r for r in results if not r.ok]
    if bad:
        raise SystemExit(f"bench {what} failed: {[(r.device, r.status, r.message) for r in bad]}")


def via_ssh(devices, art, jobs: int) -> tuple[float, float]:
    opts = Options(ssh=SSHOptions(connect_timeout=30), parallel=jobs)
    t0 = time.monotonic()
    deployed = run_all(devices, lambda d: deploy_one(d, art, opts), jobs)
    t_deploy = time.monotonic() - t0
    smoked = run_all(devices, lambda d: smoke_one(d, opts), jobs)
    _check(deployed + smoked, "ssh round")
    return t_deploy, time.monotonic() - t0


def via_ansible(devices, art, jobs: int, folder: Path) -> float:
    from edgepack.deploy import ansible, ansible_run
    opts = ansible.AnsibleOptions(canary=len(devices), batch="100%", forks=jobs, connect_timeout=30)
    t0 = time.monotonic()
    ex = ansible.export(art, devices, folder, opts)
    results = ansible_run.run(ex, art, devices, opts)
    elapsed = time.monotonic() - t0
    _check(results, "ansible round")
    return elapsed


def _row(label: str, times: dict[int, list[float]], ns: list[int]) -> str:
    one = statistics.median(times[ns[0]])
    cells = []
    for n in ns:
        m = statistics.median(times[n])
        cells.append(f"{n:>3}: {m:6.2f} s ({m / one:4.2f}x)")
    return f"{label:<30} " + "   ".join(cells)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", type=Path, help="a real artifact (default: a 2 MB stand-in script)")
    ap.add_argument("--devices", default="1,8,32", help="comma-separated device counts (first is the base)")
    ap.add_argument("--via", choices=["ssh", "ansible", "both"], default="both")
    ap.add_argument("--kind", default="x86_64", choices=["x86_64", "arm64", "jetson"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=0, help="devices at once (default: all of a group)")
    args = ap.parse_args()
    ns = sorted({int(x) for x in args.devices.split(",") if x.strip()})
    vias = ["ssh", "ansible"] if args.via == "both" else [args.via]
    tmp = Path(tempfile.mkdtemp(prefix="bench-deploy-"))
    lab = Lab(tmp / "lab")
    try:
        devs = [lab.add(f"d{i}", args.kind) for i in range(max(ns))]
        inv = load_inventory(lab.write_inventory(devs))
        all_devices = [inv.devices[d.name] for d in devs]
        ssh_deploy = {n: [] for n in ns}
        ssh_total = {n: [] for n in ns}
        ans = {n: [] for n in ns}
        version = 0
        for rnd in range(args.rounds):
            for n in ns:
                jobs = args.jobs or n
                for via in vias:
                    version += 1
                    art = inspect_artifact(variant(args.artifact, tmp, version, args.kind))
                    if via == "ssh":
                        d, t = via_ssh(all_devices[:n], art, jobs)
                        ssh_deploy[n].append(d)
                        ssh_total[n].append(t)
                        print(f"round {rnd + 1}: ssh     {n:>3} devices: deploy {d:6.2f} s, +smoke {t:6.2f} s",
                              flush=True)
                    else:
                        t = via_ansible(all_devices[:n], art, jobs, tmp / f"play{version}")
                        ans[n].append(t)
                        print(f"round {rnd + 1}: ansible {n:>3} devices: deploy {t:6.2f} s", flush=True)
        what = "real artifact" if args.artifact else "stand-in script"
        print(f"\nartifact: {art.name} ({what}, {art.size / 1e6:.2f} MB), devices: {args.kind}, rounds: "
              f"{args.rounds}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; medians:")
        if "ssh" in vias:
            print(_row("ssh (paramiko) deploy", ssh_deploy, ns))
            print(_row("ssh (paramiko) deploy+smoke", ssh_total, ns))
        if "ansible" in vias:
            print(_row("ansible (ansible-runner) deploy", ans, ns))
        for label, t in (("ssh deploy", ssh_deploy), ("ansible deploy", ans)):
            if t[ns[0]] and len(ns) > 1:
                ratio = statistics.median(t[ns[-1]]) / statistics.median(t[ns[0]])
                print(f"{label}: {ns[-1]} devices / {ns[0]}: {ratio:.2f}x (goal <= 3.00x: "
                      f"{'met' if ratio <= 3 else 'NOT met'})")
        return 0
    finally:
        lab.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
