"""The real pnnx on tanh GELUs: it fuses torch's form into ncnn's erf GELU (a different function) and
leaves jax2tf's form as nine layers; after tanh_gelu.py both become GELU with fast_gelu=1. Built for
real and checked against onnxruntime on every x86 CPU model the artifact may meet."""
from __future__ import annotations

import json
import subprocess

import numpy as np
import onnx

from gelu_forms import jax2tf_form, torch_form
from test_ncnn_thread_split import assert_matches_onnxruntime_on_every_cpu, build_fp32_ncnn


def _pnnx_layers(model: onnx.ModelProto, folder) -> list[list[str]]:
    from edgepack.backends.ncnn.convert import pnnx_executable
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, folder / "model.onnx")
    subprocess.run([str(pnnx_executable()), "model.onnx", "inputshape=[1,16,24]"], cwd=folder,
                   capture_output=True, timeout=300, check=True)
    return [ln.split() for ln in (folder / "model.ncnn.param").read_text().splitlines()[2:]]


def test_pnnx_gets_both_forms_wrong_and_the_gelu_op_right(tmp_path):
    torch_gelus = [ln for ln in _pnnx_layers(torch_form(), tmp_path / "torch") if ln[0] == "GELU"]
    assert torch_gelus and "0=1" not in torch_gelus[0], \
        "pnnx now keeps torch's tanh GELU a tanh GELU: tanh_gelu.py may be unneeded for that form"
    assert "GELU" not in [ln[0] for ln in _pnnx_layers(jax2tf_form(), tmp_path / "jax")], \
        "pnnx now fuses jax2tf's tanh GELU: tanh_gelu.py may be unneeded for that form"
    from edgepack.backends.ncnn.tanh_gelu import tanh_gelus_as_gelu
    for name, make in (("torch_r", torch_form), ("jax_r", jax2tf_form)):
        gelus = [ln for ln in _pnnx_layers(tanh_gelus_as_gelu(make())[0], tmp_path / name) if ln[0] == "GELU"]
        assert len(gelus) == 1 and "0=1" in gelus[0], (name, gelus)


def test_jax2tf_tanh_gelu_runs_as_one_fast_gelu_layer_on_every_cpu(tmp_path):
    onnx.save(jax2tf_form(), tmp_path / "gelu.onnx")  # fp32: only ncnn's tanh and order of sums differ
    art = build_fp32_ncnn(tmp_path / "gelu.onnx", tmp_path / "out")
    backend = json.loads((tmp_path / "out" / "gelu-x86_64.json").read_text())["backend"]
    assert "tanh_gelus_as_gelu x1" in backend["onnx_rewrites"], backend["onnx_rewrites"]
    assert "GELU" in backend["layers"] and "TanH" not in backend["layers"], backend["layers"]
    x = np.random.default_rng(5).uniform(-5, 5, (1, 16, 24)).astype(np.float32)
    assert_matches_onnxruntime_on_every_cpu(tmp_path / "gelu.onnx", art, x, tmp_path)
