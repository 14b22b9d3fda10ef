"""Tables: tab-separated lines when piped (nothing truncated), boxed on a terminal; the deploy tables use them."""
from __future__ import annotations

import io

from rich.console import Console

from edgepack.deploy.results import DeviceResult, table_rows
from edgepack.tables import Cell, print_table

LONG = "a-device-name-much-longer-than-any-column-rich-would-keep-in-80-characters-" * 2


def _results():
    return [DeviceResult(LONG, "root@127.0.0.2:22", "rolled back", 1.25, target="arm64", latency_ms=3.1,
                         message="selftest failed", output="line one\nline two"),
            DeviceResult("pc", "root@127.0.0.3:22", "deployed", 0.5, target="x86_64")]


def test_piped_table_is_tab_separated_and_whole():
    buf = io.StringIO()
    print_table(Console(file=buf), "title", ["name", "note"], [[LONG, Cell("ok\tfine", "green")], ["b", "x\ny"]])
    assert buf.getvalue().splitlines() == ["name\tnote", f"{LONG}\tok fine", "b\tx y"]


def test_terminal_table_keeps_line_breaks():
    buf = io.StringIO()
    print_table(Console(file=buf, force_terminal=True, width=200, color_system=None), "t", ["a"], [["x\ny"]])
    lines = [ln for ln in buf.getvalue().splitlines() if "x" in ln or "y" in ln]
    assert any("x" in ln and "y" not in ln for ln in lines) and any("y" in ln and "x" not in ln for ln in lines)


def test_deploy_rows_per_kind():
    for kind, header in [("deploy", ["device", "target", "result", "time", "latency", "detail"]),
                         ("check", ["device", "address", "arch", "glibc", "free", "current", "result", "detail"]),
                         ("smoke", ["device", "result", "time", "latency", "bench p50", "detail"]),
                         ("rollback", ["device", "result", "time", "latency", "detail"])]:
        buf = io.StringIO()
        print_table(Console(file=buf), "t", *table_rows(_results(), kind))
        lines = buf.getvalue().splitlines()
        assert lines[0].split("\t") == header, kind
        first = lines[1].split("\t")
        assert first[0] == LONG and "ROLLED BACK" in first and first[-1] == "selftest failed line one line two"
        assert lines[2].split("\t")[0] == "pc" and "deployed" in lines[2].split("\t")
