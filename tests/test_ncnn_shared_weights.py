"""x86 InnerProduct layers with the same weights share one kernel (edgepack/backends/ncnn/shared_weights_patch.py).

An unrolled recurrence: 12 one-row steps h = tanh(h W_k), alternating two 4 MiB weights that differ
in one element only, so sharing by content must tell them apart (a wrong share changes the answer).
pnnx writes one InnerProduct per step with its own copy; shared, the fp32 artifact's peak RSS holds
two kernels, not twelve. Checked against onnxruntime on every x86 CPU model the artifact may meet."""
from __future__ import annotations

import json
import os
import resource
import subprocess

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from test_ncnn_thread_split import CPUS, _run, build_fp32_ncnn
from conftest import run_edgepack
from edgepack.runner import command_for, command_for_cpu

N, STEPS = 1024, 12
# under qemu-user (its own memory counts): shared 82 MiB, twelve distinct weights 117 MiB (measured)
PEAK_ARM_MIB = 100


def _recurrence(path, n=N, steps=STEPS):
    rng = np.random.default_rng(8)
    w = (rng.standard_normal((n, n)) / np.sqrt(n) * 1.5).astype(np.float32)
    w_other = w.copy()
    w_other[n // 2, 7] += 0.5  # one element apart
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(w_other, "w_other")]
    nodes, prev = [], "x"
    for t in range(steps):
        nodes += [helper.make_node("MatMul", [prev, "w" if t % 2 == 0 else "w_other"], [f"m{t}"]),
                  helper.make_node("Tanh", [f"m{t}"], [f"h{t}" if t < steps - 1 else "y"])]
        prev = f"h{t}"
    graph = helper.make_graph(nodes, "recurrence", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _assert_weights_stored_once(manifest, art):
    """pnnx wrote the weight once per step (48 MiB); the artifact embeds its content once
    (edgepack/backends/ncnn/dedup.py): `w_other` is `w` but for one chunk around its changed element."""
    kernel = N * N * 4
    dedup = manifest["backend"]["weights_dedup"]
    assert dedup and dedup["logical_bytes"] >= STEPS * kernel, dedup
    assert dedup["stored_bytes"] < 1.1 * kernel, dedup
    embedded = manifest["artifact"]  # what the file holds: stored weights and map, and the runtime
    assert dedup["stored_bytes"] < embedded["weight_bytes"] < dedup["stored_bytes"] + 4096 < embedded["size"], embedded
    assert art.stat().st_size < 3 * kernel, f"artifact {art.stat().st_size} bytes: weights embedded more than once"


def test_steps_with_the_same_weights_share_one_kernel(tmp_path):
    model = _recurrence(tmp_path / "recurrence.onnx")
    art = build_fp32_ncnn(model, tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "recurrence-x86_64.json").read_text())
    assert "InnerProduct" in manifest["backend"]["layers"]
    assert any(r.startswith("gemv_as_gemm") for r in manifest["backend"]["onnx_rewrites"])
    _assert_weights_stored_once(manifest, art)
    x = np.random.default_rng(2).standard_normal((1, N)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    # the two weights really are told apart: every step on `w` alone gives another answer
    alone = x
    w = numpy_helper.to_array(onnx.load(model).graph.initializer[0])
    for _ in range(STEPS):
        alone = np.tanh(alone @ w)
    assert float(np.abs(alone - want).max()) > 1e-3
    for cpu in CPUS:
        got = _run(art, cpu, 1, tmp_path / "x.npy", tmp_path / f"o-{cpu}")
        assert float(np.abs(got.reshape(want.shape) - want).max()) <= 1e-4, cpu
    bench = subprocess.run(command_for_cpu(art, "native") + ["bench", "--runs", "3", "--json"],
                           capture_output=True, text=True, timeout=300)
    assert bench.returncode == 0, bench.stderr
    peak_mib = json.loads(bench.stdout.strip().splitlines()[-1])["peak_rss_kb"] / 1024
    kernel_mib = N * N * 4 / 2**20
    # measured: shared 21.5 MiB (2 kernels, a step's load, the executable); twelve distinct weights 55.5 MiB
    assert peak_mib < 8 * kernel_mib, f"peak RSS {peak_mib:.1f} MiB: the steps did not share their kernels"
    # loading reuses each step's freed 4 MiB buffer (load_reuse_patch.py): measured 3140 page faults,
    # 12.3 MiB, for the whole `run`; twelve fresh buffers alone would fault 48 MiB in
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt
    done = subprocess.run(command_for_cpu(art, "native") + ["run", "--input", f"x={tmp_path / 'x.npy'}", "--output",
                                                            str(tmp_path / "o-faults")], capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    faulted_mib = (resource.getrusage(resource.RUSAGE_CHILDREN).ru_minflt - before) * os.sysconf("SC_PAGE_SIZE") / 2**20
    assert faulted_mib < 4 * kernel_mib, f"{faulted_mib:.1f} MiB faulted in: the load did not reuse its buffers"


def test_arm64_steps_share_and_match_onnxruntime(tmp_path):
    # Arm shares its fp32 kernels the same way (checked under qemu; its speed cannot be timed here)
    model = _recurrence(tmp_path / "recurrence.onnx")
    proc = run_edgepack("build", str(model), "--target", "arm64", "--backend", "ncnn", "--fp32",
                        "--out", str(tmp_path / "out"), "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    art = tmp_path / "out" / "recurrence-arm64"
    _assert_weights_stored_once(json.loads((tmp_path / "out" / "recurrence-arm64.json").read_text()), art)
    x = np.random.default_rng(4).standard_normal((1, N)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    run = subprocess.run(command_for(art, None) + ["run", "--input", f"x={tmp_path / 'x.npy'}", "--output",
                                                   str(tmp_path / "o")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    got = np.load(json.loads(run.stdout)["outputs"]["y"]["file"])
    assert float(np.abs(got.reshape(want.shape) - want).max()) <= 1e-4
    bench = subprocess.run(command_for(art, None) + ["bench", "--runs", "2", "--warmup", "1", "--json"],
                           capture_output=True, text=True, timeout=600)
    assert bench.returncode == 0, bench.stderr
    peak_mib = json.loads(bench.stdout.strip().splitlines()[-1])["peak_rss_kb"] / 1024
    assert peak_mib < PEAK_ARM_MIB, f"peak RSS {peak_mib:.1f} MiB under qemu: the steps did not share their kernels"


def test_unpacked_fp16_kernels_are_not_shared_and_the_artifact_exits_cleanly(tmp_path):
    # 250 outputs: not a multiple of the pack width, so ncnn's fp16 cast takes the net's blob
    # allocator; sharing such a kernel once crashed every run at exit (the pool was gone)
    model = _recurrence(tmp_path / "odd.onnx", n=250, steps=6)
    proc = run_edgepack("build", str(model), "--target", "x86_64", "--backend", "ncnn", "--out", str(tmp_path / "out"), "--json")
    report = json.loads(proc.stdout) if proc.stdout.strip() else {}
    assert proc.returncode == 0 and report.get("ok"), proc.stderr[-3000:]
    assert report["results"][0]["precision"] == "fp16-storage", report["results"][0]
    art = tmp_path / "out" / "odd-x86_64"
    for args in (["selftest"], ["bench", "--runs", "2", "--json"]):
        done = subprocess.run(command_for_cpu(art, "native") + args, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (args, done.returncode, done.stderr[-2000:])
