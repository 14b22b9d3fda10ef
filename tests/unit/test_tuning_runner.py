"""The thread counts `edgepack tune` times candidates at (edgepack/backends/tvm/tuning_runner.py)."""
from __future__ import annotations

import os

from edgepack.backends.tvm.tuning_runner import THREADS_ENV, measure_threads


def test_default_is_one_thread_and_every_core(monkeypatch):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    cores = os.cpu_count() or 1
    assert measure_threads() == ((1,) if cores == 1 else (1, cores))


def test_the_environment_overrides_sorted_and_deduplicated(monkeypatch):
    monkeypatch.setenv(THREADS_ENV, "4,1,4")
    assert measure_threads() == (1, 4)
    monkeypatch.setenv(THREADS_ENV, "1")
    assert measure_threads() == (1,)


def test_a_bad_list_falls_back_to_the_default(monkeypatch):
    cores = os.cpu_count() or 1
    default = (1,) if cores == 1 else (1, cores)
    for bad in ("two", "0", "-1,2", "", ","):
        monkeypatch.setenv(THREADS_ENV, bad)
        assert measure_threads() == default, bad
