"""Rewrites that give pnnx the argument forms it converts right (edgepack/backends/ncnn/pnnx_forms.py).

Each rewrite must leave onnxruntime's outputs bit-identical; the real pnnx must still get the
original form wrong (else the rewrite may be unneeded); and edgepack's NCNN conversion of a graph
with both forms (magika's layer norm and classifier head) must agree with onnxruntime.
"""
from __future__ import annotations

import subprocess

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgepack.backends.ncnn import pnnx_forms
from edgepack.backends.ncnn.rewrite import remove_dead_nodes, rewrite_for_ncnn


def _model(nodes, x_shape, y_shape, inits, opset=15) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def _reduce_model(op="ReduceSum", axis=1, keepdims=0, opset=15) -> onnx.ModelProto:
    """x [1, 64, 32] -> op over one axis (axes as an input) -> Relu."""
    shape = [1, 64, 32]
    out = [d for i, d in enumerate(shape) if i != axis % 3] if not keepdims else \
        [1 if i == axis % 3 else d for i, d in enumerate(shape)]
    return _model([helper.make_node(op, ["x", "axes"], ["r"], keepdims=keepdims, noop_with_empty_axes=1),
                   helper.make_node("Relu", ["r"], ["y"])], shape, out,
                  {"axes": np.array([axis], np.int64)}, opset)


def _layer_norm_head() -> onnx.ModelProto:
    """magika's tail in small: mean and variance by ReduceSum over the sequence axis of [1, T, C],
    then a Gemm with a [1, N] bias (opset 15, as jax2tf writes it)."""
    rng = np.random.default_rng(3)
    t, c, n = 48, 32, 10
    return _model([
        helper.make_node("ReduceSum", ["x", "axes"], ["s"], keepdims=0),           # [1, C]
        helper.make_node("Mul", ["s", "inv_t"], ["mean"]),
        helper.make_node("Mul", ["x", "x"], ["sq"]),
        helper.make_node("ReduceSum", ["sq", "axes"], ["s2"], keepdims=0),
        helper.make_node("Mul", ["s2", "inv_t"], ["ex2"]),
        helper.make_node("Mul", ["mean", "mean"], ["m2"]),
        helper.make_node("Sub", ["ex2", "m2"], ["var"]),
        helper.make_node("Add", ["var", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["sd"]),
        helper.make_node("Div", ["mean", "sd"], ["z"]),
        helper.make_node("Gemm", ["z", "w", "b"], ["y"]),
    ], [1, t, c], [1, n], {"axes": np.array([1], np.int64), "inv_t": np.array(1.0 / t, np.float32),
                           "eps": np.array(1e-6, np.float32),
                           "w": rng.standard_normal((c, n)).astype(np.float32),
                           "b": rng.standard_normal((1, n)).astype(np.float32)})


def _run(m: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    return ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def _rewritten(fn, m: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    new = onnx.ModelProto()
    new.CopyFrom(m)
    fired = fn(new)
    remove_dead_nodes(new)
    onnx.checker.check_model(new)
    x = np.random.default_rng(5).standard_normal([d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim])
    a, b = _run(m, x.astype(np.float32)), _run(new, x.astype(np.float32))
    assert a.shape == b.shape
    np.testing.assert_array_equal(a, b)
    return new, fired


@pytest.mark.parametrize("op,axis,keepdims,opset", [
    ("ReduceSum", 1, 0, 15), ("ReduceSum", -1, 1, 13), ("ReduceMean", 2, 0, 18), ("ReduceL2", 1, 1, 18),
    ("ReduceLogSumExp", -2, 0, 18)])
def test_one_axis_reduction_becomes_batch_and_axis_exactly(op, axis, keepdims, opset):
    new, fired = _rewritten(pnnx_forms.reduce_axis_with_unit_batch, _reduce_model(op, axis, keepdims, opset))
    assert fired == 1
    red = next(n for n in new.graph.node if n.op_type == op)
    axes = numpy_helper.to_array(next(i for i in new.graph.initializer if i.name == red.input[1]))
    assert axes.tolist() == [0, axis % 3]
    assert [n.op_type for n in new.graph.node] == [op] + ([] if keepdims else ["Squeeze"]) + ["Relu"]


def test_reductions_pnnx_reads_right_are_left_alone():
    # an axes attribute (ReduceMean before opset 18), two axes, the batch axis, ReduceProd
    attr = _model([helper.make_node("ReduceMean", ["x"], ["y"], axes=[1], keepdims=0)], [1, 64, 32], [1, 32], {})
    two = _reduce_model("ReduceSum", 1, 0, 15)
    two.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.array([1, 2], np.int64), "axes"))
    two.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, [1]))
    batch = _reduce_model("ReduceSum", 0, 1, 15)
    for m in (attr, two, batch, _reduce_model("ReduceProd", 1, 0, 18)):
        assert pnnx_forms.reduce_axis_with_unit_batch(m) == 0


def test_gemm_bias_row_becomes_a_vector_exactly():
    new, fired = _rewritten(pnnx_forms.gemm_bias_as_vector, _layer_norm_head())
    assert fired == 1
    gemm = next(n for n in new.graph.node if n.op_type == "Gemm")
    assert [d for i in new.graph.initializer if i.name == gemm.input[2] for d in i.dims] == [10]


def _pnnx_ncnn_param(m: onnx.ModelProto, folder, shape: str = "[1,48,32]") -> str:
    from edgepack.backends.ncnn.convert import pnnx_executable
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(m, folder / "model.onnx")
    subprocess.run([str(pnnx_executable()), "model.onnx", f"inputshape={shape}"], cwd=folder,
                   capture_output=True, timeout=300, check=True)
    return (folder / "model.ncnn.param").read_text()


def test_pnnx_gets_both_forms_wrong_and_their_rewrites_right(tmp_path):
    before = _pnnx_ncnn_param(_layer_norm_head(), tmp_path / "before")
    reductions = [ln for ln in before.splitlines() if ln.startswith("Reduction")]
    assert reductions and all(" -23303=0 " in ln for ln in reductions), \
        "pnnx now writes a one-axis ReduceSum's axis: reduce_axis_with_unit_batch may be unneeded"
    assert any(ln.startswith("F.linear") for ln in before.splitlines()), \
        "pnnx now converts a Gemm with a [1, N] bias: gemm_bias_as_vector may be unneeded"
    new, applied = rewrite_for_ncnn(_layer_norm_head())
    assert applied == {"reduce_axis_with_unit_batch": 2, "gemm_bias_as_vector": 1}
    after = _pnnx_ncnn_param(new, tmp_path / "after")
    assert not any(" -23303=0 " in ln for ln in after.splitlines())
    assert "InnerProduct" in after and "F.linear" not in after


def test_convert_keeps_the_layer_norm_head_on_ncnn(tmp_path):
    """edgepack's conversion retries with the rewrites and its check against onnxruntime (on the
    original graph) passes: before them, the head was 10+ off (magika: 14.2) or left F.linear."""
    from edgepack.backends.ncnn.convert import convert
    from edgepack.model import load_model
    onnx.save(_layer_norm_head(), tmp_path / "head.onnx")
    converted = convert(load_model(tmp_path / "head.onnx"), "fp32", log=lambda m: None)
    assert "reduce_axis_with_unit_batch x2" in converted.rewrites
    assert "gemm_bias_as_vector x1" in converted.rewrites
    assert "InnerProduct" in converted.layer_types and "Reduction" in converted.layer_types
    assert converted.check_error < 1e-4


def _upsample_with_roi(opset=12) -> onnx.ModelProto:
    """PP-OCRv3's detector neck: nearest x2 upsampling with an eight-ones roi the mode never reads."""
    rng = np.random.default_rng(8)
    return _model([helper.make_node("Conv", ["x", "w"], ["c"]),
                   helper.make_node("Resize", ["c", "roi", "scales"], ["y"], mode="nearest",
                                    coordinate_transformation_mode="asymmetric", nearest_mode="floor")],
                  [1, 4, 6, 6], [1, 8, 12, 12],
                  {"w": rng.standard_normal((8, 4, 1, 1)).astype(np.float32),
                   "roi": np.ones(8, np.float32), "scales": np.array([1, 1, 2, 2], np.float32)}, opset)


def test_resize_roi_the_mode_never_reads_becomes_empty_exactly():
    new, fired = _rewritten(pnnx_forms.resize_roi_unread, _upsample_with_roi())
    assert fired == 1
    resize = next(n for n in new.graph.node if n.op_type == "Resize")
    assert [d for i in new.graph.initializer if i.name == resize.input[1] for d in i.dims] == [0]
    crop = _upsample_with_roi()
    for a in crop.graph.node[1].attribute:
        if a.name == "coordinate_transformation_mode":
            a.s = b"tf_crop_and_resize"
    assert pnnx_forms.resize_roi_unread(crop) == 0  # there the roi is read


def test_convert_keeps_an_upsampling_with_roi_on_ncnn(tmp_path):
    from edgepack.backends.ncnn.convert import convert
    from edgepack.model import load_model
    onnx.save(_upsample_with_roi(), tmp_path / "up.onnx")
    converted = convert(load_model(tmp_path / "up.onnx"), "fp32", log=lambda m: None)
    assert "resize_roi_unread x1" in converted.rewrites
    assert "Interp" in converted.layer_types and converted.check_error < 1e-5


def _padded_waveform_conv(mode: str | None = None) -> onnx.ModelProto:
    """NeMo's front end in small (onnx-asr): the waveform [1, 400] zero-padded on both ends by a Pad
    that names no mode, then a strided Conv1D (the STFT as edgepack lowers it)."""
    rng = np.random.default_rng(9)
    pad = helper.make_node("Pad", ["x", "pads"], ["p"], **({"mode": mode} if mode else {}))
    return _model([pad, helper.make_node("Unsqueeze", ["p", "axis"], ["u"]),
                   helper.make_node("Conv", ["u", "w"], ["y"], strides=[16])],
                  [1, 400], [1, 8, 25],
                  {"pads": np.array([0, 16, 0, 16], np.int64), "axis": np.array([1], np.int64),
                   "w": rng.standard_normal((8, 1, 32)).astype(np.float32)}, 13)


def test_a_pad_without_mode_gets_constant_written_out_exactly():
    new, fired = _rewritten(pnnx_forms.pad_mode_explicit, _padded_waveform_conv())
    assert fired == 1
    pad = next(n for n in new.graph.node if n.op_type == "Pad")
    assert [(a.name, a.s) for a in pad.attribute] == [("mode", b"constant")]
    assert pnnx_forms.pad_mode_explicit(_padded_waveform_conv("constant")) == 0
    assert pnnx_forms.pad_mode_explicit(_padded_waveform_conv("reflect")) == 0


def test_pnnx_keeps_a_modeless_pad_and_converts_the_rewritten_one(tmp_path):
    from edgepack.backends.ncnn.convert import convert
    from edgepack.model import load_model
    before = _pnnx_ncnn_param(_padded_waveform_conv(), tmp_path / "before", "[1,400]")
    assert any(ln.startswith("Pad ") for ln in before.splitlines()), \
        "pnnx now converts a Pad without a mode attribute: pad_mode_explicit may be unneeded"
    onnx.save(_padded_waveform_conv(), tmp_path / "wave.onnx")
    converted = convert(load_model(tmp_path / "wave.onnx"), "fp32", log=lambda m: None)
    assert "pad_mode_explicit x1" in converted.rewrites
    assert "Pad" not in converted.layer_types and converted.check_error < 1e-4


def _conv_relu_ir14() -> onnx.ModelProto:
    """A Conv -> Relu stamped IR 14, as onnx >= 1.23 stamps every model it writes."""
    rng = np.random.default_rng(9)
    m = _model([helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])],
               [1, 3, 8, 8], [1, 4, 8, 8], {"w": rng.standard_normal((4, 3, 3, 3)).astype(np.float32)}, opset=17)
    m.ir_version = 14
    return m


def test_pnnx_refuses_ir_14_and_convert_hands_it_a_readable_copy(tmp_path):
    from edgepack.backends.ncnn.convert import PNNX_MAX_IR_VERSION, convert
    from edgepack.model import load_model
    assert PNNX_MAX_IR_VERSION < 14
    with pytest.raises(subprocess.CalledProcessError):  # pnnx's onnxruntime refuses IR 14, then pnnx crashes
        _pnnx_ncnn_param(_conv_relu_ir14(), tmp_path / "raw", shape="[1,3,8,8]")
    path = tmp_path / "ir14.onnx"
    onnx.save(_conv_relu_ir14(), path)
    converted = convert(load_model(path), "fp32", log=lambda m: None)
    assert "Convolution" in converted.layer_types and converted.check_error < 1e-5
    assert onnx.load(path).ir_version == 14  # the user's file is left as it was


def _same_padded(op: str, mode: str, h: int, w: int, k: int = 3, stride: int = 2, dilation: int = 1,
                 **attrs) -> onnx.ModelProto:
    """One Conv (4 -> 6 channels) or pooling over x [1, 4, h, w] with auto_pad ``mode``, as keras2onnx
    writes Keras's padding="same" (MTCNN's R-Net: a 3x3 stride-2 MaxPool over 22 x 22)."""
    inits, extra = {}, dict(attrs)
    if op == "Conv":
        inits["w"] = np.random.default_rng(4).standard_normal((6, 4, k, k)).astype(np.float32)
        extra["dilations"] = [dilation, dilation]
    else:
        extra["kernel_shape"] = [k, k]
    ceil = attrs.get("ceil_mode", 0)
    out = [-(-(n - ((k - 1) * dilation + 1)) // stride) + 1 if mode == "VALID" else
           (-(-n // stride) if not ceil else -(-n // stride)) for n in (h, w)]
    node = helper.make_node(op, ["x", "w"] if op == "Conv" else ["x"], ["y"], auto_pad=mode,
                            strides=[stride, stride], **extra)
    return _model([node], [1, 4, h, w], [1, 6 if op == "Conv" else 4, *out], inits, 13)


def test_same_pads_put_the_odd_row_where_onnx_says():
    assert pnnx_forms.same_pads([22, 22], [3, 3], [2, 2], [1, 1], upper=True) == [0, 0, 1, 1]
    assert pnnx_forms.same_pads([22, 22], [3, 3], [2, 2], [1, 1], upper=False) == [1, 1, 0, 0]
    assert pnnx_forms.same_pads([21, 12], [3, 3], [2, 1], [1, 2], upper=True) == [1, 2, 1, 2]
    assert pnnx_forms.same_pads([9], [1], [4], [1], upper=True) == [0, 0]  # stride past the kernel: none


@pytest.mark.parametrize("op,mode,h,w,k,stride,dilation", [
    ("MaxPool", "SAME_UPPER", 22, 22, 3, 2, 1), ("MaxPool", "SAME_LOWER", 22, 23, 3, 2, 1),
    ("MaxPool", "SAME_UPPER", 20, 20, 2, 1, 1), ("Conv", "SAME_LOWER", 22, 21, 3, 2, 1),
    ("Conv", "SAME_UPPER", 19, 20, 3, 1, 1), ("Conv", "SAME_LOWER", 12, 12, 2, 1, 1)])
def test_auto_pad_written_out_is_exact(op, mode, h, w, k, stride, dilation):
    new, fired = _rewritten(pnnx_forms.auto_pad_explicit, _same_padded(op, mode, h, w, k, stride, dilation))
    assert fired == 1
    node = new.graph.node[0]
    assert {a.name for a in node.attribute} >= {"pads"} and "auto_pad" not in {a.name for a in node.attribute}


def test_auto_pad_rewrite_leaves_what_pnnx_has_no_better_form_for():
    # an AveragePool with asymmetric pads stays AveragePool in pnnx (no ncnn layer): left for TVM
    assert pnnx_forms.auto_pad_explicit(_same_padded("AveragePool", "SAME_UPPER", 22, 22)) == 0
    assert pnnx_forms.auto_pad_explicit(_same_padded("MaxPool", "SAME_UPPER", 22, 22, ceil_mode=1)) == 0
    assert pnnx_forms.auto_pad_explicit(_same_padded("MaxPool", "VALID", 22, 22)) == 0
    # onnxruntime refuses dilation with auto_pad, so there is nothing to match
    assert pnnx_forms.auto_pad_explicit(_same_padded("Conv", "SAME_UPPER", 19, 20, 3, 1, 2)) == 0


def test_pnnx_pads_an_odd_same_upper_pool_on_both_sides_and_the_written_out_pads_convert(tmp_path):
    from edgepack.backends.ncnn.convert import convert
    from edgepack.model import load_model
    before = _pnnx_ncnn_param(_same_padded("MaxPool", "SAME_UPPER", 22, 22), tmp_path / "before", "[1,4,22,22]")
    padding = [ln.split()[6:10] for ln in before.splitlines() if ln.startswith("Padding")]
    assert padding == [["0=1", "1=1", "2=1", "3=1"]], \
        f"pnnx now pads SAME_UPPER otherwise ({padding}): auto_pad_explicit may be unneeded"
    for name, model in (("pool", _same_padded("MaxPool", "SAME_UPPER", 22, 22)),
                        ("conv", _same_padded("Conv", "SAME_LOWER", 22, 21))):
        onnx.save(model, tmp_path / f"{name}.onnx")
        converted = convert(load_model(tmp_path / f"{name}.onnx"), "fp32", log=lambda m: None)
        assert "auto_pad_explicit x1" in converted.rewrites, name
        assert converted.check_error < 1e-5, name
