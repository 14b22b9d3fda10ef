"""Shared fixtures: real artifacts built once per test session (cached libncnn makes them fast)."""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from clirun import edgepack_cmd, run_edgepack  # noqa: F401  (tests import them from here too)

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under pytest-xdist (README command 2 runs two workers on the two cores), a test marked
    ``exclusive_cpu`` (it compares timings) runs while the other worker waits; every other test runs
    beside whatever the other worker runs. The lock spans the whole protocol, so the builds of wider-
    scoped fixtures set up for a test count as part of it. A turnstile lock in front of the shared one
    lets a waiting exclusive test in as soon as the other worker's current test ends."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not run:
        yield
        return
    base = Path(tempfile.gettempdir()) / f"edgepack-tests-{run}"
    exclusive = item.get_closest_marker("exclusive_cpu") is not None
    with open(f"{base}.turnstile", "a") as turnstile, open(f"{base}.cpu", "a") as cpu:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(cpu, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        finally:
            if not exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(cpu, fcntl.LOCK_UN)
            if exclusive:
                fcntl.flock(turnstile, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def tiny_cnn(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny_cnn.onnx"
    subprocess.run([sys.executable, str(EXAMPLES / "make_tiny_cnn.py"), str(out)], check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def tiny_artifacts(tiny_cnn, tmp_path_factory) -> dict[str, Path]:
    """The example CNN built with the NCNN backend for x86_64 and arm64 (verified by the build)."""
    dist = tmp_path_factory.mktemp("dist")
    proc = run_edgepack("build", str(tiny_cnn), "--target", "x86_64,arm64", "--backend", "ncnn",
                        "--out", str(dist), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {t: dist / f"tiny_cnn-{t}" for t in ("x86_64", "arm64")}


def verify_cpus(target: str) -> tuple[str | None, ...]:
    """The CPUs a target's artifacts are verified under, read from its target file (None: run natively),
    so tests never repeat the qemu CPU models the matrix already names."""
    from edgepack.targets import TargetMatrix
    return tuple(None if c == "native" else c for c in TargetMatrix.load().get(target).verify_cpus)


def first_cpu(target: str) -> str | None:
    """The first (weakest) CPU a target promises: enough for tests that only need the artifact to run."""
    return verify_cpus(target)[0]
