"""Lower onnxruntime's int8 ops (dynamic, and static QDQ) to float ONNX ops that compute the same numbers.

``onnxruntime.quantization.quantize_dynamic`` (and its older ``onnx.quantize`` ancestor) rewrites a
float model into DynamicQuantizeLinear + ConvInteger / MatMulInteger (+ com.microsoft
DynamicQuantizeLSTM). Neither NCNN nor TVM takes these ops, but every one of them has an exact float
equivalent: the quantised activations are small integers, held here as "integer-valued" float32
tensors, and the integer convolutions become float convolutions on (x - x_zp) and (w - w_zp).

Handled: DynamicQuantizeLinear, ConvInteger, MatMulInteger, com.microsoft.DynamicQuantizeLSTM, the
QDQ format's QuantizeLinear/DequantizeLinear (quantize_static; quantized_qdq.py) and the QOperator
format's QLinearConv/QLinearMatMul. Everything else quantised (the com.microsoft QLinear* and Q* ops)
is refused with one clear error.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .errors import UnsupportedOpError
from .model import LoadedModel, _with
from .onnx_index import constants, tensor_infos

LOWERED = ("DynamicQuantizeLinear", "ConvInteger", "MatMulInteger", "com.microsoft.DynamicQuantizeLSTM",
           "QuantizeLinear", "DequantizeLinear", "QLinearConv", "QLinearMatMul")
# quantised ops this module does not lower (and every QLinear* op): refused before any backend tries them
REFUSED = frozenset({"MatMulInteger16", "QAttention", "QGemm",
                     "DynamicQuantizeMatMul", "MatMulIntegerToFloat", "QOrderedMatMul", "MatMulNBits"})

# ops that only move or select elements: an integer-valued float stays one, same original dtype
_MOVES = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "Concat", "Slice",
          "Gather", "Expand", "Tile", "Split", "Pad", "MaxPool", "GlobalMaxPool"}
# exact on integers held in float32 while the values stay below 2^24 in magnitude
_ARITH = {"Add", "Sub", "Mul", "Neg", "Abs", "Max", "Min", "Relu"}
_INTEGRAL = {"Floor", "Ceil", "Round"}  # float outputs that already hold integers
LOWERED_KEY = "edgepack.lowered_quantisation"  # metadata of a lowered graph (onnxsim keeps it)
_STATIC = ("QuantizeLinear", "DequantizeLinear")
_QOPERATOR = ("QLinearConv", "QLinearMatMul")
_BIG = float(2.0 ** 100)


def _op(node) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"


def lower_quantized(model: LoadedModel) -> LoadedModel:
    """The model with the handled dynamic-int8 ops lowered to float ops; unchanged without them."""
    ops = model.ops()
    refused = sorted(op for op in ops if op.split(".")[-1] in REFUSED
                     or (op.split(".")[-1].startswith("QLinear") and op not in _STATIC + _QOPERATOR)
                     or (op.startswith("com.microsoft.") and op.split(".")[-1] in _STATIC))
    if refused:
        op = refused[0]
        raise UnsupportedOpError(
            f"{model.path.name}: quantised op {op} (node {ops[op][0]!r}) is not supported by any backend",
            hint=f"export the float model; of quantised ops edgepack lowers only {', '.join(LOWERED)} "
                 "(onnxruntime quantize_dynamic output)")
    found = [op for op in LOWERED if op in ops]
    if not found:
        return model
    lw = _Lowering(model.proto)
    if any(op in ops for op in _STATIC + _QOPERATOR):
        from .quantized_qdq import qdq_problem
        problem = qdq_problem(model.proto, lw.consts, lw.types)
        if problem:
            raise UnsupportedOpError(f"{model.path.name}: {problem}: no backend runs it",
                                     hint="quantise per tensor (activations) or per channel (weights) to "
                                          "8 or 16 bits with constant scales (quantize_static), or export the float model")
    proto, counts = lower_graph(model.proto, lw)
    done = ", ".join(f"{counts[op]} {op}" for op in LOWERED if counts.get(op))
    if counts.get("MatMul summed as integers"):
        done += f"; {counts['MatMul summed as integers']} MatMul of int8 weights on integers (then scaled)"
    if counts.get("com.microsoft.DynamicQuantizeLSTM"):
        done += (f"; H quantised at {counts['recurrent steps quantised']} unrolled LSTM steps"
                 + (f", {counts['LSTM MatMuls summed as integers']} LSTM MatMuls summed as integers (then scaled)"
                    if counts.get("LSTM MatMuls summed as integers") else "")
                 + (f", {counts['LSTM left whole']} LSTM left whole (H not quantised: sequence length not static)"
                    if counts["LSTM left whole"] else ""))
    return _with(model, proto, f"quantised ops lowered to float: {done}")


class _Lowering:
    def __init__(self, proto: onnx.ModelProto, infer: bool = True, tag: str = "lq"):
        self.consts = constants(proto)
        # contrib ops make onnx's inference give up on some models: their types default below
        self.types = {name: info.elem_type for name, info in tensor_infos(proto, infer=infer).items()}
        self.floated: dict[str, int] = {}   # tensor -> its original integer dtype, now held in float32
        self.producer: dict[str, onnx.NodeProto] = {}
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.counts: dict[str, int] = {}
        self.rank1: set[str] = set()             # DynamicQuantizeLinear scale/zp, [1] here, scalars there
        self.recurrent: list = []   # a quantized_lstm.QuantisedLstm for each lowered DynamicQuantizeLSTM
        self._n, self._tag = 0, tag

    def name(self, base: str) -> str:
        self._n += 1
        return f"{base}__{self._tag}{self._n}"

    def emit(self, op: str, inputs, outputs=None, **attrs) -> str:
        outputs = outputs or [self.name(op.lower())]
        node = helper.make_node(op, list(inputs), list(outputs), **attrs)
        self.nodes.append(node)
        for o in outputs:
            self.producer[o] = node
        return outputs[0]

    def const(self, value, base: str) -> str:
        name = self.name(base)
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype=np.float32), name))
        return name

    def as_float(self, name: str) -> str:
        """A float32 tensor holding the same (integer) values as `name`."""
        if name in self.floated or self.types.get(name) == TensorProto.FLOAT:
            return name
        if name in self.consts:
            return self.const(self.consts[name].astype(np.float32), name)
        return self.emit("Cast", [name], to=TensorProto.FLOAT)

    def as_original(self, name: str) -> str:
        """The tensor in its original integer dtype, for consumers that need it."""
        if name not in self.floated:
            return name
        return self.emit("Cast", [name], [self.name(name)], to=self.floated[name])

    # ---- the lowered ops ----

    def quantise(self, x: str, y: str | None = None, scale: str | None = None, zp: str | None = None):
        """DynamicQuantizeLinear's three outputs (y and zp integer-valued float; scale and zp of shape
        [1]), as the ONNX spec (uint8) and onnxruntime's kernel compute them: range widened to include
        0; scale = range/255 (onnxruntime uses 1 when the range is 0, reproduced by
        + Relu(1 - range*2^100), exact for any range >= 2^-100); zp = round(clip(-min/scale, 0, 255));
        y = clip(round(x/scale) + zp, 0, 255), rounding half to even. Written with ops NCNN has:
        min/max as GlobalMaxPool, rounding with Round (half to even)."""
        y, scale, zp = y or self.name("q"), scale or self.name("scale"), zp or self.name("zp")
        flat = self.emit("Reshape", [x, self.shape_const((1, 1, 1, -1))])
        one = self.shape_const((1,))
        hi = self.emit("Reshape", [self.emit("GlobalMaxPool", [flat]), one])
        lo = self.emit("Reshape", [self.emit("GlobalMaxPool", [self.emit("Neg", [flat])]), one])
        zero = self.const(0.0, "zero")
        hi = self.emit("Relu", [hi])                       # max(max(x), 0)
        nlo = self.emit("Relu", [lo])                      # -min(min(x), 0)
        span = self.emit("Add", [hi, nlo])
        raw = self.emit("Div", [span, self.const(255.0, "qmax")])
        empty = self.emit("Relu", [self.emit("Sub", [self.const(1.0, "one"),
                                                     self.emit("Mul", [span, self.const(_BIG, "big")])])])
        self.emit("Add", [raw, empty], [scale])
        q255 = self.const(255.0, "q255")
        self._round_even(self.emit("Clip", [self.emit("Div", [nlo, scale]), zero, q255]), zp)
        shifted = self.emit("Add", [self._round_even(self.emit("Div", [x, scale])), zp])
        self.emit("Clip", [shifted, zero, q255], [y])
        self.floated[y] = self.floated[zp] = TensorProto.UINT8
        self.rank1.update((scale, zp))
        return y, scale, zp

    def _round_even(self, v: str, out: str | None = None) -> str:
        # ONNX Round is half to even, as onnxruntime's quantiser rounds; pnnx makes it ncnn's UnaryOp
        # round (nearbyint / _mm_round_ps, half to even) and TVM's round is too (both checked on
        # ties). One layer per rounding: the Floor-based form it replaced took 12 per tensor.
        return self.emit("Round", [v], [out] if out else None)

    def shape_const(self, dims) -> str:
        name = self.name("shape")
        self.inits.append(numpy_helper.from_array(np.asarray(dims, dtype=np.int64), name))
        return name

    def fake_quantise(self, x: str, out: str | None = None) -> str:
        """x rounded to the uint8 grid DynamicQuantizeLinear would put it on, back in float:
        (q - zp) * scale, what onnxruntime's quantised GEMMs multiply."""
        centred, scale = self.quantise_centred(x)
        return self.emit("Mul", [centred, scale], [out] if out else None)

    def quantise_centred(self, x: str) -> tuple[str, str]:
        """x on DynamicQuantizeLinear's uint8 grid less its zero point (integer-valued float), and the
        scale: what onnxruntime's integer GEMMs sum before they scale."""
        y, scale, zp = self.quantise(x)
        return self.emit("Sub", [y, zp]), scale

    def centred(self, x: str, zp: str | None, axis_last: bool) -> str:
        """x - zp in float; a constant x and zp are folded into one float initializer."""
        if x in self.consts and (not zp or zp in self.consts):
            w = self.consts[x].astype(np.float32)
            if zp:
                z = self.consts[zp].astype(np.float32)
                if z.ndim == 1 and z.size > 1 and not axis_last:   # per output channel of a conv weight
                    z = z.reshape((-1,) + (1,) * (w.ndim - 1))
                w = w - z
            return self.const(w, x)
        xf = self.as_float(x)
        if not zp:
            return xf
        z = self.as_float(zp)
        if zp in self.consts and self.consts[zp].size > 1 and not axis_last:  # per-row A zero point
            z = self.const(self.consts[zp].astype(np.float32).reshape(-1, 1), zp)
        return self.emit("Sub", [xf, z])

    def integer_product(self, node) -> None:
        # ConvInteger/MatMulInteger -> Conv/MatMul on (x - x_zp) and (w - w_zp), integers in [-255, 255]:
        # their products and partial sums are exact in float32 while |sum| < 2^24, which holds for any
        # kernel of <= 258 taps and in practice far beyond (activations spread around their zero
        # point); beyond it the rounding is 2^-24 relative
        ins = list(node.input) + [""] * (4 - len(node.input))
        conv = node.op_type == "ConvInteger"
        x = self.centred(ins[0], ins[2], axis_last=False)
        w = self.centred(ins[1], ins[3], axis_last=not conv)
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        self.emit("Conv" if conv else "MatMul", [x, w], [node.output[0]], **attrs)
        self.floated[node.output[0]] = TensorProto.INT32

    def other(self, node) -> None:
        hit = [i for i in node.input if i in self.floated]
        src = self.producer.get(node.input[0]) if node.input else None
        if node.op_type == "Cast" and src is not None and src.op_type in _INTEGRAL:
            # Cast(Floor(x), to=int32), the old quantiser's bias path: keep the float integers
            self.emit("Identity", [node.input[0]], [node.output[0]])
            self.floated[node.output[0]] = helper.get_attribute_value(node.attribute[0])
            return
        if not hit:
            self.nodes.append(node)
            for o in node.output:
                self.producer[o] = node
            return
        dtype = self.floated[hit[0]]
        if node.op_type == "Cast" and helper.get_attribute_value(node.attribute[0]) == TensorProto.FLOAT:
            self.emit("Identity", [node.input[0]], [node.output[0]])
            return
        moves = node.op_type in _ARITH or (node.op_type in _MOVES and node.input[0] in self.floated)
        if moves:   # arithmetic and data movement stay in float: every data input becomes float
            data = len(node.input) if node.op_type in _ARITH | {"Concat"} else 1
            inputs = [self.as_float(i) if k < data and i else i for k, i in enumerate(node.input)]
        else:       # any other consumer gets the original integer tensor back
            inputs = [self.as_original(i) for i in node.input]
        new = onnx.NodeProto()
        new.CopyFrom(node)
        new.input[:] = inputs
        self.nodes.append(new)
        for o in new.output:
            self.producer[o] = new
            if moves:
                self.floated[o] = self.types.get(o, dtype) if node.op_type in _ARITH else dtype


def lower_graph(proto: onnx.ModelProto, lw: "_Lowering | None" = None) -> tuple[onnx.ModelProto, dict[str, int]]:
    """A copy of `proto` with the handled ops lowered; the count of each op lowered. `lw`: a fresh
    _Lowering of `proto` the caller already made (its shape inference is the costly part)."""
    from .quantized_lstm import lower_lstm, quantise_recurrence
    from .quantized_qdq import StaticLowering
    lw = lw or _Lowering(proto)
    static = StaticLowering(lw, proto)
    handlers = {"DynamicQuantizeLinear": lambda n: lw.quantise(n.input[0], *n.output),
                "ConvInteger": lw.integer_product, "MatMulInteger": lw.integer_product,
                "com.microsoft.DynamicQuantizeLSTM": lambda n: lower_lstm(lw, n),
                "QuantizeLinear": static.quantise, "DequantizeLinear": static.dequantise, "MatMul": static.matmul,
                "QLinearConv": static.qlinear, "QLinearMatMul": static.qlinear}
    for node in proto.graph.node:
        op = _op(node)
        handler = handlers.get(op, lw.other)
        handler(node)
        if op in handlers and op != "MatMul":   # a MatMul is counted only where it was lowered
            lw.counts[op] = lw.counts.get(op, 0) + 1
    outputs = {o.name for o in proto.graph.output}
    for name in outputs & (set(lw.floated) | lw.rank1):   # graph outputs keep their declared type
        inner = lw.name(name)
        for n in lw.nodes:
            n.output[:] = [inner if o == name else o for o in n.output]
            n.input[:] = [inner if i == name else i for i in n.input]
        last = lw.emit("Reshape", [inner, lw.shape_const(())]) if name in lw.rank1 else inner
        if name in lw.floated:
            lw.emit("Cast", [last], [name], to=lw.floated[name])
        else:
            lw.emit("Identity", [last], [name])
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    graph = out.graph
    nodes, inits = _live(lw.nodes, list(proto.graph.initializer) + lw.inits, outputs)
    del graph.node[:], graph.value_info[:], graph.initializer[:]
    graph.node.extend(nodes)
    graph.initializer.extend(inits)
    # LSTM and the float ops are plain ONNX: the com.microsoft import stays only if still used
    if not any(n.domain == "com.microsoft" for n in nodes):
        kept = [o for o in out.opset_import if o.domain != "com.microsoft"]
        del out.opset_import[:]
        out.opset_import.extend(kept)
    if lw.recurrent:
        out = quantise_recurrence(out, lw.recurrent, lw.counts)
    # dynamic int8 and QLinearConv sum integers in their convolutions (exact, as onnxruntime's kernels);
    # QDQ graphs convolve floats
    if lw.counts.get("QLinearConv") and not lw.counts.get("ConvInteger"):
        kind = "integer-convolutions"
    else:
        kind = "static-int8" if any(lw.counts.get(op) for op in _STATIC + _QOPERATOR) else "dynamic-int8"
    out.metadata_props.append(onnx.StringStringEntryProto(key=LOWERED_KEY, value=kind))
    return out, lw.counts


def rounds_quotients(proto: onnx.ModelProto) -> bool:
    """Whether `proto` carries lowered quantisation (dynamic or static): activations divided by a scale
    and rounded, where a quotient one ulp off a tie rounds the other way (a fast-math division is)."""
    return any(p.key == LOWERED_KEY for p in proto.metadata_props)


def sums_integers(proto: onnx.ModelProto) -> bool:
    """Whether `proto`'s lowered convolutions sum integers exactly, as ConvInteger and QLinearConv do
    (dynamic int8, the QOperator format): no Winograd there, whose fractional transforms moved
    ddddocr_old_int8 by 1.3%. A QDQ graph's reference convolutions are float ones: Winograd stays."""
    return any(p.key == LOWERED_KEY and p.value in ("dynamic-int8", "integer-convolutions")
               for p in proto.metadata_props)


def _live(nodes, inits, outputs: set[str]):
    """Nodes (and initializers) that the graph outputs depend on, in their order."""
    need, keep = set(outputs), []
    for n in reversed(nodes):
        if any(o in need for o in n.output):
            keep.append(n)
            need.update(i for i in n.input if i)
    return keep[::-1], [t for t in inits if t.name in need]
