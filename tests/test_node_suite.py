"""ONNX's node conformance suite as a peer test (issue 9 item 6), on a fixed sample: every case
through NCNN's and TVM's fast paths (real pnnx + the ncnn wheel, real TVM relax VM), and the
baseline's crash case as a full x86_64 artifact (real zig build). No case may crash or give a
wrong answer that the build's verification lets through; the full run is bench/node_suite.py."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import node_suite  # noqa: E402

CASES = [
    "test_gemm_default_scalar_bias",          # baseline crash: a 0-d input (TypeError, then a 1-d golden array)
    "test_resize_downsample_scales_linear",   # baseline crash: onnxruntime fails on random `scales`
    "test_abs", "test_relu", "test_sigmoid", "test_add_bcast", "test_conv_with_strides_padding",
    "test_maxpool_2d_default", "test_softmax_axis_1", "test_matmul_2d", "test_transpose_default",
    "test_argmax_default_axis_example",       # int64 output: NCNN refuses, TVM builds
]


@pytest.fixture(scope="module")
def rows() -> dict[str, dict]:
    cases = node_suite.load_cases(CASES)
    artifacts = [c for c in cases if c.name == "test_gemm_default_scalar_bias"]
    out = node_suite.run_suite(cases, ["ncnn", "tvm"], artifacts, timeout=240, log=print)
    return {r["case"]: r for r in out}


def test_no_crash_and_no_wrong_answer(rows):
    assert set(rows) == set(CASES)
    bad = [(name, k, r[k]) for name, r in rows.items() for k in ("ncnn", "tvm", "artifact")
           if k in r and r[k]["outcome"] in ("crash", "wrong")]
    assert not bad, bad


def test_the_baseline_crashes_are_answers_or_clean_refusals(rows):
    gemm = rows["test_gemm_default_scalar_bias"]
    assert gemm["tvm"]["outcome"] == "pass", gemm
    assert gemm["ncnn"]["outcome"] == "refused" and "scalar (0-d)" in gemm["ncnn"]["detail"], gemm
    # the artifact built with --fp32 (NCNN refuses the 0-d input, TVM builds it) answers the case
    assert gemm["artifact"]["outcome"] == "pass" and gemm["artifact"]["backend"] == "tvm", gemm
    resize = rows["test_resize_downsample_scales_linear"]
    for k in ("ncnn", "tvm"):
        assert resize[k]["outcome"] == "refused", resize
        assert "onnxruntime, the reference, fails" in resize[k]["detail"], resize


def test_common_ops_pass_on_both_fast_paths(rows):
    for name in ("test_abs", "test_relu", "test_sigmoid", "test_conv_with_strides_padding", "test_matmul_2d"):
        for k in ("ncnn", "tvm"):
            assert rows[name][k]["outcome"] == "pass", (name, k, rows[name][k])
    argmax = rows["test_argmax_default_axis_example"]
    assert argmax["tvm"]["outcome"] == "pass" and argmax["ncnn"]["outcome"] == "refused", argmax


def test_judge_catches_a_wrong_answer():
    import numpy as np
    exp = {"y": np.linspace(-1, 1, 100, dtype=np.float32)}
    assert node_suite.judge(exp, exp, 1e-3, 1e-7)[:2] == (True, True)
    off = {"y": exp["y"] * 1.02}  # 2% of scale: the build's bound (0.5%) must reject it
    assert node_suite.judge(off, exp, 1e-3, 1e-7)[0] is False
