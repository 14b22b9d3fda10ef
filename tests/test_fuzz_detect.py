"""The artifact's detection decoding + NMS (runtimes/common/ep_detect.c) survives arbitrary model
outputs (NaN, Inf, huge values) and settings under AddressSanitizer + UBSan, and its answers keep their
invariants (tests/fuzz/detect_fuzz.c), for a bounded number of inputs."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np

from edgepack.resources import runtimes_dir

FUZZ = Path(__file__).parent / "fuzz"


def test_detect_survives_fuzzing_under_asan(tmp_path):
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "a host C compiler is needed (apt-get install gcc)"
    common = runtimes_dir() / "common"
    exe = tmp_path / "detect_fuzz"
    subprocess.run([cc, "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=all", f"-I{common}",
                    f"-I{FUZZ}", str(FUZZ / "detect_fuzz.c"), str(common / "ep_detect.c"), str(common / "ep_util.c"),
                    "-lm", "-o", str(exe)], check=True)
    rng = np.random.default_rng(0)
    seeds = []
    for i in range(6):
        # format, classes, flags (layout/grid/agnostic), max_det, conf, iou, input h/w, anchors
        head = bytes([i % 3, 2 + i, i, 30, 40 + 20 * i, 100, 3 + i, 4, 150, i])
        vals = rng.random(1500).astype(np.float32) * np.float32(1 if i % 2 else 320)
        if i == 5:
            vals[::7] = np.nan
            vals[3::11] = np.inf
        p = tmp_path / f"seed{i}.bin"
        p.write_bytes(head + vals.tobytes())
        seeds.append(str(p))
    proc = subprocess.run([str(exe), "1500", *seeds], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fuzzed 9000 inputs" in proc.stdout
    assert "ERROR: AddressSanitizer" not in proc.stderr and "runtime error" not in proc.stderr
