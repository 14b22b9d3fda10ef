"""Graph partitioning (issue 9 item 4): plans on tiny onnx.helper graphs, checked by running
the segments in sequence with onnxruntime against the whole graph; and partitioned artifacts
(NCNN + TVM in one executable) built for x86_64 and arm64 (qemu) and run on fresh inputs."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgepack.model import load_model, simplify
from edgepack.partition import Plan, PlanError, plan

RNG_SEED = 9


def _save(model: onnx.ModelProto, path: Path) -> Path:
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _conv(name: str, x: str, y: str, cin: int, cout: int, rng) -> tuple[onnx.NodeProto, list]:
    w = numpy_helper.from_array((rng.standard_normal((cout, cin, 3, 3)) * 0.3).astype(np.float32), f"{name}_w")
    b = numpy_helper.from_array((rng.standard_normal(cout) * 0.1).astype(np.float32), f"{name}_b")
    return helper.make_node("Conv", [x, w.name, b.name], [y], name=name, pads=[1, 1, 1, 1]), [w, b]


def conv_topk_conv(path: Path, op: str = "TopK") -> Path:
    """Conv -> Relu -> (an op NCNN lacks) -> Conv: NCNN, then TVM, then NCNN."""
    rng = np.random.default_rng(RNG_SEED)
    c1, i1 = _conv("conv1", "x", "c1", 3, 8, rng)
    c2, i2 = _conv("conv2", "mid", "y", 8, 4, rng)
    nodes, inits = [c1, helper.make_node("Relu", ["c1"], ["r1"], name="relu1")], i1 + i2
    if op == "TopK":  # the 8 largest along W, sorted: 1x8x16x16 -> 1x8x16x8
        inits.append(numpy_helper.from_array(np.array([8], np.int64), "k"))
        nodes.append(helper.make_node("TopK", ["r1", "k"], ["mid", "idx"], name="topk", axis=3))
    elif op == "CumSum":
        inits.append(numpy_helper.from_array(np.array(3, np.int64), "axis"))
        nodes.append(helper.make_node("CumSum", ["r1", "axis"], ["mid"], name="cumsum"))
    else:
        raise ValueError(op)
    nodes.append(c2)
    w = 8 if op == "TopK" else 16
    g = helper.make_graph(nodes, "partition_test", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 16, w])], inits)
    return _save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)


def branches(path: Path) -> Path:
    """Two branches from one input, one with an op NCNN lacks, joined by Add; plus a second output."""
    rng = np.random.default_rng(RNG_SEED + 1)
    c1, i1 = _conv("conv1", "x", "c1", 3, 4, rng)
    c2, i2 = _conv("conv2", "x", "c2", 3, 4, rng)
    c3, i3 = _conv("conv3", "s", "y", 4, 4, rng)
    axis = numpy_helper.from_array(np.array(2, np.int64), "axis")
    nodes = [c1, c2, helper.make_node("CumSum", ["c1", "axis"], ["cs"], name="cumsum"),
             helper.make_node("Add", ["cs", "c2"], ["s"], name="add"), c3,
             helper.make_node("Sigmoid", ["c2"], ["side"], name="sig")]
    g = helper.make_graph(nodes, "branches", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8]),
                           helper.make_tensor_value_info("side", TensorProto.FLOAT, [1, 4, 8, 8])],
                          i1 + i2 + i3 + [axis])
    return _save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)


def where_int_mask(path: Path) -> Path:
    """Conv -> Greater (bool) -> Where -> Conv: the bool tensor must not cross into NCNN."""
    rng = np.random.default_rng(RNG_SEED + 2)
    c1, i1 = _conv("conv1", "x", "c1", 3, 4, rng)
    c2, i2 = _conv("conv2", "w", "y", 4, 4, rng)
    zero = numpy_helper.from_array(np.array(0.0, np.float32), "zero")
    nodes = [c1, helper.make_node("Greater", ["c1", "zero"], ["m"], name="gt"),
             helper.make_node("Neg", ["c1"], ["n"], name="neg"),
             helper.make_node("Where", ["m", "c1", "n"], ["w"], name="where"), c2]
    g = helper.make_graph(nodes, "where", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])], i1 + i2 + [zero])
    return _save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)


# ---- the plan, with onnxruntime ----------------------------------------------------------------

NCNN_LACKS = {"TopK", "CumSum", "Where", "Greater"}


def _support(tvm_lacks=frozenset()):
    return {"ncnn": lambda op: op not in NCNN_LACKS, "tvm": lambda op: op not in tvm_lacks}


def _ort(model: onnx.ModelProto, feeds: dict) -> dict:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, {i.name: feeds[i.name] for i in sess.get_inputs()})))


def _run_in_sequence(p: Plan, feeds: dict) -> dict:
    values = dict(feeds)
    for seg in p.segments:
        assert set(seg.inputs) <= set(values), f"segment reads {seg.inputs} before they exist"
        assert [i.name for i in seg.model.graph.input] == list(seg.inputs)
        values.update(_ort(seg.model, values))
    return values


def _check_plan_equals_whole(path: Path, support) -> Plan:
    model = simplify(load_model(path))
    p = plan(model, support)
    feeds = {s.name: np.random.default_rng(3).standard_normal(s.shape).astype(np.float32) for s in model.inputs}
    want = _ort(model.proto, feeds)
    got = _run_in_sequence(p, feeds)
    for name, ref in want.items():
        np.testing.assert_array_equal(got[name], ref)  # same kernels, same order: bit-identical
    return p


def test_plan_cuts_around_the_op_ncnn_lacks(tmp_path):
    p = _check_plan_equals_whole(conv_topk_conv(tmp_path / "m.onnx"), _support())
    assert p.backends == ("ncnn", "tvm", "ncnn")
    assert p.segments[1].ops == ("TopK",)
    assert p.segments[0].outputs == p.segments[1].inputs and p.segments[1].outputs == p.segments[2].inputs
    # initializers stay with their consumer
    assert {i.name for i in p.segments[0].model.graph.initializer} == {"conv1_w", "conv1_b"}
    assert {i.name for i in p.segments[2].model.graph.initializer} == {"conv2_w", "conv2_b"}


def test_plan_one_backend_is_one_segment(tmp_path):
    p = _check_plan_equals_whole(conv_topk_conv(tmp_path / "m.onnx"), {"ncnn": lambda op: True})
    assert p.backends == ("ncnn",) and not p.is_split


def test_plan_branches_and_two_outputs(tmp_path):
    p = _check_plan_equals_whole(branches(tmp_path / "b.onnx"), _support())
    # both convs of the input and the side output first (one NCNN segment), CumSum on TVM, then
    # Add + conv3 together on NCNN: three segments, not four
    assert p.backends == ("ncnn", "tvm", "ncnn"), p.describe()
    assert p.segments[0].ops == ("Conv", "Sigmoid") and p.segments[2].ops == ("Add", "Conv")
    assert set(p.segments[0].outputs) >= {"side"}


def test_plan_keeps_bool_tensors_inside_tvm(tmp_path):
    p = _check_plan_equals_whole(where_int_mask(tmp_path / "w.onnx"), _support())
    types = {v.name: v.type.tensor_type.elem_type for s in p.segments for v in list(s.model.graph.input)
             + list(s.model.graph.output)}
    for s in p.segments:
        if s.backend == "ncnn":
            assert all(types[t] == TensorProto.FLOAT for t in s.inputs + s.outputs)
    assert p.backends == ("ncnn", "tvm", "ncnn")


def test_plan_reverse_tvm_lacks_the_op(tmp_path):
    # the same graph with the roles swapped: TVM lacks Conv here, NCNN has it
    p = _check_plan_equals_whole(conv_topk_conv(tmp_path / "m.onnx", "CumSum"),
                                 {"tvm": lambda op: op != "Conv", "ncnn": lambda op: op not in NCNN_LACKS})
    assert p.backends == ("ncnn", "tvm", "ncnn")


def test_plan_refuses_an_op_no_backend_has(tmp_path):
    with pytest.raises(PlanError, match="TopK"):
        plan(simplify(load_model(conv_topk_conv(tmp_path / "m.onnx"))), {"ncnn": lambda op: op != "TopK"})


# ---- the runtime's segment sequencer (ep_engine_seq.c), with two small engines, under ASan ------

SEQ_HARNESS = r"""
#include "ep_engine_table.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
/* engine "add": out0 = in0 + 1; out1 = in0 * in1 when it has two inputs (all float32) */
typedef struct { const ep_model_spec *spec; int runs; } fake;
static int f_open(const ep_model_spec *spec, int threads, void **out, ep_status *st) {
    (void)threads; fake *f = calloc(1, sizeof *f); if (!f) return ep_fail(st, EP_ERR_NOMEM, "oom");
    f->spec = spec; *out = f; return EP_OK; }
static int f_run(void *h, const ep_tensor *in, ep_tensor *out, ep_status *st) {
    fake *f = h; size_t n = in[0].nbytes / 4; const float *a = in[0].data;
    if (out[0].nbytes != in[0].nbytes) return ep_fail(st, EP_ERR_MODEL, "size");
    for (size_t i = 0; i < n; i++) ((float *)out[0].data)[i] = a[i] + 1.0f;
    if (f->spec->n_inputs == 2)
        for (size_t i = 0; i < n; i++) ((float *)out[0].data)[i] = a[i] * ((const float *)in[1].data)[i];
    f->runs++; return EP_OK; }
static void f_close(void *h) { free(h); }
static const char *f_describe(void) { return "fake"; }
static const ep_engine_ops fake_a = {"a", f_open, f_run, f_close, f_describe};
static const ep_engine_ops fake_b = {"b", f_open, f_run, f_close, f_describe};
#define IO(n) {n, EP_F32, 2, {2, 3}}
static const ep_io_spec x[] = {IO("x")}, p[] = {IO("p")}, q[] = {IO("q")}, pq[] = {IO("p"), IO("q")}, y[] = {IO("y")};
#ifdef CONSTS
#define NOUT 4
static const ep_io_spec outs[] = {IO("y"), IO("p"), IO("y2"), IO("c")};
#else
#define NOUT 3
static const ep_io_spec outs[] = {IO("y"), IO("p"), IO("y2")};
#endif
static const ep_blob nog[] = {{0, 0}, {0, 0}};
#define SPEC(i, ni, o, no) {.model_name = "m", .target = "t", .backend = "fake", .n_inputs = ni, .inputs = i, \
                            .n_outputs = no, .outputs = o, .golden_inputs = nog, .golden_outputs = nog}
static const ep_model_spec s0 = SPEC(x, 1, p, 1), s1 = SPEC(p, 1, q, 1), s2 = SPEC(pq, 2, y, 1);
const ep_model_spec ep_spec = SPEC(x, 1, outs, NOUT);
/* x(0) -a-> p(1) -b-> q(2); a(p, q) -> y(3); outputs y, p, y again */
static const int i0[] = {0}, o0[] = {1}, i1[] = {1}, o1[] = {2}, o2[] = {3};
#ifdef DAMAGED
static const int I2[] = {1, 3}; /* q read from y's slot, before anything wrote it */
#else
static const int I2[] = {1, 2};
#endif
static const ep_segment segs[] = {{&fake_a, &s0, i0, o0}, {&fake_b, &s1, i1, o1}, {&fake_a, &s2, I2, o2}};
#ifdef CONSTS
/* output c: a constant in slot 4, filled at open (a wrong byte count is refused) */
static const ep_io_spec slots[] = {IO("x"), IO("p"), IO("q"), IO("y"), IO("c")};
static const int out_slots[] = {3, 1, 3, 4}, const_slots[] = {4};
static const float cvals[6] = {7, 8, 9, 10, 11, 12};
#ifdef CONSTS_DAMAGED
static const uint64_t cvals_size = 20;
#else
static const uint64_t cvals_size = sizeof cvals;
#endif
static const ep_blob const_data[] = {{(const unsigned char *)cvals, &cvals_size}};
const ep_segment_table ep_segments = {.n_slots = 5, .slots = slots, .n_segments = 3, .segments = segs,
                                      .output_slots = out_slots, .n_consts = 1, .const_slots = const_slots,
                                      .const_data = const_data};
#else
static const ep_io_spec slots[] = {IO("x"), IO("p"), IO("q"), IO("y")};
static const int out_slots[] = {3, 1, 3};
const ep_segment_table ep_segments = {4, slots, 3, segs, out_slots};
#endif
int main(void) {
    ep_status st = {0}; ep_engine *e = NULL;
    int rc = ep_engine_open(&ep_spec, 1, &e, &st);
    if (rc) { printf("open failed: %s\n", st.message); return rc; }
    printf("describe: %s\n", ep_engine_describe());
    ep_tensor in[1], out[NOUT]; int64_t shape[2] = {2, 3};
    ep_tensor_alloc(&in[0], EP_F32, 2, shape, &st);
    for (int run = 0; run < 3; run++) {
        for (int i = 0; i < 6; i++) ((float *)in[0].data)[i] = (float)(i + run);
        if (ep_alloc_outputs(&ep_spec, out, &st)) return 9;
        if ((rc = ep_engine_run(e, in, out, &st))) { printf("run failed: %s\n", st.message); return rc; }
        for (int k = 0; k < NOUT; k++) {
            printf("out%d:", k);
            for (int i = 0; i < 6; i++) printf(" %g", ((float *)out[k].data)[i]);
            printf("\n");
            ep_tensor_free(&out[k]);
        }
    }
    ep_tensor_free(&in[0]);
    ep_engine_close(e);
    return 0;
}
"""


def _seq_harness(tmp_path: Path, *defines: str) -> subprocess.CompletedProcess:
    import shutil
    from edgepack.resources import runtimes_dir
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "a host C compiler is needed (apt-get install gcc)"
    common = runtimes_dir() / "common"
    src, exe = tmp_path / "seq_harness.c", tmp_path / "seq_harness"
    src.write_text(SEQ_HARNESS)
    subprocess.run([cc, "-std=c11", "-O1", "-g", "-Wall", "-Werror", "-fsanitize=address,undefined",
                    "-fno-sanitize-recover=all", *defines, f"-I{common}", str(src), str(common / "ep_engine_seq.c"),
                    str(common / "ep_util.c"), "-lm", "-o", str(exe)], check=True)
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)


def test_seq_engine_passes_tensors_by_slot(tmp_path):
    proc = _seq_harness(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "describe: a -> b -> a"
    for run in range(3):
        x = np.arange(6, dtype=np.float32) + run
        p, q = x + 1, x + 2
        want = [p * q, p, p * q]
        for k in range(3):
            got = np.array([float(v) for v in lines[1 + run * 3 + k].split(":")[1].split()])
            np.testing.assert_array_equal(got, want[k])
    assert "AddressSanitizer" not in proc.stderr and "runtime error" not in proc.stderr


def test_seq_engine_returns_constant_slots(tmp_path):
    proc = _seq_harness(tmp_path, "-DCONSTS")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("out3:")]
    assert lines == ["out3: 7 8 9 10 11 12"] * 3, proc.stdout  # every run, the callers' tensors filled
    assert "AddressSanitizer" not in proc.stderr and "runtime error" not in proc.stderr
    bad = _seq_harness(tmp_path, "-DCONSTS", "-DCONSTS_DAMAGED")
    assert bad.returncode == 4, bad.stdout + bad.stderr  # EP_ERR_MODEL
    assert "open failed: segment table: constant 0 holds 20 bytes for a 24-byte slot" in bad.stdout


def test_seq_engine_refuses_a_damaged_table(tmp_path):
    proc = _seq_harness(tmp_path, "-DDAMAGED")
    assert proc.returncode == 4, proc.stdout + proc.stderr  # EP_ERR_MODEL
    assert "open failed: segment 2 (a): input q reads slot 3, which is unset or differs" in proc.stdout


# ---- partitioned artifacts (real pnnx, TVM, zig, qemu) -----------------------------------------

from conftest import first_cpu, run_edgepack, verify_cpus  # noqa: E402
from edgepack.runner import run_artifact  # noqa: E402

ARM_CPUS = verify_cpus("arm64")  # without and with fp16 arithmetic, as the target file says
RUNTIME_BYTES_GOAL = 4_500_000    # issue 9: a partitioned arm64 artifact's runtime


def lstm_between_cumsums(path: Path) -> Path:
    """CumSum -> LSTM -> Linear -> CumSum, as torch exports it: NCNN lacks CumSum and the plan keeps
    the LSTM on NCNN, so it is TVM, NCNN, TVM (two TVM segments in one artifact)."""
    import warnings

    import torch
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = torch.nn.LSTM(4, 8, batch_first=True)
            self.fc = torch.nn.Linear(8, 6)

        def forward(self, x):
            y, _ = self.lstm(torch.cumsum(x, dim=1))
            return torch.cumsum(self.fc(y), dim=2)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Net().eval(), (torch.randn(1, 5, 4),), str(path), opset_version=17, dynamo=False,
                          input_names=["x"], output_names=["y"])
    return path


def _build(model: Path, dist: Path, *args: str) -> dict:
    # --select first: these tests are about the split artifact, which auto offers right after NCNN; with
    # the default (fastest) a whole-TVM build of these tiny models can win the timing by noise
    proc = run_edgepack("build", str(model), "--target", "x86_64,arm64", "--out", str(dist), "--json",
                        "--select", "first", *args)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"no JSON report (exit {proc.returncode}): {proc.stderr[-3000:]}")
    assert proc.returncode == 0 and report["ok"], proc.stderr[-4000:]
    return {r["target"]: r for r in report["results"]}


def _check_run(art: Path, model: Path, tmp: Path, seed: int, cpus) -> float:
    """The artifact's `run` on a fresh input against onnxruntime; the worst error."""
    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    feeds = {i.name: np.random.default_rng(seed).standard_normal([d if isinstance(d, int) else 1 for d in i.shape])
             .astype(np.float32) for i in sess.get_inputs()}
    ref = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    args = ["run", "--threads", "1", "--output", str(tmp / "out")]
    for name, v in feeds.items():
        np.save(tmp / f"{name}.npy", v)
        args += ["--input", f"{name}={tmp / f'{name}.npy'}"]
    manifest = json.loads(art.with_name(art.name + ".json").read_text())
    tol = manifest["tolerance"]
    worst = 0.0
    for cpu in cpus:
        proc = run_artifact(art, args, qemu_cpu=cpu)
        assert proc.returncode == 0, (cpu, proc.stderr)
        outs = json.loads(proc.stdout)["outputs"]
        for name, want in ref.items():
            got = np.load(outs[name]["file"])
            err = float(np.max(np.abs(got - want)))
            bound = tol["atol"] + tol["rtol"] * float(np.max(np.abs(want)))
            assert err <= bound, (cpu, name, err, bound)
            worst = max(worst, err)
    return worst


@pytest.fixture(scope="module")
def topk_split(tmp_path_factory):
    folder = tmp_path_factory.mktemp("split-topk")
    model = conv_topk_conv(folder / "split_topk.onnx")
    return model, folder / "dist", _build(model, folder / "dist")


@pytest.mark.parametrize("target", ["x86_64", "arm64"])
def test_partitioned_artifact_runs_ncnn_then_tvm_then_ncnn(topk_split, target, tmp_path):
    model, dist, results = topk_split
    res = results[target]
    assert res["backend"] == "ncnn+tvm", res
    art = dist / f"split_topk-{target}"
    manifest = json.loads(art.with_name(art.name + ".json").read_text())
    assert manifest["backend"]["name"] == "ncnn+tvm"
    assert [s["backend"] for s in manifest["backend"]["segments"]] == ["ncnn", "tvm", "ncnn"]
    assert manifest["backend"]["segments"][1]["ops"] == ["TopK"]
    assert any("TopK" in r for r in manifest["backend_choice"]["skipped"])
    info = run_artifact(art, ["info", "--json"], qemu_cpu=first_cpu(target))
    assert info.returncode == 0 and json.loads(info.stdout)["backend"]["name"] == "ncnn+tvm"
    _check_run(art, model, tmp_path, seed=42, cpus=ARM_CPUS if target == "arm64" else (None,))
    st = run_artifact(art, ["selftest", "--runs", "1", "--warmup", "0"],
                      qemu_cpu=first_cpu(target))
    assert st.returncode == 0 and "PASS" in st.stdout, st.stdout + st.stderr
    if target == "arm64":
        runtime = res["runtime_bytes"]
        print(f"partitioned arm64 artifact: {res['size']} bytes, runtime {runtime} bytes")
        assert runtime <= RUNTIME_BYTES_GOAL, runtime


def test_partitioned_artifact_with_two_tvm_segments(tmp_path):
    model = lstm_between_cumsums(tmp_path / "lstm_split.onnx")
    results = _build(model, tmp_path / "dist")
    for target in ("x86_64", "arm64"):
        assert results[target]["backend"] == "ncnn+tvm", results[target]
        art = tmp_path / "dist" / f"lstm_split-{target}"
        manifest = json.loads(art.with_name(art.name + ".json").read_text())
        assert [s["backend"] for s in manifest["backend"]["segments"]] == ["tvm", "ncnn", "tvm"]
        assert "LSTM" in manifest["backend"]["segments"][1]["ops"]
        _check_run(art, model, tmp_path, seed=5, cpus=(first_cpu(target),))


def test_inspect_shows_the_plan(tmp_path):
    model = conv_topk_conv(tmp_path / "m.onnx")
    proc = run_edgepack("inspect", str(model), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [s["backend"] for s in report["plan"]] == ["ncnn", "tvm", "ncnn"]
    assert report["targets"]["x86_64"].startswith("builds partitioned: ncnn[")
    text = run_edgepack("inspect", str(model))
    assert "plan segment 1: tvm <- TopK" in text.stdout


def test_auto_offers_the_split_after_ncnn(tmp_path):
    from edgepack.partition_build import SPLIT, with_split
    from edgepack.pipeline import backend_candidates
    from edgepack.targets import TargetMatrix
    target = TargetMatrix.load().get("arm64")
    split = simplify(load_model(conv_topk_conv(tmp_path / "s.onnx")))
    cands = with_split(backend_candidates(split, target, "auto"), split, target, "auto")
    assert [n for n, _ in cands] == ["ncnn", SPLIT, "tvm"] and cands[1][1] is None
    assert [n for n, _ in with_split(backend_candidates(split, target, "tvm"), split, target, "tvm")] == ["tvm"]
    # NCNN refused nothing: it is tried on the whole graph first; the split follows it (it builds only
    # when NCNN's conversion left layers whose nodes can be cut out: test_partition_leftover.py)
    assert with_split([("ncnn", None), ("tvm", None)], split, target, "auto") == [("ncnn", None), (SPLIT, None),
                                                                                  ("tvm", None)]
    assert with_split([("ncnn", None), ("tvm", "tvm cannot build op LSTM")], split, target, "auto") == \
        [("ncnn", None), ("tvm", "tvm cannot build op LSTM")]
    assert with_split([], split, target, SPLIT) == [(SPLIT, None)]  # verify-build of a split artifact


def test_a_constant_output_of_a_split_artifact_is_filled_from_its_table(tmp_path):
    """onnx-asr's log-mel front ends return features_lens = ConstantOfShape(Shape(lens)), a constant once
    the input shapes are fixed, which no segment computes: the segment table holds it in a slot filled
    at open (it was a KeyError at bundling)."""
    rng = np.random.default_rng(RNG_SEED + 3)
    c1, i1 = _conv("conv1", "x", "c1", 3, 8, rng)
    nodes = [c1, helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("CumSum", ["r1", "axis"], ["y"]),
             helper.make_node("Shape", ["lens"], ["lens_shape"]),
             helper.make_node("ConstantOfShape", ["lens_shape"], ["frames"],
                              value=helper.make_tensor("v", TensorProto.INT64, [1], [3000]))]
    inits = i1 + [numpy_helper.from_array(np.array(3, np.int64), "axis")]
    g = helper.make_graph(nodes, "const_out", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16]),
                                               helper.make_tensor_value_info("lens", TensorProto.INT64, ["batch"])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16]),
                           helper.make_tensor_value_info("frames", TensorProto.INT64, ["batch"])], inits)
    model = _save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "const_out.onnx")
    proc = run_edgepack("build", str(model), "--target", "x86_64", "--input-shape", "lens=1", "--fp32", "--out",
                        str(tmp_path / "dist"), "--json", "--select", "first")
    report = json.loads(proc.stdout) if proc.stdout.strip() else {}
    assert proc.returncode == 0 and report.get("ok"), proc.stderr[-3000:]
    assert report["results"][0]["backend"] == "ncnn+tvm", report["results"][0]
    art = tmp_path / "dist" / "const_out-x86_64"
    x = np.random.default_rng(4).standard_normal((1, 3, 16, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "lens.npy", np.array([7], np.int64))
    out = tmp_path / "out"
    run = subprocess.run([str(art), "run", "--input", f"x={tmp_path / 'x.npy'}", "--input", f"lens={tmp_path / 'lens.npy'}",
                          "--output", str(out)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "lens": np.array([7], np.int64)})
    np.testing.assert_allclose(np.load(out / "y.npy").reshape(want[0].shape), want[0], rtol=1e-4, atol=1e-4)
    assert np.load(out / "frames.npy").reshape(-1).tolist() == [3000]
