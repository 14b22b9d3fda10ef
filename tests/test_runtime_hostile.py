"""Issue 11, part B: the artifact's C runtime against careless and hostile input, on real artifacts.

No fixed-size arrays indexed by model counts (70 inputs, 70 outputs), tensor names of any length and
names that sanitise alike, float16 end to end, inputs only as the model declares them, and `run` /
batch never destroying an input or earlier results. Artifacts are built once per module, x86_64 only.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import EXAMPLES, REPO, run_edgepack
from edgepack.model import load_model
from edgepack.reference import run_onnxruntime

N_WIDE = 70
LONG_NAME = "t" * 5000
# the last three outputs: two names that sanitise to the same file name, one of 5000 characters
WIDE_OUTPUTS = [f"o{i}" for i in range(N_WIDE - 3)] + ["a/b", "a:b", LONG_NAME]


def _save(graph, path: Path, opset: int = 17) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def wide_model(path: Path) -> Path:
    """70 inputs x{i} [1,4] -> 70 outputs, output i = Relu(x{i}) (so every mapping is checkable)."""
    nodes = [helper.make_node("Relu", [f"x{i}"], [o], name=f"relu{i}") for i, o in enumerate(WIDE_OUTPUTS)]
    graph = helper.make_graph(
        nodes, "wide", [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [1, 4]) for i in range(N_WIDE)],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, [1, 4]) for o in WIDE_OUTPUTS])
    return _save(graph, path)


def half_model(path: Path) -> Path:
    """float16 in and out: y = Relu(x) + x (values chosen to hit subnormals, large and negative halves)."""
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Add", ["r", "x"], ["y"], name="add")]
    graph = helper.make_graph(nodes, "half", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 8])])
    return _save(graph, path)


def _build(model: Path, out: Path, *extra: str) -> Path:
    proc = run_edgepack("build", str(model), "--target", "x86_64", "--out", str(out), "--json", *extra)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out / f"{model.stem}-x86_64"


@pytest.fixture(scope="module")
def arts(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hostile")
    return {
        "wide": _build(wide_model(d / "wide.onnx"), d / "dist", "--backend", "ncnn", "--fp32"),
        "cnn": _build(EXAMPLES / "tiny_cnn.onnx", d / "dist", "--backend", "ncnn", "--fp32"),
        "half": _build(half_model(d / "half.onnx"), d / "dist", "--backend", "tvm"),
        "models": d,
    }


def run(art: Path, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(art), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def snapshot(*paths: Path) -> dict:
    return {p: (p.read_bytes(), p.stat().st_ino) for p in paths}


# ---- no fixed-size traps -------------------------------------------------------------------------
def test_70_inputs_70_outputs_and_hostile_output_names(arts, tmp_path):
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((1, 4)).astype(np.float32) for _ in range(N_WIDE)]
    args = []
    for i, x in enumerate(xs):
        np.save(tmp_path / f"x{i}.npy", x)
        args += ["--input", f"x{i}={tmp_path / f'x{i}.npy'}"]
    out = tmp_path / "out"
    proc = run(arts["wide"], "run", *args, "--output", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)["outputs"]
    assert list(report) == WIDE_OUTPUTS
    files = [Path(report[o]["file"]) for o in WIDE_OUTPUTS]
    assert len(set(files)) == N_WIDE and sorted(p.name for p in out.iterdir()) == sorted(p.name for p in files)
    # "a/b" and "a:b" sanitise alike: the second gets a suffix, neither overwrites the other
    assert (files[-3].name, files[-2].name) == ("a_b.npy", "a_b_2.npy")
    assert len(files[-1].name) <= 110 and files[-1].parent == out
    for i, f in enumerate(files):
        np.testing.assert_array_equal(np.load(f), np.maximum(xs[i], 0), err_msg=WIDE_OUTPUTS[i][:20])
    # JSON to stdout, and selftest (the golden comparison over all 70 outputs)
    proc = run(arts["wide"], "run", *args)
    assert proc.returncode == 0 and len(json.loads(proc.stdout)["outputs"]) == N_WIDE, proc.stderr[-2000:]
    proc = run(arts["wide"], "selftest", "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout)["result"] == "PASS", proc.stdout + proc.stderr


def test_spec_check_and_float16_conversion_in_c(tmp_path):
    """ep_spec_check (called by both engines' ep_engine_open) refuses damaged counts; the float16
    accessors agree with numpy bit for bit over all 65536 halves and around every rounding boundary."""
    src = tmp_path / "t.c"
    src.write_text(r'''
#include "ep_runtime.h"
#include <string.h>
static ep_io_spec io[2] = {{"x", EP_F32, 2, {1, 4}}, {"y", EP_F32, 2, {1, 4}}};
static ep_blob gold[2];
int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "h2f") == 0) {
        uint16_t h; while (fread(&h, 2, 1, stdin) == 1) { float f = ep_half_to_float(h); fwrite(&f, 4, 1, stdout); }
        return 0;
    }
    if (argc > 1 && strcmp(argv[1], "d2h") == 0) {
        double d; while (fread(&d, 8, 1, stdin) == 1) { uint16_t h = ep_double_to_half(d); fwrite(&h, 2, 1, stdout); }
        return 0;
    }
    ep_model_spec s = {0};
    s.n_inputs = 1; s.inputs = io; s.n_outputs = 1; s.outputs = io + 1; s.golden_inputs = gold; s.golden_outputs = gold;
    ep_status st = {0, ""};
    printf("ok=%d\n", ep_spec_check(&s, &st));
    int bad[6];
    s.n_outputs = -1; bad[0] = ep_spec_check(&s, &st); s.n_outputs = 1;
    s.n_inputs = EP_MAX_IO + 1; bad[1] = ep_spec_check(&s, &st); s.n_inputs = 1;
    io[0].ndim = EP_MAX_DIMS + 1; bad[2] = ep_spec_check(&s, &st); io[0].ndim = 2;
    io[1].shape[1] = -4; bad[3] = ep_spec_check(&s, &st); io[1].shape[1] = 4;
    io[1].shape[0] = (int64_t)1 << 62; bad[4] = ep_spec_check(&s, &st); io[1].shape[0] = 1;
    io[0].dtype = (ep_dtype)99; bad[5] = ep_spec_check(&s, &st); io[0].dtype = EP_F32;
    for (int i = 0; i < 6; i++) printf("bad=%d\n", bad[i]);
    printf("last=%s\n", st.message);
    return 0;
}
''')
    common = REPO / "runtimes" / "common"
    exe = tmp_path / "t"
    subprocess.run(["gcc", "-O2", "-Wall", "-Werror", "-fsanitize=undefined", "-fno-sanitize-recover=all",
                    f"-I{common}", str(src), str(common / "ep_util.c"), "-lm", "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "ok=0" and out[1:7] == ["bad=4"] * 6, out
    assert "embedded model spec damaged: input 0 has dtype 99" in out[7]

    halves = np.arange(65536, dtype=np.uint16)
    got = np.frombuffer(subprocess.run([str(exe), "h2f"], input=halves.tobytes(), capture_output=True,
                                       check=True).stdout, np.uint32)
    np.testing.assert_array_equal(got, halves.view(np.float16).astype(np.float32).view(np.uint32))  # NaN payloads too
    f = np.unique(halves.view(np.float16).astype(np.float64)[np.isfinite(halves.view(np.float16))])
    mids = (f[:-1] + f[1:]) / 2  # ties: round to even; a hair off: the nearer half
    rng = np.random.default_rng(0)
    ds = np.concatenate([halves.view(np.float16).astype(np.float64), mids, np.nextafter(mids, np.inf),
                         np.nextafter(mids, -np.inf), rng.standard_normal(50000) * 10.0 ** rng.integers(-9, 6, 50000),
                         [65519.99, 65520.0, 1e300, -1e300, 5e-324, 2.0 ** -25, 2.0 ** -25 * 1.0000001]])
    got = np.frombuffer(subprocess.run([str(exe), "d2h"], input=ds.tobytes(), capture_output=True,
                                       check=True).stdout, np.uint16)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(got, ds.astype(np.float16).view(np.uint16))


# ---- float16 end to end -----------------------------------------------------------------------------
def test_float16_model_end_to_end(arts, tmp_path):
    x = np.array([[0.0, -0.0, 1.5, -2.25, 6.0e-8, -3.0e4, 65504.0, 0.1]], np.float16)
    np.save(tmp_path / "x.npy", x)
    want = run_onnxruntime(load_model(arts["models"] / "half.onnx"), {"x": x})["y"]
    proc = run(arts["half"], "run", "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    got = np.load(tmp_path / "out" / "y.npy")
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, want)  # exact (65504 + 65504 = inf in both; the sign of -0 may differ)
    values = json.loads(run(arts["half"], "run", "--input", str(tmp_path / "x.npy")).stdout)["outputs"]["y"]
    assert values["dtype"] == "float16" and values["values"][:4] == [0, 0, 3, -2.25] and values["values"][6] is None
    st = json.loads(run(arts["half"], "selftest", "--json").stdout)
    assert st["result"] == "PASS" and np.isfinite(st["max_abs_err"]), st
    # a float32 array is not silently narrowed
    np.save(tmp_path / "f32.npy", x.astype(np.float32))
    proc = run(arts["half"], "run", "--input", str(tmp_path / "f32.npy"))
    assert proc.returncode == 3
    assert one_error_line(proc).endswith("input x: dtype float32, the model needs float16 (convert the data first)")


# ---- inputs are what the model declares -------------------------------------------------------------
def test_wrong_shape_or_dtype_is_refused_not_reshaped(arts, tmp_path):
    rng = np.random.default_rng(3)
    nchw = rng.standard_normal((1, 3, 64, 64)).astype(np.float32)
    cases = {"hwc.npy": nchw[0].transpose(1, 2, 0), "nhwc.npy": nchw.transpose(0, 2, 3, 1)}
    for name, arr in cases.items():
        np.save(tmp_path / name, np.ascontiguousarray(arr))
        proc = run(arts["cnn"], "run", "--input", str(tmp_path / name))
        assert proc.returncode == 3 and proc.stdout == ""
        shape = ",".join(map(str, arr.shape))
        assert one_error_line(proc) == f"error: input image: shape [{shape}], the model needs [1,3,64,64]"
    np.save(tmp_path / "u8.npy", (nchw * 40 + 128).clip(0, 255).astype(np.uint8))
    proc = run(arts["cnn"], "run", "--input", str(tmp_path / "u8.npy"))
    assert proc.returncode == 3 and "input image: dtype uint8, the model needs float32" in one_error_line(proc)
    # the one allowance: a missing leading batch dim of 1
    np.save(tmp_path / "full.npy", nchw)
    np.save(tmp_path / "nobatch.npy", nchw[0])
    a, b = (run(arts["cnn"], "run", "--input", str(tmp_path / n)) for n in ("full.npy", "nobatch.npy"))
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert json.loads(a.stdout)["outputs"] == json.loads(b.stdout)["outputs"]
    want = run_onnxruntime(load_model(EXAMPLES / "tiny_cnn.onnx"), {"image": nchw})["logits"]
    np.testing.assert_allclose(json.loads(a.stdout)["outputs"]["logits"]["values"], want.reshape(-1), atol=1e-4)


def test_uint8_pixels_only_where_preprocessing_says_so(tmp_path):
    from prepost_fixtures import baked_x86
    px = np.random.default_rng(4).integers(0, 256, (1, 64, 64, 3), dtype=np.uint8)
    np.save(tmp_path / "u8.npy", px)
    np.save(tmp_path / "f32.npy", px.astype(np.float32))
    a, b = (run(baked_x86(), "run", "--input", str(tmp_path / n)) for n in ("u8.npy", "f32.npy"))
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert json.loads(a.stdout)["outputs"] == json.loads(b.stdout)["outputs"]


def test_sdk_refuses_what_the_artifact_refuses(arts):
    import edgepack
    from edgepack.sdk import InputError
    nchw = np.zeros((1, 3, 64, 64), np.float32)
    for m in (edgepack.load(EXAMPLES / "tiny_cnn.onnx"), edgepack.load(arts["cnn"])):
        with pytest.raises(InputError, match=r"input image: got shape \[64, 64, 3\], the model takes \[1, 3, 64, 64\]"):
            m.predict(np.zeros((64, 64, 3), np.float32))
        with pytest.raises(InputError, match="got dtype uint8, the model takes float32"):
            m.predict(nchw.astype(np.uint8))
        assert m.predict(nchw[0])["logits"].shape == (1, 10)


# ---- run / batch never destroy input or results -------------------------------------------------------
def test_run_output_never_overwrites_an_input(arts, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    x = tmp_path / "x.npy"
    np.save(x, np.ones((1, 3, 64, 64), np.float32))
    os.link(x, out / "logits.npy")  # the output file is the input, through a hard link
    (tmp_path / "ln").mkdir()
    (tmp_path / "ln" / "logits.npy").symlink_to(x)  # ... or through a symlink
    before = snapshot(x)
    for d in (out, tmp_path / "ln"):
        proc = run(arts["cnn"], "run", "--input", str(x), "--output", str(d))
        assert proc.returncode == 2
        assert one_error_line(proc) == f"error: --output {d}: output {d}/logits.npy would overwrite the input {x}"
    assert snapshot(x) == before and (tmp_path / "ln" / "logits.npy").is_symlink()


def test_input_path_with_equals_sign(arts, tmp_path):
    d = tmp_path / "a=b"
    d.mkdir()
    np.save(d / "x.npy", np.zeros((1, 3, 64, 64), np.float32))
    proc = run(arts["cnn"], "run", "--input", str(d / "x.npy"))
    assert proc.returncode == 0, proc.stderr
    proc = run(arts["cnn"], "run", "--input", f"image={d / 'x.npy'}")
    assert proc.returncode == 0, proc.stderr
    proc = run(arts["cnn"], "run", "--input", f"imgae={d / 'x.npy'}")  # a mistyped name before a real file
    assert proc.returncode == 2 and "no such input imgae (the model's inputs: image)" in one_error_line(proc)
    proc = run(arts["wide"], "run", "--input", str(d / "x.npy"))
    assert proc.returncode == 2 and "the model has 70 inputs, write NAME=FILE" in one_error_line(proc)


def test_batch_keeps_old_results_and_inputs(arts, tmp_path):
    old = tmp_path / "old.jsonl"
    old.write_text('{"file": "earlier", "precious": true}\n')
    rows = tmp_path / "rows.csv"
    rows.write_text("1,2,3\n")
    os.link(rows, tmp_path / "rows_link.csv")
    before = snapshot(old, rows)
    proc = run(arts["cnn"], "run", "--input-dir", str(tmp_path / "missing"), "--output", str(old))
    assert proc.returncode == 5 and "--input-dir" in one_error_line(proc) and "missing" in proc.stderr
    for out in (rows, tmp_path / "rows_link.csv"):
        proc = run(arts["cnn"], "run", "--input", str(rows), "--output", str(out))
        assert proc.returncode == 2
        assert one_error_line(proc) == f"error: --output {out} is the input {rows}: write the results to another file"
    inputs = tmp_path / "in"
    inputs.mkdir()
    np.save(inputs / "a.npy", np.zeros((1, 3, 64, 64), np.float32))
    np.save(inputs / "b.npy", np.zeros((64, 64, 3), np.float32))  # wrong shape: an error line
    proc = run(arts["cnn"], "run", "--input-dir", str(inputs), "--output", str(inputs / "res.jsonl"))
    assert proc.returncode == 2 and "is inside --input-dir" in one_error_line(proc)
    assert snapshot(old, rows) == before and sorted(p.name for p in inputs.iterdir()) == ["a.npy", "b.npy"]
    # a batch with a failed file: the results (error line included) replace old.jsonl, exit 3
    proc = run(arts["cnn"], "run", "--input-dir", str(inputs), "--output", str(old))
    assert proc.returncode == 3, proc.stderr
    assert proc.stderr.splitlines() == ["2 files: 1 ok, 1 failed",
                                        f"error: 1 of 2 files failed (their error lines are in {old})"]
    lines = [json.loads(ln) for ln in old.read_text().splitlines()]
    assert [ln["file"] for ln in lines] == ["a.npy", "b.npy"] and "outputs" in lines[0]
    assert lines[1]["error"] == "input image: shape [64,64,3], the model needs [1,3,64,64]"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".edgepack-")]  # no temporary file left


def test_edgepack_run_on_onnx_keeps_results_and_fails_batches(tmp_path):
    model = EXAMPLES / "tiny_cnn.onnx"
    old = tmp_path / "old.jsonl"
    old.write_text("precious\n")
    proc = run_edgepack("run", str(model), "--input-dir", str(tmp_path / "missing"), "--output", str(old))
    # the artifact's exit-code table for both kinds of MODEL: 5 is I/O (a missing folder), 3 bad input
    assert proc.returncode == 5 and "no such folder" in proc.stderr and old.read_text() == "precious\n"
    inputs = tmp_path / "in"
    inputs.mkdir()
    np.save(inputs / "a.npy", np.zeros((1, 3, 64, 64), np.float32))
    np.save(inputs / "b.npy", np.zeros((64, 64, 3), np.float32))
    proc = run_edgepack("run", str(model), "--input-dir", str(inputs), "--output", str(old))
    assert proc.returncode == 3 and "1 of 2 files failed" in proc.stderr and "Traceback" not in proc.stderr
    assert [json.loads(ln)["file"] for ln in old.read_text().splitlines()] == ["a.npy", "b.npy"]
    d = tmp_path / "a=b"
    d.mkdir()
    np.save(d / "x.npy", np.zeros((1, 3, 64, 64), np.float32))
    proc = run_edgepack("run", str(model), "--input", str(d / "x.npy"))
    assert proc.returncode == 0 and "logits" in json.loads(proc.stdout)["outputs"], proc.stderr
