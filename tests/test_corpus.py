"""The real-model corpus (bench/corpus.py): its table, and a small subset through the real pipeline.

The subset's models are fetched at set-up (.ci/deps-corpus.sh), so this test uses no network: a
missing model fails with the command that fetches it. Full runs are a benchmark, not a test.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import corpus  # noqa: E402

SUBSET = ("ppocr_cls", "silero_vad")  # small; a Paddle-exported CNN and an audio model with a Pad


def test_table_pins_at_least_twelve_real_models_with_checksums():
    entries = corpus.load_table()
    assert len(entries) >= 12
    assert len({e.name for e in entries}) == len(entries)
    for e in entries:
        assert re.fullmatch(r"[0-9a-f]{64}", e.sha256), e.name
        assert re.fullmatch(r"[0-9][0-9a-z.]*", e.version), f"{e.name}: pin an exact version"
        assert e.path.endswith(".onnx")
        for s in e.shapes:
            assert re.fullmatch(r"[^=]+=\d+(x\d+)*", s), f"{e.name}: bad shape {s}"
    kinds = " ".join(e.kind for e in entries).lower()
    for needed in ("ocr text detector", "recogniser", "classifier", "yolox", "yolov8", "lstm", "audio", "text"):
        assert needed in kinds, f"the corpus lacks a {needed} model"
    assert set(SUBSET) <= {e.name for e in entries}


def test_fetch_checks_the_pinned_sha256():
    e = next(x for x in corpus.load_table() if x.name == SUBSET[0])
    path = corpus.fetch(e, offline=True)
    assert corpus.sha256_file(path) == e.sha256


def test_small_subset_builds_verifies_and_is_timed_against_onnxruntime(tmp_path):
    out_json = tmp_path / "corpus.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "corpus.py"), "--models", ",".join(SUBSET), "--targets", "x86_64",
         "--offline", "--runs", "3", "--rounds", "1", "--json", str(out_json), "--out", str(tmp_path / "dist")],
        capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads(out_json.read_text())["rows"]
    assert sorted(r["model"] for r in rows) == sorted(SUBSET)
    for r in rows:
        assert r["ok"] and r["target"] == "x86_64"
        # both stay on the fast backend: silero's Pad is left to conversion (it becomes ncnn Padding)
        assert r["backend"] == "ncnn", r
        assert r["max_abs_err"] is not None and r["max_abs_err"] <= r["bound"]
        assert r["precision"] in ("fp16-arith", "fp16-storage", "fp32")  # the precision ladder's rung kept
        assert r["edgepack_ms"] > 0 and r["onnxruntime_ms"] > 0
    assert "models built and verified on every target" in proc.stdout
    assert "| model |" not in proc.stdout  # plain table unless --markdown


# Real models that once left NCNN or failed, each for an exporter form (docs/backends.md): magika's
# one-axis ReduceSum and [1, N] Gemm bias (jax2tf), hey_jarvis's data-dependent If (openWakeWord),
# PP-OCRv3's Resize with an unread roi, MTCNN R-Net's padding="same" MaxPool (keras2onnx, from an
# sdist). Verified natively only: the forms, not the CPUs, are the point.
FORMS = {"magika": "ncnn", "oww_hey_jarvis": None, "ppocr_v3_det": "ncnn", "mtcnn_rnet": "ncnn"}


def test_exporter_forms_of_real_models_stay_built_and_on_ncnn(tmp_path):
    out_json = tmp_path / "forms.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "corpus.py"), "--models", ",".join(FORMS), "--targets", "x86_64",
         "--offline", "--no-bench", "--build-arg=--verify-on=native", "--json", str(out_json),
         "--out", str(tmp_path / "dist")], capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {r["model"]: r for r in json.loads(out_json.read_text())["rows"]}
    assert sorted(rows) == sorted(FORMS)
    for name, needs in FORMS.items():
        r = rows[name]
        assert r["ok"] and r["max_abs_err"] <= r["bound"], r
        if needs:
            assert needs in r["backend"].split("+"), r  # magika: its layer norms and head on NCNN
    assert rows["ppocr_v3_det"]["backend"] == "ncnn"  # whole: its six upsamplings no longer cut out
    assert rows["mtcnn_rnet"]["backend"] == "ncnn"  # whole: it went to TVM while pnnx mis-padded its pool
    manifest = json.loads((tmp_path / "dist" / "oww_hey_jarvis-x86_64.json").read_text())
    assert any(n.startswith("If as Where") for n in manifest["model"]["notes"])
