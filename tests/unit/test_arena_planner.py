"""The arena planner (edgepack/backends/ncnn/arena_plan.py): the first run of an arena log, the greedy
placement (no two requests alive at once share a byte, none meets a block made before the run), and
the blob the engine reads (runtimes/ncnn/ep_ncnn_pool.cc, ep_ncnn_arena_set_plan)."""
from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest

from edgepack.backends.ncnn.arena_plan import (MAGIC, MIN_SAVING, ArenaPlan, RecordedRun, Request, carried_plan,
                                               first_run, greedy_plan, plan_from_log, plans_blob)

MB = 1 << 20


def first_fit_log(events: list[tuple[str, int, int]], fixed: int = 0) -> str:
    """An arena log as the engine writes it, offsets by first fit: a block of `fixed` bytes made before
    the run, then the run's events ("A", index, bytes) and ("F", index, 0)."""
    free: list[tuple[int, int]] = []
    top, lent, lines = 0, {}, []

    def alloc(size: int) -> int:
        nonlocal top
        for k, (at, n) in enumerate(free):
            if n >= size:
                free[k:k + 1] = [(at + size, n - size)] if n > size else []
                return at
        if free and free[-1][0] + free[-1][1] == top:
            at = free.pop()[0]
        else:
            at = top
        top = at + size
        return at

    def release(at: int, size: int) -> None:
        free.append((at, size))
        free.sort()
        merged: list[tuple[int, int]] = []
        for a, n in free:
            if merged and merged[-1][0] + merged[-1][1] == a:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((a, n))
        free[:] = merged

    if fixed:
        lines.append(f"A 0 {fixed} {alloc(fixed)}")
    lines.append("R")
    for kind, index, size in events:
        if kind == "A":
            at = alloc(size)
            lent[index] = (at, size)
            lines.append(f"A {index} {size} {at}")
        else:
            release(*lent.pop(index))
            lines.append(f"F {index}")
    lines.append("R")
    lines += [f"A {i} {s} 0" for _, i, s in events if _ == "A"]   # a second run: ignored
    return "\n".join(lines) + "\n"


# the YOLO pattern: a small block made early and kept splits the hole the large maps need
FRAGMENTING = [("A", 0, 4 * MB), ("A", 1, 64 * 1024), ("A", 2, 4 * MB), ("F", 0, 0), ("A", 3, 6 * MB),
               ("F", 2, 0), ("A", 4, 8 * MB), ("F", 3, 0), ("F", 4, 0), ("F", 1, 0)]


def test_first_run_reads_fixed_blocks_lifetimes_and_first_fits_top():
    run = first_run(first_fit_log(FRAGMENTING, fixed=4096))
    assert run.fixed == ((0, 4096),)
    assert [r.index for r in run.requests] == [0, 1, 2, 3, 4]
    by = {r.index: r for r in run.requests}
    assert by[1].born < by[0].dies < by[4].born < by[1].dies   # the small block outlives the large ones
    # the 6 and 8 MB maps fit no hole: the small block splits the two 4 MB ones
    assert run.first_fit_top == 4096 + 4 * MB + 64 * 1024 + 4 * MB + 6 * MB + 8 * MB
    assert first_run("A 0 64 0\nF 0\n") is None   # no run recorded


def _assert_valid(run: RecordedRun, plan: ArenaPlan) -> None:
    spans = {r.index: (r.born, r.dies, plan.offsets[r.index], plan.offsets[r.index] + r.size) for r in run.requests}
    for i, (b1, d1, lo1, hi1) in spans.items():
        assert plan.sizes[i] == hi1 - lo1
        for lo, n in run.fixed:
            assert hi1 <= lo or lo + n <= lo1, (i, "meets a fixed block")
        for j, (b2, d2, lo2, hi2) in spans.items():
            if i < j and b1 < d2 and b2 < d1:
                assert hi1 <= lo2 or hi2 <= lo1, (i, j, "alive together and overlapping")
    assert plan.planned_top == max([hi for *_, hi in spans.values()] + [lo + n for lo, n in run.fixed])


def test_greedy_plan_beats_first_fit_where_a_small_block_splits_the_holes():
    run = first_run(first_fit_log(FRAGMENTING, fixed=4096))
    plan = greedy_plan(run)
    _assert_valid(run, plan)
    # 8 + 6 MB and the small block: the 4 MB maps reuse the space the 8 MB one takes later
    assert plan.planned_top <= run.first_fit_top - 4 * MB, (plan.planned_top, run.first_fit_top)
    assert plan_from_log(first_fit_log(FRAGMENTING)) is not None


def test_random_lifetimes_never_overlap():
    rng = np.random.default_rng(5)
    for trial in range(20):
        events, alive, n = [], [], 0
        for _ in range(200):
            if alive and rng.random() < 0.45:
                events.append(("F", alive.pop(int(rng.integers(len(alive)))), 0))
            else:
                events.append(("A", n, int(rng.integers(1, 4096)) * 64))
                alive.append(n)
                n += 1
        run = first_run(first_fit_log(events, fixed=int(rng.integers(0, 3)) * 4096))
        plan = greedy_plan(run)
        _assert_valid(run, plan)
        # never alive at once: the plan needs at least the most the requests hold together
        assert plan.planned_top >= max(r.size for r in run.requests)


def test_no_plan_where_first_fit_is_as_good():
    # one block after another, each freed before the next: first fit is already tight
    events = []
    for i in range(10):
        events += [("A", i, MB), ("F", i, 0)]
    assert plan_from_log(first_fit_log(events)) is None
    assert MIN_SAVING >= 64 * 1024


def test_blob_layout():
    a = ArenaPlan((0, 128), (128, 64), 192, 4096)
    b = ArenaPlan((64,), (64,), 128, 4096)
    blob = plans_blob({2: b, 1: a})
    assert blob[:8] == MAGIC and struct.unpack_from("<Q", blob, 8)[0] == 2
    # by thread count: 1 (two requests), then 2 (one)
    assert struct.unpack_from("<QQ", blob, 16) == (1, 2)
    assert struct.unpack_from("<QQQQ", blob, 32) == (128, 0, 64, 128)
    assert struct.unpack_from("<QQ", blob, 64) == (2, 1)
    assert struct.unpack_from("<QQ", blob, 80) == (64, 64)
    assert len(blob) == 96
    assert a.manifest() == {"requests": 2, "first_fit_bytes": 4096, "planned_bytes": 192}
    assert Request(0, 64, 1, 2).size == 64


def test_no_plan_where_runs_disagree():
    # threads racing for the pool: the second run asked in another order, so no plan is followed
    log = first_fit_log(FRAGMENTING)
    assert plan_from_log(log) is not None
    runs = log.split("R\n")
    swapped = runs[2].splitlines()
    swapped[0], swapped[1] = swapped[1], swapped[0]
    assert plan_from_log("R\n".join(runs[:2] + ["\n".join(swapped) + "\n"])) is None


def test_the_carried_plan_is_found_by_its_hash():
    blob = plans_blob({1: ArenaPlan((0, 128), (128, 64), 192, 4096)})
    other = plans_blob({1: ArenaPlan((64,), (64,), 128, 4096)})
    # the runtime's own copy of the magic, then another plan-like stretch, then the plan
    data = b"code" + MAGIC + b"\xff" * 12 + other + b"\0" * 7 + blob + b"tail"
    manifest = {"build": {"options": {"ncnn.arena_plan": "3"}},
                "model_blobs_sha256": ["p", "b", "m", hashlib.sha256(blob).hexdigest()]}
    assert carried_plan(data, manifest) == blob
    assert carried_plan(data, {"build": {"options": {}}}) == b""   # none carried: none pinned
    manifest["model_blobs_sha256"][3] = hashlib.sha256(b"elsewhere").hexdigest()
    with pytest.raises(ValueError):
        carried_plan(data, manifest)
