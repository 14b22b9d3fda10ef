"""The one way tests run the real command line (a module of its own: `from conftest import ...` at run
time can resolve to tests/unit/conftest.py once the unit tier has been collected in the same session)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def edgepack_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "edgepack", *args]


def run_edgepack(*args, cwd: Path | None = None, timeout: float = 3600, env: dict | None = None
                 ) -> subprocess.CompletedProcess:
    """A subprocess, so exit codes and stderr are exactly what a user sees. A wide COLUMNS keeps rich
    from wrapping what it prints."""
    env = {**os.environ, "COLUMNS": "250", **(env or {})}
    return subprocess.run(edgepack_cmd(*map(str, args)), capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env=env)
