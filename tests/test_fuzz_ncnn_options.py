"""The ncnn engine's EDGEPACK_NCNN_OPTIONS parser (runtimes/ncnn/ep_ncnn_switches.h) parses a table of
known lists as expected and survives mutated lists under AddressSanitizer + UBSan
(tests/fuzz/ncnn_options_fuzz.c); an artifact built with the engine rejects a bad list with the
parser's message and runs with a good one."""
from __future__ import annotations

import os
import subprocess

from edgepack.runner import command_for
from fuzz_targets import build_fuzzer, run_fuzzer, write_seeds

SEEDS = ("winograd=1,sgemm=0,pool=arena", "pool=local,fp16=1,fp16a=0,packing=0", "pool=unlocked,pool=none",
         "pool=one,winograd=0", "pool=best", "isa=avx2,pool=best", "direct=2,fp16a=1")


def test_ncnn_options_parser_survives_fuzzing_under_asan(tmp_path):
    exe = build_fuzzer("ncnn_options", tmp_path)
    seeds = write_seeds(tmp_path / "seeds", ((f"seed{i}.txt", t.encode()) for i, t in enumerate(SEEDS)))
    out = run_fuzzer(exe, "6000", seeds)
    assert "known lists: 34 parsed as expected" in out
    assert f"fuzzed {6000 * len(SEEDS)} inputs" in out


def test_engine_applies_the_parsed_list(tiny_artifacts):
    """The engine uses the parser: a bad list fails the run with its message (exit 4, the model
    error), a good one (every switch, pools replaced twice) runs."""
    art = tiny_artifacts["x86_64"]

    def bench(options: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(art), "bench", "--runs", "2", "--warmup", "1", "--json"], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "EDGEPACK_NCNN_OPTIONS": options})

    bad = bench("winograd=1,turbo=1")
    assert bad.returncode == 4, (bad.returncode, bad.stderr)
    assert "EDGEPACK_NCNN_OPTIONS: unknown switch 'turbo'" in bad.stderr
    assert "Traceback" not in bad.stderr
    bad = bench("pool=best1001")
    assert bad.returncode == 4 and "pool=best1001: arena, best, local, shared, one, unlocked or none" in bad.stderr
    bad = bench("isa=avx3")
    assert bad.returncode == 4 and "isa=avx3: avx512, avx2 or sse" in bad.stderr
    good = bench("winograd=0,sgemm=1,packing=1,fp16=0,fp16a=0,pool=shared,pool=unlocked,pool=best50,pool=arena,isa=avx2,direct=2")
    assert good.returncode == 0, good.stderr
    assert '"median_ms"' in good.stdout
    # the ISA cap is an x86 switch: an Arm artifact says so instead of ignoring it
    arm = subprocess.run(command_for(tiny_artifacts["arm64"], "max") + ["bench", "--runs", "1", "--warmup", "0"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "EDGEPACK_NCNN_OPTIONS": "isa=avx2"})
    assert arm.returncode == 4 and "isa= is for x86 artifacts" in arm.stderr, (arm.returncode, arm.stderr)
