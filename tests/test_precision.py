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


def test_scale_comes_from_every_input_the_output_was_seen_on():
    # a detector: ~0 on noise, ~1 on a scene; its error on the noise is judged against the ~1
    ref = {"p": np.full((1, 1, 8, 8), 3e-5, np.float32)}
    got = {"p": np.zeros((1, 1, 8, 8), np.float32)}
    (alone,) = compare(got, ref, POLICY)
    assert not alone.ok                                   # 100% of its own tiny scale
    (seen,) = compare(got, ref, POLICY, {"p": 1.0})
    assert seen.ok and seen.cosine is None and seen.scale == 1.0
    (wrong,) = compare({"p": got["p"] + np.float32(0.02)}, ref, POLICY, {"p": 1.0})
    assert not wrong.ok                                   # 2% of the scale it can reach


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


def test_realistic_inputs_are_synthetic_scenes_in_range():
    specs = (TensorSpec("image", (1, 3, 32, 48), "float32"), TensorSpec("pixels", (1, 24, 24, 3), "float32"),
             TensorSpec("audio", (1, 400), "float32"), TensorSpec("ids", (1, 8), "int64"))
    pre = {"preprocess": {"input": "pixels", "dtype": "uint8"}}
    x = realistic_inputs(specs, 7, pre)
    img = x["image"]
    assert img.shape == (1, 3, 32, 48) and img.dtype == np.float32
    assert -2.2 <= img.min() and img.max() <= 2.7                     # ImageNet-normalised [0,1] pixels
    d = np.abs(np.diff(img, axis=3))
    assert np.median(d) < 0.2 and d.max() > 1.0       # smooth regions (noise: median ~0.9) and sharp edges
    assert 0 <= x["pixels"].min() and x["pixels"].max() <= 255 and x["pixels"].max() > 100   # raw 0..255
    assert np.abs(x["audio"]).max() <= 1.0
    assert x["ids"].dtype == np.int64
    assert np.array_equal(realistic_inputs(specs, 7, pre)["image"], img)  # seeded


# ---- real builds ------------------------------------------------------------------------------

from clirun import host_cpu_flags  # noqa: E402
from conftest import run_edgepack  # noqa: E402


def _cancelling_convs(path, r=0.03):
    """y = conv(x, W) - conv(x, W + r*N): the output is a small difference of large terms, so
    rounding W to fp16 (relative 5e-4) moves it by ~1.1% of its scale; fp32 is exact to ~1e-7."""
    import onnx
    from onnx import TensorProto as T, helper, numpy_helper
    rng = np.random.default_rng(5)
    w = rng.standard_normal((8, 8, 1, 1)).astype(np.float32)
    w2 = (w + r * rng.standard_normal(w.shape)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["a"]), helper.make_node("Conv", ["x", "w2"], ["b"]),
             helper.make_node("Sub", ["a", "b"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, [1, 8, 16, 16])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [1, 8, 16, 16])],
                          [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w2, "w2")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return path


def test_fp16_build_off_by_more_than_one_percent_ends_on_fp32(tmp_path):
    model = _cancelling_convs(tmp_path / "cancel.onnx")
    proc = run_edgepack("build", str(model), "--target", "x86_64", "--backend", "ncnn", "--out",
                        str(tmp_path / "dist"), "--json", timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)["results"][0]
    assert res["ok"] and res["backend"] == "ncnn" and res["precision"] == "fp32", res
    (rung,) = res["precision_rejected"]
    assert rung["precision"] == "fp16-storage" and rung["backend"] == "ncnn"
    assert rung["rel_err"] > 0.01, rung              # measured on the artifact, and recorded
    assert res["rel_err"] < 1e-4 and set(res["per_cpu"]) == {"native", "Haswell-noTSX", "Denverton"}
    manifest = json.loads((tmp_path / "dist" / "cancel-x86_64.json").read_text())
    assert manifest["precision_rung"] == "fp32" and manifest["build"]["precision"] == "fp32"
    choice = manifest["precision_choice"]
    assert choice["allowed"] == "fp16" and choice["kept"] == "fp32"
    assert choice["rejected"][0]["checks"][0]["outputs"][0]["rel_err"] > 0.01
    assert manifest["build"]["options"]["ncnn.fp32"] == "1"
    # --fp32: never fp16, nothing to reject
    proc = run_edgepack("build", str(model), "--target", "x86_64", "--backend", "ncnn", "--fp32", "--out",
                        str(tmp_path / "dist32"), "--json", timeout=1800)
    res32 = json.loads(proc.stdout)["results"][0]
    assert res32["ok"] and res32["precision"] == "fp32" and res32["precision_rejected"] == []


def test_arm64_artifact_verified_without_and_with_fp16_arithmetic(tiny_artifacts):
    m = json.loads(tiny_artifacts["arm64"].with_name("tiny_cnn-arm64.json").read_text())
    v = m["verification"]
    assert set(v["per_cpu"]) == {"cortex-a53", "max"} and all(c["ok"] for c in v["per_cpu"].values())
    # under qemu the realistic input; the selftest on each CPU checks the seeded random (golden) one
    assert {(c["cpu"], c["input"]) for c in v["checks"]} == {(cpu, "realistic") for cpu in ("cortex-a53", "max")}
    assert all(c["ok"] for c in v["checks"]) and set(v["selftests"]) == {"cortex-a53", "max"}
    assert v["rel_err"] <= v["policy"]["rtol"] and v["policy"] == {"atol": 1e-5, "rtol": 5e-3, "min_cosine": 0.999}
    kept = m["precision_choice"]["kept"]
    assert kept in ("fp16-arith", "fp16-storage", "fp32") and m["precision_rung"] == kept
    # what was kept is what the engine does: fp16 arithmetic only when that rung verified
    assert m["backend"]["fp16_arithmetic"] == (kept == "fp16-arith")
    assert [r["precision"] for r in m["precision_choice"]["rejected"]] == \
        ["fp16-arith", "fp16-storage", "fp32"][:["fp16-arith", "fp16-storage", "fp32"].index(kept)]
    x86 = json.loads(tiny_artifacts["x86_64"].with_name("tiny_cnn-x86_64.json").read_text())
    assert set(x86["verification"]["per_cpu"]) == {"native", "Haswell-noTSX", "Denverton"}
    # what no verification CPU ran is said: qemu has no AVX-512 or VNNI, so only this machine can run them
    flags = host_cpu_flags()
    assert x86["verification"]["not_run"] == [name for name, flag in (
        ("AVX-512", "avx512f"), ("AVX-512 VNNI", "avx512_vnni"), ("AVX-VNNI", "avx_vnni")) if flag not in flags]


def test_verification_rejects_a_perturbed_reference(tiny_artifacts, tiny_cnn, tmp_path):
    """The real artifact against onnxruntime's answer scaled by 1.02: verification must fail."""
    from edgepack.errors import VerificationError
    from edgepack.pipeline import BuildOptions, prepare, verify
    from edgepack.targets import TargetMatrix
    prep = prepare(tiny_cnn, BuildOptions())
    target = TargetMatrix.load().get("x86_64")
    honest = verify(tiny_artifacts["x86_64"], target, prep, POLICY, tmp_path / "ok")
    assert honest.ok and honest.rel_err < POLICY.rtol
    prep.__dict__["verify_cases"] = {k: (x, {n: v * np.float32(1.02) for n, v in ref.items()})
                                    for k, (x, ref) in prep.verify_cases.items()}
    with pytest.raises(VerificationError) as e:
        verify(tiny_artifacts["x86_64"], target, prep, POLICY, tmp_path / "bad")
    assert "of its scale" in e.value.message and e.value.checks and not e.value.checks[-1].ok


def test_selftest_rejects_a_perturbed_golden_output(tiny_artifacts, tiny_cnn, tmp_path):
    """The same artifact with its embedded golden output scaled by 1.02: its own selftest fails."""
    import io
    import subprocess
    from edgepack.pipeline import BuildOptions, prepare
    prep = prepare(tiny_cnn, BuildOptions())
    (golden,) = prep.golden_outputs.values()
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(golden), allow_pickle=False)
    want = buf.getvalue()
    data = tiny_artifacts["x86_64"].read_bytes()
    assert data.count(want) == 1
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(golden * np.float32(1.02)), allow_pickle=False)
    bad = tmp_path / "perturbed"
    bad.write_bytes(data.replace(want, buf.getvalue()))
    bad.chmod(0o755)
    ok = subprocess.run([str(tiny_artifacts["x86_64"]), "selftest", "--runs", "1"], capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("PASS"), ok.stdout + ok.stderr
    st = subprocess.run([str(bad), "selftest", "--runs", "1"], capture_output=True, text=True, timeout=120)
    assert st.returncode != 0 and st.stdout.startswith("FAIL"), st.stdout + st.stderr
