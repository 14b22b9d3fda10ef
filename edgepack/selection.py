"""`--backend auto` keeps the fastest verified build (issue 10 item 4).

``--select`` says how many candidates `auto` builds:

* ``fastest`` (the default): where the artifact can be timed (a target this machine runs natively, or
  ``--bench-on DEVICE`` of the target's architecture) every candidate that verifies is built and the
  candidates are timed side by side; the fastest is kept. One rule keeps build time sane: a whole-graph
  TVM build is not tried once a whole-graph NCNN build verified, unless a tuning database would
  schedule it. Re-measured with the default schedules (2026-12-01, `bench/bench_tvm_untuned.py --ncnn`,
  1 thread, alternating rounds): untuned TVM / NCNN = 1.17x silero_vad, 1.25x ppocr_cls, 1.55x
  orientation, 2.7x captcha_crnn, 3.7x nudenet_320n, 6.3x ddddocr_crnn (geomean 2.3x): TVM lost on
  every model both can build, and its build took 1-4x NCNN's (75-630 s), so building it is minutes
  spent on a candidate that loses. No predictor was needed: there was no class of model on which it
  won. After the NCNN+TVM split, which runs TVM code too, whole-graph TVM is built and timed.
* ``all``: every candidate that verifies is built and timed (no rule).
* ``first``: the first candidate that verifies (NCNN first), nothing timed.

A target that can be timed nowhere keeps the first candidate that verifies (NCNN first).

Timing: the artifact's own ``bench --json`` (same input, the golden one; same threads, 1), candidates
alternating within each round so that load on the machine hits all alike; the median of the rounds'
medians decides.
"""
from __future__ import annotations

import contextlib
import json
import shlex
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .errors import DeployError, UsageError
from .runner import NATIVE, host_arch, run_artifact

POLICIES = ("fastest", "all", "first")
DEFAULT = "fastest"
BENCH_RUNS, BENCH_WARMUP, BENCH_ROUNDS, BENCH_THREADS = 10, 2, 3, 1


@dataclass
class BenchDevice:
    """--bench-on: one device of the inventory (or an ssh alias), reached with deploy's connectors."""
    device: object                   # deploy.device.Device
    options: object                  # deploy.engine.Options
    _facts: object = field(default=None, repr=False)  # deploy.probe.DeviceFacts
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def name(self) -> str:
        return self.device.name

    def runs(self, arch: str) -> bool:
        """Whether the device runs ``arch`` executables (natively, or through binfmt_misc/qemu-user as
        deploy's probe sees it); asked once, as targets build in threads."""
        with self._lock:
            if self._facts is None:
                from .deploy.engine import open_connector
                from .deploy.probe import parse_probe, probe_script
                with open_connector(self.device, self.options) as conn:
                    res = conn.run(probe_script("/nonexistent/edgepack-bench"), 60)
                if res.rc != 0:
                    raise DeployError(f"device {self.name}: probing its architecture failed: {res.output[:200]}",
                                      hint=f"check the device with `edgepack check -d {self.name}`")
                self._facts = parse_probe(res.stdout)
            return self._facts.runs(arch)


def resolve_bench_device(spec: str, inventory: Path | None, ssh_config: Path | None = None) -> BenchDevice:
    """A device name as deploy's -d takes it -> BenchDevice (a usage error names what is known)."""
    from .deploy.engine import Options
    from .deploy.inventory import load_inventory, select_devices
    inv = load_inventory(inventory) if inventory else None
    devices = select_devices([spec], [], inv, ssh_config)
    if len(devices) != 1:
        raise UsageError(f"--bench-on takes one device, {spec!r} names {len(devices)}")
    return BenchDevice(devices[0], Options())


def where_to_time(target, policy: str, bench_on: BenchDevice | None) -> str | None:
    """'device', 'native' or None (cannot be timed: keep the first candidate that verifies)."""
    if policy == "first":
        return None
    if bench_on is not None and bench_on.runs(target.arch):
        return "device"
    if target.arch == host_arch() and NATIVE in target.verify_cpus:
        return "native"
    return None


def skip_reason(name: str, verified: list, target, tuning_db: str | None, policy: str) -> str | None:
    """Why candidate ``name`` is not built although it could be (the rule above), or None."""
    if policy != "fastest" or name != "tvm":
        return None
    # only a whole-graph NCNN build is a sign that TVM loses: a split already runs TVM code, and whole-graph
    # TVM (no hand-over between engines) may beat it
    ncnn = [r for r in verified if r.backend == "ncnn"]
    if not ncnn:
        return None
    try:
        from .backends.tvm.tuning import find_database
        db, _ = find_database(target, tuning_db)
    except Exception:  # noqa: BLE001  (no TVM installed: the candidate list already says so)
        db = None
    if db is not None:
        return None
    return (f"tvm not built: {ncnn[0].backend} verified and TVM has no tuning database for {target.name} "
            f"(untuned TVM measured 1.2-6.3x slower than NCNN; --select all builds it anyway)")


def _bench_json(text: str) -> float:
    obj = json.loads(text.strip().splitlines()[-1])
    return float(obj["median_ms"])


def _bench_args(runs: int) -> list[str]:
    return ["bench", "--runs", str(runs), "--warmup", str(BENCH_WARMUP), "--threads", str(BENCH_THREADS), "--json"]


def time_native(paths: list[Path], runs: int = BENCH_RUNS, rounds: int = BENCH_ROUNDS) -> list[list[float]]:
    """Each artifact's median per round, the artifacts alternating within a round."""
    out: list[list[float]] = [[] for _ in paths]
    for _ in range(rounds):
        for i, p in enumerate(paths):
            proc = run_artifact(p, _bench_args(runs), timeout=1800)
            if proc.returncode != 0:
                raise DeployError(f"{p.name} bench failed (exit {proc.returncode}): {(proc.stderr or '')[-200:]}")
            out[i].append(_bench_json(proc.stdout))
    return out


@contextlib.contextmanager
def uploaded(conn, dev: BenchDevice, paths: list[Path], prefix: str):
    """The artifacts copied, executable, into a fresh temporary folder on the device (its remote paths),
    removed again afterwards whatever happened."""
    res = conn.run(f"mktemp -d \"${{TMPDIR:-/tmp}}/{prefix}.XXXXXX\"", 30)
    tmp = res.stdout.strip()
    if res.rc != 0 or not tmp.startswith("/"):
        raise DeployError(f"device {dev.name}: cannot make a temporary folder: {res.output[:200]}")
    remote = [f"{tmp}/c{i}-{p.name}" for i, p in enumerate(paths)]
    try:
        for p, r in zip(paths, remote):
            conn.put(p, r)
            conn.chmod(r, 0o755)
        yield remote
    finally:
        for r in remote:
            try:
                conn.remove(r)
            except Exception:  # noqa: BLE001  (a file never uploaded)
                pass
        try:
            conn.rmdir(tmp)
        except Exception:  # noqa: BLE001
            pass


def time_on_device(paths: list[Path], dev: BenchDevice, runs: int = BENCH_RUNS,
                   rounds: int = BENCH_ROUNDS) -> list[list[float]]:
    """The same on a device over SSH: upload into a fresh temporary folder, time, remove it again."""
    from .deploy.engine import open_connector
    out: list[list[float]] = [[] for _ in paths]
    try:
        with open_connector(dev.device, dev.options) as conn, uploaded(conn, dev, paths, "edgepack-bench") as remote:
            for _ in range(rounds):
                for i, r in enumerate(remote):
                    res = conn.run(shlex.join([r, *_bench_args(runs)]), 1800)
                    if res.rc != 0:
                        raise DeployError(f"device {dev.name}: {paths[i].name} bench failed (exit {res.rc}): "
                                          f"{res.output[-200:]}")
                    out[i].append(_bench_json(res.stdout))
    except DeployError as exc:
        if not exc.hint:
            exc.hint = f"check the device with `edgepack check -d {dev.name}`"
        raise
    return out


def choose(results: list, where: str, dev: BenchDevice | None, log: Callable[[str], None] = lambda m: None,
           skipped: tuple[str, ...] = ()) -> tuple[int, dict]:
    """(index of the fastest verified candidate, the manifest's "selection" record)."""
    t0 = time.monotonic()
    paths = [Path(r.path) for r in results]
    if where == "device":
        log(f"timing {len(paths)} candidates on {dev.name} over SSH")
        rounds = time_on_device(paths, dev)
    else:
        log(f"timing {len(paths)} candidates here, {BENCH_ROUNDS} alternating rounds")
        rounds = time_native(paths)
    medians = [statistics.median(r) for r in rounds]
    kept = min(range(len(results)), key=lambda i: medians[i])
    cands = [{"backend": r.backend, "precision": r.precision, "verified": r.max_abs_err is not None,
              "median_ms": round(m, 4), "rounds_ms": [round(x, 4) for x in rounds[i]]}
             for i, (r, m) in enumerate(zip(results, medians))]
    k = results[kept]
    if len(results) == 1:
        why = (f"{k.backend} {k.precision}: the only candidate built; median {medians[0]:.3g} ms"
               + (f" on {dev.name}" if where == "device" else " here"))
    else:
        others = ", ".join(f"{c['backend']} {c['median_ms']:.3g} ms" for i, c in enumerate(cands) if i != kept)
        why = (f"{k.backend} {k.precision}: fastest median {medians[kept]:.3g} ms "
               f"(vs {others}; {BENCH_ROUNDS} alternating rounds of bench --runs {BENCH_RUNS} --threads "
               f"{BENCH_THREADS}" + (f" on {dev.name})" if where == "device" else " here)"))
    rec = {"policy": "fastest", "measured_on": dev.name if where == "device" else "native",
           "candidates": cands, "kept": {"backend": k.backend, "precision": k.precision}, "why": why,
           "not_built": list(skipped), "seconds": round(time.monotonic() - t0, 2)}
    return kept, rec


def keep_fastest(verified: list, where: str, opts, not_built: tuple[str, ...], reasons: tuple[str, ...], t0: float,
                 log: Callable[[str], None] = lambda m: None):
    """Time the verified candidates (built into a staging folder), move the fastest and its .json
    manifest into opts.out_dir with the "selection" record added; returns its TargetResult."""
    import dataclasses
    import shutil
    kept, rec = choose(verified, where, opts.bench_on, log, not_built)
    rec["policy"] = opts.select
    res = verified[kept]
    log(f"kept {rec['why']}")
    src = Path(res.path)
    dest = Path(opts.out_dir) / src.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    manifest = json.loads(src.with_name(src.name + ".json").read_text())
    manifest["selection"] = rec
    shutil.move(src, dest)
    dest.with_name(dest.name + ".json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    notes = res.notes + tuple(f"not built: {w}" for w in not_built) + (f"selection: {rec['why']}",)
    notes += tuple(f"skipped: {r}" for r in reasons if f"skipped: {r}" not in res.notes)
    return dataclasses.replace(res, path=dest, notes=notes, selection=rec, seconds=time.monotonic() - t0)
