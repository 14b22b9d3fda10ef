"""Bad input: each case is one clear line, a distinct exit code, and no traceback."""
from pathlib import Path

import pytest

from conftest import run_edgepack
from models import topk_model


def _assert_one_clear_error(proc, code, *needles):
    assert proc.returncode == code, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    error_lines = [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(error_lines) == 1, proc.stderr
    for n in needles:
        assert n in proc.stderr, proc.stderr


def test_truncated_onnx(tiny_cnn, tmp_path):
    bad = tmp_path / "truncated.onnx"
    bad.write_bytes(tiny_cnn.read_bytes()[:3000])
    proc = run_edgepack("build", str(bad), "--target", "x86_64", "--out", str(tmp_path / "d"))
    _assert_one_clear_error(proc, 4, "truncated.onnx")


def test_not_onnx(tmp_path):
    bad = tmp_path / "notes.onnx"
    bad.write_text("these are my notes, not a model\n" * 20)
    proc = run_edgepack("build", str(bad), "--target", "x86_64", "--out", str(tmp_path / "d"))
    _assert_one_clear_error(proc, 4, "notes.onnx")


def test_missing_file(tmp_path):
    proc = run_edgepack("build", str(tmp_path / "nope.onnx"), "--target", "x86_64")
    _assert_one_clear_error(proc, 4, "nope.onnx", "no such file")


def test_unknown_target_suggests_nearest(tiny_cnn):
    proc = run_edgepack("build", str(tiny_cnn), "--target", "jetson-orn")
    _assert_one_clear_error(proc, 3, "jetson-orn", "did you mean 'jetson-orin'")


def test_op_ncnn_lacks_names_op_and_node(tmp_path):
    model = topk_model(tmp_path / "topk.onnx")
    proc = run_edgepack("build", str(model), "--target", "x86_64", "--backend", "ncnn", "--out", str(tmp_path / "d"))
    assert proc.returncode == 5, proc.stderr
    assert "TopK" in proc.stderr and "top3" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "d" / "topk-x86_64").exists()


def test_symbolic_dims_need_shapes(tmp_path):
    from models import single_op_model
    m = single_op_model(tmp_path / "dyn.onnx", "Relu", {"x": ["N", 3, "H", "W"]}, {"y": ["N", 3, "H", "W"]})
    proc = run_edgepack("build", str(m), "--target", "x86_64", "--out", str(tmp_path / "d"))
    _assert_one_clear_error(proc, 2, "symbolic dims", "--input-shape x=")


def test_debug_shows_traceback(tmp_path):
    bad = tmp_path / "notes.onnx"
    bad.write_text("garbage")
    proc = run_edgepack("--debug", "build", str(bad), "--target", "x86_64")
    assert proc.returncode != 0 and "Traceback" in proc.stderr
