"""The artifact's .npy parser survives mutated files under AddressSanitizer + UBSan."""
import shutil
from pathlib import Path
import subprocess

import numpy as np

from edgepack.resources import runtimes_dir


def test_npy_parser_survives_fuzzing_under_asan(tmp_path):
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "a host C compiler is needed (apt-get install gcc)"
    common = runtimes_dir() / "common"
    exe = tmp_path / "npy_fuzz"
    subprocess.run([cc, "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                    f"-I{common}", str(Path(__file__).parent / "fuzz" / "npy_fuzz.c"), str(common / "ep_npy.c"),
                    str(common / "ep_util.c"), "-lm", "-o", str(exe)], check=True)
    seeds = []
    for i, arr in enumerate([np.zeros((1, 3, 4, 4), np.float32), np.arange(7, dtype=np.int64),
                             np.ones((2, 2), np.uint8), np.float64(3.0), np.zeros((0, 5), np.float32)]):
        p = tmp_path / f"seed{i}.npy"
        np.save(p, arr)
        seeds.append(str(p))
    proc = subprocess.run([str(exe), "4000", *seeds], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fuzzed 20000 inputs" in proc.stdout
    assert "ERROR: AddressSanitizer" not in proc.stderr and "runtime error" not in proc.stderr
