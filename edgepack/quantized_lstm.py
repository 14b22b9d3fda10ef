"""DynamicQuantizeLSTM's per-step quantisation of H, for edgepack/quantized.py.

onnxruntime's DynamicQuantizeLSTM quantises H (uint8, dynamic range) before every recurrent GEMM;
a whole ONNX LSTM cannot, so the lowered LSTM is unrolled (onnx_lstm.decompose) and H is
fake-quantised before each step's recurrent MatMul.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from . import onnx_lstm
from .errors import UnsupportedOpError
from .onnx_index import tensor_infos
from .quantized import _live, _Lowering


@dataclass(frozen=True, eq=False)
class QuantisedLstm:
    """One lowered DynamicQuantizeLSTM: X fake-quantised (x_fq = x_centred * x_scale) and its weights
    ([dirs, 4h, K], ONNX LSTM's layout): the integers less their zero points with one scale per
    direction, or, where the scales are per channel (scale None), the dequantised weights."""
    x_fq: str
    x_centred: str
    x_scale: str
    w: np.ndarray
    w_scale: np.ndarray | None
    r: np.ndarray
    r_scale: np.ndarray | None

    def dequantised(self, which: str) -> np.ndarray:
        ints, scale = (self.w, self.w_scale) if which == "w" else (self.r, self.r_scale)
        return ints * scale.reshape(-1, 1, 1) if scale is not None else ints


def lower_lstm(lw: _Lowering, node) -> None:
    """com.microsoft.DynamicQuantizeLSTM -> an ONNX LSTM on the dequantised weights, X fake-quantised."""
    # W [dirs, input, 4h] and R [dirs, h, 4h] (transposed against
    # ONNX LSTM), quantised per direction: w = (q - zp[d]) * scale[d]. onnxruntime also quantises
    # what it multiplies them with (uint8, dynamic range): X once for the whole sequence, and H
    # at every step. X is fake-quantised here; H needs the unrolled LSTM (quantise_recurrence).
    ins = list(node.input) + [""] * (12 - len(node.input))

    def weight(q, scale, zp):
        """(the dequantised weight, its integers less the zero point, one scale per direction or None)."""
        if q not in lw.consts or scale not in lw.consts or (zp and zp not in lw.consts):
            raise UnsupportedOpError(f"DynamicQuantizeLSTM {node.name!r}: weights are not constants",
                                     hint="export the float model")
        w = lw.consts[q].astype(np.float32)
        s = lw.consts[scale].astype(np.float32).reshape(-1, 1, 1)
        z = lw.consts[zp].astype(np.float32).reshape(-1, 1, 1) if zp else 0.0
        per_direction = np.broadcast_to(s.reshape(-1), (w.shape[0],)) if s.size in (1, w.shape[0]) else None
        return ((w - z) * s).transpose(0, 2, 1), (w - z).transpose(0, 2, 1), per_direction

    w, w_int, w_scale = weight(ins[1], ins[8], ins[9])
    r, r_int, r_scale = weight(ins[2], ins[10], ins[11])
    x_centred, x_scale = lw.quantise_centred(lw.as_float(ins[0]))
    x_fq = lw.emit("Mul", [x_centred, x_scale])
    lw.recurrent.append(QuantisedLstm(x_fq, x_centred, x_scale, w_int if w_scale is not None else w, w_scale,
                                      r_int if r_scale is not None else r, r_scale))
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    inputs = [x_fq, lw.const(w, ins[1]), lw.const(r, ins[2])]
    inputs += ins[3:8]
    while inputs and not inputs[-1]:
        inputs.pop()
    lw.nodes.append(helper.make_node("LSTM", inputs, list(node.output), name=lw.name(node.name or "lstm"), **attrs))


def quantise_recurrence(proto: onnx.ModelProto, lstms: list[QuantisedLstm], counts: dict) -> onnx.ModelProto:
    """Unroll the lowered LSTMs (onnx_lstm.decompose) and fake-quantise H before every recurrent
    MatMul, as onnxruntime's DynamicQuantizeLSTM quantises it at every step: without it the CRNN of
    the corpus (ddddocr_old_int8) is 1% of scale off, with it 1e-6. An LSTM that cannot be unrolled
    (dynamic sequence length) stays whole, and a count says so.

    Where a weight has one scale per direction, its MatMuls (X's projection, each step's recurrent
    product) sum the centred integers and scale after, as onnxruntime's integer GEMMs do: the integer
    GEMM kernels of the backends can take them (NCNN's int8 Gemm)."""
    inferred = onnx.shape_inference.infer_shapes(proto)   # decompose needs the static sequence length
    unrolled = onnx_lstm.decompose(inferred)
    del unrolled.graph.value_info[:]
    inits = {t.name: t for t in unrolled.graph.initializer}
    # decompose's constants: W^T [K, 4H] and R^T [H, 4H] per direction
    kinds = {}   # initializer -> (lstm, which, direction)
    for lstm in lstms:
        for which in ("w", "r"):
            deq = lstm.dequantised(which)
            for d in range(deq.shape[0]):
                for name, t in inits.items():
                    if tuple(t.dims) == deq[d].T.shape and np.array_equal(numpy_helper.to_array(t), deq[d].T):
                        kinds[name] = (lstm, which, d)
    lw = _Lowering(unrolled, infer=False, tag="lh")
    shapes = _static_shapes(unrolled)
    steps, summed, time_major = 0, 0, {}
    ints: dict[tuple, tuple[str, str]] = {}   # (lstm, which, direction) -> (integer weight, its scale)
    for node in unrolled.graph.node:
        scaled = None
        if node.op_type == "MatMul" and node.input[1] in kinds:
            lstm, which, d = kinds[node.input[1]]
            scale = lstm.w_scale if which == "w" else lstm.r_scale
            a = None     # (A's centred integers, A's scale)
            if which == "r":
                steps += 1
                if scale is None:        # per-channel scales: the fake-quantised H times the float weight
                    node.input[0] = lw.fake_quantise(node.input[0])
                else:
                    a = lw.quantise_centred(node.input[0])
            elif scale is not None and node.input[0] == lstm.x_fq:
                a = (lstm.x_centred, lstm.x_scale)
            if a:
                # (A - zp_a) . (W - zp_w), then * (scale_a * scale_w), as onnxruntime's integer GEMMs
                key = (id(lstm), which, d)
                if key not in ints:
                    ints[key] = (lw.const((lstm.w if which == "w" else lstm.r)[d].T, f"{which}_int"),
                                 lw.const(scale[d], f"{which}_scale"))
                node.input[0], node.input[1] = a[0], ints[key][0]
                scaled = (node.output[0], lw.emit("Mul", [a[1], ints[key][1]]))
                node.output[0] = lw.name(node.output[0])
                summed += 1
        lw.nodes.extend(_batch_axis_free(lw, node, shapes, time_major))
        if scaled:
            lw.emit("Mul", [node.output[0], scaled[1]], [scaled[0]])
    counts["recurrent steps quantised"] = steps
    counts["LSTM MatMuls summed as integers"] = summed
    counts["LSTM left whole"] = sum(n.op_type == "LSTM" for n in lw.nodes)
    nodes, kept = _live(lw.nodes, list(unrolled.graph.initializer) + lw.inits, {o.name for o in unrolled.graph.output})
    del unrolled.graph.node[:], unrolled.graph.initializer[:]
    unrolled.graph.node.extend(nodes)
    unrolled.graph.initializer.extend(kept)
    return unrolled


def _static_shapes(proto) -> dict[str, tuple]:
    """tensor -> dims, 0 for a dim not known (as _batch_axis_free reads them)."""
    return {name: tuple(d or 0 for d in info.dims) for name, info in tensor_infos(proto, strict=True, initializers=False).items()
            if info.dims is not None}


def _batch_axis_free(lw: _Lowering, node, shapes: dict, time_major: dict) -> list:
    """The unrolled LSTM slices its steps off axis 0 of [T, 1, K] and concatenates them back there;
    pnnx takes axis 0 for the batch, which ncnn cannot slice or concatenate (pnnx writes a Slice
    that ncnn refuses to load). With batch 1 the steps lie along axis 1 of [1, T, K] as well: the
    nodes that replace `node`, with the steps moved there."""
    if node.op_type == "Slice" and len(node.input) >= 4 and node.input[3] in lw.consts:
        shape = shapes.get(node.input[0], ())
        if lw.consts[node.input[3]].reshape(-1).tolist() == [0] and len(shape) == 3 and shape[1] == 1:
            if node.input[0] not in time_major:
                dims = lw.shape_const((1, shape[0], shape[2]))
                time_major[node.input[0]] = lw.emit("Reshape", [node.input[0], dims])
            node.input[0] = time_major[node.input[0]]
            node.input[3] = lw.shape_const((1,))
    elif node.op_type == "Concat" and helper.get_attribute_value(node.attribute[0]) == 0 and node.input:
        # the steps' H are [1, B, H] (decompose's Concats; shapes may be unknown before onnxsim):
        # Concat on axis 1 -> [1, T*B, H], Reshape to [T, B, H] with dims -1 and 0 (= copy H)
        parts = [shapes.get(i) for i in node.input]     # a dim of 0: not known
        if all(p is None or (len(p) == 3 and p[0] in (0, 1)) for p in parts) and \
                (any(p and p[0] == 1 for p in parts) or "/unrolled" in node.name):
            out = node.output[0]
            node.output[0] = lw.name(out)
            node.attribute[0].i = 1
            dims = lw.shape_const((len(node.input), -1, 0))
            return [node, helper.make_node("Reshape", [node.output[0], dims], [out])]
    return [node]
