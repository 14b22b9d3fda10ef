"""One Python API: edgepack.load over an NCNN artifact, a TVM artifact, an Arm artifact (qemu) and the
plain ONNX file (onnxruntime), with the same inputs, outputs and answers."""
from __future__ import annotations

import numpy as np
import pytest

import edgepack
from edgepack.backends import all_backends
from edgepack.sdk import InputError
from prepost_fixtures import LABELS, TARGET, baked_x86, build, classifier_dir, decode, make_images, tabular_model, \
    tabular_x86


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_images(tmp_path_factory.mktemp("images"))


@pytest.fixture(scope="module")
def models():
    onnx_path = classifier_dir() / "tiny_cnn.onnx"
    out = {"onnx": edgepack.load(onnx_path), "ncnn": edgepack.load(baked_x86())}
    assert "tvm" in all_backends(), "the TVM backend has landed in edgepack/backends/tvm; it must register"
    out["tvm"] = edgepack.load(build(onnx_path, TARGET, "--backend", "tvm", "--fp32")[TARGET])
    out["ncnn-arm64"] = edgepack.load(build(onnx_path, "arm64", "--backend", "ncnn")["arm64"])
    return out


def test_same_signature_everywhere(models):
    ref = models["onnx"]
    assert ref.kind == "onnx" and ref.backend == "onnxruntime"
    for name, m in models.items():
        assert m.inputs == ref.inputs and m.outputs == ref.outputs, name
        assert m.prepost["postprocess"]["labels"] == LABELS, name
    assert models["tvm"].backend == "tvm" and models["ncnn"].backend == "ncnn"


def test_predict_parity_on_images(models, images):
    ref = models["onnx"]
    tol = {"ncnn": 1e-4, "tvm": 1e-4, "ncnn-arm64": 2e-2}  # fp32, fp32, fp16 under qemu
    for fname in ("img0.png", "img3.png", "img4.jpg"):
        img = decode(images[fname])
        want = ref.predict(img)
        assert set(want) == {"scores"} and want["scores"].shape == (1, 10) and want["scores"].dtype == np.float32
        for name, m in models.items():
            if name == "onnx":
                continue
            got = m.predict(img)
            np.testing.assert_allclose(got["scores"], want["scores"], atol=tol[name], err_msg=f"{name} {fname}")
            assert m.top(got)[0]["label"] == ref.top(want)[0]["label"], (name, fname)


def test_predict_forms_and_batches(models, images):
    img = decode(images["img1.png"])
    from edgepack.prepost import image_to_input
    for name in ("onnx", "ncnn", "tvm"):
        m = models[name]
        x = image_to_input(img, m.prepost["preprocess"])
        a = m.predict(x)
        b = m.predict({"image": x})
        c = m.predict(images["img1.png"])  # a file: decoded by the artifact (stb) / Pillow (onnx)
        np.testing.assert_allclose(a["scores"], b["scores"], atol=1e-6)
        np.testing.assert_allclose(a["scores"], c["scores"], atol=1e-4)
        batch = m.predict_batch([x, images["img1.png"], decode(images["img2.ppm"])])
        assert len(batch) == 3
        np.testing.assert_allclose(batch[0]["scores"], a["scores"], atol=1e-6)
        np.testing.assert_allclose(batch[2]["scores"], m.predict(decode(images["img2.ppm"]))["scores"], atol=1e-6)
        with pytest.raises(InputError, match="got shape"):
            m.predict(np.zeros((3, 3), np.float32))
        with pytest.raises(InputError, match="unknown input"):
            m.predict({"nope": x})


def test_plain_tabular_model_parity():
    o, a = edgepack.load(tabular_model()), edgepack.load(tabular_x86())
    xs = [np.random.default_rng(i).standard_normal((1, 4)).astype(np.float32) for i in range(4)]
    for x, ro, ra in zip(xs, o.predict_batch(xs), a.predict_batch(xs)):
        np.testing.assert_allclose(ra["y"], ro["y"], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(a.predict(x)["y"], ro["y"], rtol=1e-4, atol=1e-4)
    with pytest.raises(edgepack.errors.UsageError, match="no baked postprocessing"):
        o.top(o.predict(xs[0]))
