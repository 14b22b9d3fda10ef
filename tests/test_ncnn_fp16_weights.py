"""x86 InnerProduct layers, and Gemm layers with a large constant B, pack fp16 weights without widening
them whole (edgepack/backends/ncnn/fp16_weights_patch.py): the same answers on every x86 CPU model, and a
lower load-time peak.

Four fully connected heads, each a different way through the patch: 8210 outputs (packing 1 on every
ISA: the loaded fp16 weights are the kernel), 4000 (packs of 16 on AVX-512, 8 on AVX2: chunks of 256
rows and a tail of 16-row chunks), 1000 (packs of 8: 120-row chunks, a tail of 8s) and 1004 (packs of
4: 60-row chunks, a tail of 4s). A row packed into the wrong place moves its output by the whole
signal; the bound below is a few fp16 steps. Nehalem has no F16C: there the weights are widened whole
and run in fp32."""
from __future__ import annotations

import json
import subprocess

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from conftest import run_edgepack
from edgepack.runner import command_for_cpu
from test_ncnn_thread_split import CPUS, _run

K = 512
HEADS = (8210, 4000, 1000, 1004)


def _heads_model(path):
    rng = np.random.default_rng(11)
    inits, nodes, outs, weights = [], [], [], []
    for i, n in enumerate(HEADS):
        w = (rng.standard_normal((K, n)) / np.sqrt(K)).astype(np.float32)
        b = rng.standard_normal(n).astype(np.float32) * 0.1
        weights.append((w, b))
        if i % 2 == 0:   # MatMul + Add
            inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
            nodes += [helper.make_node("MatMul", ["x", f"w{i}"], [f"m{i}"]),
                      helper.make_node("Add", [f"m{i}", f"b{i}"], [f"h{i}"])]
        else:            # Gemm with a transposed weight (nn.Linear as torch exports it)
            inits += [numpy_helper.from_array(np.ascontiguousarray(w.T), f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
            nodes.append(helper.make_node("Gemm", ["x", f"w{i}", f"b{i}"], [f"h{i}"], transB=1))
        outs.append(f"h{i}")
    nodes.append(helper.make_node("Concat", outs, ["y"], axis=1))
    graph = helper.make_graph(nodes, "heads", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, sum(HEADS)])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return path, weights


def _build_fp16(model, out, layer):
    """The fp16-storage x86_64 NCNN artifact of `model`, which must hold a `layer` layer."""
    proc = run_edgepack("build", str(model), "--target", "x86_64", "--backend", "ncnn", "--out", str(out), "--json")
    report = json.loads(proc.stdout) if proc.stdout.strip() else {}
    assert proc.returncode == 0 and report.get("ok"), proc.stderr[-3000:]
    assert report["results"][0]["precision"] == "fp16-storage", report["results"][0]
    layers = json.loads((out / f"{model.stem}-x86_64.json").read_text())["backend"]["layers"]
    assert layer in layers, layers
    return out / f"{model.stem}-x86_64"


def test_fp16_weights_packed_in_chunks_match_on_every_x86_cpu(tmp_path):
    model, weights = _heads_model(tmp_path / "heads.onnx")
    art = _build_fp16(model, tmp_path / "out", "InnerProduct")

    x = np.random.default_rng(3).standard_normal((1, K)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    # what fp16 storage computes: fp16 input and weights, products summed in fp32
    x16 = x.astype(np.float16).astype(np.float64)
    want = np.concatenate([x16 @ w.astype(np.float16).astype(np.float64) + b for w, b in weights], axis=1)
    scale = float(np.abs(want).max())
    for cpu in CPUS:
        got = _run(art, cpu, 1, tmp_path / "x.npy", tmp_path / f"o-{cpu}").reshape(want.shape)
        err = np.abs(got - want)
        start = 0
        for n in HEADS:  # each head on its own, so a failure names the packing that broke
            head_err = float(err[0, start:start + n].max())
            assert head_err <= 4e-3 * scale, (cpu, n, head_err, scale)
            start += n

    bench = subprocess.run(command_for_cpu(art, "native") + ["bench", "--runs", "2", "--json"],
                           capture_output=True, text=True, timeout=300)
    assert bench.returncode == 0, bench.stderr
    peak_mib = json.loads(bench.stdout.strip().splitlines()[-1])["peak_rss_kb"] / 1024
    fp16_mib = K * sum(HEADS) * 2 / 2**20
    # widened whole, the 8210-output head held its fp16 read (8.0 MiB), its fp32 copy (16.0 MiB) and its
    # packed kernel at once: 37.1 MiB peak (measured, libncnn before the patch); now 23.4 MiB
    assert peak_mib < fp16_mib + 12, f"peak RSS {peak_mib:.1f} MiB for {fp16_mib:.1f} MiB of fp16 weights"


T, GEMM_HEADS = 20, (8210, 3000)


def _sequence_model(path):
    """A sequence of 20 rows through two classifiers (ddddocr's CRNN ends in a 20 x 1024 @ 1024 x 8210
    one): pnnx writes each as a Gemm with a constant, transposed B, which ncnn's x86 Gemm packs in fp32."""
    rng = np.random.default_rng(5)
    w0 = (rng.standard_normal((K, GEMM_HEADS[0])) / np.sqrt(K)).astype(np.float32)
    w1 = (rng.standard_normal((GEMM_HEADS[1], K)) / np.sqrt(K)).astype(np.float32)
    b1 = rng.standard_normal(GEMM_HEADS[1]).astype(np.float32) * 0.1
    inits = [numpy_helper.from_array(w0, "w0"), numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1")]
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["y0"]),
             helper.make_node("Gemm", ["x", "w1", "b1"], ["y1"], transB=1),
             helper.make_node("Concat", ["y0", "y1"], ["y"], axis=1)]
    graph = helper.make_graph(nodes, "seqgemm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [T, sum(GEMM_HEADS)])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return path, [(w0, np.zeros(GEMM_HEADS[0], np.float32)), (w1.T, b1)]


def test_gemm_with_a_large_constant_b_packs_it_from_fp16(tmp_path):
    model, weights = _sequence_model(tmp_path / "seqgemm.onnx")
    art = _build_fp16(model, tmp_path / "out", "Gemm")

    x = np.random.default_rng(6).standard_normal((T, K)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    # ncnn's x86 Gemm computes in fp32 from the fp16-stored weights
    want = np.concatenate([x.astype(np.float64) @ w.astype(np.float16).astype(np.float64) + b for w, b in weights], axis=1)
    scale = float(np.abs(want).max())
    for cpu in CPUS:
        got = _run(art, cpu, 2, tmp_path / "x.npy", tmp_path / f"o-{cpu}").reshape(want.shape)
        err = np.abs(got - want)
        assert float(err[:, :GEMM_HEADS[0]].max()) <= 4e-3 * scale, (cpu, "8210", float(err.max()), scale)
        assert float(err[:, GEMM_HEADS[0]:].max()) <= 4e-3 * scale, (cpu, "3000", float(err.max()), scale)

    bench = subprocess.run(command_for_cpu(art, "native") + ["bench", "--runs", "2", "--json"],
                           capture_output=True, text=True, timeout=300)
    assert bench.returncode == 0, bench.stderr
    peak_mib = json.loads(bench.stdout.strip().splitlines()[-1])["peak_rss_kb"] / 1024
    fp32_mib = K * sum(GEMM_HEADS) * 4 / 2**20  # what ncnn keeps after the load: B packed in fp32
    # B widened whole, the 8210-column Gemm held B in fp32 (16.0 MiB) beside its packed copy: measured
    # 40.1 MiB (21.9 + 18.2); packed from fp16 tile by tile, 32.2 MiB (21.9 + 10.3)
    assert peak_mib < fp32_mib + 14, f"peak RSS {peak_mib:.1f} MiB for {fp32_mib:.1f} MiB of packed weights"
