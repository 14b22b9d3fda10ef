"""pytest fixtures for the deploy tests (imported by tests/test_deploy*.py)."""
from __future__ import annotations

import json
import subprocess
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
    """conftest.run_edgepack from the repository root, with a deploy-sized timeout."""
    from clirun import run_edgepack
    return run_edgepack(*args, cwd=REPO, timeout=timeout, env=env)


def edgepack_json(*args, timeout: float = 300) -> tuple[int, dict, str]:
    p = edgepack(*args, "--json", timeout=timeout)
    try:
        data = json.loads(p.stdout)
    except ValueError:
        raise AssertionError(f"no JSON (exit {p.returncode}):\nstdout:{p.stdout}\nstderr:{p.stderr}") from None
    return p.returncode, data, p.stderr


def by_device(data: dict) -> dict:
    return {r["device"]: r for r in data["results"]}
