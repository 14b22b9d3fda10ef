"""The NCNN op table stays true: single-op models for a sample of 'supported' ops convert with
pnnx and match onnxruntime through the ncnn Python wheel; 'unsupported' ones are refused."""
import numpy as np
import pytest
from onnx import numpy_helper

from edgepack.backends.ncnn.convert import convert
from edgepack.backends.ncnn.ops import KNOWN_UNSUPPORTED, SUPPORTED
from edgepack.errors import EdgepackError
from edgepack.model import load_model
from edgepack.pipeline import backend_candidates
from edgepack.targets import TargetMatrix
from models import single_op_model, topk_model

X = {"x": [1, 8, 6, 6]}
UNARY = ["Relu", "Sigmoid", "Tanh", "Abs", "Neg", "Exp", "Floor", "Ceil", "Round", "Sin", "Cos", "HardSwish", "Softplus",
         "Elu", "Selu", "HardSigmoid", "Erf"]


def _convert(path):
    return convert(load_model(path), "fp32", log=lambda m: None)


@pytest.mark.parametrize("op", UNARY)
def test_unary_ops_convert_and_match(op, tmp_path):
    assert op in SUPPORTED
    m = single_op_model(tmp_path / f"{op}.onnx", op, X, {"y": [1, 8, 6, 6]})
    assert _convert(m).check_error < 1e-3


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Max", "Min"])
def test_binary_ops_convert_and_match(op, tmp_path):
    b = numpy_helper.from_array(np.random.default_rng(1).uniform(0.5, 2, (1, 8, 1, 1)).astype(np.float32), "b")
    m = single_op_model(tmp_path / f"{op}.onnx", op, X, {"y": [1, 8, 6, 6]}, inits=[b])
    assert _convert(m).check_error < 1e-3


def _i64(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _f32(name, values):
    return numpy_helper.from_array(np.array(values, np.float32), name)


def _structured(op, spec, out, tmp_path):
    """Single-op models for ops that need attributes, constant inputs or positive inputs."""
    p = tmp_path / f"{op}.onnx"
    rng = np.random.default_rng(3)
    if isinstance(spec, dict):
        return single_op_model(p, op, X, {"y": out}, **spec)
    if spec is None:  # InstanceNormalization
        return single_op_model(p, op, X, {"y": out}, inits=[_f32("s", rng.uniform(0.5, 1.5, 8)),
                                                            _f32("b", rng.uniform(-0.1, 0.1, 8))])
    if spec == "abs":  # positive domain: x -> Abs -> op
        import onnx
        from onnx import TensorProto, helper
        nodes = [helper.make_node("Abs", ["x"], ["a"]), helper.make_node("Add", ["a", "one"], ["p"]),
                 helper.make_node(op, ["p"], ["y"], name=f"{op.lower()}_node")]
        g = helper.make_graph(nodes, op, [helper.make_tensor_value_info("x", TensorProto.FLOAT, X["x"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)], [_f32("one", 1.0)])
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        onnx.save(m, str(p))
        return p
    extra = {
        "axes": ([_i64("axes", [2, 3])], {"keepdims": 1}),
        "pad": ([_i64("pads", [0, 0, 1, 1, 0, 0, 1, 1])], {}),
        "tile": ([_i64("reps", [1, 1, 2, 1])], {}),
        "resize": ([numpy_helper.from_array(np.zeros(0, np.float32), "roi"), _f32("scales", [1, 1, 2, 2])],
                   {"mode": "nearest"}),
        "expand": ([_i64("shape", [2, 8, 6, 6])], {}),
        "squeeze": ([_i64("axes", [0])], {}),
        "unsqueeze": ([_i64("axes", [1])], {}),
        "slice": ([_i64("starts", [2]), _i64("ends", [6]), _i64("sl_axes", [1])], {}),
        "reshape": ([_i64("shape", [1, 8, 36])], {}),
        "matmul": ([_f32("w", rng.standard_normal((6, 4)))], {}),
        "pow": ([_f32("e", 2.0)], {}),
        "prelu": ([_f32("slope", rng.uniform(0, 0.3, (8, 1, 1)))], {}),
        "clip": ([_f32("lo", -0.5), _f32("hi", 0.5)], {}),
    }
    if spec == "split":
        return single_op_model(p, op, X, {"y0": [1, 4, 6, 6], "y1": [1, 4, 6, 6]}, inits=[_i64("split", [4, 4])],
                               axis=1)
    if spec == "concat":
        return single_op_model(p, op, {"x": X["x"], "x2": X["x"]}, {"y": out}, axis=1)
    if spec == "einsum":
        return single_op_model(p, op, {"x": X["x"], "x2": X["x"]}, {"y": out}, equation="bchw,bchw->bchw")
    inits, attrs = extra[spec]
    return single_op_model(p, op, X, {"y": out}, inits=inits, **attrs)


@pytest.mark.parametrize("op,attrs,out", [
    ("Softmax", {"axis": 1}, [1, 8, 6, 6]),
    ("LogSoftmax", {"axis": 1}, [1, 8, 6, 6]),
    ("GlobalAveragePool", {}, [1, 8, 1, 1]),
    ("GlobalMaxPool", {}, [1, 8, 1, 1]),
    ("MaxPool", {"kernel_shape": [2, 2], "strides": [2, 2]}, [1, 8, 3, 3]),
    ("AveragePool", {"kernel_shape": [2, 2], "strides": [2, 2]}, [1, 8, 3, 3]),
    ("Transpose", {"perm": [0, 2, 3, 1]}, [1, 6, 6, 8]),
    ("Flatten", {"axis": 1}, [1, 288]),
    ("InstanceNormalization", None, [1, 8, 6, 6]),
    ("LRN", {"size": 3}, [1, 8, 6, 6]),
    ("Mish", {"opset": 18}, [1, 8, 6, 6]),
    ("Sqrt", "abs", [1, 8, 6, 6]),
    ("Log", "abs", [1, 8, 6, 6]),
    ("Reciprocal", "abs", [1, 8, 6, 6]),
    ("ReduceSum", "axes", [1, 8, 1, 1]),
    ("Gelu", {"opset": 20}, [1, 8, 6, 6]),
    ("Split", "split", None),
    ("Resize", "resize", [1, 8, 12, 12]),
    ("Expand", "expand", [2, 8, 6, 6]),
    ("Squeeze", "squeeze", [8, 6, 6]),
    ("Unsqueeze", "unsqueeze", [1, 1, 8, 6, 6]),
    ("Slice", "slice", [1, 4, 6, 6]),
    ("Concat", "concat", [1, 16, 6, 6]),
    ("Reshape", "reshape", [1, 8, 36]),
    ("MatMul", "matmul", [1, 8, 6, 4]),
    ("Pow", "pow", [1, 8, 6, 6]),
    ("PRelu", "prelu", [1, 8, 6, 6]),
    ("Clip", "clip", [1, 8, 6, 6]),
    ("Einsum", "einsum", [1, 8, 6, 6]),
    ("LeakyRelu", {"alpha": 0.1}, [1, 8, 6, 6]),
    ("ReduceMean", {"axes": [2, 3], "keepdims": 1}, [1, 8, 1, 1]),
    ("ReduceSumSquare", {"axes": [-1], "keepdims": 0}, [1, 8, 6]),  # a power spectrum's re^2 + im^2
])
def test_structured_ops_convert_and_match(op, attrs, out, tmp_path):
    assert op in SUPPORTED
    assert _convert(_structured(op, attrs, out, tmp_path)).check_error < 1e-3


@pytest.mark.parametrize("op,spec,out", [
    ("SpaceToDepth", {"blocksize": 2}, [1, 32, 3, 3]),   # pnnx converts it, ncnn computes garbage
    ("DepthToSpace", {"blocksize": 2}, [1, 2, 12, 12]),
    ("Tile", "tile", [1, 8, 12, 6]),
])
def test_ops_listed_unsupported_really_fail(op, spec, out, tmp_path):
    """If pnnx/ncnn learn one of these, this fails and the op moves to SUPPORTED."""
    assert op in KNOWN_UNSUPPORTED
    with pytest.raises(EdgepackError):
        _convert(_structured(op, spec, out, tmp_path))


def test_conversion_decides_a_pad(tmp_path):
    """Pad is let through to conversion (CONVERSION_DECIDES): a lone constant Pad that names no mode
    converts once pnnx_forms writes the mode out; an edge Pad with negative pads (kaldi's shift) does not,
    and the conversion says so (the split then moves that node to TVM)."""
    from edgepack.backends.ncnn.ops import CONVERSION_DECIDES
    assert "Pad" in CONVERSION_DECIDES
    converted = _convert(_structured("Pad", "pad", [1, 8, 8, 8], tmp_path))
    assert "pad_mode_explicit x1" in converted.rewrites and converted.check_error < 1e-5
    shift = single_op_model(tmp_path / "shift.onnx", "Pad", X, {"y": [1, 8, 6, 6]},
                            inits=[_i64("pads", [0, 0, 0, 1, 0, 0, 0, -1])], mode="edge")
    with pytest.raises(EdgepackError):
        _convert(shift)


def test_topk_is_refused_by_the_table_with_node_name(tmp_path):
    assert "TopK" in KNOWN_UNSUPPORTED and "TopK" not in SUPPORTED
    model = load_model(topk_model(tmp_path / "topk.onnx"))
    target = TargetMatrix.load().get("x86_64")
    cands = dict(backend_candidates(model, target, "ncnn"))
    assert "TopK" in cands["ncnn"] and "top3" in cands["ncnn"]


def test_tables_do_not_overlap():
    assert not SUPPORTED & KNOWN_UNSUPPORTED
