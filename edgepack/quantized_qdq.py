"""Static (QDQ) quantisation, for edgepack/quantized.py: QuantizeLinear and DequantizeLinear as float ops.

`onnxruntime.quantization.quantize_static` (and other QDQ exporters) keep a float graph and put
QuantizeLinear -> DequantizeLinear pairs on the activations and DequantizeLinear on int8 weights;
onnxruntime fuses each group into an integer kernel. Neither NCNN nor TVM takes the two ops, but both
have exact float forms:
- DequantizeLinear of a constant (the weights, the int32 biases) is a float constant, computed as
  onnxruntime does: float(q - zp) * scale, per tensor or per axis;
- QuantizeLinear on an activation is round_half_even(x / scale) + zp, clipped to the type's range
  (onnxruntime divides, then rounds to nearest even); a DequantizeLinear of it is (q - zp) * scale.
  Where every reader of the quantised tensor is a DequantizeLinear with the same scale and zero
  point (the QDQ format), the pair is one fake quantisation: clip(round(x / s), lo - zp, hi - zp) * s,
  four float ops per activation and no integer tensor at all.
The division is rounded next, so these graphs carry quantized.LOWERED_KEY (an exact division in
ncnn, exact_div_patch.py). Refused with one clear error: non-constant scales or zero points,
per-axis quantisation of an activation, blocked quantisation (block_size) and 4-bit or float8 types.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

RANGES = {TensorProto.UINT8: (0, 255), TensorProto.INT8: (-128, 127),
          TensorProto.UINT16: (0, 65535), TensorProto.INT16: (-32768, 32767)}
_DEQUANT_ONLY = {TensorProto.INT32: (-2 ** 31, 2 ** 31 - 1)}   # biases: DequantizeLinear reads them


def _attrs(node) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _inputs(node) -> tuple[str, str, str]:
    ins = list(node.input) + ["", ""]
    return ins[0], ins[1], ins[2]


def qdq_problem(proto: onnx.ModelProto, consts: dict, types: dict) -> str | None:
    """Why a QuantizeLinear/DequantizeLinear/QLinearConv/QLinearMatMul of `proto` cannot be lowered, or None."""
    for node in proto.graph.node:
        if node.domain in ("", "ai.onnx") and node.op_type in ("QLinearConv", "QLinearMatMul"):
            what = f"{node.op_type} (node {node.name!r})"
            ins = list(node.input) + [""] * (9 - len(node.input))
            params = [ins[k] for k in (1, 2, 4, 5, 6, 7) if ins[k]]
            if any(p not in consts for p in params) or ins[3] not in consts or (ins[8] and ins[8] not in consts):
                return f"{what} has weights, a scale or a zero point computed at run time"
            if consts[ins[1]].size > 1 or consts[ins[6]].size > 1:
                return f"{what} quantises an activation per axis"
            if ins[7] and _np_type(consts[ins[7]]) not in RANGES:
                return f"{what} writes {TensorProto.DataType.Name(_np_type(consts[ins[7]]))}"
            continue
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        what = f"{node.op_type} (node {node.name!r})"
        x, scale, zp = _inputs(node)
        attrs = _attrs(node)
        if attrs.get("block_size", 0):
            return f"{what} uses blocked quantisation (block_size)"
        if scale not in consts or (zp and zp not in consts):
            return f"{what} has a scale or zero point computed at run time"
        if node.op_type == "QuantizeLinear":
            dtype = _qtype(node, consts, zp)
            if dtype not in RANGES:
                return f"{what} quantises to {TensorProto.DataType.Name(dtype)}"
        else:
            dtype = types.get(x, _np_type(consts[x]) if x in consts else None)
            if dtype is not None and dtype not in RANGES and dtype not in _DEQUANT_ONLY:
                return f"{what} reads {TensorProto.DataType.Name(dtype)}"
        if consts[scale].size > 1 and x not in consts:
            return f"{what} quantises an activation per axis"
    return None


def _np_type(value: np.ndarray) -> int:
    return helper.np_dtype_to_tensor_dtype(value.dtype)


def _qtype(node, consts: dict, zp: str) -> int:
    """The integer type QuantizeLinear writes: its zero point's, else output_dtype, else uint8."""
    if zp:
        return _np_type(consts[zp])
    return int(_attrs(node).get("output_dtype", 0)) or TensorProto.UINT8


def _per_axis(value: np.ndarray, axis: int, rank: int) -> np.ndarray:
    """A per-axis scale or zero point shaped to broadcast against a tensor of `rank` dims."""
    if value.size <= 1:
        return value.reshape(())
    axis = axis + rank if axis < 0 else axis
    return value.reshape([1] * axis + [value.size] + [1] * (rank - axis - 1))


def dequantised(q: np.ndarray, scale: np.ndarray, zp: np.ndarray | None, axis: int) -> np.ndarray:
    """float(q - zp) * scale in float32, as onnxruntime computes DequantizeLinear."""
    s = _per_axis(scale.astype(np.float32), axis, q.ndim)
    z = _per_axis(zp.astype(np.int64), axis, q.ndim) if zp is not None else 0
    return ((q.astype(np.int64) - z).astype(np.float32) * s).astype(np.float32)


def quantised(x: np.ndarray, scale: np.ndarray, zp: np.ndarray | None, axis: int, dtype: int) -> np.ndarray:
    """QuantizeLinear of a constant: round_half_even(x / scale) + zp, saturated (numpy's rint is half to even)."""
    lo, hi = RANGES[dtype]
    s = _per_axis(scale.astype(np.float32), axis, x.ndim)
    z = _per_axis(zp.astype(np.int64), axis, x.ndim) if zp is not None else 0
    q = np.clip(np.rint(x.astype(np.float32) / s).astype(np.int64) + z, lo, hi)
    return q.astype(helper.tensor_dtype_to_np_dtype(dtype))


class StaticLowering:
    """The QuantizeLinear/DequantizeLinear handlers of one lowering (quantized._Lowering `lw`)."""

    def __init__(self, lw, proto: onnx.ModelProto):
        self.lw = lw
        self.readers: dict[str, list] = {}
        for node in proto.graph.node:
            for name in node.input:
                self.readers.setdefault(name, []).append(node)
        self.graph_outputs = {o.name for o in proto.graph.output}
        self.pending: dict[str, tuple] = {}   # quantised tensor -> (round(x / s), zp, lo, hi)
        self.fake: dict[str, tuple] = {}      # fake-quantised activation -> (round(x / s), zp, lo, hi, s)
        self.weights: dict[str, tuple] = {}   # dequantised constant -> (q, scale, zp, axis)
        self.centred: dict[str, str] = {}     # fake-quantised activation -> its integers, x / s rounded
        # Clip takes its bounds as inputs from opset 11; DequantizeLinear exists from opset 10
        self.opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 11)

    def _clip(self, x: str, lo: float, hi: float, out: str | None = None) -> str:
        lw = self.lw
        if self.opset >= 11:
            return lw.emit("Clip", [x, lw.const(lo, "qlo"), lw.const(hi, "qhi")], [out] if out else None)
        return lw.emit("Min", [lw.emit("Max", [x, lw.const(lo, "qlo")]), lw.const(hi, "qhi")], [out] if out else None)

    def _params(self, node):
        x, scale, zp = _inputs(node)
        c = self.lw.consts
        return x, c[scale], (c[zp] if zp else None), int(_attrs(node).get("axis", 1))

    def _constant(self, name: str, value: np.ndarray) -> None:
        self.lw.inits.append(numpy_helper.from_array(value, name))
        self.lw.consts[name] = value

    def quantise(self, node) -> None:
        lw = self.lw
        x, scale, zp, axis = self._params(node)
        dtype = _qtype(node, lw.consts, _inputs(node)[2])
        y = node.output[0]
        if x in lw.consts:
            self._constant(y, quantised(lw.consts[x], scale, zp, axis, dtype))
            return
        rounded = lw.emit("Round", [lw.emit("Div", [x, lw.const(scale.reshape(()), "qscale")])])
        z = float(zp.reshape(())) if zp is not None else 0.0
        lo, hi = RANGES[dtype]
        if y not in self.graph_outputs and all(self._same_dequantiser(r, node) for r in self.readers.get(y, [])):
            self.pending[y] = (rounded, z, lo, hi)
            return
        self._clip(lw.emit("Add", [rounded, lw.const(z, "qzp")]), lo, hi, y)
        lw.floated[y] = dtype

    def _same_dequantiser(self, reader, quantiser) -> bool:
        if reader.op_type != "DequantizeLinear" or reader.input[0] != quantiser.output[0]:
            return False
        c = self.lw.consts
        _, qs, qz = _inputs(quantiser)
        _, ds, dz = _inputs(reader)
        same = lambda a, b: (not a and not b) or (a in c and b in c and np.array_equal(c[a], c[b]))  # noqa: E731
        return ds in c and np.array_equal(c[qs], c[ds]) and same(qz, dz)

    def dequantise(self, node) -> None:
        lw = self.lw
        q, scale, zp, axis = self._params(node)
        out = node.output[0]
        if q in lw.consts:
            self._constant(out, dequantised(lw.consts[q], scale, zp, axis))
            self.weights[out] = (lw.consts[q], scale, zp, axis)
            return
        s = lw.const(scale.reshape(()), "dqscale")
        if q in self.pending:   # the QDQ pair: clip(round(x / s), lo - zp, hi - zp) * s
            rounded, z, lo, hi = self.pending[q]
            self.fake[out] = (rounded, z, lo, hi, float(scale.reshape(())))
            lw.emit("Mul", [self._clip(rounded, lo - z, hi - z), s], [out])
            return
        centred = lw.as_float(q)
        if zp is not None and float(zp.reshape(())) != 0.0:
            centred = lw.emit("Sub", [centred, lw.const(float(zp.reshape(())), "dqzp")])
        lw.emit("Mul", [centred, s], [out])

    def matmul(self, node) -> None:
        """MatMul(fake-quantised activation, dequantised int8 weight [K, N], per column or per tensor, zero
        point 0) -> MatMul of the integers, times s_a * s_w[n]: the same sum, in the form
        int8_gemm_patch.py sums as integers (the conversion marks the Gemm; B is integers there)."""
        lw = self.lw
        a, b = node.input[0], node.input[1]
        act, weight = self.fake.get(a), self.weights.get(b)
        if act is None or weight is None:
            lw.other(node)
            return
        q, w_scale, w_zp, axis = weight
        per_column = w_scale.size == 1 or (q.ndim == 2 and axis in (1, -1) and w_scale.size == q.shape[1])
        if q.ndim != 2 or not per_column or (w_zp is not None and np.any(w_zp != 0)) or q.dtype.itemsize != 1:
            lw.other(node)
            return
        rounded, z, lo, hi, a_scale = act
        if a not in self.centred:   # one integer tensor for every MatMul that reads the activation
            self.centred[a] = self._clip(rounded, lo - z, hi - z)
        centred = self.centred[a]
        product = lw.emit("MatMul", [centred, lw.const(q.astype(np.float32), b + "_int")])
        scale = (np.float32(a_scale) * w_scale.astype(np.float32)).reshape(-1 if w_scale.size > 1 else ())
        lw.emit("Mul", [product, lw.const(scale, "mmscale")], [node.output[0]])
        lw.counts["MatMul summed as integers"] = lw.counts.get("MatMul summed as integers", 0) + 1

    def qlinear(self, node) -> None:
        """QLinearConv / QLinearMatMul (the QOperator format) -> the integer Conv / MatMul on centred
        integers (exact sums, the int32 bias added as onnxruntime adds it), then onnxruntime's
        requantisation: round_half_even(clip(acc * s, lo - zp, hi - zp)) + zp, with the multiplier
        s = x_scale * w_scale / y_scale computed in float32 in that order (qlinearconv.cc, MLAS)."""
        lw = self.lw
        conv = node.op_type == "QLinearConv"
        ins = list(node.input) + [""] * (9 - len(node.input))
        x, x_s, x_zp, w, w_s, w_zp, y_s, y_zp = ins[:8]
        c = lw.consts
        xc = lw.centred(x, x_zp or None, axis_last=False)
        wc = lw.centred(w, w_zp or None, axis_last=not conv)
        attrs = _attrs(node)
        multiplier = (np.float32(c[x_s].reshape(())) * c[w_s].astype(np.float32).reshape(-1)) / np.float32(c[y_s].reshape(()))
        inputs = [xc, wc]
        if conv and ins[8]:
            inputs.append(lw.const(c[ins[8]].astype(np.float32), ins[8]))   # int32 bias, exact in float
        acc = lw.emit("Conv" if conv else "MatMul", inputs, **attrs)
        if multiplier.size > 1 and conv:   # one per output channel: [C, 1, ...] against [N, C, spatial...]
            multiplier = multiplier.reshape((-1,) + (1,) * (c[w].ndim - 2))
        dtype = _np_type(c[y_zp]) if y_zp else TensorProto.UINT8
        lo, hi = RANGES[dtype]
        z = float(c[y_zp].reshape(())) if y_zp else 0.0
        scaled = lw.emit("Mul", [acc, lw.const(multiplier if multiplier.size > 1 else multiplier.reshape(()), "requant")])
        rounded = lw.emit("Round", [self._clip(scaled, lo - z, hi - z)])
        lw.emit("Add", [rounded, lw.const(z, "qzp")], [node.output[0]])
        lw.floated[node.output[0]] = dtype
