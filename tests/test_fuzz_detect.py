"""The artifact's detection decoding + NMS (runtimes/common/ep_detect.c) survives arbitrary model
outputs (NaN, Inf, huge values) and settings under AddressSanitizer + UBSan, and its answers keep their
invariants (tests/fuzz/detect_fuzz.c), for a bounded number of inputs."""
from __future__ import annotations

import numpy as np

from fuzz_targets import build_fuzzer, run_fuzzer, write_seeds


def test_detect_survives_fuzzing_under_asan(tmp_path):
    exe = build_fuzzer("detect", tmp_path)
    rng = np.random.default_rng(0)
    seeds = []
    for i in range(6):
        # format, classes, flags (layout/grid/agnostic), max_det, conf, iou, input h/w, anchors
        head = bytes([i % 3, 2 + i, i, 30, 40 + 20 * i, 100, 3 + i, 4, 150, i])
        vals = rng.random(1500).astype(np.float32) * np.float32(1 if i % 2 else 320)
        if i == 5:
            vals[::7] = np.nan
            vals[3::11] = np.inf
        seeds.append((f"seed{i}.bin", head + vals.tobytes()))
    out = run_fuzzer(exe, "1500", write_seeds(tmp_path / "seeds", seeds))
    assert "fuzzed 9000 inputs" in out
