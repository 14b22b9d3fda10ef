"""ONNX GRUs in the form pnnx turns into ncnn's GRU layer (torch's export form), same values.

ncnn's GRU computes PyTorch's GRU: the reset gate applied after the hidden product
(linear_before_reset=1), sigmoid and tanh, time-major input. pnnx maps an ONNX GRU to it only as
torch exports one, and two forms that other exporters (or onnxsim) leave go wrong:
- no initial_h input (onnxsim drops torch's zero initial state): pnnx took the bias B for the
  initial state and dropped the bias, a wrong model (speechmos' PLCMOS);
- Y unread and only Y_h read (`_, h = gru(x)`): pnnx left a raw GRU that ncnn cannot load.
So a zero initial_h is written out, and Y is kept in use (gru_sequence_kept). Y_h stays what ncnn's
GRU returns: pnnx sizes the layers after it for that blob (a state rebuilt from Y's steps came out
2-D where they expect ncnn's 3-D [dirs, 1, H], and a Concat of the two mixed them).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper


def torch_form_gru(node) -> bool:
    """Whether an ONNX GRU computes what ncnn's GRU layer computes: linear_before_reset=1, the default
    activations, no clip, time-major, and no sequence_lens."""
    from .rewrite import _attr
    return (node.op_type == "GRU" and _attr(node, "linear_before_reset", 0) == 1
            and not _attr(node, "activations") and _attr(node, "clip") is None and not _attr(node, "layout", 0)
            and not (len(node.input) > 4 and node.input[4]))


def _directions(node) -> int:
    from .rewrite import _attr
    return 2 if _attr(node, "direction", b"forward") in (b"bidirectional", "bidirectional") else 1


def gru_initial_state_explicit(model: onnx.ModelProto) -> int:
    """GRU without initial_h (or B) -> the same GRU with zeros for them, as torch exports it."""
    from .rewrite import _attr, _Graph
    gr, fired = _Graph(model), 0
    for node in gr.g.node:
        if not torch_form_gru(node) or (len(node.input) > 5 and node.input[5]):
            continue
        x = gr.shapes.get(node.input[0])
        if not x or len(x) != 3:
            continue
        dirs, hidden = _directions(node), int(_attr(node, "hidden_size"))
        ins = list(node.input) + [""] * (6 - len(node.input))
        if not ins[3]:
            ins[3] = gr.add_const(f"{node.name or 'gru'}_b", np.zeros((dirs, 6 * hidden), np.float32))
        ins[5] = gr.add_const(f"{node.name or 'gru'}_h0", np.zeros((dirs, x[1], hidden), np.float32))
        del node.input[:]
        node.input.extend(ins)
        fired += 1
    return fired


def _merged(gr, y: str) -> str | None:
    """The output of torch's merge of a bidirectional Y (its one reader Transpose 0,2,1,3, whose one
    reader is Reshape [0, 0, -1]), if Y already goes through it: pnnx matches a GRU with one such chain."""
    from .rewrite import _attr
    t = gr.consumers.get(y, [])
    if len(t) != 1 or t[0].op_type != "Transpose" or list(_attr(t[0], "perm") or []) != [0, 2, 1, 3]:
        return None
    r = gr.consumers.get(t[0].output[0], [])
    if len(r) != 1 or r[0].op_type != "Reshape" or gr.const_ints(r[0].input[1]) != [0, 0, -1]:
        return None
    return r[0].output[0]


def gru_sequence_kept(model: onnx.ModelProto) -> int:
    """A GRU whose Y nothing reads and whose Y_h is read -> Y kept in use, through torch's merge.

    pnnx matches a GRU only with its Y going through torch's merge (a bidirectional Y: Transpose
    0,2,1,3 + Reshape [0, 0, -1]; a forward one: Squeeze of axis 1); `_, h = gru(x)` leaves Y unread
    and the GRU raw. So Y_h's readers read Y_h + 0 * (one element of the merged Y): the same values
    (a GRU's outputs are finite wherever its state is: tanh-bounded steps), and Y in use."""
    from .rewrite import _apply, _attr, _Graph, _opset
    gr, plan = _Graph(model), {}
    used = {i for n in gr.g.node for i in n.input} | gr.outputs
    for pos, node in enumerate(gr.g.node):
        if not torch_form_gru(node) or len(node.output) < 2 or not node.output[1]:
            continue
        y, yh = node.output[0], node.output[1]
        x = gr.shapes.get(node.input[0])
        if (y and y in used) or yh in gr.outputs or yh not in used or not x or len(x) != 3:
            continue
        if _attr(node, "direction", b"forward") in (b"reverse", "reverse"):
            continue
        if not y:
            y = gr.fresh(f"{node.name or 'gru'}_y")
            node.output[0] = y

        def const(values, dtype=np.int64):
            return gr.add_const("gru_keep", np.array(values, dtype))
        merged, first, zero, kept = (gr.fresh(f"{y}_{part}") for part in ("merged", "first", "zero", "kept"))
        if _directions(node) == 2:
            moved = gr.fresh(f"{y}_moved")
            added = [helper.make_node("Transpose", [y], [moved], perm=[0, 2, 1, 3], name=gr.fresh("gru_merge")),
                     helper.make_node("Reshape", [moved, const([0, 0, -1])], [merged], name=gr.fresh("gru_merge"))]
        else:
            added = [helper.make_node("Squeeze", [y, const([1])], [merged], name=gr.fresh("gru_merge"))
                     if _opset(model) >= 13 else
                     helper.make_node("Squeeze", [y], [merged], axes=[1], name=gr.fresh("gru_merge"))]
        added += [
            helper.make_node("Slice", [merged, const([0, 0, 0]), const([1, 1, 1]), const([0, 1, 2])], [first],
                             name=gr.fresh("gru_keep")),
            helper.make_node("Mul", [first, const(0.0, np.float32)], [zero], name=gr.fresh("gru_keep")),
            helper.make_node("Add", [yh, zero], [kept], name=gr.fresh("gru_keep"))]
        for reader in gr.consumers.get(yh, []):
            reader.input[:] = [kept if i == yh else i for i in reader.input]
        plan[pos] = [node, *added]
    return _apply(gr.g, plan)

