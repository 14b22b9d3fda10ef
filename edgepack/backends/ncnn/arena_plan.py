"""A placement plan for the NCNN engine's arena, made from one recorded run (issue 10 item 5).

The engine's arena (runtimes/ncnn/ep_ncnn_pool.cc) places each tensor first-fit. A block that outlives
its neighbours splits a hole that a later, larger tensor cannot use, so the arena touches more than the
most its tensors ever hold at once: YOLO11s-seg touched 35.1 MB for 31.1 MB held, smart_turn_v3 8.1
for 6.4. Every page touched stays resident (that is what keeps the second run free of page faults), so
the difference is peak RSS.

A run asks for the same sizes in the same order every time, so the build runs the artifact with
EDGEPACK_NCNN_ARENA_LOG, reads each request's size and lifetime, and places them offline: largest
first, each at the lowest offset where nothing alive at the same time lies (greedy by size, as
TensorFlow Lite plans its arena). Where that beats first fit by at least MIN_SAVING, the offsets are
embedded; the engine follows them while the requests match and falls back to first fit otherwise.
Workspace sizes depend on the thread count, so there is one plan per thread count recorded.

Log lines: "A index bytes offset", "F index", "R" (a run begins); index counts a run's requests.
Plan blob (little-endian): b"EPAPLAN1", u64 plan count, then per plan u64 threads, u64 request count,
and per request u64 bytes, u64 offset."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import EngineBuild

MAGIC = b"EPAPLAN1"
MIN_SAVING = 256 << 10  # below this the artifact keeps first fit (and no plan to follow)


@dataclass(frozen=True)
class Request:
    index: int      # its place in the run
    size: int       # bytes, as the arena rounds them
    born: int       # the event it was made at
    dies: int       # the event it was freed at (the run's end if never)


@dataclass(frozen=True)
class RecordedRun:
    fixed: tuple[tuple[int, int], ...]  # (offset, bytes) of blocks made before the run and alive through it
    requests: tuple[Request, ...]        # by index
    first_fit_top: int                   # the most the arena touched by the run's end


@dataclass(frozen=True)
class ArenaPlan:
    offsets: tuple[int, ...]  # one per request, by index
    sizes: tuple[int, ...]
    planned_top: int
    first_fit_top: int

    def rows(self) -> bytes:
        return b"".join(struct.pack("<QQ", s, o) for s, o in zip(self.sizes, self.offsets))

    def manifest(self) -> dict:
        return {"requests": len(self.sizes), "first_fit_bytes": self.first_fit_top, "planned_bytes": self.planned_top}


def plans_blob(plans: dict[int, ArenaPlan]) -> bytes:
    """The blob the engine reads: every plan, with the thread count it was recorded at."""
    out = [MAGIC, struct.pack("<Q", len(plans))]
    for threads, plan in sorted(plans.items()):
        out += [struct.pack("<QQ", threads, len(plan.sizes)), plan.rows()]
    return b"".join(out)


def first_run(log: str) -> RecordedRun | None:
    """The first run in an arena log, or None when the log holds no run."""
    lent: dict[int, tuple[int, int]] = {}   # index -> (offset, bytes), before the run
    born: dict[int, tuple[int, int]] = {}   # index -> (event, bytes), in the run
    done: list[Request] = []
    top, in_run, t = 0, False, 0
    for line in log.splitlines():
        f = line.split()
        if not f:
            continue
        if f[0] == "R":
            if in_run:
                break
            in_run = True
            continue
        t += 1
        if f[0] == "A" and len(f) == 4:
            index, size, at = int(f[1]), int(f[2]), int(f[3])
            top = max(top, at + size)
            if in_run:
                born[index] = (t, size)
            else:
                lent[index] = (at, size)
        elif f[0] == "F" and len(f) == 2:
            index = int(f[1])
            if in_run and index in born:
                start, size = born.pop(index)
                done.append(Request(index, size, start, t))
            elif not in_run:
                lent.pop(index, None)
    if not in_run:
        return None
    done += [Request(i, size, start, t + 1) for i, (start, size) in born.items()]
    # requests made before the run and still lent were made in an earlier extractor; a block freed in
    # the run but made before it cannot be told from them by index, so it counts as fixed throughout
    return RecordedRun(tuple(sorted(lent.values())), tuple(sorted(done, key=lambda r: r.index)), top)


def _lowest_gap(busy: list[tuple[int, int]], size: int) -> int:
    """The lowest offset where [offset, offset + size) meets none of the busy stretches."""
    at = 0
    for lo, hi in sorted(busy):
        if at + size <= lo:
            break
        at = max(at, hi)
    return at


def greedy_plan(run: RecordedRun) -> ArenaPlan:
    """Largest request first (earliest first among equals), each at the lowest offset free of the fixed
    blocks and of every placed request alive at the same time."""
    n = max((r.index for r in run.requests), default=-1) + 1
    offsets, sizes = [0] * n, [0] * n   # an index the log never showed: 0 bytes, which no request matches
    placed: list[tuple[int, int, int, int]] = []   # born, dies, offset, end
    fixed = [(o, o + s) for o, s in run.fixed]
    top = max((hi for _, hi in fixed), default=0)
    for r in sorted(run.requests, key=lambda r: (-r.size, r.born)):
        busy = fixed + [(lo, hi) for b, d, lo, hi in placed if b < r.dies and r.born < d]
        at = _lowest_gap(busy, r.size)
        placed.append((r.born, r.dies, at, at + r.size))
        offsets[r.index], sizes[r.index] = at, r.size
        top = max(top, at + r.size)
    return ArenaPlan(tuple(offsets), tuple(sizes), top, run.first_fit_top)


def _requests_of_runs(log: str) -> list[list[str]]:
    """Each run's requests ("A index bytes", offsets left out), in order."""
    runs: list[list[str]] = []
    for line in log.splitlines():
        if line == "R":
            runs.append([])
        elif runs and line.startswith("A "):
            runs[-1].append(line.rsplit(" ", 1)[0])
    return runs


def plan_from_log(log: str) -> ArenaPlan | None:
    """The plan for the log's first run, or None when it would save less than MIN_SAVING or when the
    runs asked for different sizes or in another order (threads racing for the pool: a plan would not
    be followed, and two builds would embed different ones)."""
    runs = _requests_of_runs(log)
    if any(r != runs[0] for r in runs[1:]):
        return None
    run = first_run(log)
    if run is None or not run.requests:
        return None
    plan = greedy_plan(run)
    return plan if plan.first_fit_top - plan.planned_top >= MIN_SAVING else None


def recorded_threads() -> tuple[int, ...]:
    """The thread counts a build records plans at: 1, and 2 where this machine has two CPUs."""
    return (1, 2) if (os.cpu_count() or 1) >= 2 else (1,)


def plan_arena(engine: EngineBuild, artifact: Path, workdir: Path, log: Callable[[str], None],
               pinned: bytes | None = None) -> EngineBuild:
    """The engine with a plan for its arena, from runs of the bundled artifact on this machine (one per
    recorded thread count), or the engine as it was when no plan saves MIN_SAVING. The plan is blob 3
    (blob 2, the weight map, stays empty where there is none) and option ncnn.arena_plan names it.
    pinned (verify-build): the plan an artifact carries, embedded as it is (b"": none), since another
    machine records other requests and the rebuild must give the same bytes."""
    workdir.mkdir(parents=True, exist_ok=True)
    if pinned is not None:
        if pinned:
            log("arena plan: the one the artifact carries (pinned)")
        return _with_blob(engine, pinned, workdir, {"pinned": True}) if pinned else engine
    plans: dict[int, ArenaPlan] = {}
    for threads in recorded_threads():
        record = workdir / f"arena-{threads}.log"
        # the selftest's verdict is the verification's to judge (a precision rung that fails it is
        # rejected there, and the ladder goes on): here only its requests count. A run that did not
        # finish (killed, out of time) leaves no plan; verification then reports the artifact itself.
        try:
            done = subprocess.run([str(artifact), "selftest", "--threads", str(threads)], capture_output=True,
                                  text=True, errors="replace", timeout=900,
                                  env={**os.environ, "EDGEPACK_NCNN_ARENA_LOG": str(record)})
        except subprocess.TimeoutExpired:
            log(f"arena plan: the selftest on {threads} thread(s) ran past 900 s; first fit stays")
            return engine
        if done.returncode not in (0, 1) or not record.is_file():
            log(f"arena plan: the selftest on {threads} thread(s) ended with code {done.returncode}; first fit stays")
            return engine
        plan = plan_from_log(record.read_text())
        if plan:
            plans[threads] = plan
    if not plans:
        return engine
    for threads, plan in sorted(plans.items()):
        log(f"arena plan ({threads} thread{'s' if threads > 1 else ''}): {plan.first_fit_top / 1e6:.1f} MB "
            f"first fit -> {plan.planned_top / 1e6:.1f} MB")
    return _with_blob(engine, plans_blob(plans), workdir, {str(t): p.manifest() for t, p in sorted(plans.items())})


def _with_blob(engine: EngineBuild, plan: bytes, workdir: Path, about: dict) -> EngineBuild:
    blob = workdir / "arena.plan"
    blob.write_bytes(plan)
    blobs = tuple(engine.model_blobs)
    if len(blobs) == 2:
        no_map = workdir / "no-weight-map"
        no_map.write_bytes(b"")
        blobs += (no_map,)
    return dataclasses.replace(
        engine, model_blobs=blobs + (blob,), options={**engine.options, "ncnn.arena_plan": str(len(blobs))},
        manifest={**engine.manifest, "arena_plan": about})


def carried_plan(artifact_bytes: bytes, manifest: dict) -> bytes:
    """The plan blob an artifact carries (found by the sha256 its manifest records for it), b"" when it
    carries none; ValueError when the manifest names one the bytes do not hold."""
    options = manifest.get("build", {}).get("options", {})
    if "ncnn.arena_plan" not in options:
        return b""
    want = manifest["model_blobs_sha256"][int(options["ncnn.arena_plan"])]
    at = artifact_bytes.find(MAGIC)
    while at >= 0:
        end = _blob_end(artifact_bytes, at)
        if end and hashlib.sha256(artifact_bytes[at:end]).hexdigest() == want:
            return artifact_bytes[at:end]
        at = artifact_bytes.find(MAGIC, at + 1)
    raise ValueError("the artifact's arena plan is not in its bytes")


def _blob_end(data: bytes, at: int) -> int | None:
    """Where a plan blob starting at `at` ends, if its counts fit the bytes."""
    if at + 16 > len(data):
        return None
    (plans,) = struct.unpack_from("<Q", data, at + 8)
    pos = at + 16
    for _ in range(min(plans, 64)):
        if pos + 16 > len(data):
            return None
        (count,) = struct.unpack_from("<Q", data, pos + 8)
        pos += 16 + 16 * count
        if pos > len(data):
            return None
    return pos if plans <= 64 else None
