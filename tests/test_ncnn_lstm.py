"""ncnn's x86 LSTM as edgepack builds it (edgepack/backends/ncnn/lstm_patch.py: the input products of
every step are computed before the recurrence; W_hc and W_xc in fp16 under fp16 storage) gives onnxruntime's answer on every x86 CPU model the
artifact may meet: AVX-512 (native here), AVX2+FMA (Haswell) and SSE only (Nehalem) each run a
different copy of the patched code. The shapes reach every branch of the patch: an odd hidden size
(the 4-lane unit left over after the 8-lane pairs), a sequence of 7 (one block of 4 steps and a tail
of 3), both directions, and an input width that is not a multiple of 4. A CRNN-sized LSTM shows the load's
memory: its weights are packed straight into fp16 (lstm_patch.py version 4)."""
from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import onnxruntime as ort
import pytest

from clirun import host_cpu_flags
from conftest import run_edgepack
from test_memory import memory_trace
from edgepack.runner import command_for_cpu

CPUS = ["native", "Haswell-noTSX", "Nehalem"]
T, K, H = 7, 19, 37


@pytest.fixture(scope="module")
def lstm_model(tmp_path_factory):
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = torch.nn.LSTM(K, H, batch_first=True, bidirectional=True)
            self.head = torch.nn.Linear(2 * H, 5)

        def forward(self, x):
            y, _ = self.lstm(x)
            return self.head(y)

    torch.manual_seed(3)
    net = Net().eval()
    with torch.no_grad():  # weights large enough that every gate saturates somewhere
        for p in net.lstm.parameters():
            p.mul_(3.0)
    path = tmp_path_factory.mktemp("lstm") / "bilstm.onnx"
    torch.onnx.export(net, (torch.randn(1, T, K),), str(path), input_names=["x"], output_names=["y"],
                      opset_version=17, dynamo=False)
    return path


def _build(model, out, *precision):
    proc = run_edgepack("build", str(model), "--target", "x86_64", "--backend", "ncnn", *precision,
                        "--out", str(out), "--json")
    report = json.loads(proc.stdout) if proc.stdout.strip() else {}
    assert proc.returncode == 0 and report.get("ok"), proc.stderr[-3000:]
    backend = json.loads((out / f"{model.stem}-x86_64.json").read_text())["backend"]
    assert "LSTM" in backend["layers"], backend  # ncnn's own LSTM layer runs it
    return out / f"{model.stem}-x86_64", backend


def _run(art, cpu, x_path, out, ncnn_options=""):
    run = subprocess.run(command_for_cpu(art, cpu) + ["run", "--input", f"x={x_path}", "--output", str(out)],
                         capture_output=True, text=True, timeout=900,
                         env={**os.environ, "EDGEPACK_NCNN_OPTIONS": ncnn_options})
    assert run.returncode == 0, f"{cpu}: {run.stderr}"
    return np.load(json.loads(run.stdout)["outputs"]["y"]["file"])


def test_patched_lstm_matches_onnxruntime_on_every_x86_cpu(lstm_model, tmp_path):
    x = np.random.default_rng(5).standard_normal((1, T, K)).astype(np.float32) * 2
    np.save(tmp_path / "x.npy", x)
    want = ort.InferenceSession(str(lstm_model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    scale = max(1.0, float(np.abs(want).max()))
    fp32, backend = _build(lstm_model, tmp_path / "fp32", "--fp32")
    assert backend["precision"] == "fp32"
    exact = {}
    for cpu in CPUS:
        exact[cpu] = _run(fp32, cpu, tmp_path / "x.npy", tmp_path / f"fp32-{cpu}")
        # fp32 throughout: only the order of additions differs from onnxruntime's
        err = float(np.abs(exact[cpu] - want).max())
        assert err <= 1e-4 * scale, (cpu, err)

    # fp16 storage keeps W_hc and W_xc in fp16 where the LSTM code that runs has F16C: the AVX-512 build of the
    # layer (native here) and the AVX build's hand-over to lstm_fma (Haswell); Nehalem has neither. The
    # fp32 artifact's weights are exact fp32, so switching fp16 storage on at run time shows where the
    # fp16 copy is used (an fp16-storage build stores fp16-rounded weights: the copy would be exact).
    for cpu in CPUS:
        got = _run(fp32, cpu, tmp_path / "x.npy", tmp_path / f"fp16-{cpu}", "fp16=1")
        moved = float(np.abs(got - exact[cpu]).max())
        if cpu == "Nehalem":
            assert moved == 0.0, (cpu, moved)
        else:
            assert 1e-7 * scale < moved <= 2e-3 * scale, (cpu, moved)
            assert float(np.abs(got - want).max()) <= 2e-3 * scale, cpu

    # the default build (fp16 allowed) keeps fp16 storage and agrees with onnxruntime everywhere
    fp16, backend = _build(lstm_model, tmp_path / "fp16")
    assert backend["precision"] == "fp16-storage", backend
    for cpu in CPUS:
        got = _run(fp16, cpu, tmp_path / "x.npy", tmp_path / f"default-{cpu}")
        assert float(np.abs(got - want).max()) <= 2e-3 * scale, cpu


def test_loading_packs_the_lstm_weights_straight_into_fp16(tmp_path):
    """ddddocr_crnn-like: 2 directions x 4 gates x 384 units over 384 inputs, W and R 9.4 MB in fp32. At the fp16
    rung the load now holds the fp32 weights the loader widened while it packs them, a row at a time, into fp16,
    and then lets them go: VmHWM at load stands about their size over what stays. Version 3 also held their
    whole fp32 packed copy and part of the fp16 one: 1.75 times their size."""
    import torch
    size = 384

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = torch.nn.LSTM(size, size, batch_first=True, bidirectional=True)

        def forward(self, x):
            return self.lstm(x)[0]

    torch.manual_seed(11)
    net = Net().eval()
    with torch.no_grad():  # fp16 values, as an fp16-storage build stores them
        for p in net.parameters():
            p.copy_(p.half().float())
    model = tmp_path / "crnn_lstm.onnx"
    torch.onnx.export(net, (torch.randn(1, 20, size),), str(model), input_names=["x"], output_names=["y"],
                      opset_version=17, dynamo=False)
    art, backend = _build(model, tmp_path / "out")
    assert backend["precision"] == "fp16-storage", backend
    fp32_weights = 2 * 2 * 4 * size * size * 4  # W and R, both directions, fp32
    rss, hwm = memory_trace(str(art))["loaded"]
    assert rss > fp32_weights / 2, (rss, hwm)  # the fp16 packed weights are resident
    if not {"f16c", "fma"} <= host_cpu_flags():
        return  # fp32 packed weights: ncnn's own load
    assert hwm - rss < 1.25 * fp32_weights, (rss, hwm, fp32_weights)


def test_lstm_patch_is_in_the_x86_library_only(monkeypatch):
    from edgepack.backends.ncnn import library
    from edgepack.backends.ncnn.lstm_patch import LSTM_FILE
    from edgepack.targets import TargetMatrix
    from edgepack.toolchains import Toolchain
    matrix, tc = TargetMatrix.load(), Toolchain.load()
    lib = library.build_library(matrix.get("x86_64"), tc)
    assert "ep_lstm_input_gates(bottom_blob, weight_xc" in (lib.root / "src" / LSTM_FILE).read_text()
    # the arm64 library does not compile that file: its cache key does not change with the patch
    arm_key, _ = library.library_key(matrix.get("arm64"), tc)
    monkeypatch.setattr(library, "LSTM_PATCH_KEY", library.LSTM_PATCH_KEY + "-changed")
    assert library.library_key(matrix.get("arm64"), tc)[0] == arm_key
    assert library.library_key(matrix.get("x86_64"), tc)[0] != lib.key
