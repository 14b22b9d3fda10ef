"""Running the artifact's own `selftest` and `bench` on the device, and reading what they print."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

# the exported playbook's filter plugin reads the same output and imports nothing from edgepack:
# it holds the one parser of the artifact's JSON line
from .ansible_filters import _json_object
from .connector import Connector

_TEXT_RE = re.compile(r"^(PASS|FAIL)\b.*", re.M)
_LAT_RE = re.compile(r"latency_ms=([0-9.]+)")


@dataclass(frozen=True)
class Selftest:
    passed: bool
    latency_ms: float | None
    rc: int
    output: str          # what the artifact printed (stdout + stderr), for the report


@dataclass(frozen=True)
class Bench:
    min_ms: float | None
    median_ms: float | None
    p90_ms: float | None
    peak_rss_kb: float | None
    output: str
    emulated: bool = False  # the artifact found itself under qemu-user: the emulator's speed, not the device's


def _float(v) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def parse_selftest(rc: int, stdout: str, stderr: str) -> Selftest:
    output = (stdout.strip() + "\n" + stderr.strip()).strip()
    obj = _json_object(stdout)
    if obj is not None:
        verdict = str(obj.get("result", "")).upper()
        latency = _float(obj.get("latency_ms"))
    else:
        m = _TEXT_RE.search(stdout)
        verdict = m.group(1) if m else ""
        lat = _LAT_RE.search(stdout)
        latency = float(lat.group(1)) if lat else None
    # both must agree: a zero exit with a FAIL line, or a PASS line with a crash exit, is a failure
    return Selftest(passed=rc == 0 and verdict == "PASS", latency_ms=latency, rc=rc, output=output)


def run_selftest(conn: Connector, exe: str, timeout: float) -> Selftest:
    res = conn.run(f"{exe} selftest --json", timeout)
    return parse_selftest(res.rc, res.stdout, res.stderr)


def run_bench(conn: Connector, exe: str, timeout: float, runs: int = 20) -> Bench:
    res = conn.run(f"{exe} bench --runs {int(runs)} --warmup 2 --json", timeout)
    obj = _json_object(res.stdout) or {}
    return Bench(*(_float(obj.get(k)) for k in ("min_ms", "median_ms", "p90_ms", "peak_rss_kb")),
                 output=res.output if res.rc != 0 or not obj else "", emulated=obj.get("emulated") is True)


def exe_path(dest_abs: str, name: str) -> str:
    return shlex.quote(f"{dest_abs}/current/{name}")
