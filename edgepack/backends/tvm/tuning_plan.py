"""Which tasks a tuning run searches: where the model spends its time, first.

MetaSchedule's task scheduler hands every task one batch of candidates before it weighs them
(round robin, then by gradient). On a 2-core machine one batch costs 1-2.5 minutes, so a 20-minute
budget over orientation's 29 tasks ended before the scheduler weighed anything: 8 tasks reached,
one batch each, most of them small kernels whose speed does not show in the model's time.

`tune` times every task's default schedule first (tuning_defaults.py). That time, times the task's
call count, says where the model's time goes; the plan searches the fewest tasks that together take
HOT_SHARE of it, leaving out tasks under MIN_SHARE, and with a time budget no more tasks than get
SECONDS_PER_TASK each (a few batches), so the budget buys rounds of evolution on the kernels that
matter rather than one random batch on each. When those are done (MetaSchedule stops a task at its
trial cap) and budget is left, the run plans again over the tasks it has not searched: waves, hottest
first. Tasks never reached keep their default schedule (or an earlier tune's record), and a later
`tune` of the same model takes them up.

A task counts as searched when the database holds a record for it that is not its default
schedule: a later model with the same workload reuses it, and a run whose unsearched tasks are all
cold continues the search on the hot searched ones (MetaSchedule seeds it with the records).
"""
from __future__ import annotations

from dataclasses import dataclass

HOT_SHARE = 0.90   # search the fewest tasks that together take this share of the model's time
MIN_SHARE = 0.005  # never search a task under this share of it
SECONDS_PER_TASK = 180.0  # budget per searched task: 2-3 batches of candidates on a loaded 2-core machine


def max_tasks_for(budget_s: float | None) -> int | None:
    return None if budget_s is None else max(1, int(budget_s // SECONDS_PER_TASK))


@dataclass(frozen=True)
class TaskCost:
    index: int
    name: str
    weight: int                   # calls per model run
    seconds: float | None         # best known time of one call (default schedule or record); None: unknown
    searched: bool                # the database has a non-default record for it

    @property
    def total(self) -> float | None:
        return None if self.seconds is None else self.seconds * self.weight


@dataclass(frozen=True)
class TuningPlan:
    costs: tuple[TaskCost, ...]
    chosen: tuple[int, ...]       # task indices to search, hottest first
    share: float                  # of the model's known time, what the chosen tasks take
    fresh: bool                   # the chosen tasks were never searched (else: continuing a search)

    def describe(self) -> str:
        what = "never searched" if self.fresh else "searched before, continuing"
        return (f"searching the {len(self.chosen)} hottest of {len(self.costs)} tasks left ({what}; "
                f"{100 * self.share:.1f}% of the model's time on their default schedules)")


def _mean(xs) -> float | None:
    xs = [float(x) for x in xs]
    return sum(xs) / len(xs) if xs else None


def task_costs(tasks, database, defaults: dict, new_records: dict) -> list[TaskCost]:
    """One TaskCost per task. ``defaults``: task index -> default Schedule (tuning_defaults.
    default_traces); ``new_records``: task index -> timed record not committed (a default schedule,
    or the naive loop nest of a kernel no rule schedules)."""
    out = []
    for i, task in enumerate(tasks):
        mod = task.dispatched[0]
        times, searched = [], False
        if database.has_workload(mod):
            default_trace = str(defaults[i].trace) if i in defaults else None
            for rec in database.get_top_k(database.commit_workload(mod), 1 << 16):
                t = _mean(rec.run_secs or [])
                if t is not None:
                    times.append(t)
                searched = searched or str(rec.trace) != default_trace
        if i in new_records:
            t = _mean(new_records[i].run_secs or [])
            if t is not None:
                times.append(t)
        out.append(TaskCost(i, str(task.task_name), int(task.weight), min(times) if times else None, searched))
    return out


def _pick(pool: list[TaskCost], known_total: float, max_tasks: int | None) -> tuple[list[int], float]:
    """Unknown-cost tasks (no rule schedules them: naive loops) first, then the hottest known ones
    until HOT_SHARE of the model's time is covered, none under MIN_SHARE, at most max_tasks."""
    limit = len(pool) if max_tasks is None else max_tasks
    chosen = [c.index for c in pool if c.total is None][:limit]
    if known_total <= 0:  # nothing timed (default schedules off): every task, as MetaSchedule would
        return [c.index for c in pool][:limit], 0.0
    covered = 0.0
    for c in sorted((c for c in pool if c.total is not None), key=lambda c: -c.total):
        share = c.total / known_total
        if covered >= HOT_SHARE or share < MIN_SHARE or len(chosen) >= limit:
            break
        chosen.append(c.index)
        covered += share
    return chosen, covered


def plan(costs: list[TaskCost], max_tasks: int | None = None, exclude: frozenset = frozenset()) -> TuningPlan:
    """The next tasks to search; ``exclude``: task indices searched already in this run (a run
    searches in waves: when the first wave is done and the budget allows, the next hottest)."""
    known_total = sum(c.total for c in costs if c.total is not None)
    pool = [c for c in costs if c.index not in exclude]
    chosen, covered = _pick([c for c in pool if not c.searched], known_total, max_tasks)
    fresh = bool(chosen)
    if not chosen:
        chosen, covered = _pick([c for c in pool if c.searched], known_total, max_tasks)
    return TuningPlan(tuple(costs), tuple(chosen), covered, fresh)


def ms4(seconds: float | None) -> float | None:
    # four significant digits, not four decimals: a copy kernel takes ~0.00003 ms, and 0 would read
    # as "not timed"
    return None if seconds is None else float(f"{seconds * 1e3:.4g}")


def task_rows(costs: list[TaskCost], chosen) -> tuple[dict, ...]:
    """Per task, hottest first: name, calls, ms per call and in all (best known schedule), share of
    the model's known kernel time, searched by an earlier tune, and `chosen` (searched now / next)."""
    known_total = sum(c.total for c in costs if c.total is not None) or 1.0
    picked = set(chosen)
    rows = sorted(costs, key=lambda c: -(c.total if c.total is not None else float("inf")))
    return tuple({"task": c.name, "calls": c.weight,
                  "ms_per_call": ms4(c.seconds), "ms": ms4(c.total),
                  "share": None if c.total is None else round(c.total / known_total, 4),
                  "searched_before": c.searched, "chosen": c.index in picked} for c in rows)
