"""Tables the CLI prints: boxed and coloured on a terminal, tab-separated when piped or in CI logs.

A piped table must never truncate a file or target name (rich cuts columns to 80 characters when it
cannot see a terminal), so anything that is not a terminal gets one header line and one line per row,
fields separated by tabs: readable in a CI log, and `cut -f`/`awk -F'\\t'` friendly.
"""
from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape, render
from rich.table import Table


@dataclass(frozen=True)
class Cell:
    text: str
    style: str = ""   # rich style used on a terminal only, e.g. "green"


def _plain(value) -> str:
    text = value.text if isinstance(value, Cell) else str(value)
    return text.replace("\t", " ").replace("\n", " ")


def print_table(console: Console, title: str, columns: list[str], rows: list[list]) -> None:
    if not console.is_terminal:
        console.file.write("\t".join(columns) + "\n")
        for row in rows:
            console.file.write("\t".join(_plain(v) for v in row) + "\n")
        console.file.flush()
        return
    table = Table(title=title)
    for col in columns:
        table.add_column(col, overflow="fold")
    for row in rows:
        # a terminal keeps a cell's line breaks (a failed selftest's output under its message)
        table.add_row(*(render(f"[{v.style}]{escape(v.text)}[/{v.style}]") if isinstance(v, Cell) and v.style
                        else escape(v.text if isinstance(v, Cell) else str(v)) for v in row))
    console.print(table)
