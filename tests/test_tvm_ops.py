"""The TVM op table stays true: every op it claims has a converter in the installed relax ONNX
frontend, and a sample of single-op models (the ops NCNN lacks among them) compiles with the
same fused pipeline edgepack uses and matches onnxruntime (run here on the host CPU)."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgepack.backends.ncnn.ops import SUPPORTED as NCNN_SUPPORTED
from edgepack.backends.tvm import ops

import tvm  # noqa: E402  (a missing TVM must fail, not skip)


def test_table_matches_the_frontend():
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map
    converters = set(_get_convert_map())
    assert ops.SUPPORTED <= converters, sorted(ops.SUPPORTED - converters)
    assert not ops.SUPPORTED & ops.EXCLUDED
    # Everything the frontend knows is either offered or excluded on purpose.
    assert converters <= ops.SUPPORTED | ops.EXCLUDED, sorted(converters - ops.SUPPORTED - ops.EXCLUDED)


def test_covers_ops_ncnn_cannot_build():
    for op in ("TopK", "Where", "GatherElements", "CumSum"):
        assert op in ops.SUPPORTED and op not in NCNN_SUPPORTED


F = TensorProto.FLOAT
I64 = TensorProto.INT64


def _model(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def _vi(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


def _const(name, arr):
    return numpy_helper.from_array(np.asarray(arr), name)


rng = np.random.default_rng(3)
W = rng.standard_normal((8, 4, 3, 3)).astype(np.float32)

CASES = {
    "TopK": (_model([helper.make_node("TopK", ["x", "k"], ["v", "i"], axis=1)],
                    [_vi("x", F, [2, 10])], [_vi("v", F, [2, 3]), _vi("i", I64, [2, 3])], [_const("k", np.array([3]))]),
             {"x": rng.standard_normal((2, 10)).astype(np.float32)}),
    "Where": (_model([helper.make_node("Greater", ["x", "z"], ["c"]), helper.make_node("Where", ["c", "x", "y"], ["o"])],
                     [_vi("x", F, [3, 5]), _vi("y", F, [3, 5])], [_vi("o", F, [3, 5])],
                     [_const("z", np.float32(0))]),
              {"x": rng.standard_normal((3, 5)).astype(np.float32), "y": rng.standard_normal((3, 5)).astype(np.float32)}),
    "GatherElements": (_model([helper.make_node("GatherElements", ["x", "idx"], ["o"], axis=1)],
                              [_vi("x", F, [3, 4])], [_vi("o", F, [3, 2])],
                              [_const("idx", np.array([[0, 3], [1, 1], [2, 0]], np.int64))]),
                       {"x": rng.standard_normal((3, 4)).astype(np.float32)}),
    "CumSum": (_model([helper.make_node("CumSum", ["x", "ax"], ["o"])], [_vi("x", F, [4, 6])], [_vi("o", F, [4, 6])],
                      [_const("ax", np.array(1, np.int64))]),
               {"x": rng.standard_normal((4, 6)).astype(np.float32)}),
    "Conv": (_model([helper.make_node("Conv", ["x", "w"], ["o"], pads=[1, 1, 1, 1])], [_vi("x", F, [1, 4, 9, 9])],
                    [_vi("o", F, [1, 8, 9, 9])], [_const("w", W)]),
             {"x": rng.standard_normal((1, 4, 9, 9)).astype(np.float32)}),
    "Softmax": (_model([helper.make_node("Softmax", ["x"], ["o"], axis=-1)], [_vi("x", F, [2, 7])], [_vi("o", F, [2, 7])]),
                {"x": rng.standard_normal((2, 7)).astype(np.float32)}),
    "ArgMax": (_model([helper.make_node("ArgMax", ["x"], ["o"], axis=1, keepdims=0)], [_vi("x", F, [3, 8])],
                      [_vi("o", I64, [3])]),
               {"x": rng.standard_normal((3, 8)).astype(np.float32)}),
    "LayerNormalization": (_model([helper.make_node("LayerNormalization", ["x", "g", "b"], ["o"], axis=-1)],
                                  [_vi("x", F, [2, 3, 16])], [_vi("o", F, [2, 3, 16])],
                                  [_const("g", rng.standard_normal(16).astype(np.float32)),
                                   _const("b", rng.standard_normal(16).astype(np.float32))]),
                           {"x": rng.standard_normal((2, 3, 16)).astype(np.float32)}),
}


@pytest.mark.parametrize("op", sorted(CASES))
def test_single_op_matches_onnxruntime(op, tmp_path):
    from tvm import relax

    from edgepack.backends.tvm.compile import fuse, lower_pipeline
    from edgepack.model import load_model

    model, feeds = CASES[op]
    assert op in ops.SUPPORTED
    path = tmp_path / f"{op}.onnx"
    onnx.save(model, str(path))
    loaded = load_model(path)
    from edgepack.backends.tvm.compile import import_onnx
    host = tvm.target.Target({"kind": "llvm", "mtriple": "x86_64-unknown-linux-gnu", "mcpu": "x86-64"})
    mod = fuse(import_onnx(loaded), host)
    with tvm.transform.PassContext(opt_level=3):
        ex = relax.build(mod, target=host, relax_pipeline=lower_pipeline(host))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(feeds[s.name]) for s in loaded.inputs])
    got = [out.numpy()] if hasattr(out, "numpy") else [o.numpy() for o in out]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
