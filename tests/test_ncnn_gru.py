"""GRUs on NCNN (edgepack/backends/ncnn/recurrent_forms.py): two stacked bidirectional GRUs as speechmos'
PLCMOS has them (the first one's output and final state both read, the second one's final state only),
fed a time-major [T, 1, K] input (pnnx drops its axis 1, the batch, not axis 0), build on ncnn's own GRU
layer and give onnxruntime's answer on fresh inputs; a GRU ncnn cannot compute
(linear_before_reset=0, TensorFlow's form) is reported as unsupported, so it goes to TVM."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from clirun import run_edgepack
from edgepack.backends.ncnn import NcnnBackend
from edgepack.backends.ncnn.recurrent_forms import flat_gru_initial_states
from edgepack.model import load_model
from edgepack.runner import run_artifact

T, K, H = 11, 12, 27  # 3H = 81 gate rows: two blocks of 64 in ep_gru_fma; gates 3 x 8 units + a tail of 3


@pytest.fixture(scope="module")
def stacked_gru(tmp_path_factory):
    import torch

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gru1 = torch.nn.GRU(K, H, bidirectional=True)
            self.gru2 = torch.nn.GRU(2 * H, H, bidirectional=True)
            self.head = torch.nn.Linear(2 * H, 3)

        def forward(self, x):            # x [T, 1, K], time-major: pnnx drops axis 1, the batch, on input
            y1, h1 = self.gru1(x)
            _, h2 = self.gru2(y1)
            h = torch.cat((h1, h2), 0)    # [4, 1, H]
            return self.head(torch.cat((h[-2], h[-1]), -1)) + self.head(torch.cat((h[0], h[1]), -1))

    torch.manual_seed(4)
    net = Net().eval()
    with torch.no_grad():  # weights large enough that the gates saturate somewhere
        for p in [*net.gru1.parameters(), *net.gru2.parameters()]:
            p.mul_(2.0)
    path = tmp_path_factory.mktemp("gru") / "grus.onnx"
    torch.onnx.export(net, (torch.randn(T, 1, K),), str(path), input_names=["x"], output_names=["y"],
                      opset_version=14, dynamo=False)
    return path


def test_stacked_grus_run_on_ncnns_gru_layer_and_match_onnxruntime(stacked_gru, tmp_path):
    out = tmp_path / "out"
    proc = run_edgepack("build", str(stacked_gru), "--target", "x86_64", "--backend", "ncnn", "--out", str(out), "--json")
    report = json.loads(proc.stdout) if proc.stdout.strip() else {}
    assert proc.returncode == 0 and report.get("ok"), proc.stderr[-3000:]
    manifest = json.loads((out / "grus-x86_64.json").read_text())
    assert "GRU" in manifest["backend"]["layers"], manifest["backend"]  # ncnn's own GRU layer runs them
    art = out / "grus-x86_64"
    sess = ort.InferenceSession(str(stacked_gru), providers=["CPUExecutionProvider"])
    tol = manifest["tolerance"]
    for seed in (1, 2, 3):
        x = np.random.default_rng(seed).standard_normal((T, 1, K)).astype(np.float32)
        want = sess.run(None, {"x": x})[0]
        np.save(tmp_path / "x.npy", x)
        run = run_artifact(art, ["run", "--input", f"x={tmp_path / 'x.npy'}", "--output", str(tmp_path / f"o{seed}")])
        assert run.returncode == 0, run.stderr
        got = np.load(json.loads(run.stdout)["outputs"]["y"]["file"]).reshape(want.shape)
        assert float(np.abs(got - want).max()) <= tol["atol"] + tol["rtol"] * float(np.abs(want).max()), seed


def _gru(linear_before_reset: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [helper.make_tensor(n, TensorProto.FLOAT, s, rng.standard_normal(s).astype(np.float32).ravel())
             for n, s in (("W", [1, 3 * H, K]), ("R", [1, 3 * H, H]), ("B", [1, 6 * H]))]
    node = helper.make_node("GRU", ["x", "W", "R", "B"], ["y"], name="gru0", hidden_size=H,
                            linear_before_reset=linear_before_reset)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, 1, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [T, 1, 1, H])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


def test_a_gru_of_tensorflows_form_is_not_given_to_ncnn(tmp_path):
    for lbr, expected in ((0, {"GRU": ["gru0"]}), (1, {})):
        path = tmp_path / f"gru{lbr}.onnx"
        onnx.save(_gru(lbr), path)
        assert NcnnBackend().unsupported_ops(load_model(path)) == expected


def test_a_constant_gru_state_is_written_flat_and_an_input_state_is_left_alone():
    # ncnn's GRU returns its final state in the shape of the state it was given: [dirs, H] as pnnx
    # sizes the layers after it, not the 3-D [dirs, 1, H] MemoryData pnnx writes
    param = "\n".join([
        "7767517", "5 6",
        "Input in0 0 1 in0",
        "MemoryData h0 0 1 13 0=32 1=1 2=2",
        "Split splitncnn_0 1 2 13 14 15",
        "GRU gru_0 2 2 in0 14 16 17 0=32 1=24576 2=2",
        "Input in1 0 1 in1",
        "GRU gru_1 2 1 16 in1 18 0=32 1=12288 2=2"]) + "\n"
    flat, changed = flat_gru_initial_states(param)
    assert changed == 1
    assert "MemoryData h0 0 1 13 0=32 1=2\n" in flat
    assert flat.replace("MemoryData h0 0 1 13 0=32 1=2", "MemoryData h0 0 1 13 0=32 1=1 2=2") == param


def test_fp32_grus_match_onnxruntime_on_every_x86_cpu(stacked_gru, tmp_path):
    # gru_patch.py runs the two directions one a thread: within 1e-4 of onnxruntime's scale on every CPU
    # model (1% of error would show a hundred times over), and the same bits on 1 and 2 threads
    from test_ncnn_thread_split import assert_matches_onnxruntime_on_every_cpu, build_fp32_ncnn
    art = build_fp32_ncnn(stacked_gru, tmp_path / "out")
    x = np.random.default_rng(7).standard_normal((T, 1, K)).astype(np.float32)
    assert_matches_onnxruntime_on_every_cpu(stacked_gru, art, x, tmp_path)


def test_gru_patch_is_in_the_x86_library_only(monkeypatch):
    from edgepack.backends.ncnn import library
    from edgepack.backends.ncnn.gru_patch import GRU_FILE
    from edgepack.targets import TargetMatrix
    from edgepack.toolchains import Toolchain
    matrix, tc = TargetMatrix.load(), Toolchain.load()
    lib = library.build_library(matrix.get("x86_64"), tc)
    text = (lib.root / "src" / GRU_FILE).read_text()
    assert text.count("ep_gru_both_directions(") == 2  # defined, and called for the forward direction
    assert "int ret = 0; // computed with the forward direction" in text
    # the Arm libraries run gru_arm.cpp: their cache key does not change with the patch
    arm_key, _ = library.library_key(matrix.get("arm64"), tc)
    monkeypatch.setattr(library, "GRU_PATCH_KEY", library.GRU_PATCH_KEY + "-changed")
    assert library.library_key(matrix.get("arm64"), tc)[0] == arm_key
    assert library.library_key(matrix.get("x86_64"), tc)[0] != lib.key


def test_one_direction_grus_match_onnxruntime_on_every_x86_cpu(tmp_path):
    # unidirectional GRUs take gru_patch.py's kernel through the one-direction forward (the other call
    # sites): two stacked, on every CPU model at 1e-4 of scale, 1 and 2 threads the same bits
    import torch

    from test_ncnn_thread_split import assert_matches_onnxruntime_on_every_cpu, build_fp32_ncnn

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gru1 = torch.nn.GRU(K, H)
            self.gru2 = torch.nn.GRU(H, H)

        def forward(self, x):            # x [T, 1, K]
            y1, _ = self.gru1(x)
            y2, _ = self.gru2(y1)
            return y2 + y1

    torch.manual_seed(5)
    net = Net().eval()
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(2.0)
    path = tmp_path / "gru1d.onnx"
    torch.onnx.export(net, (torch.randn(T, 1, K),), str(path), input_names=["x"], output_names=["y"],
                      opset_version=14, dynamo=False)
    art = build_fp32_ncnn(path, tmp_path / "out")
    assert "GRU" in json.loads((tmp_path / "out" / "gru1d-x86_64.json").read_text())["backend"]["layers"]
    x = np.random.default_rng(8).standard_normal((T, 1, K)).astype(np.float32)
    assert_matches_onnxruntime_on_every_cpu(path, art, x, tmp_path)
