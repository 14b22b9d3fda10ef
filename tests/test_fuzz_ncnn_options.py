"""The ncnn engine's EDGEPACK_NCNN_OPTIONS parser (runtimes/ncnn/ep_ncnn_switches.h) parses a table of
known lists as expected and survives mutated lists under AddressSanitizer + UBSan
(tests/fuzz/ncnn_options_fuzz.c); an artifact built with the engine rejects a bad list with the
parser's message and runs with a good one."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from edgepack.resources import runtimes_dir

FUZZ = Path(__file__).parent / "fuzz"
SEEDS = ("winograd=1,sgemm=0,pool=best300", "pool=local,fp16=1,packing=0", "pool=unlocked,pool=none",
         "pool=one,winograd=0", "pool=best")


def test_ncnn_options_parser_survives_fuzzing_under_asan(tmp_path):
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "a host C compiler is needed (apt-get install gcc)"
    common = runtimes_dir() / "common"
    exe = tmp_path / "ncnn_options_fuzz"
    # no libncnn: the parser is apart from the engine so that it can be fuzzed alone
    subprocess.run([cc, "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", f"-I{common}",
                    f"-I{runtimes_dir() / 'ncnn'}", f"-I{FUZZ}", str(FUZZ / "ncnn_options_fuzz.c"),
                    str(common / "ep_util.c"), "-lm", "-o", str(exe)], check=True)
    seeds = []
    for i, text in enumerate(SEEDS):
        p = tmp_path / f"seed{i}.txt"
        p.write_text(text)
        seeds.append(str(p))
    proc = subprocess.run([str(exe), "6000", *seeds], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "known lists: 20 parsed as expected" in proc.stdout
    assert "fuzzed 30000 inputs" in proc.stdout
    assert "ERROR: AddressSanitizer" not in proc.stderr and "runtime error" not in proc.stderr


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
    assert bad.returncode == 4 and "pool=best1001: best, local, shared, one, unlocked or none" in bad.stderr
    good = bench("winograd=0,sgemm=1,packing=1,fp16=0,pool=shared,pool=unlocked,pool=best50")
    assert good.returncode == 0, good.stderr
    assert '"median_ms"' in good.stdout
