"""One bound policy for every backend and precision, the precision ladder, and verification on
every CPU a target may meet.

The fast tests check the comparison itself; the build tests use real pnnx, zig and qemu."""
from __future__ import annotations

import json

import numpy as np
import pytest

from edgepack.reference import POLICY, compare, realistic_inputs
from edgepack.model import TensorSpec


def _ref(seed=0, shape=(1, 64, 32)):
    return {"y": np.random.default_rng(seed).standard_normal(shape).astype(np.float32)}


def test_policy_fails_one_percent_of_scale_and_passes_fp32_noise():
    ref = _ref()
    scaled = {"y": ref["y"] * np.float32(1.02)}          # every output 2% off: the perturbed artifact
    (bad,) = compare(scaled, ref, POLICY)
    assert not bad.ok and bad.rel_err == pytest.approx(0.02, rel=1e-3)
    one_pct = {"y": ref["y"] + np.float32(0.01) * np.abs(ref["y"]).max() * np.sign(ref["y"])}
    (c,) = compare(one_pct, ref, POLICY)
    assert not c.ok and "of its scale" in c.why()
    noise = {"y": ref["y"] + np.random.default_rng(1).standard_normal(ref["y"].shape).astype(np.float32) * 1e-6}
    (good,) = compare(noise, ref, POLICY)
    assert good.ok and good.rel_err < 1e-5 and good.cosine > 0.999999


def test_cosine_catches_errors_spread_under_the_max_bound():
    # a sparse map (detector-like): a few peaks, the rest ~0.01; every element off by 0.4% of the
    # peak passes the max-abs bound, but the map's shape is lost
    ref = np.full((1, 1, 64, 64), 0.01, np.float32)
    ref[0, 0, 10, 10] = ref[0, 0, 40, 50] = 1.0
    got = ref + np.float32(0.004) * np.where(np.random.default_rng(2).random(ref.shape) < 0.5, -1, 1).astype(np.float32)
    (c,) = compare({"y": got}, {"y": ref}, POLICY)
    assert c.max_abs_err <= c.bound and c.cosine < POLICY.min_cosine and not c.ok
    assert "cosine" in c.why()


def test_shape_nonfinite_and_zero_outputs():
    ref = _ref()
    (c,) = compare({"y": ref["y"].reshape(1, 32, 64)}, ref, POLICY)
    assert not c.ok and not c.shape_ok
    nan = ref["y"].copy()
    nan[0, 0, 0] = np.nan
    (c,) = compare({"y": nan}, ref, POLICY)
    assert not c.ok
    # where onnxruntime itself says inf (log(0)), the artifact must agree; the rest is compared
    r = {"y": np.array([-np.inf, 0.5, 1.0], np.float32)}
    assert compare({"y": np.array([-np.inf, 0.5, 1.0], np.float32)}, r, POLICY)[0].ok
    assert not compare({"y": np.array([-1e30, 0.5, 1.0], np.float32)}, r, POLICY)[0].ok
    zeros = {"y": np.zeros((4,), np.float32)}
    (z,) = compare({"y": np.full((4,), 1e-7, np.float32)}, zeros, POLICY)
    assert z.ok and z.cosine is None                  # ~0 output: the atol floor, no cosine noise
    assert not compare({"y": np.full((4,), 1e-3, np.float32)}, zeros, POLICY)[0].ok


def test_realistic_inputs_are_smooth_images_in_range():
    specs = (TensorSpec("image", (1, 3, 32, 48), "float32"), TensorSpec("pixels", (1, 24, 24, 3), "float32"),
             TensorSpec("audio", (1, 400), "float32"), TensorSpec("ids", (1, 8), "int64"))
    pre = {"preprocess": {"input": "pixels", "dtype": "uint8"}}
    x = realistic_inputs(specs, 7, pre)
    img = x["image"]
    assert img.shape == (1, 3, 32, 48) and img.dtype == np.float32
    assert -2.2 <= img.min() and img.max() <= 2.7                     # ImageNet-normalised [0,1] pixels
    assert np.abs(np.diff(img, axis=3)).mean() < 0.4                  # smooth, unlike N(0,1) noise (~1.1)
    assert 0 <= x["pixels"].min() and x["pixels"].max() <= 255 and x["pixels"].max() > 100   # raw 0..255
    assert np.abs(x["audio"]).max() <= 1.0
    assert x["ids"].dtype == np.int64
    assert np.array_equal(realistic_inputs(specs, 7, pre)["image"], img)  # seeded
