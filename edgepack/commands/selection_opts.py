"""`edgepack build`'s options for `auto`'s choice among verified candidates (edgepack/selection.py)."""
from __future__ import annotations

from pathlib import Path

import click

from ..selection import DEFAULT, POLICIES

_OPTIONS = (
    click.option("--select", "select", type=click.Choice(POLICIES), default=DEFAULT, show_default=True,
                 help="auto: 'fastest' builds every backend that can verify where the artifact can be timed (this "
                      "machine's arch, or --bench-on), times them and keeps the fastest, but skips untuned TVM "
                      "once NCNN verified; 'all' builds and times every one; 'first' keeps the first that verifies."),
    click.option("--bench-on", "bench_on", default=None, metavar="DEVICE",
                 help="Time the candidates on this device over SSH (an inventory name, ~/.ssh/config alias or "
                      "user@host[:port], as deploy's -d) for targets of its architecture."),
    click.option("--inventory", "-I", "inventory", type=click.Path(path_type=Path), default=None,
                 help="Device inventory (TOML) that --bench-on names a device of."),
)


def selection_options(fn):
    for opt in reversed(_OPTIONS):
        fn = opt(fn)
    return fn


def bench_device(bench_on: str | None, inventory: Path | None):
    """--bench-on DEVICE -> selection.BenchDevice (an unknown device is a usage error before any build)."""
    if bench_on is None:
        if inventory is not None:
            raise click.UsageError("--inventory is only used with --bench-on")
        return None
    from ..selection import resolve_bench_device
    return resolve_bench_device(bench_on, inventory, Path("~/.ssh/config").expanduser())


def timed(selection: dict | None) -> str:
    """The build table's cell: each candidate's median, the kept one first, and where it was timed."""
    if not selection:
        return "-"
    cands = sorted(selection["candidates"], key=lambda c: c["median_ms"])
    where = selection.get("measured_on")
    return " < ".join(f"{c['backend']} {c['median_ms']:.3g} ms" for c in cands) + \
        (f" on {where}" if where and where != "native" else "")
