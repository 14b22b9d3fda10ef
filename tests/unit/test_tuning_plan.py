"""Which tasks `edgepack tune` searches (edgepack/backends/tvm/tuning_plan.py): the hottest never-searched
tasks that together take 90% of the model's time, unknown-cost ones first, none under 2%; once every hot
task was searched, the search continues on the hot searched ones."""
from edgepack.backends.tvm.tuning_plan import MIN_SHARE, SECONDS_PER_TASK, TaskCost, max_tasks_for, plan


def costs(*rows):
    """rows: (ms per call, calls, searched)"""
    return [TaskCost(i, f"t{i}", w, None if ms is None else ms / 1e3, s) for i, (ms, w, s) in enumerate(rows)]


def test_the_hottest_tasks_covering_ninety_percent_are_chosen_hottest_first():
    # times x calls: 50, 30, 12, 5, 2, 1 (of 100)
    p = plan(costs((50, 1, False), (10, 3, False), (12, 1, False), (5, 1, False), (2, 1, False), (1, 1, False)))
    assert p.chosen == (0, 1, 2) and p.fresh
    assert abs(p.share - 0.92) < 1e-9
    assert "3 hottest of 6 tasks" in p.describe() and "92.0%" in p.describe()


def test_tasks_under_the_minimum_share_are_never_searched():
    p = plan(costs((80, 1, False), (19.6, 1, False), (0.4, 1, False)))  # 0.4% < MIN_SHARE
    assert 0.004 < MIN_SHARE
    assert p.chosen == (0, 1)


def test_a_budget_caps_the_tasks_at_a_few_batches_each():
    rows = [(1, 1, False)] * 60  # time spread evenly: 90% would be 54 tasks
    assert len(plan(costs(*rows)).chosen) in (54, 55)  # 54 x 1/60 = 0.9, give or take a rounding
    p = plan(costs(*rows), max_tasks_for(20 * 60))
    assert len(p.chosen) == 20 * 60 // SECONDS_PER_TASK == 6
    assert max_tasks_for(15) == 1 and max_tasks_for(None) is None


def test_unknown_cost_tasks_come_first_and_searched_tasks_are_reused():
    p = plan(costs((80, 1, True), (None, 1, False), (15, 1, False), (5, 1, False)))
    assert p.chosen == (1, 2, 3) and p.fresh  # the searched hot task is left to the database
    assert abs(p.share - 0.20) < 1e-9


def test_a_search_continues_on_hot_searched_tasks_when_nothing_new_is_hot():
    p = plan(costs((70, 1, True), (29.7, 1, True), (0.3, 1, False)))  # the new task: 0.3%, not worth a batch
    assert p.chosen == (0, 1) and not p.fresh
    assert "continuing" in p.describe()


def test_nothing_timed_means_every_task():
    p = plan(costs((0, 1, False), (0, 2, False)))
    assert p.chosen == (0, 1)


def test_waves_take_the_next_hottest_tasks_once_the_first_are_searched():
    rows = costs((50, 1, False), (30, 1, False), (12, 1, False), (5, 1, False), (2, 1, False), (1, 1, False))
    first = plan(rows, max_tasks=2)
    assert first.chosen == (0, 1)
    second = plan(rows, max_tasks=2, exclude=frozenset(first.chosen))
    assert second.chosen == (2, 3) and second.fresh and abs(second.share - 0.17) < 1e-9
    third = plan(rows, exclude=frozenset(first.chosen + second.chosen))
    assert third.chosen == (4, 5)
    assert plan(rows, exclude=frozenset(range(6))).chosen == ()  # every task searched: the run ends
