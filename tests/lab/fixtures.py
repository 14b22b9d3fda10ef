"""pytest fixtures for the deploy tests (imported by tests/test_deploy*.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .lab import Lab

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def lab(tmp_path):
    the_lab = Lab(tmp_path / "lab")
    try:
        yield the_lab
    finally:
        the_lab.close()


@pytest.fixture(scope="module")
def module_lab(tmp_path_factory):
    """One lab for a whole test module (devices start once; tests keep apart by --dest)."""
    the_lab = Lab(tmp_path_factory.mktemp("lab"))
    try:
        yield the_lab
    finally:
        the_lab.close()


def edgepack(*args, timeout: float = 300, env=None) -> subprocess.CompletedProcess:
    """The real command line, in a subprocess (exit codes and stderr exactly as a user sees them)."""
    # a wide console: rich would otherwise wrap the table's cells at 80 columns
    env = {**os.environ, "COLUMNS": "250", **(env or {})}
    return subprocess.run([sys.executable, "-m", "edgepack", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


def edgepack_json(*args, timeout: float = 300) -> tuple[int, dict, str]:
    p = edgepack(*args, "--json", timeout=timeout)
    try:
        data = json.loads(p.stdout)
    except ValueError:
        raise AssertionError(f"no JSON (exit {p.returncode}):\nstdout:{p.stdout}\nstderr:{p.stderr}") from None
    return p.returncode, data, p.stderr


def by_device(data: dict) -> dict:
    return {r["device"]: r for r in data["results"]}
