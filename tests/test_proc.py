"""Checked subprocess calls with streamed output (the one-time library builds use them)."""
import pytest

from edgepack import proc
from edgepack.errors import BuildError


def test_run_streaming_feeds_lines_and_keeps_the_log(tmp_path):
    seen = []
    log = tmp_path / "logs" / "build.log"
    proc.run_streaming(["sh", "-c", "for i in 1 2 3; do echo \"[$i/3] step $i\"; done"], what="steps",
                       on_line=seen.append, log=log)
    assert [s.strip() for s in seen] == ["[1/3] step 1", "[2/3] step 2", "[3/3] step 3"]
    assert log.read_text().count("step") == 3


def test_run_streaming_failure_names_the_log_and_the_tail(tmp_path):
    log = tmp_path / "build.log"
    with pytest.raises(BuildError) as exc:
        proc.run_streaming(["sh", "-c", "echo compiling; echo 'error: no such layer' >&2; exit 3"], what="building x",
                           on_line=lambda line: None, log=log)
    assert "building x failed with exit code 3" in exc.value.message and str(log) in exc.value.message
    assert "error: no such layer" in exc.value.message


def _forked_square(x):
    return x * x


def _forked_twice(x):
    # a forked child forking again: node_suite runs a conversion in a child, and the conversion's
    # ncnn check forks its own (a daemonic child could not: "daemonic processes are not allowed
    # to have children", which the conversion cache had hidden)
    return proc.run_forked(_forked_square, (x,), timeout=60)


def test_run_forked_nests_and_reports_what_the_child_raised():
    assert proc.run_forked(_forked_twice, (7,), timeout=120) == ("ok", ("ok", 49))
    kind, (cls, message, _) = proc.run_forked(_forked_square, ("a",), timeout=60)
    assert kind == "raised" and cls is None and message.startswith("TypeError")


def _abort_quietly():
    import faulthandler
    import os
    # pytest's faulthandler would print "Fatal Python error: Aborted" and every module to the shared
    # stderr: the unexplained dump in CI logs (stop 19) came from this test
    faulthandler.disable()
    os.abort()


def test_run_forked_reports_a_dead_child():
    kind, why = proc.run_forked(_abort_quietly, (), timeout=60)
    assert kind == "died" and why.startswith("exit "), why
