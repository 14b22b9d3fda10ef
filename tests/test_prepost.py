"""Baked pre/post-processing: graph surgery checked against onnxruntime + numpy preprocessing, and
artifacts that take raw images and answer with labelled top-k."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import first_cpu, run_edgepack
from edgepack.errors import UsageError
from edgepack.model import load_model
from edgepack.prepost import bake_prepost, image_to_input, prepost_of, reference_preprocess, resize_image
from edgepack.reference import run_onnxruntime
from edgepack.runner import run_artifact
from prepost_fixtures import LABELS, TARGET, baked_x86, build, classifier_dir, decode, make_images


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def reference_scores(img: np.ndarray) -> np.ndarray:
    """onnxruntime on the ORIGINAL model, preprocessing done in numpy."""
    model = load_model(classifier_dir() / "tiny_cnn.onnx")
    pre = {"size": [64, 64], "channels": 3, "resize": "bilinear", "mean": [0.485, 0.456, 0.406],
           "std": [0.229, 0.224, 0.225]}
    x = reference_preprocess(img, pre)
    return softmax(run_onnxruntime(model, {"image": x})["logits"][0].astype(np.float64))


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_images(tmp_path_factory.mktemp("images"))


def test_resize_matches_independent_bilinear():
    """Half-pixel bilinear, checked against a direct per-pixel formula (and identity at equal size)."""
    img = np.random.default_rng(0).integers(0, 256, (7, 9, 3)).astype(np.uint8)
    out = resize_image(img, 4, 5, "bilinear")
    for y, x in [(0, 0), (3, 4), (1, 2)]:
        sy, sx = max((y + 0.5) * 7 / 4 - 0.5, 0), max((x + 0.5) * 9 / 5 - 0.5, 0)
        y0, x0 = int(sy), int(sx)
        y1, x1 = min(y0 + 1, 6), min(x0 + 1, 8)
        fy, fx = sy - y0, sx - x0
        f = img.astype(np.float64)
        want = (f[y0, x0] * (1 - fx) + f[y0, x1] * fx) * (1 - fy) + (f[y1, x0] * (1 - fx) + f[y1, x1] * fx) * fy
        np.testing.assert_allclose(out[y, x], want, atol=1e-3)
    np.testing.assert_array_equal(resize_image(img, 7, 9, "bilinear"), img.astype(np.float32))


def test_baked_graph_equals_numpy_preprocessing_plus_original_model(images):
    d = classifier_dir()
    model = load_model(d / "tiny_cnn.onnx")
    from edgepack.model import fix_input_shapes
    baked = bake_prepost(fix_input_shapes(model, {}), d / "tiny_cnn.onnx", None, None)
    cfg = prepost_of(baked.proto)
    assert [s.name for s in baked.inputs] == ["image"] and baked.inputs[0].shape == (1, 64, 64, 3)
    assert cfg["postprocess"]["labels"] == LABELS and cfg["postprocess"]["topk"] == 3
    ops = [n.op_type for n in baked.proto.graph.node]
    assert ops[:3] == ["Mul", "Add", "Transpose"] and ops[-1] == "Softmax"
    for p in images.values():
        img = decode(p)
        got = run_onnxruntime(baked, {"image": image_to_input(img, cfg["preprocess"])})["scores"][0]
        np.testing.assert_allclose(got, reference_scores(img), atol=1e-5)


def test_cli_settings_override_the_toml(tmp_path):
    d = classifier_dir()
    from edgepack.model import fix_input_shapes
    m = fix_input_shapes(load_model(d / "tiny_cnn.onnx"), {})
    baked = bake_prepost(m, d / "tiny_cnn.onnx", "image:layout=nchw,dtype=float32,mean=0.5,std=0.25,resize=nearest",
                         "topk=2")
    cfg = prepost_of(baked.proto)
    assert baked.inputs[0].shape == (1, 3, 64, 64)
    assert cfg["preprocess"]["mean"] == [0.5] * 3 and cfg["preprocess"]["resize"] == "nearest"
    assert cfg["postprocess"] == {"output": "logits", "softmax": False, "topk": 2, "labels": [], "labels_file": ""}
    with pytest.raises(UsageError, match="3 labels for 10 classes"):
        (tmp_path / "l.txt").write_text("a\nb\nc\n")
        bake_prepost(m, d / "tiny_cnn.onnx", None, f"labels={tmp_path / 'l.txt'}")
    with pytest.raises(UsageError, match="differs from the model's 64x64"):
        bake_prepost(m, d / "tiny_cnn.onnx", "image:size=224x224", None)


@pytest.mark.parametrize("args,needle", [
    (("--preprocess", "image:size=abc"), "expected HEIGHTxWIDTH"),
    (("--preprocess", "image:colour=red"), "unknown preprocess setting"),
    (("--postprocess", "topk=zero"), "expected a number"),
    (("--postprocess", "labels=/nonexistent/labels.txt"), "not found"),
])
def test_bad_settings_are_one_line_and_exit_2(tiny_cnn, args, needle):
    proc = run_edgepack("build", str(tiny_cnn), "--target", "x86_64", "--out", "/tmp/never", *args)
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr


def test_artifact_takes_raw_images_and_matches_onnxruntime_top1(images, tmp_path):
    art = baked_x86()
    info = json.loads(run_artifact(art, ["info", "--json"]).stdout)
    assert info["prepost"]["postprocess"]["labels"] == LABELS
    assert info["inputs"] == [{"name": "image", "shape": [1, 64, 64, 3], "dtype": "float32"}]
    d = tmp_path / "in"
    d.mkdir()
    for p in images.values():
        (d / p.name).write_bytes(p.read_bytes())
    proc = run_artifact(art, ["run", "--input-dir", str(d), "--output", str(tmp_path / "r.jsonl")])
    assert proc.returncode == 0, proc.stderr
    lines = {j["file"]: j for j in map(json.loads, (tmp_path / "r.jsonl").read_text().splitlines())}
    assert set(lines) == set(images)
    for name, p in images.items():
        ref = reference_scores(decode(p))
        top = lines[name]["top"]
        assert len(top) == 3
        order = np.argsort(-ref)
        margin = ref[order[0]] - ref[order[1]]
        assert margin > 1e-3, f"{name}: ambiguous reference (margin {margin}); pick another image"
        assert top[0]["index"] == int(order[0]), (name, top, ref)
        assert top[0]["label"] == LABELS[order[0]]
        # PNG/PPM decode identically; JPEG decoders (stb vs libjpeg) may differ by a level or two
        tol = 2e-2 if name.endswith(".jpg") else 2e-4
        assert abs(top[0]["score"] - ref[order[0]]) < tol, (name, top[0], ref[order[0]])
        np.testing.assert_allclose(lines[name]["outputs"]["scores"]["values"], ref, atol=tol)


def test_arm64_artifact_under_qemu_takes_images(images):
    """One Arm check (fp16, under qemu): the same top-1 on a PNG as onnxruntime."""
    art = build(classifier_dir() / "tiny_cnn.onnx", "arm64", "--backend", "ncnn")["arm64"]
    p = images["img1.png"]
    proc = run_artifact(art, ["run", "--input", str(p)], qemu_cpu=first_cpu("arm64"))
    assert proc.returncode == 0, proc.stderr
    ans = json.loads(proc.stdout)
    ref = reference_scores(decode(p))
    assert ans["top"][0]["index"] == int(np.argmax(ref)) and ans["top"][0]["label"] == LABELS[int(np.argmax(ref))]


def test_image_input_errors_are_clear(tmp_path):
    art = baked_x86()
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    proc = run_artifact(art, ["run", "--input", str(bad)])
    assert proc.returncode == 3 and "cannot decode the image" in proc.stderr, proc.stderr
    plain = build(tabular_path(), TARGET, "--backend", "ncnn", "--fp32")[TARGET]
    img = make_images(tmp_path / "imgs")["img0.png"]
    proc = run_artifact(plain, ["run", "--input", str(img)])
    assert proc.returncode == 3 and "takes no images" in proc.stderr, proc.stderr


def tabular_path() -> Path:
    from prepost_fixtures import tabular_model
    return tabular_model()
