"""The artifact's .npy parser survives mutated files under AddressSanitizer + UBSan."""
import io

import numpy as np

from fuzz_targets import build_fuzzer, run_fuzzer, write_seeds

SEED_ARRAYS = [np.zeros((1, 3, 4, 4), np.float32), np.arange(7, dtype=np.int64), np.ones((2, 2), np.uint8),
               np.float64(3.0), np.zeros((0, 5), np.float32)]


def npy_seeds():
    for i, arr in enumerate(SEED_ARRAYS):
        b = io.BytesIO()
        np.save(b, arr)
        yield f"seed{i}.npy", b.getvalue()


def test_npy_parser_survives_fuzzing_under_asan(tmp_path):
    exe = build_fuzzer("npy", tmp_path)
    out = run_fuzzer(exe, "4000", write_seeds(tmp_path / "seeds", npy_seeds()))
    assert f"fuzzed {4000 * len(SEED_ARRAYS)} inputs" in out
