"""Progress of long steps (one-time library builds, verification runs), fed by the steps' own counts.

On a terminal a rich progress bar on stderr; elsewhere (pipes, CI logs) one line per tenth, so a log
shows that a 10-minute build is moving without thousands of lines.
"""
from __future__ import annotations

import re
import sys
from typing import Callable

# ninja prints "[N/M] ..." per finished edge; CMake's Makefiles print "[ NN%]"
_NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\]")


def parse_step(line: str) -> tuple[int, int] | None:
    m = _NINJA_STEP.match(line)
    return (int(m[1]), int(m[2])) if m else None


class StepProgress:
    """``update(done, total)`` as a step finishes; use as a context manager."""

    def __init__(self, what: str, log: Callable[[str], None] | None = None, *, terminal: bool | None = None):
        self.what = what
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.terminal = sys.stderr.isatty() if terminal is None else terminal
        self._bar = None
        self._task = None
        self._tenth = 0  # the first line comes at 10%

    def __enter__(self) -> "StepProgress":
        if self.terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self.what, total=None)
        return self

    def update(self, done: int, total: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total)
            return
        tenth = (10 * done) // max(total, 1)
        if tenth > self._tenth:
            self._tenth = tenth
            self.log(f"{self.what}: {done}/{total} steps ({10 * tenth}%)")

    def feed(self, line: str) -> None:
        step = parse_step(line)
        if step:
            self.update(*step)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
