"""Verification inputs for a model that takes sequence lengths (edgepack/reference.py).

onnx-asr's front ends take `waveforms [1, N]` and `waveforms_lens [1]` and zero every frame past
the length. A small random integer there (an id, as for other integer inputs) zeroed the whole
output, and an fp16 NeMo artifact 0.94% off "verified" with error 0 against all zeros."""
from __future__ import annotations

import numpy as np

from edgepack.model import TensorSpec
from edgepack.reference import random_inputs, realistic_inputs

ASR = (TensorSpec("waveforms", (1, 160000), "float32"), TensorSpec("waveforms_lens", (1,), "int64"))


def test_a_length_covers_half_to_all_of_the_signal_on_random_inputs():
    seen = {int(random_inputs(ASR, seed)["waveforms_lens"][0]) for seed in range(20)}
    assert min(seen) >= 80000 and max(seen) <= 160000 and len(seen) > 1


def test_a_length_is_the_whole_signal_on_realistic_inputs():
    got = realistic_inputs(ASR, 3)
    assert got["waveforms_lens"].dtype == np.int64 and got["waveforms_lens"].tolist() == [160000]
    assert got["waveforms"].shape == (1, 160000) and float(np.abs(got["waveforms"]).max()) > 0.1


def test_frames_lengths_follow_the_longest_axis_and_ids_stay_small():
    specs = (TensorSpec("features", (1, 80, 3000), "float32"), TensorSpec("length", (), "int32"),
             TensorSpec("token_ids", (1, 12), "int64"))
    got = random_inputs(specs, 0)
    assert 1500 <= int(got["length"]) <= 3000 and got["length"].dtype == np.int32
    assert int(got["token_ids"].max()) < 10
    assert int(realistic_inputs(specs, 0)["length"]) == 3000


def test_an_output_zero_on_every_input_is_named_and_others_are_not():
    from edgepack.reference import uninformative_outputs
    zeros, signal = np.zeros((1, 80, 10), np.float32), np.ones((1, 80, 10), np.float32)
    refs = [{"features": zeros, "lens": np.zeros(1, np.int64), "logits": signal},
            {"features": zeros, "lens": np.zeros(1, np.int64), "logits": zeros}]
    assert uninformative_outputs(refs) == ["features"]   # ints (a length, a class id) may be 0 by right
    refs[1]["features"] = signal
    assert uninformative_outputs(refs) == []
