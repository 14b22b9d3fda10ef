"""x86 artifacts flush denormals to zero (flush_denormals_patch.py): ncnn's default (Option.flush_denormals
= 3) was compiled out of the baseline x86-64 library, and a denormal in a multiply costs ~100 cycles
(PP-OCRv6 small's detector: 93 -> 22 ms). A model multiplies an input holding denormals (read as zero
under DAZ) and normal values small enough that their product is denormal (written as zero under FTZ):
the artifact's output is zero at both, on the calling thread and on simpleomp's worker (2 threads), on
AVX-512 natively, under an AVX2 cap and on qemu's Nehalem (SSE2); onnxruntime, which flushes nothing,
gives the denormals, within any verification bound of them."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from clirun import run_artifact_on
from test_ncnn_thread_split import build_fp32_ncnn

C, H, W = 64, 32, 32


def test_denormals_read_and_written_as_zero(tmp_path):
    # y = x * 1e-20: a product below 1.2e-38 (FTZ); z = x * 1e6: a denormal x read as zero (DAZ)
    f = TensorProto.FLOAT
    graph = helper.make_graph([helper.make_node("Mul", ["x", "s"], ["y"]), helper.make_node("Mul", ["x", "t"], ["z"])],
                              "denormals", [helper.make_tensor_value_info("x", f, [1, C, H, W])],
                              [helper.make_tensor_value_info("y", f, [1, C, H, W]), helper.make_tensor_value_info("z", f, [1, C, H, W])],
                              [numpy_helper.from_array(np.full((1, C, 1, 1), 1e-20, np.float32), "s"),
                               numpy_helper.from_array(np.full((1, C, 1, 1), 1e6, np.float32), "t")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = tmp_path / "denormals.onnx"
    onnx.save(model, path)
    art = build_fp32_ncnn(path, tmp_path / "out")

    rng = np.random.default_rng(2)
    x = (rng.standard_normal((1, C, H, W)) * 1e3).astype(np.float32)
    denormal = rng.random((1, C, H, W)) < 0.25           # x itself denormal
    tiny = ~denormal & (rng.random((1, C, H, W)) < 0.33)  # x * 1e-20 below 1.2e-38
    x[denormal] = np.float32(1e-39)
    x[tiny] = np.float32(2e-19)
    np.save(tmp_path / "x.npy", x)
    want_y, want_z = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert np.all(want_y[tiny] != 0) and np.all(want_z[denormal] != 0)   # onnxruntime keeps them
    for cpu in ("native", "native isa=avx2", "Nehalem"):
        for threads in (1, 2):
            got = run_artifact_on(art, cpu, {"x": tmp_path / "x.npy"}, tmp_path / f"{cpu}-{threads}".replace(" ", "_"),
                                  ("y", "z"), threads)[0]
            y, z = got["y"].reshape(want_y.shape), got["z"].reshape(want_z.shape)
            assert np.all(y[tiny] == 0) and np.all(z[denormal] == 0), (cpu, threads)
            np.testing.assert_array_equal(z[~denormal], want_z[~denormal], err_msg=f"{cpu} {threads}")
            np.testing.assert_array_equal(y[~tiny & ~denormal], want_y[~tiny & ~denormal], err_msg=f"{cpu} {threads}")
