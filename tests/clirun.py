"""The one way tests run the real command line (a module of its own: `from conftest import ...` at run
time can resolve to tests/unit/conftest.py once the unit tier has been collected in the same session)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def host_cpu_flags() -> set[str]:
    """This machine's CPU flags, as /proc/cpuinfo lists them (empty where it lists none)."""
    line = next((s for s in Path("/proc/cpuinfo").read_text().splitlines() if s.startswith("flags")), "")
    return set(line.partition(":")[2].split())


def edgepack_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "edgepack", *args]


def run_edgepack(*args, cwd: Path | None = None, timeout: float = 3600, env: dict | None = None
                 ) -> subprocess.CompletedProcess:
    """A subprocess, so exit codes and stderr are exactly what a user sees. A wide COLUMNS keeps rich
    from wrapping what it prints."""
    env = {**os.environ, "COLUMNS": "250", **(env or {})}
    return subprocess.run(edgepack_cmd(*map(str, args)), capture_output=True, text=True, cwd=cwd, timeout=timeout,
                          env=env)


def run_artifact_on(art: Path, cpu: str, inputs: dict, out: Path, names, threads: int = 1,
                    env: dict | None = None) -> tuple[dict, str]:
    """Run an artifact on one CPU: "native", a qemu CPU model, or either followed by an
    EDGEPACK_NCNN_OPTIONS list ("native isa=sse"). Returns its outputs `names` as arrays, and its stderr."""
    import json

    import numpy as np

    from edgepack.runner import command_for_cpu
    cpu, _, switches = cpu.partition(" ")
    env = {**os.environ, **(env or {})}
    if switches:
        env["EDGEPACK_NCNN_OPTIONS"] = switches
    argv = command_for_cpu(art, cpu) + ["run", "--output", str(out), "--threads", str(threads)]
    for name, path in inputs.items():
        argv += ["--input", f"{name}={path}"]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)
    assert run.returncode == 0, f"{cpu} {switches}: {run.stderr[-3000:]}"
    files = json.loads(run.stdout)["outputs"]
    return {name: np.load(files[name]["file"]) for name in names}, run.stderr
