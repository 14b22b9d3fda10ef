"""Progress of long steps (one-time library builds, verification runs), fed by the steps' own counts.

On a terminal a rich progress bar on stderr; elsewhere (pipes, CI logs) one line per tenth, so a log
shows that a 10-minute build is moving without thousands of lines.
"""
from __future__ import annotations

import re
import sys
import threading
from typing import Callable

# ninja prints "[N/M] ..." per finished edge; CMake's Makefiles print "[ NN%]"
_NINJA_STEP = re.compile(r"^\[(\d+)/(\d+)\]")


def parse_step(line: str) -> tuple[int, int] | None:
    m = _NINJA_STEP.match(line)
    return (int(m[1]), int(m[2])) if m else None


class _SharedBar:
    """One live rich display on stderr for every step in progress: targets build side by side in
    threads, and rich allows only one live display at a time."""
    lock = threading.Lock()
    bar = None
    users = 0

    @classmethod
    def add(cls, what: str):
        with cls.lock:
            if cls.bar is None:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
                cls.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                   TimeElapsedColumn(), transient=True, console=Console(stderr=True))
                cls.bar.start()
            cls.users += 1
            return cls.bar, cls.bar.add_task(what, total=None)

    @classmethod
    def remove(cls, task) -> None:
        with cls.lock:
            cls.bar.remove_task(task)
            cls.users -= 1
            if cls.users == 0:
                cls.bar.stop()
                cls.bar = None


class StepProgress:
    """``update(done, total)`` as a step finishes; use as a context manager (thread-safe: steps of
    targets built side by side share one display)."""

    def __init__(self, what: str, log: Callable[[str], None] | None = None, *, terminal: bool | None = None,
                 unit: str = "steps"):
        self.what = what
        self.unit = unit
        self.log = log or (lambda msg: print(msg, file=sys.stderr))
        self.terminal = sys.stderr.isatty() if terminal is None else terminal
        self._bar = None
        self._task = None
        self._tenth = 0  # the first line comes at 10%
        self._done = 0

    def __enter__(self) -> "StepProgress":
        if self.terminal:
            self._bar, self._task = _SharedBar.add(self.what)
        return self

    def update(self, done: int, total: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total)
            return
        tenth = (10 * done) // max(total, 1)
        if tenth > self._tenth:
            self._tenth = tenth
            self.log(f"{self.what}: {done}/{total} {self.unit} ({10 * tenth}%)")

    def advance(self, total: int) -> None:
        """One more step of ``total`` finished."""
        self._done += 1
        self.update(self._done, total)

    def feed(self, line: str) -> None:
        step = parse_step(line)
        if step:
            self.update(*step)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            _SharedBar.remove(self._task)
            self._bar = None
