"""Batch runs: a folder -> JSON lines (a bad file is an error line, not a stop); CSV in -> CSV/JSONL out;
the same through `edgepack run` on an artifact and on the ONNX file."""
from __future__ import annotations

import csv
import json

import numpy as np

from conftest import run_edgepack
from edgepack.model import load_model
from edgepack.reference import run_onnxruntime
from edgepack.runner import run_artifact
from prepost_fixtures import LABELS, baked_x86, classifier_dir, make_images, tabular_model, tabular_x86


def test_input_dir_to_jsonl_with_bad_files(tmp_path):
    d = tmp_path / "in"
    imgs = make_images(d)
    (d / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0garbage")
    (d / "notes.txt").write_text("hello")
    (d / "wrong.json").write_text("[1, 2, 3]")
    (d / ".hidden").write_text("skipped")
    (d / "sub").mkdir()
    out = tmp_path / "results.jsonl"
    proc = run_artifact(baked_x86(), ["run", "--input-dir", str(d), "--output", str(out)])
    assert proc.returncode == 3, proc.stderr  # results kept, but a batch with failed files is not a success
    assert f"{len(imgs) + 3} files: {len(imgs)} ok, 3 failed" in proc.stderr
    assert f"error: 3 of {len(imgs) + 3} files failed (their error lines are in {out})" in proc.stderr
    lines = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [ln["file"] for ln in lines] == sorted(list(imgs) + ["broken.jpg", "notes.txt", "wrong.json"])
    by = {ln["file"]: ln for ln in lines}
    assert "cannot decode the image" in by["broken.jpg"]["error"]
    assert "unrecognised file" in by["notes.txt"]["error"]
    assert "shape [3], the model needs [1,64,64,3]" in by["wrong.json"]["error"]
    for name in imgs:
        assert by[name]["top"][0]["label"] in LABELS and len(by[name]["outputs"]["scores"]["values"]) == 10
    # the ONNX reference through `edgepack run` gives the same top-1 for every good file
    ref = tmp_path / "ref.jsonl"
    proc = run_edgepack("run", str(classifier_dir() / "tiny_cnn.onnx"), "--input-dir", str(d), "--output", str(ref))
    assert proc.returncode == 3 and "3 of" in proc.stderr, proc.stderr  # the artifact's code for bad input
    ref_by = {j["file"]: j for j in map(json.loads, ref.read_text().splitlines())}
    assert "error" in ref_by["broken.jpg"] and "error" in ref_by["notes.txt"]
    for name in imgs:
        assert ref_by[name]["top"][0]["index"] == by[name]["top"][0]["index"], name


def test_csv_in_csv_and_jsonl_out(tmp_path):
    rows = np.random.default_rng(9).standard_normal((6, 4)).astype(np.float32)
    src = tmp_path / "rows.csv"
    src.write_text("f0,f1,f2,f3\n" + "\n".join(",".join(f"{v:.6f}" for v in r) for r in rows) + "\n")
    art = tabular_x86()
    ref = run_onnxruntime(load_model(tabular_model()), {"x": np.round(rows, 6).astype(np.float32)[:1]})
    proc = run_artifact(art, ["run", "--input", str(src), "--output", str(tmp_path / "out.csv")])
    assert proc.returncode == 0, proc.stderr
    table = list(csv.reader((tmp_path / "out.csv").open()))
    assert table[0] == ["row", "y_0", "y_1", "y_2"] and len(table) == 7
    np.testing.assert_allclose([float(v) for v in table[1][1:]], ref["y"][0], rtol=1e-4, atol=1e-4)
    proc = run_artifact(art, ["run", "--input", str(src), "--output", str(tmp_path / "out.jsonl")])
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(ln) for ln in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [ln["row"] for ln in lines] == list(range(6))
    for ln, row in zip(lines, rows):
        want = run_onnxruntime(load_model(tabular_model()), {"x": np.round(row, 6)[None].astype(np.float32)})["y"]
        np.testing.assert_allclose(ln["outputs"]["y"]["values"], want.reshape(-1), rtol=1e-4, atol=1e-4)
    bad = tmp_path / "bad.csv"
    bad.write_text("1,2,3,4\n1,2,x,4\n")
    proc = run_artifact(art, ["run", "--input", str(bad)])
    assert proc.returncode == 3 and "line 2" in proc.stderr


def test_edgepack_run_cli_on_artifact_and_onnx(tmp_path):
    img = make_images(tmp_path)["img0.png"]
    a = run_edgepack("run", str(baked_x86()), "--input", str(img))
    o = run_edgepack("run", str(classifier_dir() / "tiny_cnn.onnx"), "--input", str(img))
    assert a.returncode == 0 and o.returncode == 0, a.stderr + o.stderr
    ja, jo = json.loads(a.stdout), json.loads(o.stdout)
    assert ja["top"][0]["index"] == jo["top"][0]["index"] and ja["top"][0]["label"] == jo["top"][0]["label"]
    missing = run_edgepack("run", str(tmp_path / "nope.onnx"), "--input", str(img))
    assert missing.returncode == 2 and "no such file" in missing.stderr and "Traceback" not in missing.stderr
