"""The arena plan (edgepack/backends/ncnn/arena_plan.py, runtimes/ncnn/ep_ncnn_pool.cc): an x86_64 build
records its arena's requests on this machine at 1 and 2 threads and embeds offsets planned for them;
the artifact then touches no more of its arena than its tensors hold at their worst moment.

verify-build pins the plan the artifact carries, so a rebuild on any machine gives the same bytes.

The model splits first fit's holes: a GlobalAveragePool of the first convolution's output (a few
bytes) lives until the last layer multiplies by it, so it sits between the early maps, and the larger
maps after them find no hole. First fit touches at least 256 KiB (MIN_SAVING) more than the plan
here. A run whose requests differ from the plan (capped to AVX2: other packings, other sizes) falls
back to first fit and gives the same answer."""
from __future__ import annotations

import json
import re
import struct
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from clirun import run_artifact_on
from conftest import run_edgepack

from edgepack.backends.ncnn.arena_plan import MIN_SAVING

H = 96


def fragmenting_model(path: Path) -> Path:
    rng = np.random.default_rng(3)
    nodes, inits = [], []

    def conv(name: str, x: str, cin: int, cout: int) -> str:
        w = (rng.standard_normal((cout, cin, 3, 3)) / np.sqrt(cin * 9)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, name + "_w"))
        nodes.extend([helper.make_node("Conv", [x, name + "_w"], [name], pads=[1] * 4, name=name),
                      helper.make_node("Relu", [name], [name + "_r"], name=name + "_relu")])
        return name + "_r"

    a = conv("c1", "x", 8, 16)
    nodes.append(helper.make_node("GlobalAveragePool", [a], ["g"], name="gap"))  # small, alive to the end
    y = a
    for i, (cin, cout) in enumerate(((16, 16), (16, 32), (32, 32), (32, 64), (64, 16))):
        y = conv(f"c{i + 2}", y, cin, cout)
    nodes.append(helper.make_node("Mul", [y, "g"], ["y"], name="scale"))
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "frag", [helper.make_tensor_value_info("x", f, [1, 8, H, H])],
                              [helper.make_tensor_value_info("y", f, [1, 16, H, H])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _touched(stderr: str) -> tuple[int, int]:
    """The arena's touched bytes and the most its tensors held, after the run (EDGEPACK_NCNN_TRACE)."""
    m = re.findall(r"ncnn-trace: ran .* arena touched=(\d+) kB held=\d+ kB held-peak=(\d+) kB", stderr)
    assert m, stderr[-2000:]
    return int(m[-1][0]) * 1024, int(m[-1][1]) * 1024


def test_planned_arena_touches_only_what_its_tensors_hold(tmp_path):
    model = fragmenting_model(tmp_path / "frag.onnx")
    proc = run_edgepack("build", model, "--target", "x86_64", "--backend", "ncnn", "--fp32", "--out",
                        tmp_path / "dist", "--verify-on=native", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)["results"][0]
    assert res["ok"], res
    art = Path(res["file"])
    plans = json.loads(Path(res["file"] + ".json").read_text())["backend"]["arena_plan"]
    assert "1" in plans, plans
    for plan in plans.values():
        assert plan["first_fit_bytes"] - plan["planned_bytes"] >= MIN_SAVING, plans

    x = np.random.default_rng(1).standard_normal((1, 8, H, H)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    trace = {"EDGEPACK_NCNN_TRACE": "1"}
    outs = {}
    for threads in (1, 2):
        got, err = run_artifact_on(art, "native", {"x": tmp_path / "x.npy"}, tmp_path / f"t{threads}", ["y"],
                                   threads, env=trace)
        touched, held = _touched(err)
        if str(threads) in plans:
            # the plan followed to the end: the arena is exactly as large as the plan says, which
            # first fit missed by MIN_SAVING or more
            assert touched == plans[str(threads)]["planned_bytes"] >> 10 << 10, (threads, touched, plans)  # in kB
            assert touched <= held + 64 * 1024, (threads, touched, held)
        outs[threads] = got["y"]
        np.testing.assert_allclose(got["y"].reshape(want.shape), want, atol=1e-4 * float(np.abs(want).max()))
    # verify-build embeds the plan the artifact carries instead of recording one (another machine
    # records other requests): the same bytes
    proc = run_edgepack("verify-build", art, model)
    assert proc.returncode == 0 and "IDENTICAL" in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
    assert "(pinned)" in proc.stdout + proc.stderr
    # the same answer without the plan (the best-fit pool has none) and where the plan does not match
    for cpu in ("native pool=best300", "native isa=avx2"):
        got, err = run_artifact_on(art, cpu, {"x": tmp_path / "x.npy"}, tmp_path / cpu.split()[1], ["y"], 1,
                                   env=trace)
        if cpu.endswith("pool=best300"):
            np.testing.assert_array_equal(got["y"], outs[1])
        else:
            np.testing.assert_allclose(got["y"].reshape(want.shape), want, atol=1e-4 * float(np.abs(want).max()))


@pytest.mark.parametrize("damage", ["magic", "count"])
def test_a_damaged_plan_is_refused(tmp_path, damage):
    """The plan blob is checked as the weight map is: a damaged one stops the artifact with a clear
    error, not a wrong placement. The artifact's bytes are patched where the blob lies."""
    from edgepack.backends.ncnn.arena_plan import MAGIC
    model = fragmenting_model(tmp_path / "frag.onnx")
    proc = run_edgepack("build", model, "--target", "x86_64", "--backend", "ncnn", "--out", tmp_path / "dist",
                        "--no-verify", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    art = Path(json.loads(proc.stdout)["results"][0]["file"])
    data = bytearray(art.read_bytes())
    # the blob: the magic followed by its plan count (the runtime's own copy of the magic is followed by code)
    found = [m.start() for m in re.finditer(re.escape(MAGIC), data)
             if struct.unpack_from("<Q", data, m.start() + 8)[0] in (1, 2)]
    assert len(found) == 1, found
    at = found[0]
    if damage == "magic":
        data[at] ^= 0xFF
    else:
        data[at + 8] += 1  # one plan more than the blob holds
    art.write_bytes(bytes(data))
    run = subprocess.run([str(art), "selftest"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 4, run.stderr[-2000:]   # EP_ERR_MODEL
    assert "arena plan is malformed" in run.stderr
