"""End to end with the NCNN backend: build, then run the artifacts (natively or under qemu)
on fresh random inputs and compare with onnxruntime."""
from __future__ import annotations

import json
import subprocess

import numpy as np
import onnxruntime as ort
import pytest

from conftest import first_cpu, run_edgepack
from edgepack.elf import read_elf
from edgepack.runner import command_for
from models import mobilenet_v2_like, transformer_block

QEMU_CPU = {t: first_cpu(t) for t in ("x86_64", "arm64", "android-arm64", "jetson-orin", "jetson-xavier")}


def _run(artifact, args, target, **kw):
    return subprocess.run(command_for(artifact, QEMU_CPU[target]) + args, capture_output=True, text=True,
                          timeout=600, **kw)


def _ort(model_path, feeds):
    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def _check_against_ort(artifact, target, model_path, feeds, tmp_path, rtol):
    args = ["run", "--output", str(tmp_path / "out"), "--threads", "1"]
    for name, arr in feeds.items():
        np.save(tmp_path / f"{name}.npy", arr)
        args += ["--input", f"{name}={tmp_path / f'{name}.npy'}"]
    proc = _run(artifact, args, target)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    ref = _ort(model_path, feeds)
    for name, want in ref.items():
        got = np.load(report["outputs"][name]["file"])
        assert got.shape == want.shape
        err = float(np.max(np.abs(got - want)))
        assert err <= 1e-3 + rtol * float(np.max(np.abs(want))), (name, err)


@pytest.mark.parametrize("target", ["x86_64", "arm64"])
def test_tiny_cnn_matches_onnxruntime(tiny_artifacts, tiny_cnn, target, tmp_path):
    art = tiny_artifacts[target]
    feeds = {"image": np.random.default_rng(99).standard_normal((1, 3, 64, 64)).astype(np.float32)}
    _check_against_ort(art, target, tiny_cnn, feeds, tmp_path, rtol=1e-2)


@pytest.mark.parametrize("target", ["x86_64", "arm64"])
def test_selftest_and_info(tiny_artifacts, tiny_cnn, target):
    art = tiny_artifacts[target]
    st = _run(art, ["selftest", "--json"], target)
    assert st.returncode == 0, st.stdout + st.stderr
    res = json.loads(st.stdout)
    assert res["result"] == "PASS" and res["max_abs_err"] <= res["bound"] and res["latency_ms"] > 0
    # the build's second check, inside the artifact too: the direction of every output
    assert res["min_cosine"] == 0.999 and 0.999 <= res["cosine"] <= 1.0 + 1e-9, res
    info = json.loads(_run(art, ["info", "--json"], target).stdout)
    assert info["target"]["name"] == target
    assert info["inputs"] == [{"name": "image", "shape": [1, 3, 64, 64], "dtype": "float32"}]
    assert info["outputs"] == [{"name": "logits", "shape": [1, 10], "dtype": "float32"}]
    import hashlib
    assert info["model"]["sha256"] == hashlib.sha256(tiny_cnn.read_bytes()).hexdigest()
    assert info["backend"]["name"] == "ncnn"
    assert len(info["model_blobs_sha256"]) == 2
    sidecar = json.loads(art.with_name(art.name + ".json").read_text())
    assert sidecar["artifact"]["sha256"] == hashlib.sha256(art.read_bytes()).hexdigest()
    assert sidecar["verification"]["max_abs_err"] <= sidecar["verification"]["bound"]


def test_artifact_is_static_for_its_arch(tiny_artifacts):
    x86, arm = read_elf(tiny_artifacts["x86_64"]), read_elf(tiny_artifacts["arm64"])
    assert (x86.machine, x86.type, x86.has_interp) == ("x86_64", "EXEC", False)
    assert (arm.machine, arm.type, arm.has_interp) == ("aarch64", "EXEC", False)


def test_run_rejects_wrong_shape_and_dtype(tiny_artifacts, tmp_path):
    art = tiny_artifacts["x86_64"]
    np.save(tmp_path / "bad.npy", np.zeros((1, 3, 32, 32), np.float32))
    proc = _run(art, ["run", "--input", f"image={tmp_path / 'bad.npy'}"], "x86_64")
    assert proc.returncode == 3
    assert proc.stderr.strip() == "error: input image: shape [1,3,32,32], the model needs [1,3,64,64]"
    np.save(tmp_path / "f64.npy", np.zeros((1, 3, 64, 64), np.float64))
    proc = _run(art, ["run", "--input", str(tmp_path / "f64.npy")], "x86_64")
    assert proc.returncode == 3 and "dtype float64, the model needs float32" in proc.stderr
    proc = _run(art, ["run", "--input", f"pixels={tmp_path / 'bad.npy'}"], "x86_64")
    assert proc.returncode == 2 and "no such input" in proc.stderr
    (tmp_path / "junk.npy").write_bytes(b"\x93NUMPY\x01\x00\xff\xff{'descr'")
    proc = _run(art, ["run", "--input", str(tmp_path / "junk.npy")], "x86_64")
    assert proc.returncode == 3 and "junk.npy" in proc.stderr
    proc = _run(art, ["run"], "x86_64")
    assert proc.returncode == 2


def test_bench_reports_latency_and_rss(tiny_artifacts):
    proc = _run(tiny_artifacts["x86_64"], ["bench", "--runs", "20", "--warmup", "2", "--json"], "x86_64")
    assert proc.returncode == 0, proc.stderr
    b = json.loads(proc.stdout)
    assert 0 < b["min_ms"] <= b["median_ms"] <= b["p90_ms"] and b["peak_rss_kb"] > 0 and b["runs"] == 20


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    d = tmp_path_factory.mktemp("zoo")
    return {"mobilenet": mobilenet_v2_like(d / "mobilenet.onnx"), "encoder": transformer_block(d / "encoder.onnx")}


@pytest.mark.parametrize("name,shape", [("mobilenet", (1, 3, 96, 96)), ("encoder", (1, 16, 64))])
def test_real_architectures_x86_and_arm64(zoo, name, shape, tmp_path):
    model = zoo[name]
    proc = run_edgepack("build", str(model), "--target", "x86_64,arm64", "--backend", "ncnn", "--out",
                        str(tmp_path / "dist"), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout)["results"]
    assert [r["ok"] for r in results] == [True, True]
    feeds_name = "image" if name == "mobilenet" else "tokens"
    feeds = {feeds_name: np.random.default_rng(5).standard_normal(shape).astype(np.float32)}
    for target in ("x86_64", "arm64"):
        art = tmp_path / "dist" / f"{name}-{target}"
        _check_against_ort(art, target, model, feeds, tmp_path, rtol=2e-2)
        assert _run(art, ["selftest"], target).returncode == 0


@pytest.fixture(scope="module")
def family_artifacts(tiny_cnn, tmp_path_factory):
    dist = tmp_path_factory.mktemp("family")
    proc = run_edgepack("build", str(tiny_cnn), "--target", "android-arm64,jetson-orin,jetson-xavier",
                        "--backend", "ncnn", "--out", str(dist), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dist


def test_android_is_static_pie_with_16k_pages(family_artifacts):
    art = family_artifacts / "tiny_cnn-android-arm64"
    info = read_elf(art)
    assert info.machine == "aarch64" and info.type == "DYN" and not info.has_interp
    assert info.load_align and all(a == 16384 for a in info.load_align)
    assert _run(art, ["selftest"], "android-arm64").returncode == 0


@pytest.mark.parametrize("target", ["jetson-orin", "jetson-xavier"])
def test_jetson_artifacts_run_on_a_cpu_with_their_features(family_artifacts, target):
    art = family_artifacts / f"tiny_cnn-{target}"
    assert read_elf(art).machine == "aarch64"
    st = _run(art, ["selftest", "--json"], target)
    assert st.returncode == 0, st.stdout + st.stderr
    manifest = json.loads(_run(art, ["info", "--json"], target).stdout)
    assert manifest["backend"]["fp16_arithmetic"] is True


def unrolled_lstm(path, steps: int = 12, k: int = 512, hidden: int = 128):
    """An LSTMCell looped over time steps, as torch exports it (captcha_crnn's form): each step's
    input product x_t @ W_ih^T (and the head's h_t @ W^T) is its own Gemm on one shared weight."""
    import torch
    torch.manual_seed(0)

    class Unrolled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.cell, self.head = torch.nn.LSTMCell(k, hidden), torch.nn.Linear(hidden, 10)

        def forward(self, x):
            h, c, outs = torch.zeros(1, hidden), torch.zeros(1, hidden), []
            for t in range(steps):
                h, c = self.cell(x[:, t], (h, c))
                outs.append(self.head(h))
            return torch.stack(outs, 1)

    torch.onnx.export(Unrolled().eval(), torch.randn(1, steps, k), str(path), input_names=["x"], output_names=["y"],
                      opset_version=17, dynamo=False)
    return path


def test_shared_weight_products_are_batched_into_one_weight_copy(tmp_path):
    """fuse.py: pnnx would write one copy of W_ih per time step (12 x 512 KiB in fp16); batched,
    the artifact carries one, and still matches onnxruntime on fresh inputs."""
    model = unrolled_lstm(tmp_path / "unrolled.onnx")
    proc = run_edgepack("build", str(model), "--target", "x86_64", "--backend", "ncnn", "--out",
                        str(tmp_path / "dist"), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout)["results"][0]
    assert r["ok"], r
    manifest = json.loads((tmp_path / "dist" / "unrolled-x86_64.json").read_text())
    assert "batch_shared_products x22" in manifest["backend"]["onnx_rewrites"]  # 11 input + 11 head products
    # weights: W_ih once (512 KiB) + W_hh per step (12 x 128 KiB, a recurrence: not batched) ~ 2 MB;
    # unbatched W_ih alone would be 6 MB
    assert r["size"] - r["runtime_bytes"] < 3_000_000, r
    feeds = {"x": np.random.default_rng(7).standard_normal((1, 12, 512)).astype(np.float32)}
    _check_against_ort(tmp_path / "dist" / "unrolled-x86_64", "x86_64", model, feeds, tmp_path, rtol=2e-2)
