"""`auto`'s choice among verified candidates (edgepack/selection.py): where candidates can be timed,
which are not built, and the build table's cell. The timing itself is tested in tests/test_select.py."""
from __future__ import annotations

from types import SimpleNamespace

import click
import pytest

from edgepack.commands.selection_opts import bench_device, timed
from edgepack.selection import BenchDevice, skip_reason, where_to_time
from edgepack.targets import TargetMatrix


def target(name: str):
    return TargetMatrix.load().get(name)


class FakeDevice(BenchDevice):
    """A device whose probe answered: runs only ``arch``."""

    def __init__(self, arch: str):
        super().__init__(SimpleNamespace(name="dev"), None)
        self._runs = arch

    def runs(self, arch: str) -> bool:
        return arch == self._runs


def test_where_candidates_are_timed():
    x86, arm = target("x86_64"), target("arm64")
    assert where_to_time(x86, "fastest", None) == "native"
    assert where_to_time(x86, "all", None) == "native"
    assert where_to_time(x86, "first", None) is None
    assert where_to_time(arm, "fastest", None) is None          # cannot run arm64 natively here
    assert where_to_time(arm, "fastest", FakeDevice("aarch64")) == "device"
    assert where_to_time(arm, "first", FakeDevice("aarch64")) is None
    assert where_to_time(x86, "fastest", FakeDevice("aarch64")) == "native"  # device of another arch


def test_untuned_tvm_is_skipped_only_after_whole_graph_ncnn():
    x86 = target("x86_64")
    ncnn, split = SimpleNamespace(backend="ncnn"), SimpleNamespace(backend="ncnn+tvm")
    why = skip_reason("tvm", [ncnn], x86, "off", "fastest")
    assert why and why.startswith("tvm not built: ncnn verified")
    assert skip_reason("tvm", [split], x86, "off", "fastest") is None   # the split runs TVM code too
    assert skip_reason("tvm", [], x86, "off", "fastest") is None
    assert skip_reason("tvm", [ncnn], x86, "off", "all") is None
    assert skip_reason("ncnn+tvm", [ncnn], x86, "off", "fastest") is None


def test_timed_cell():
    assert timed(None) == "-"
    sel = {"measured_on": "pi", "candidates": [{"backend": "tvm", "median_ms": 41.0},
                                               {"backend": "ncnn", "median_ms": 2.5}]}
    assert timed(sel) == "ncnn 2.5 ms < tvm 41 ms on pi"
    assert timed(sel | {"measured_on": "native"}) == "ncnn 2.5 ms < tvm 41 ms"


def test_inventory_without_bench_on_is_a_usage_error(tmp_path):
    assert bench_device(None, None) is None
    with pytest.raises(click.UsageError):
        bench_device(None, tmp_path / "devices.toml")
