"""ONNX GRUs in the form pnnx turns into ncnn's GRU layer (torch's export form), same values.

ncnn's GRU computes PyTorch's GRU: the reset gate applied after the hidden product
(linear_before_reset=1), sigmoid and tanh, time-major input. pnnx maps an ONNX GRU to it only as
torch exports one, and two forms that other exporters (or onnxsim) leave go wrong:
- no initial_h input (onnxsim drops torch's zero initial state): pnnx took the bias B for the
  initial state and dropped the bias, a wrong model (speechmos' PLCMOS);
- Y unread and only Y_h read (`_, h = gru(x)`): pnnx left a raw GRU that ncnn cannot load.
So a zero initial_h is written out, and Y is kept in use (gru_sequence_kept). Y_h stays what ncnn's
GRU returns, and after pnnx a constant initial state is written as the 2-D [dirs, H] blob pnnx sizes
the later layers for (flat_gru_initial_states): ncnn's GRU returns its state in its input's shape.
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
    and the GRU raw. So Y_h's readers read Y_h + 0 * (a slice of the merged Y of Y_h's shape): the same
    values (a GRU's outputs are finite wherever its state is: tanh-bounded steps), and Y in use."""
    from .rewrite import _apply, _attr, _Graph, _opset
    gr, plan = _Graph(model), {}
    used = {i for n in gr.g.node for i in n.input} | gr.outputs
    for pos, node in enumerate(gr.g.node):
        if not torch_form_gru(node) or len(node.output) < 2 or not node.output[1]:
            continue
        y, yh = node.output[0], node.output[1]
        x = gr.shapes.get(node.input[0])
        dirs, hidden = _directions(node), int(_attr(node, "hidden_size"))
        if (y and y in used) or yh in gr.outputs or yh not in used or not x or len(x) != 3 or x[1] != 1 or x[0] < dirs:
            continue
        if _attr(node, "direction", b"forward") in (b"reverse", "reverse"):
            continue
        if not y:
            y = gr.fresh(f"{node.name or 'gru'}_y")
            node.output[0] = y

        def const(values, dtype=np.int64):
            return gr.add_const("gru_keep", np.array(values, dtype))
        merged, first, zero, kept = (gr.fresh(f"{y}_{part}") for part in ("merged", "first", "zero", "kept"))
        if dirs == 2:
            moved = gr.fresh(f"{y}_moved")
            added = [helper.make_node("Transpose", [y], [moved], perm=[0, 2, 1, 3], name=gr.fresh("gru_merge")),
                     helper.make_node("Reshape", [moved, const([0, 0, -1])], [merged], name=gr.fresh("gru_merge"))]
        else:
            added = [helper.make_node("Squeeze", [y, const([1])], [merged], name=gr.fresh("gru_merge"))
                     if _opset(model) >= 13 else
                     helper.make_node("Squeeze", [y], [merged], axes=[1], name=gr.fresh("gru_merge"))]
        added += [
            # Y_h's own shape [dirs, 1, H], cut from the merged [T, 1, dirs*H]: pnnx gives both the same
            # 2-D ncnn blob, so the Add needs no broadcast (a [1, 1, 1] one came out 3-D)
            helper.make_node("Slice", [merged, const([0, 0, 0]), const([dirs, 1, hidden]), const([0, 1, 2])], [first],
                             name=gr.fresh("gru_keep")),
            helper.make_node("Mul", [first, const(0.0, np.float32)], [zero], name=gr.fresh("gru_keep")),
            helper.make_node("Add", [yh, zero], [kept], name=gr.fresh("gru_keep"))]
        for reader in gr.consumers.get(yh, []):
            reader.input[:] = [kept if i == yh else i for i in reader.input]
        plan[pos] = [node, *added]
    return _apply(gr.g, plan)


def flat_gru_initial_states(param: str) -> tuple[str, int]:
    """The .param with each constant initial state of a GRU as the 2-D [dirs, H] blob ncnn's GRU reads;
    how many it changed.

    pnnx writes a zero initial_h [dirs, 1, H] as a 3-D MemoryData (w=H, h=1, c=dirs), and ncnn's GRU
    returns its final state in the shape of the state it was given, while pnnx sizes every later layer
    for [dirs, H] (it drops the batch axis): a Concat of that state with another then mixed 3-D and
    2-D blobs (PLCMOS: 2.5% of scale off). Same values, same bytes in the .bin."""
    lines = param.splitlines()
    producer = {}
    for k, line in enumerate(lines[2:], start=2):
        parts = line.split()
        if len(parts) < 4:
            continue
        n_in, n_out = int(parts[2]), int(parts[3])
        for blob in parts[4 + n_in:4 + n_in + n_out]:
            producer[blob] = k
    changed = 0
    for line in lines[2:]:
        parts = line.split()
        if len(parts) < 6 or parts[0] != "GRU" or int(parts[2]) < 2:
            continue
        k = producer.get(parts[5])
        while k is not None and lines[k].split()[0] == "Split":
            k = producer.get(lines[k].split()[4])
        if k is None:
            continue
        fields = lines[k].split()
        if fields[0] != "MemoryData":
            continue
        n = 4 + int(fields[2]) + int(fields[3])
        params = dict(p.split("=", 1) for p in fields[n:])
        if params.get("1") != "1" or "2" not in params or "11" in params:
            continue
        lines[k] = " ".join(fields[:n] + [f"0={params['0']}", f"1={params['2']}"])
        changed += 1
    return "\n".join(lines) + ("\n" if param.endswith("\n") else ""), changed
