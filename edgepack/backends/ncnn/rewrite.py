"""ONNX graph rewrites that keep real models on NCNN.

pnnx tracks one batch axis per tensor and gives up on layers that move or cut across it: a
Transpose that puts the batch axis second followed by a Slice/Squeeze/Gather (SVTR attention's
qkv split), a Reshape that drops a unit axis pnnx takes for the batch (CRNN heads), strided
slices (YOLOX's Focus). Those stay as `Tensor.reshape`/`Tensor.slice`/`torch.unbind` layers that
ncnn cannot load. A time-major [T, C] tail that meets a batch-0 tensor has its T axis dropped
(seq_first.py lifts it to [1, T, C]). pnnx also maps an ONNX LSTM to ncnn's only in the exact form torch exports.
With every input shape fixed and batch 1, each of these has an equivalent form pnnx converts.

Each rewrite changes a static-shape model in place and returns how often it fired;
`rewrite_for_ncnn` applies them all to a copy. Values are unchanged: the rewrites move unit axes,
reorder slicing and transposing, or pick pixels with one-hot convolutions (tests/test_rewrite.py
checks each against onnxruntime, bit for bit).
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...onnx_index import remove_dead_nodes  # noqa: F401  (rewrites and their callers use it from here)
from .pnnx_forms import auto_pad_explicit, gemm_bias_as_vector, pad_mode_explicit, reduce_axis_with_unit_batch, resize_roi_unread
from .seq_first import lift_sequence_tail

# Part of the NCNN conversion cache key: bump when a rewrite's output changes.
VERSION = 8  # 2: lift_sequence_tail; 3: focus_to_pixel_unshuffle; 4-6: pnnx_forms; 7: GRU forms (recurrent_forms.py); 8: auto_pad_explicit


class _Graph:
    """Index of one (static-shape) graph: producers, consumers, shapes and constants."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.g = model.graph
        inferred = onnx.shape_inference.infer_shapes(model)
        self.shapes: dict[str, tuple[int, ...]] = {}
        for v in [*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output]:
            dims = v.type.tensor_type.shape.dim
            if v.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
                self.shapes[v.name] = tuple(int(d.dim_value) for d in dims)
        self.consts = {i.name: numpy_helper.to_array(i) for i in self.g.initializer}
        for n in self.g.node:
            if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
                self.consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
        for name, arr in self.consts.items():
            self.shapes.setdefault(name, tuple(arr.shape))
        self.producer = {o: n for n in self.g.node for o in n.output}
        self.consumers: dict[str, list] = {}
        for n in self.g.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.outputs = {o.name for o in self.g.output}
        # fresh names continue after any this module gave before (deterministic, so builds reproduce)
        names = [*(o for n in self.g.node for o in n.output), *(i.name for i in self.g.initializer)]
        self._uid = max((int(x.rsplit("__ep", 1)[1]) for x in names
                         if "__ep" in x and x.rsplit("__ep", 1)[1].isdigit()), default=0)

    def const_ints(self, name: str) -> list[int] | None:
        arr = self.consts.get(name)
        return None if arr is None else [int(v) for v in np.asarray(arr).reshape(-1)]

    def only_reader(self, name: str):
        """The one node that reads ``name``, when nothing else does and it is not a graph output; else None."""
        users = self.consumers.get(name, [])
        return users[0] if len(users) == 1 and name not in self.outputs else None

    def fresh(self, base: str) -> str:
        self._uid += 1
        return f"{base}__ep{self._uid}"

    def add_const(self, base: str, arr: np.ndarray) -> str:
        name = self.fresh(base)
        self.g.initializer.append(numpy_helper.from_array(arr, name))
        return name


def _apply(graph: onnx.GraphProto, plan: dict[int, list], fired: int | None = None) -> int:
    """Put plan[i]'s nodes where node i was (keeps the node list topologically sorted); returns how
    many rewrites fired (fired, or one per planned node)."""
    if plan:
        nodes = []
        for i, n in enumerate(graph.node):
            nodes.extend(plan.get(i, [n]))
        del graph.node[:]
        graph.node.extend(nodes)
    return len(plan) if fired is None else fired


def _attr(node, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _plain_conv(gr: _Graph, node, rank: int) -> tuple[tuple[int, ...], np.ndarray] | None:
    """(input shape, weight) of a group-1 Conv with explicit padding and a constant weight of ``rank``
    dims over a batch-1 input of the same rank (the shape every conv rewrite here starts from), else
    None."""
    shape, weight = gr.shapes.get(node.input[0]), gr.consts.get(node.input[1])
    if shape is None or weight is None or len(shape) != rank or shape[0] != 1 or weight.ndim != rank:
        return None
    if _attr(node, "group", 1) != 1 or _attr(node, "auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
        return None
    return shape, weight


def _slice_args(gr: _Graph, node) -> tuple[list, list, list, list] | None:
    """(starts, ends, axes, steps) of an opset-10+ Slice with constant arguments."""
    if len(node.input) < 3:
        return None
    args = [gr.const_ints(x) if x else None for x in node.input[1:5]]
    starts, ends = args[0], args[1]
    if starts is None or ends is None:
        return None
    axes = args[2] if len(args) > 2 and args[2] is not None else list(range(len(starts)))
    steps = args[3] if len(args) > 3 and args[3] is not None else [1] * len(starts)
    rank = len(gr.shapes.get(node.input[0], ()))
    return starts, ends, [a + rank if a < 0 else a for a in axes], steps


def _inverse(perm: list[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


# ---- rewrites -------------------------------------------------------------------------------

def slice_before_transpose(model: onnx.ModelProto) -> int:
    """Slice(Transpose(x, perm)) -> Transpose(Slice(x) on the matching axes, perm).

    SVTR attention splits q/k/v with slices on axis 0 after a transpose that moved the batch axis
    to position 1; slicing before the transpose keeps pnnx's batch axis where it can follow it."""
    gr, plan = _Graph(model), {}
    for pos, node in enumerate(list(gr.g.node)):
        if node.op_type != "Slice":
            continue
        t = gr.producer.get(node.input[0])
        args = _slice_args(gr, node)
        if t is None or t.op_type != "Transpose" or args is None or node.input[0] in gr.outputs:
            continue
        perm = _attr(t, "perm")
        if perm is None:
            continue
        starts, ends, axes, steps = args
        new_axes = np.array([perm[a] for a in axes], np.int64)
        sliced = gr.fresh(node.output[0] + "_pre")
        ins = [t.input[0], gr.add_const("starts", np.array(starts, np.int64)),
               gr.add_const("ends", np.array(ends, np.int64)), gr.add_const("axes", new_axes),
               gr.add_const("steps", np.array(steps, np.int64))]
        plan[pos] = ([helper.make_node("Slice", ins, [sliced], name=gr.fresh(node.name or "slice")),
                              helper.make_node("Transpose", [sliced], list(node.output), perm=list(perm),
                                               name=gr.fresh(t.name or "transpose"))])
    return _apply(gr.g, plan)


def squeeze_before_transpose(model: onnx.ModelProto) -> int:
    """Squeeze(Transpose(x, perm), axes) -> Transpose(Squeeze(x, perm[axes]), perm without them)."""
    gr, plan = _Graph(model), {}
    for pos, node in enumerate(list(gr.g.node)):
        if node.op_type != "Squeeze":
            continue
        t = gr.producer.get(node.input[0])
        if t is None or t.op_type != "Transpose" or _attr(t, "perm") is None:
            continue
        perm = list(_attr(t, "perm"))
        axes = _attr(node, "axes") if len(node.input) < 2 else gr.const_ints(node.input[1])
        if axes is None:
            continue
        axes = sorted(a + len(perm) if a < 0 else a for a in axes)
        src_axes = sorted(perm[a] for a in axes)
        kept = [p for i, p in enumerate(perm) if i not in axes]
        new_perm = [p - sum(1 for s in src_axes if s < p) for p in kept]
        squeezed = gr.fresh(node.output[0] + "_pre")
        sq = helper.make_node("Squeeze", [t.input[0], gr.add_const("axes", np.array(src_axes, np.int64))],
                              [squeezed], name=gr.fresh(node.name or "squeeze"))
        if model.opset_import and _opset(model) < 13:
            sq = helper.make_node("Squeeze", [t.input[0]], [squeezed], axes=src_axes, name=sq.name)
        plan[pos] = ([sq, helper.make_node("Transpose", [squeezed], list(node.output), perm=new_perm,
                                                   name=gr.fresh(t.name or "transpose"))])
    return _apply(gr.g, plan)


def gather_before_transpose(model: onnx.ModelProto) -> int:
    """Gather(Transpose(x, perm), scalar i, axis a) -> Transpose(Gather(x, i, perm[a]), perm')."""
    gr, plan = _Graph(model), {}
    for pos, node in enumerate(list(gr.g.node)):
        if node.op_type != "Gather":
            continue
        t = gr.producer.get(node.input[0])
        idx = gr.consts.get(node.input[1])
        if t is None or t.op_type != "Transpose" or _attr(t, "perm") is None or idx is None or idx.ndim != 0:
            continue
        perm = list(_attr(t, "perm"))
        a = _attr(node, "axis", 0)
        a = a + len(perm) if a < 0 else a
        src = perm[a]
        new_perm = [p - (p > src) for i, p in enumerate(perm) if i != a]
        gathered = gr.fresh(node.output[0] + "_pre")
        plan[pos] = ([
            helper.make_node("Gather", [t.input[0], node.input[1]], [gathered], axis=src,
                             name=gr.fresh(node.name or "gather")),
            helper.make_node("Transpose", [gathered], list(node.output), perm=new_perm,
                             name=gr.fresh(t.name or "transpose"))])
    return _apply(gr.g, plan)


def unit_axis_first_before_reshape(model: onnx.ModelProto) -> int:
    """Reshape of x[d0, ..., 1 at axis k>0, ...] (d0 > 1) -> Reshape(Transpose(x) with axis k first).

    A time-major CRNN tensor [T, 1, C] carries the batch axis second; pnnx cannot reshape across
    it. Moving a unit axis does not move any data, so the Reshape's result is the same."""
    gr, plan = _Graph(model), {}
    for pos, node in enumerate(list(gr.g.node)):
        if node.op_type != "Reshape":
            continue
        shape = gr.shapes.get(node.input[0])
        if not shape or len(shape) < 2 or shape[0] == 1 or 1 not in shape[1:]:
            continue
        if _feeds_recurrent(gr, node.output[0]) or _from_recurrent(gr, node.input[0]):
            continue  # pnnx matches LSTM and GRU with their own reshapes around them
        k = shape.index(1, 1)
        perm = [k] + [i for i in range(len(shape)) if i != k]
        moved = gr.fresh(node.input[0] + "_unitfirst")
        plan[pos] = ([
            helper.make_node("Transpose", [node.input[0]], [moved], perm=perm, name=gr.fresh("unitfirst")),
            helper.make_node("Reshape", [moved, node.input[1]], list(node.output),
                             name=node.name or gr.fresh("reshape"))])
    return _apply(gr.g, plan)


def _stride2_pick(gr: _Graph, name: str) -> tuple[str, tuple[int, int]] | None:
    """(x, (row, col)) when ``name`` is x[:, :, row::2, col::2] of a 4-D x with even H and W: one Slice on
    both axes, or two chained one-axis Slices (the second the only reader of the first)."""
    offset: dict[int, int] = {}
    for depth in range(2):
        node = gr.producer.get(name)
        if node is None or node.op_type != "Slice" or (depth and len(gr.consumers.get(name, [])) != 1):
            return None
        args, shape = _slice_args(gr, node), gr.shapes.get(node.input[0])
        if args is None or shape is None or len(shape) != 4:
            return None
        for st, en, ax, sp in zip(*args):
            if ax not in (2, 3) or ax in offset or sp != 2 or st not in (0, 1) or en < shape[ax] or shape[ax] % 2:
                return None
            offset[ax] = st
        name = node.input[0]
        if len(offset) == 2:
            return name, (offset[2], offset[3])
    return None


def focus_to_pixel_unshuffle(model: onnx.ModelProto) -> int:
    """Concat on channels of x's four stride-2 pixel picks (YOLOX's and YOLOv5's Focus), read only by
    Convs -> pixel_unshuffle(x) as Reshape-Transpose-Reshape, which pnnx turns into one ncnn Reorg,
    with each Conv's input channels reordered to the Reorg's order (channel-major: c*4 + row*2 + col).

    Without it strided_slice_to_conv makes four one-hot depthwise Convs and a Concat: five passes
    over the input, channel-parallel over 3 channels only (ddddocr_det, x86, 3.3 of 50 ms on 1 thread,
    no faster on 2). ONNX's SpaceToDepth would say it in one node, but pnnx maps it to a Reorg of the
    other channel order (wrong results, checked against onnxruntime)."""
    gr, plan = _Graph(model), {}
    pos_of = {id(n): i for i, n in enumerate(gr.g.node)}
    for pos, node in enumerate(list(gr.g.node)):
        if node.op_type != "Concat" or len(node.input) != 4 or node.output[0] in gr.outputs:
            continue
        picks = [_stride2_pick(gr, i) for i in node.input]
        if any(p is None for p in picks) or len({p[0] for p in picks}) != 1 or len({p[1] for p in picks}) != 4:
            continue
        x = picks[0][0]
        n, c, h, w = gr.shapes[x]
        if _attr(node, "axis") not in (1, -3) or n != 1:
            continue
        readers = gr.consumers.get(node.output[0], [])
        if not readers or any(r.op_type != "Conv" or list(r.input).count(node.output[0]) != 1 or r.input[0] != node.output[0]
                              or _attr(r, "group", 1) != 1 or r.input[1] not in gr.consts for r in readers):
            continue
        # Reorg channel q*4 + row*2 + col holds what the Concat had at k*C + q, k = the pick's place
        source = np.empty(4 * c, np.int64)
        for k, (_, (row, col)) in enumerate(picks):
            source[np.arange(c) * 4 + row * 2 + col] = k * c + np.arange(c)
        grid = gr.fresh(x + "_grid")
        moved = gr.fresh(x + "_moved")
        plan[pos] = [
            helper.make_node("Reshape", [x, gr.add_const("shape", np.array([1, c, h // 2, 2, w // 2, 2], np.int64))],
                             [grid], name=gr.fresh("unshuffle")),
            helper.make_node("Transpose", [grid], [moved], perm=[0, 1, 3, 5, 2, 4], name=gr.fresh("unshuffle")),
            helper.make_node("Reshape", [moved, gr.add_const("shape", np.array([1, 4 * c, h // 2, w // 2], np.int64))],
                             list(node.output), name=node.name or gr.fresh("unshuffle"))]
        for r in readers:
            conv = onnx.NodeProto()
            conv.CopyFrom(r)
            conv.input[1] = gr.add_const("focus_w", np.ascontiguousarray(gr.consts[r.input[1]][:, source]))
            plan[pos_of[id(r)]] = [conv]
    return _apply(gr.g, plan, fired=sum(1 for p in plan.values() if len(p) == 3))


def strided_slice_to_conv(model: onnx.ModelProto) -> int:
    """Slice with steps > 1 on H/W of a float NCHW tensor -> depthwise Conv with one-hot kernels.

    YOLOX's Focus takes x[..., ::2, ::2] four ways; ncnn's Crop has no step. A kernel of size
    step with a single 1 at (start_h, start_w), stride step, picks exactly the same pixels."""
    gr, plan = _Graph(model), {}
    for pos, node in enumerate(list(gr.g.node)):
        if node.op_type != "Slice":
            continue
        shape = gr.shapes.get(node.input[0])
        args = _slice_args(gr, node)
        if args is None or shape is None or len(shape) != 4:
            continue
        starts, ends, axes, steps = args
        if not any(s > 1 for s in steps) or not set(axes) <= {2, 3}:
            continue
        kernel, offset, ok = [1, 1], [0, 0], True
        for st, en, ax, sp in zip(starts, ends, axes, steps):
            dim = shape[ax]
            want = len(range(st, min(en, dim), sp)) if 0 <= st < sp and sp > 0 else -1
            if want != dim // sp or want <= 0:  # the Conv's output size must match the slice's
                ok = False
            kernel[ax - 2], offset[ax - 2] = sp, st
        if not ok:
            continue
        c = shape[1]
        w = np.zeros((c, 1, kernel[0], kernel[1]), np.float32)
        w[:, 0, offset[0], offset[1]] = 1.0
        plan[pos] = ([helper.make_node(
            "Conv", [node.input[0], gr.add_const("onehot", w)], list(node.output), group=c,
            kernel_shape=kernel, strides=kernel, pads=[0, 0, 0, 0], name=gr.fresh(node.name or "focus"))])
    return _apply(gr.g, plan)


def slice_of_split_reshape(model: onnx.ModelProto) -> int:
    """Slice(Reshape(x -> [..., K, H, D]), axis of K, one step) -> Reshape(Slice(x on its last axis)).

    A fused qkv projection is reshaped to 5-D [1, N, 3, heads, dim] and then cut on the "3" axis;
    pnnx leaves both the 5-D reshape and the cut. When the cut axis and everything after it come
    from x's last axis, the same values are a contiguous range of that axis."""
    gr, plan = _Graph(model), {}
    for pos, node in enumerate(list(gr.g.node)):
        if node.op_type != "Slice":
            continue
        r = gr.producer.get(node.input[0])
        args = _slice_args(gr, node)
        if r is None or r.op_type != "Reshape" or args is None or len(args[2]) != 1 or args[3] != [1]:
            continue
        x_shape, s_shape = gr.shapes.get(r.input[0]), gr.shapes.get(r.output[0])
        out_shape = gr.shapes.get(node.output[0])
        if not x_shape or not s_shape or not out_shape:
            continue
        a = args[2][0]
        inner = int(np.prod(s_shape[a + 1:]))
        if int(np.prod(s_shape[a:])) != x_shape[-1]:
            continue
        start = max(0, min(args[0][0], s_shape[a]))
        stop = start + out_shape[a]
        cut = gr.fresh(node.output[0] + "_cut")
        ins = [r.input[0], gr.add_const("starts", np.array([start * inner], np.int64)),
               gr.add_const("ends", np.array([stop * inner], np.int64)),
               gr.add_const("axes", np.array([len(x_shape) - 1], np.int64))]
        plan[pos] = [helper.make_node("Slice", ins, [cut], name=gr.fresh(node.name or "slice")),
                     helper.make_node("Reshape", [cut, gr.add_const("shape", np.array(out_shape, np.int64))],
                                      list(node.output), name=gr.fresh(r.name or "reshape"))]
    return _apply(gr.g, plan)


def merge_reshape_chains(model: onnx.ModelProto) -> int:
    """Reshape/Squeeze/Unsqueeze/Flatten of a Reshape's output -> one Reshape to the final shape.

    Leaves no 5-D intermediate (ncnn has at most 4 axes) and no squeeze that pnnx may take for
    a squeeze of its batch axis."""
    gr, plan = _Graph(model), {}
    for pos, node in enumerate(list(gr.g.node)):
        if node.op_type not in ("Reshape", "Squeeze", "Unsqueeze", "Flatten"):
            continue
        r = gr.producer.get(node.input[0])
        out_shape = gr.shapes.get(node.output[0])
        if r is None or r.op_type != "Reshape" or out_shape is None or r.output[0] in gr.outputs:
            continue
        if _from_recurrent(gr, r.input[0]):
            continue  # keep the [0, 0, -1] merge pnnx needs after an LSTM or GRU
        plan[pos] = [helper.make_node("Reshape", [r.input[0], gr.add_const("shape", np.array(out_shape, np.int64))],
                                      list(node.output), name=gr.fresh(node.name or "reshape"))]
    return _apply(gr.g, plan)


def lstm_outputs_as_pnnx_expects(model: onnx.ModelProto) -> int:
    """LSTM -> Transpose(0,2,1,3) -> Reshape(any static shape) -> LSTM -> ... Reshape([0,0,-1]) -> Reshape.

    pnnx turns an ONNX LSTM into ncnn's LSTM only in the form torch exports: unused Y_h/Y_c
    dropped, and a bidirectional output merged by exactly Reshape [0, 0, -1] (a forward one by
    Squeeze axis 1). onnxsim folds that shape to numbers ([-1, 1024] in ddddocr's CRNN), so pnnx
    keeps a raw LSTM that ncnn cannot load. Same values, pnnx's spelling."""
    gr, plan = _Graph(model), {}
    used = {i for n in gr.g.node for i in n.input} | gr.outputs
    for pos, node in enumerate(list(gr.g.node)):
        if node.op_type not in _RECURRENT:
            continue
        outs = [o if (k == 0 or o in used) else "" for k, o in enumerate(node.output)]
        while len(outs) > 1 and outs[-1] == "":
            outs.pop()
        if outs != list(node.output):
            del node.output[:]
            node.output.extend(outs)
            plan[pos] = [node]
        y = node.output[0]
        t = gr.consumers.get(y, [])
        if len(t) != 1:
            continue
        t = t[0]
        bidi = _attr(node, "direction", b"forward") in (b"bidirectional", "bidirectional")
        if bidi and t.op_type == "Transpose" and list(_attr(t, "perm") or []) == [0, 2, 1, 3]:
            # every reader a Reshape (onnxsim merges a second reshape of the same output, e.g. a
            # quantisation range's [1, 1, 1, N], into one more reader): all read the merged tensor
            rs = gr.consumers.get(t.output[0], [])
            if not rs or t.output[0] in gr.outputs or any(
                    r.op_type != "Reshape" or r.input[0] != t.output[0] or gr.const_ints(r.input[1]) == [0, 0, -1]
                    for r in rs):
                continue
            merged = gr.fresh(rs[0].output[0] + "_lstm")
            merge = helper.make_node("Reshape", [t.output[0], gr.add_const("shape", np.array([0, 0, -1], np.int64))],
                                     [merged], name=gr.fresh("lstm_merge"))
            positions = sorted(next(k for k, n in enumerate(gr.g.node) if n.output == r.output) for r in rs)
            for k in positions:
                r = gr.g.node[k]
                plan[k] = ([merge] if k == positions[0] else []) + [
                    helper.make_node("Reshape", [merged, r.input[1]], list(r.output), name=r.name)]
        elif not bidi and t.op_type == "Reshape":
            y_shape = gr.shapes.get(y)
            if not y_shape or len(y_shape) != 4 or y_shape[1] != 1:
                continue
            tpos = next(k for k, n in enumerate(gr.g.node) if n.output == t.output)
            squeezed = gr.fresh(t.output[0] + "_lstm")
            sq = (helper.make_node("Squeeze", [y, gr.add_const("axes", np.array([1], np.int64))], [squeezed],
                                   name=gr.fresh("lstm_squeeze")) if _opset(model) >= 13 else
                  helper.make_node("Squeeze", [y], [squeezed], axes=[1], name=gr.fresh("lstm_squeeze")))
            plan[tpos] = [sq, helper.make_node("Reshape", [squeezed, t.input[1]], list(t.output), name=t.name)]
    return _apply(gr.g, plan)


_RECURRENT = ("LSTM", "GRU")   # pnnx matches both in torch's export form, the same reshapes around them


def _feeds_recurrent(gr: "_Graph", name: str) -> bool:
    return any(n.op_type in _RECURRENT for n in gr.consumers.get(name, []))


def _from_recurrent(gr: "_Graph", name: str) -> bool:
    p = gr.producer.get(name)
    return p is not None and p.op_type == "Transpose" and (gr.producer.get(p.input[0]) or p).op_type in _RECURRENT


def lstm_state_from_sequence_output(model: onnx.ModelProto) -> int:
    """One-step forward LSTM whose Y is unused: all but one reader of Y_h read Squeeze(Y, axis 1).

    Streaming models (Silero VAD) run one time step per call and keep only the states; pnnx maps
    an ONNX LSTM to ncnn's only when its Y goes through Squeeze axis 1 and Y_h, Y_c stay in use.
    With one step Y_h is exactly Y without its direction axis."""
    gr, plan = _Graph(model), {}
    used = {i for n in gr.g.node for i in n.input} | gr.outputs
    for pos, node in enumerate(list(gr.g.node)):
        if node.op_type != "LSTM" or len(node.output) < 2 or node.output[0] in used or not node.output[1]:
            continue
        if _attr(node, "direction", b"forward") not in (b"forward", "forward"):
            continue
        y, yh = node.output[0], node.output[1]
        y_shape = gr.shapes.get(y)
        if not y or y_shape is None or y_shape[0] != 1:
            continue
        readers = [n for n in gr.g.node if yh in n.input]
        keep_yh = yh in gr.outputs
        if len(readers) + keep_yh < 2:
            continue  # pnnx's match also needs Y_h itself to stay in use
        squeezed = gr.fresh(y + "_step")
        sq = (helper.make_node("Squeeze", [y, gr.add_const("axes", np.array([1], np.int64))], [squeezed],
                               name=gr.fresh("lstm_squeeze")) if _opset(model) >= 13 else
              helper.make_node("Squeeze", [y], [squeezed], axes=[1], name=gr.fresh("lstm_squeeze")))
        plan[pos] = [node, sq]
        for other in readers[:len(readers) if keep_yh else -1]:
            for k, name in enumerate(other.input):
                if name == yh:
                    other.input[k] = squeezed
    return _apply(gr.g, plan)


_FOLDABLE = {
    "Unsqueeze": lambda x, axes: np.expand_dims(x, tuple(int(a) for a in axes)),
    "Squeeze": lambda x, axes=None: np.squeeze(x, tuple(int(a) for a in axes) if axes is not None else None),
    "Reshape": lambda x, shape: x.reshape([x.shape[i] if d == 0 else int(d) for i, d in enumerate(shape)]),
    "Identity": lambda x: x,
}


def fold_constant_shape_ops(model: onnx.ModelProto) -> int:
    """Unsqueeze/Squeeze/Reshape/Identity of constants -> one initializer.

    When onnxsim fails on a model (Silero VAD: `If` branches), LSTM weights still arrive through
    Unsqueeze nodes, and pnnx matches an LSTM only when W/R/B are constants."""
    gr, plan = _Graph(model), {}
    for pos, node in enumerate(list(gr.g.node)):
        fn = _FOLDABLE.get(node.op_type)
        ins = [i for i in node.input if i]
        if fn is None or not ins or any(i not in gr.consts for i in ins) or len(node.output) != 1:
            continue
        args = [gr.consts[i] for i in ins]
        if node.op_type in ("Unsqueeze", "Squeeze") and len(args) == 1 and _attr(node, "axes") is not None:
            args.append(np.array(_attr(node, "axes")))
        try:
            value = np.asarray(fn(*args))
        except Exception:  # an unusual attribute (allowzero, ...): leave the node
            continue
        gr.g.initializer.append(numpy_helper.from_array(value.astype(args[0].dtype), node.output[0]))
        gr.consts[node.output[0]] = value
        plan[pos] = []
    return _apply(gr.g, plan)


def gather_unsqueeze_to_slice(model: onnx.ModelProto) -> int:
    """Gather(x, scalar i, axis a) -> Unsqueeze(axes=[a]) == Slice(x, i:i+1, axis a).

    Silero VAD splits its [2, 1, 128] state into h and c this way; pnnx fuses the two Gathers into
    a `torch.unbind` that ncnn has no layer for, while a Slice becomes ncnn's Crop."""
    gr, plan = _Graph(model), {}
    index = {n.output[0]: k for k, n in enumerate(gr.g.node) if n.output}
    for pos, node in enumerate(list(gr.g.node)):
        idx = gr.consts.get(node.input[1]) if node.op_type == "Gather" else None
        readers = gr.consumers.get(node.output[0], []) if idx is not None else []
        if idx is None or idx.ndim != 0 or len(readers) != 1 or node.output[0] in gr.outputs:
            continue
        u = readers[0]
        rank = len(gr.shapes.get(node.input[0], ()))
        a = _attr(node, "axis", 0)
        a = a + rank if a < 0 else a
        axes = _attr(u, "axes") if len(u.input) < 2 else gr.const_ints(u.input[1])
        if u.op_type != "Unsqueeze" or axes is None or [x + rank if x < 0 else x for x in axes] != [a] or rank == 0:
            continue
        i = int(idx) + (gr.shapes[node.input[0]][a] if int(idx) < 0 else 0)
        ins = [node.input[0], gr.add_const("starts", np.array([i], np.int64)),
               gr.add_const("ends", np.array([i + 1], np.int64)), gr.add_const("axes", np.array([a], np.int64))]
        plan[pos] = []
        plan[index[u.output[0]]] = [helper.make_node("Slice", ins, list(u.output), name=gr.fresh(node.name or "gather"))]
    return _apply(gr.g, plan, len(plan) // 2)


def _axes_of(gr: "_Graph", node) -> list[int] | None:
    """A node's axes, from its constant second input (opset 13+/18+) or its attribute (older)."""
    if len(node.input) > 1 and node.input[1]:
        return gr.const_ints(node.input[1])
    return _attr(node, "axes")


def stack_max_to_max(model: onnx.ModelProto) -> int:
    """ReduceMax over the axis a Concat of Unsqueezes stacked on -> a chain of element-wise Max.

    `torch.stack((a, b, c), d).max(d)` (AttaCut's three convolution branches) exports as
    Unsqueeze x n -> Concat -> ReduceMax; pnnx leaves no ncnn layer for that ReduceMax, while a
    binary Max becomes ncnn's BinaryOp. Exact: the maximum of the same values."""
    gr, plan, fired = _Graph(model), {}, 0
    index = {o: k for k, n in enumerate(gr.g.node) for o in n.output}
    for pos, node in enumerate(list(gr.g.node)):
        if node.op_type != "ReduceMax" or not node.input or node.input[0] not in index:
            continue
        cat = gr.g.node[index[node.input[0]]]
        rank = len(gr.shapes.get(node.input[0], ()))
        axes = _axes_of(gr, node)
        keep = _attr(node, "keepdims", 1)
        if cat.op_type != "Concat" or rank == 0 or axes is None or len(axes) != 1 or len(cat.input) < 2 \
                or len(gr.consumers.get(cat.output[0], [])) != 1 or cat.output[0] in gr.outputs \
                or (keep and _opset(model) < 13):  # there Unsqueeze takes axes as an attribute: left alone
            continue
        a = axes[0] + rank if axes[0] < 0 else axes[0]
        cat_axis = _attr(cat, "axis", 0)
        if (cat_axis + rank if cat_axis < 0 else cat_axis) != a:
            continue
        sources, ups = [], []
        for x in cat.input:
            u = gr.g.node[index[x]] if x in index else None
            u_axes = _axes_of(gr, u) if u is not None and u.op_type == "Unsqueeze" else None
            if u_axes is None or [v + rank if v < 0 else v for v in u_axes] != [a] \
                    or len(gr.consumers.get(x, [])) != 1 or x in gr.outputs:
                break
            sources.append(u.input[0])
            ups.append(index[x])
        else:
            out, chain, acc = node.output[0], [], sources[0]
            for k, x in enumerate(sources[1:]):
                name = out if k == len(sources) - 2 and not keep else gr.fresh(out + "_max")
                chain.append(helper.make_node("Max", [acc, x], [name], name=gr.fresh(node.name or "max")))
                acc = name
            if keep:
                chain.append(helper.make_node("Unsqueeze", [acc, gr.add_const("axes", np.array([a], np.int64))],
                                              [out], name=gr.fresh(node.name or "unsqueeze")))
            for k in ups:
                plan[k] = []
            plan[index[cat.output[0]]] = []
            plan[pos] = chain
            fired += 1
    return _apply(gr.g, plan, fired)


def _split_sum_of_squares(model: onnx.ModelProto) -> int:
    """ReduceSumSquare(Reshape(x [1, K*F, T] -> [1, K, F, T]), axis 1) -> the sum of the K slices' squares.

    An STFT written as a Conv (Whisper's, OnnxScript's front ends) puts the real and imaginary parts
    in the two halves of the output channels, reshapes them onto an axis of 2 and sums their squares
    over it. ncnn ran that as two copies (Flatten of the padded channels, then Reshape: ~11% of
    whisper_logmel_conv) and a Reduction; Slices of the channel ranges, a Mul each and an Add take
    one copy. The same sums: (re^2 + im^2) in that order. A speed rewrite (convert._batched), before
    strided_conv's, which makes the Conv 2-D."""
    gr, plan, fired = _Graph(model), {}, 0
    index = {o: k for k, n in enumerate(gr.g.node) for o in n.output}
    for pos, node in enumerate(list(gr.g.node)):
        if node.op_type != "ReduceSumSquare" or node.input[0] not in index or _attr(node, "keepdims", 1):
            continue
        r = gr.g.node[index[node.input[0]]]
        x_shape, r_shape = gr.shapes.get(r.input[0]) if r.op_type == "Reshape" else None, gr.shapes.get(r.output[0])
        if x_shape is None or r_shape is None or len(x_shape) != 3 or len(r_shape) != 4 or x_shape[0] != 1 \
                or r_shape[0] != 1 or r_shape[3] != x_shape[2] or r_shape[1] * r_shape[2] != x_shape[1] \
                or not 2 <= r_shape[1] <= 4 or _axes_of(gr, node) not in ([1], [-3]) or gr.only_reader(r.output[0]) is not node:
            continue
        k, f = r_shape[1], r_shape[2]
        nodes, squared = [], []
        for i in range(k):
            part = gr.fresh(node.output[0] + "_part")
            ins = [r.input[0], gr.add_const("starts", np.array([i * f], np.int64)),
                   gr.add_const("ends", np.array([(i + 1) * f], np.int64)), gr.add_const("axes", np.array([1], np.int64))]
            nodes += [helper.make_node("Slice", ins, [part], name=gr.fresh("slice")),
                      helper.make_node("Mul", [part, part], [part + "_sq"], name=gr.fresh("square"))]
            squared.append(part + "_sq")
        acc = squared[0]
        for i, sq in enumerate(squared[1:], 1):
            out = node.output[0] if i == k - 1 else gr.fresh(node.output[0] + "_sum")
            nodes.append(helper.make_node("Add", [acc, sq], [out], name=gr.fresh("add")))
            acc = out
        plan[index[r.output[0]]] = []
        plan[pos] = nodes
        fired += 1
    return _apply(gr.g, plan, fired)


def split_sum_of_squares(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """_split_sum_of_squares on a copy of ``model``: (the copy, how often it fired)."""
    return on_copy(_split_sum_of_squares, model)


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def on_copy(rewrite, model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """``rewrite`` (in place, returning how many places it changed) on a copy of ``model``, then what
    nothing reads any more dropped: (the copy, the count)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    count = rewrite(out)
    if count:
        remove_dead_nodes(out)
    return out, count


from .recurrent_forms import gru_initial_state_explicit, gru_sequence_kept  # noqa: E402  (it imports this module lazily)

REWRITES = (reduce_axis_with_unit_batch, gemm_bias_as_vector, resize_roi_unread, pad_mode_explicit, auto_pad_explicit, fold_constant_shape_ops, stack_max_to_max, gather_unsqueeze_to_slice, lstm_state_from_sequence_output, gru_initial_state_explicit, gru_sequence_kept, lstm_outputs_as_pnnx_expects, focus_to_pixel_unshuffle, strided_slice_to_conv, slice_before_transpose, squeeze_before_transpose, gather_before_transpose,
            slice_of_split_reshape, merge_reshape_chains, unit_axis_first_before_reshape, lift_sequence_tail)


def rewrite_for_ncnn(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, int]]:
    """A rewritten copy of a static-shape model, and how often each rewrite fired."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    applied: Counter = Counter()
    for _ in range(4):  # a rewrite can expose another (a Squeeze after a moved Slice); bounded
        fired = 0
        for fn in REWRITES:
            n = fn(out)
            if n:
                applied[fn.__name__] += n
                fired += n
                remove_dead_nodes(out)
        if not fired:
            break
    return out, dict(applied)
