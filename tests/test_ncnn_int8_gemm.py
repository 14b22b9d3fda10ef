"""Dynamically quantised MatMuls (quantize_dynamic: DynamicQuantizeLinear + MatMulInteger) are summed as
integers on AVX2 CPUs (edgepack/backends/ncnn/int8_gemm_patch.py; vpdpwssd on VNNI CPUs, vpmaddwd on
the others) and give onnxruntime's answer.

The model has two heads on one M x 301 input, M = 20 (packed 4 rows a pack: A converted row by row, the
sums stored one float at a time), 21 (not packed: whole 8-column blocks stored as vectors row by row) or
48 (packed 8 rows a pack, 16 on AVX-512: A converted eight rows at once, vectorised, and whole 8 x 8
blocks summed and stored column by column, into half a 16-row pack on AVX-512): a
quantised MatMul to 1001 columns with uint8 weights (less their zero point: wider than int8) or int8
weights (zero point 0: they fit int8) and a bias (N not a multiple of 8: a part block),
and a float MatMul whose weights are integers but whose input is not, which the conversion marks
too (it marks every Gemm of constant B in a lowered graph) and which must fall back to fp32 sums. With
int8 weights its integers are small (they fit int8: byte quads on VNNI CPUs); with uint8 weights they span
400 (int16 pairs on VNNI CPUs, packed whole; AVX2 CPUs cannot keep them as bytes and leave the layer to
ncnn's fp32 Gemm).
On AVX2 CPUs (natively, capped with EDGEPACK_NCNN_OPTIONS=isa=avx2, and qemu's Haswell) the library says
both layers took integer sums — on VNNI CPUs byte quads (vpdpbusd): uint8 A (shifted into [0, 255], the
shift's share taken back through B's column sums) x int8 B where B fits int8, else int8 A x uint8 B (both
shifted; A's row sums take back B's share); int16 pairs on other AVX2 CPUs, B kept as bytes (each
8-column block shifted into [0, 255]) and widened back block by block —
and the second fell back; on SSE CPUs (capped with isa=sse, qemu's Nehalem)
neither is taken and ncnn's fp32 Gemm runs. The quantised head's outputs are the same bits on every CPU
and thread count: its integer sums are exact either way."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from clirun import host_cpu_flags, run_artifact_on
from models import quantised_graph
from test_ncnn_thread_split import build_fp32_ncnn
from edgepack.backends.ncnn.int8_gemm_patch import MARK_KEY, mark_integer_gemms

K, N, N2 = 301, 1001, 40  # K odd: a last pair padded with 0, and an odd pair count (the unrolled kernels' tail)


def _expected_mode(cpu: str, fits_int8: bool) -> str | None:
    """Which integer kernel the library should pick on `cpu` for a B whose values do or do not all fit
    int8 (they span 255 at most either way), None for ncnn's fp32 Gemm: on CPUs with AVX-512 VNNI (a cap
    to AVX2 removes it) or AVX-VNNI (a cap to AVX2 keeps it: Alder Lake's kind) vpdpbusd, uint8 A x int8
    B where B fits int8, else int8 A x uint8 B (B shifted); vpmaddwd (int16 pairs) on other AVX2 CPUs, of
    B kept as bytes."""
    flags = host_cpu_flags()
    if cpu == "Haswell-noTSX" or cpu in ("native", "native isa=avx2") and "avx2" in flags:
        isa = "AVX2"
        if cpu == "native" and "avx512_vnni" in flags:
            isa = "AVX-512 VNNI"
        elif cpu.startswith("native") and "avx_vnni" in flags:
            isa = "AVX-VNNI"
        if isa == "AVX2":
            return "int16 pairs, B as bytes, AVX2"
        return f"{'uint8 x int8' if fits_int8 else 'int8 x uint8'}, {isa}"
    return None   # "native isa=sse", Nehalem


def _expected_wide_mode(cpu: str) -> str | None:
    """The same for integer weights spanning more than 255: int16 pairs on VNNI CPUs, ncnn's fp32 Gemm on
    the others (a block of bytes spans 255 at most)."""
    mode = _expected_mode(cpu, False)
    return "int16 pairs, " + mode.split(", ")[1] if mode and mode.startswith("int8 x uint8") else None


# (M, weights): uint8 weights less their zero point span more than int8 (int16 pairs); int8 weights
# (symmetric, zero point 0) fit int8 (uint8 x int8 quads on VNNI CPUs)
@pytest.fixture(scope="module", params=[(20, "uint8"), (21, "uint8"), (48, "uint8"), (21, "int8"), (48, "int8")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def int8_model(request, tmp_path_factory) -> tuple[Path, int, str]:
    from onnxruntime.quantization import QuantType
    M, weights = request.param
    rng = np.random.default_rng(11)
    tmp = tmp_path_factory.mktemp(f"int8gemm{M}{weights}")
    w = (rng.standard_normal((K, N)) * 0.2 + 0.05).astype(np.float32)   # off-centre: uint8 zero point not 128
    span = 3 if weights == "int8" else 200                              # integers, fed a float input
    w2 = rng.integers(-span, span + 1, (K, N2)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="quantised"),
             helper.make_node("Add", ["m", "b"], ["y"]),
             helper.make_node("Sigmoid", ["x"], ["s"]),
             helper.make_node("MatMul", ["s", "w2"], ["z"], name="float_integer_weights")]
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array((rng.standard_normal(N) * 0.1).astype(np.float32), "b"),
             numpy_helper.from_array(w2, "w2")]
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "int8gemm", [helper.make_tensor_value_info("x", f, [1, M, K])],
                              [helper.make_tensor_value_info("y", f, [1, M, N]),
                               helper.make_tensor_value_info("z", f, [1, M, N2])], inits)
    dst = quantised_graph(graph, tmp, "int8gemm", weight_type=QuantType.QUInt8 if weights == "uint8" else QuantType.QInt8,
                          nodes_to_exclude=["float_integer_weights"])
    ops = [n.op_type for n in onnx.load(dst).graph.node]
    assert ops.count("MatMulInteger") == 1 and ops.count("MatMul") == 1, ops
    return dst, M, weights


def _run(art: Path, cpu: str, x_path: Path, out: Path, threads: int = 1) -> tuple[dict, str]:
    return run_artifact_on(art, cpu, {"x": x_path}, out, ("y", "z"), threads, env={"EDGEPACK_NCNN_TRACE": "1"})


def test_marks_only_gemms_of_constant_b():
    text = ("7767517\n3 3\nInput in0 0 1 in0\n"
            "Gemm gemm_0 1 1 in0 a 5=1 8=1000 9=300 3=1\n"
            "Gemm gemm_1 2 1 a c b 5=0 3=1\n")
    marked, count = mark_integer_gemms(text)
    lines = marked.splitlines()
    assert count == 1
    assert lines[3].endswith(f" {MARK_KEY}=1") and f"{MARK_KEY}=" not in lines[4]
    assert mark_integer_gemms(marked) == (marked, 1)   # marking twice adds nothing


def test_quantised_matmul_runs_in_int8_and_matches_onnxruntime(int8_model, tmp_path):
    int8_model, M, weights = int8_model
    dist = tmp_path / "dist"
    art = build_fp32_ncnn(int8_model, dist)
    assert json.loads((dist / "int8gemm-x86_64.json").read_text())["backend"]["name"] == "ncnn"

    x = (np.random.default_rng(7).standard_normal((1, M, K)) * 2).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    want_y, want_z = ort.InferenceSession(str(int8_model), providers=["CPUExecutionProvider"]).run(None, {"x": x})

    runs = {}
    for cpu in ("native", "native isa=avx2", "native isa=sse", "Haswell-noTSX", "Nehalem"):
        got, log = _run(art, cpu, tmp_path / "x.npy", tmp_path / cpu.replace(" ", "-"))
        taken = [line for line in log.splitlines() if "edgepack int8 gemm:" in line and "taken" in line]
        fell_back = [line for line in log.splitlines() if "fp32 loop" in line]
        mode = _expected_mode(cpu, weights == "int8")
        mode2 = _expected_mode(cpu, True) if weights == "int8" else _expected_wide_mode(cpu)
        if mode:
            # both marked Gemms (their B are integers), where their B fit the CPU's form; the float-fed
            # one falls back, once per run
            assert len(taken) == 1 + bool(mode2), (cpu, log[-2000:])
            assert f"{N} x {K} taken ({mode})" in log, (cpu, mode, log[-2000:])
            if mode2:
                assert f"{N2} x {K} taken ({mode2})" in log, (cpu, log[-2000:])
            assert len(fell_back) == bool(mode2), (cpu, log[-2000:])
        else:
            assert not taken and not fell_back, (cpu, log[-2000:])
        runs[cpu] = got

    native = runs["native"]
    # the quantised head: exact integer sums, then the same scale and bias as onnxruntime
    y_scale = float(np.abs(want_y).max())
    assert y_scale > 1 and float(np.abs(native["y"].reshape(want_y.shape) - want_y).max()) <= 1e-6 * y_scale
    # the float-fed head: fp32 sums of a float input
    z_scale = float(np.abs(want_z).max())
    assert z_scale > 1 and float(np.abs(native["z"].reshape(want_z.shape) - want_z).max()) <= 1e-5 * z_scale
    for cpu, got in runs.items():
        np.testing.assert_array_equal(got["y"], native["y"], err_msg=cpu)   # integers: the same sums everywhere
        assert float(np.abs(got["z"] - native["z"]).max()) <= 1e-5 * z_scale, cpu
    two, _ = _run(art, "native", tmp_path / "x.npy", tmp_path / "native2", threads=2)
    np.testing.assert_array_equal(two["y"], native["y"])
    np.testing.assert_array_equal(two["z"], native["z"])


def test_quantised_lstm_projects_its_input_in_int8(tmp_path):
    """quantize_dynamic's DynamicQuantizeLSTM (edgepack/quantized_lstm.py): X's projection sums centred
    integers and scales after, as onnxruntime does, so the int8 Gemm takes it (both directions); the
    artifact matches onnxruntime. Each dynamic quantisation is one engine layer (EpDynQuant), and the
    recurrent products take int8 quads on AVX-512 VNNI and AVX2 CPUs, the same bits as ncnn's gemv on
    SSE ones."""
    rng = np.random.default_rng(5)
    hidden, inp, seq = 32, 64, 20
    w = (rng.standard_normal((2, 4 * hidden, inp)) * 0.3).astype(np.float32)
    r = (rng.standard_normal((2, 4 * hidden, hidden)) * 0.3).astype(np.float32)
    # onnxruntime's AVX2 u8s8 GEMM adds adjacent K pairs in int16, which saturates (an MLAS trait the
    # lowering does not copy); zeros at odd K keep every pair exact
    w[:, :, 1::2] = 0
    r[:, :, 1::2] = 0
    f = TensorProto.FLOAT
    graph = helper.make_graph([helper.make_node("LSTM", ["x", "W", "R", "B"], ["y"], hidden_size=hidden,
                                                direction="bidirectional")], "qlstm",
                              [helper.make_tensor_value_info("x", f, [seq, 1, inp])],
                              [helper.make_tensor_value_info("y", f, [seq, 2, 1, hidden])],
                              [numpy_helper.from_array(w, "W"), numpy_helper.from_array(r, "R"),
                               numpy_helper.from_array((rng.standard_normal((2, 8 * hidden)) * 0.1).astype(np.float32), "B")])
    dst = quantised_graph(graph, tmp_path, "qlstm", opset=14)
    assert "DynamicQuantizeLSTM" in [n.op_type for n in onnx.load(dst).graph.node]
    art = build_fp32_ncnn(dst, tmp_path / "dist")
    # X's quantisation and H's before each step but the first two (H = 0) run as one layer each
    # (dynamic_quant_fold.py)
    backend = json.loads((tmp_path / "dist" / "qlstm-x86_64.json").read_text())["backend"]
    assert backend["dynamic_quant_folds"] == 1 + 2 * (seq - 1), backend["dynamic_quant_folds"]
    x = rng.standard_normal((seq, 1, inp)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    want = ort.InferenceSession(str(dst), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got, log = run_artifact_on(art, "native", {"x": tmp_path / "x.npy"}, tmp_path / "out", ("y",), 1,
                               env={"EDGEPACK_NCNN_TRACE": "1"})
    mode = _expected_mode("native", True)
    if mode:
        assert log.count(f"{4 * hidden} x {inp} taken ({mode})") == 2, log[-2000:]
    err = float(np.abs(got["y"].reshape(want.shape) - want).max())
    assert err <= 1e-3 * float(np.abs(want).max()), err
    # the recurrent products (int8_gemv_patch.py): int8 quads on AVX-512 VNNI CPUs (vpdpbusd) and on
    # AVX2 ones (widened to int16, vpmaddwd), ncnn's fp16 gemv on SSE CPUs; exact integer sums each way,
    # so the same bits on every FMA CPU and thread count (an SSE CPU's gates round without FMA: close,
    # not equal)
    steps = 2 * (seq - 1)
    assert backend["integer_gemvs_marked"] == steps, backend["integer_gemvs_marked"]
    flags = host_cpu_flags()
    native_isa = "AVX-512 VNNI" if "avx512_vnni" in flags else "AVX2" if "avx2" in flags else None
    taken = f"int8 gemv: {4 * hidden} x {hidden} taken"
    assert log.count(taken) == (steps if native_isa else 0), log[-2000:]
    if native_isa:
        assert log.count(f"{taken} ({native_isa})") == steps, log[-2000:]
    for cpu, isa in (("native isa=avx2", "AVX2"), ("Haswell-noTSX", "AVX2"), ("Nehalem", None)):
        other, log = run_artifact_on(art, cpu, {"x": tmp_path / "x.npy"}, tmp_path / cpu.replace(" ", "_"), ("y",), 1,
                                     env={"EDGEPACK_NCNN_TRACE": "1"})
        assert log.count(taken) == (steps if isa else 0), (cpu, log[-2000:])
        if isa:
            assert log.count(f"{taken} ({isa})") == steps, (cpu, log[-2000:])
        if cpu == "Nehalem":
            assert float(np.abs(other["y"] - got["y"]).max()) <= 1e-5 * float(np.abs(want).max()), cpu
        else:
            np.testing.assert_array_equal(other["y"], got["y"], err_msg=cpu)
    two, _ = run_artifact_on(art, "native", {"x": tmp_path / "x.npy"}, tmp_path / "out2", ("y",), 2)
    np.testing.assert_array_equal(two["y"], got["y"])


def test_loading_an_int8_classifier_hands_its_weights_back_as_it_packs(tmp_path):
    """A CRNN-sized quantised classifier (20 x 1024 -> 4096, int8 weights) at the fp16 rung: its B arrives as
    4M fp16 integers (8 MiB). On VNNI CPUs the range pass checks every block before B is packed to byte
    quads, so packing hands B's rows back as it goes (int8_gemm_patch.py version 14): loading peaks with B
    resident, before its quads exist, and VmHWM at load stands about B less its quads (half of B) over what
    stays: 4.6 MB measured. Version 13 held B whole beside its quads until the end: all of B over (8.2 MB;
    ddddocr_old_int8 16.4 MB). Elsewhere a block may fail and the fp32 Gemm needs all of B."""
    from onnxruntime.quantization import QuantType
    from test_memory import memory_trace
    from test_ncnn_winograd_fp16 import build_x86_ncnn
    rows, k, n = 20, 1024, 4096
    rng = np.random.default_rng(3)
    f = TensorProto.FLOAT
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "classifier",
                              [helper.make_tensor_value_info("x", f, [1, rows, k])],
                              [helper.make_tensor_value_info("y", f, [1, rows, n])],
                              [numpy_helper.from_array((rng.standard_normal((k, n)) * 0.05).astype(np.float32), "w")])
    dst = quantised_graph(graph, tmp_path, "classifier", weight_type=QuantType.QInt8)
    res = build_x86_ncnn(dst, tmp_path / "dist")
    assert res["precision"] == "fp16-storage", res
    rss, hwm = memory_trace(res["file"])["loaded"]
    b = n * k * 2  # fp16
    assert rss > b / 2, (rss, hwm)  # the byte quads are resident
    if _expected_mode("native", True) and "VNNI" in _expected_mode("native", True):
        assert hwm - rss < 0.75 * b, (rss, hwm, b)
