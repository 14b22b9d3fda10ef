"""ncnn's x86 LSTM as edgepack builds it (edgepack/backends/ncnn/lstm_patch.py: the input products of
every step are computed before the recurrence) gives onnxruntime's answer on every x86 CPU model the
artifact may meet: AVX-512 (native here), AVX2+FMA (Haswell) and SSE only (Nehalem) each run a
different copy of the patched code. The shapes reach every branch of the patch: an odd hidden size
(the 4-lane unit left over after the 8-lane pairs), a sequence of 7 (one block of 4 steps and a tail
of 3), both directions, and an input width that is not a multiple of 4."""
from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import onnxruntime as ort
import pytest

from conftest import run_edgepack
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


def test_patched_lstm_matches_onnxruntime_on_every_x86_cpu(lstm_model, tmp_path):
    out = tmp_path / "dist"
    proc = run_edgepack("build", str(lstm_model), "--target", "x86_64", "--backend", "ncnn", "--fp32",
                        "--out", str(out), "--json")
    report = json.loads(proc.stdout) if proc.stdout.strip() else {}
    assert proc.returncode == 0 and report.get("ok"), proc.stderr[-3000:]
    assert report["results"][0]["backend"] == "ncnn"
    art = out / "bilstm-x86_64"
    backend = json.loads((out / "bilstm-x86_64.json").read_text())["backend"]
    assert "LSTM" in backend["layers"] and backend["precision"] == "fp32", backend  # ncnn's own LSTM layer runs it

    x = np.random.default_rng(5).standard_normal((1, T, K)).astype(np.float32) * 2
    np.save(tmp_path / "x.npy", x)
    want = ort.InferenceSession(str(lstm_model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for cpu in CPUS:
        run = subprocess.run(command_for_cpu(art, cpu) + ["run", "--input", f"x={tmp_path / 'x.npy'}",
                                                          "--output", str(tmp_path / cpu)],
                             capture_output=True, text=True, timeout=900, env=dict(os.environ))
        assert run.returncode == 0, f"{cpu}: {run.stderr}"
        got = np.load(json.loads(run.stdout)["outputs"]["y"]["file"])
        # fp32 throughout: only the order of additions differs from onnxruntime's
        err = float(np.abs(got - want).max())
        assert err <= 1e-4 * max(1.0, float(np.abs(want).max())), (cpu, err)


def test_lstm_patch_is_in_the_x86_library_only():
    from edgepack.backends.ncnn.library import build_library, library_key
    from edgepack.backends.ncnn.lstm_patch import LSTM_FILE
    from edgepack.targets import TargetMatrix
    from edgepack.toolchains import Toolchain
    matrix, tc = TargetMatrix.load(), Toolchain.load()
    lib = build_library(matrix.get("x86_64"), tc)
    assert "ep_lstm_input_gates(bottom_blob, weight_xc" in (lib.root / "src" / LSTM_FILE).read_text()
    # the arm64 library does not compile that file: its cache key does not change with the patch
    from edgepack.backends.ncnn import lstm_patch
    key_before, _ = library_key(matrix.get("arm64"), tc)
    old = lstm_patch.LSTM_PATCH_VERSION
    try:
        import edgepack.backends.ncnn.library as library
        library.LSTM_PATCH_VERSION = old + 1
        assert library_key(matrix.get("arm64"), tc)[0] == key_before
        assert library_key(matrix.get("x86_64"), tc)[0] != lib.key
    finally:
        library.LSTM_PATCH_VERSION = old
