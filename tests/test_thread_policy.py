"""The default-thread cap on real artifacts: measured by the build, carried in the executable, obeyed
by it, and reproduced by verify-build (whose own test rebuilds the measured tiny_artifacts)."""
import json
import os
import shutil

from clirun import run_edgepack
from edgepack.runner import run_artifact
import subprocess
import sys

import pytest

from edgepack.thread_policy import (BUSY_LIMIT, ROUNDS, _Native, best_rounds, counts_for, decide, measure, read_cap,
                                    write_cap)


def _bench_threads(art) -> int:
    proc = run_artifact(art, ["bench", "--runs", "3", "--warmup", "0", "--json"])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["threads"]


def test_the_build_measures_and_writes_the_cap(tiny_artifacts):
    art = tiny_artifacts["x86_64"]
    rec = json.loads(art.with_name(art.name + ".json").read_text())["default_threads"]
    cores = len(os.sched_getaffinity(0))
    assert rec["measured_on"] == "native" and rec["option"] == "auto"
    assert rec["counts"] == counts_for(cores) and rec["selftest_failed"] == {}
    if cores > 1:  # every count timed in every round, and the cap is the rule's answer to those medians
        lengths = {len(rec["rounds_ms"][str(c)]) for c in rec["counts"]}
        assert lengths in ({ROUNDS}, {2 * ROUNDS}), rec
        if lengths == {2 * ROUNDS}:  # timed again only to confirm a cap the first rounds decided
            first = best_rounds({int(c): r[:ROUNDS] for c, r in rec["rounds_ms"].items()})
            assert decide(first)[0] != 0, rec
        if rec["others_cpu_share"] > BUSY_LIMIT:  # built beside another test worker: not trusted
            assert rec["cap"] == 0 and "not decided" in rec["why"], rec
        else:
            assert rec["cap"] == decide({int(c): m for c, m in rec["medians_ms"].items()})[0]
    assert read_cap(art) == rec["cap"]
    info = json.loads(run_artifact(art, ["info", "--json"]).stdout)
    assert info["default_threads_cap"] == rec["cap"] and info["target"]["name"] == "x86_64"
    # arm64 does not run here and no --bench-on device was named: nothing measured, no cap
    arm = tiny_artifacts["arm64"]
    rec = json.loads(arm.with_name(arm.name + ".json").read_text())["default_threads"]
    assert rec["cap"] == 0 and "not measured" in rec["why"] and read_cap(arm) == 0


def test_the_executable_obeys_its_cap(tiny_artifacts, tmp_path):
    art = tmp_path / "tiny"
    shutil.copy(tiny_artifacts["x86_64"], art)
    write_cap(art, 1)
    assert _bench_threads(art) == 1
    assert "at most 1 (the fastest measured at build" in run_artifact(art, ["info"]).stdout
    assert run_artifact(art, ["selftest"]).returncode == 0  # the patched executable still checks itself
    # an explicit --threads overrides the cap
    proc = run_artifact(art, ["bench", "--runs", "3", "--warmup", "0", "--threads", "2", "--json"])
    assert json.loads(proc.stdout)["threads"] == 2
    write_cap(art, 0)
    assert "threads every free core (--threads N overrides)" in run_artifact(art, ["info"]).stdout
    assert json.loads(run_artifact(art, ["info", "--json"]).stdout)["default_threads_cap"] == 0


def test_a_pinned_cap_is_written_without_timing(tiny_cnn, tmp_path):
    proc = run_edgepack("build", tiny_cnn, "--target", "x86_64", "--backend", "ncnn", "--no-verify",
                        "--default-threads", "3", "--out", tmp_path, "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout)["results"][0]
    art = tmp_path / "tiny_cnn-x86_64"
    assert res["default_threads"] == {"cap": 3, "option": "3", "why": "at most 3 (--default-threads 3, not measured)"}
    assert read_cap(art) == 3 and res["sha256"] == json.loads(art.with_name(art.name + ".json").read_text())[
        "artifact"]["sha256"]
    bad = run_edgepack("build", tiny_cnn, "--target", "x86_64", "--default-threads", "0", "--out", tmp_path)
    assert bad.returncode == 2 and "--default-threads takes auto, all or a count" in bad.stderr


@pytest.mark.exclusive_cpu  # times the artifact against a spinning process of its own (tests/conftest.py)
def test_a_busy_machine_decides_no_cap(tiny_artifacts):
    """Another process spinning on a core makes 2 threads look slow: the timing sees it and writes no cap."""
    art = tiny_artifacts["x86_64"]
    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("needs 2 cores to time 1 against 2 threads")
    spin = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<120: pass"])
    try:
        rec = measure(_Native(art))
    finally:
        spin.kill()
        spin.wait()
    assert rec["others_cpu_share"] > BUSY_LIMIT and rec["cap"] == 0, rec
    assert rec["why"].startswith("every free core: not decided, other processes took"), rec
