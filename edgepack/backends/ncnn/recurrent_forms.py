"""ONNX GRUs in the form pnnx turns into ncnn's GRU layer (torch's export form), same values.

ncnn's GRU computes PyTorch's GRU: the reset gate applied after the hidden product
(linear_before_reset=1), sigmoid and tanh, time-major input. pnnx maps an ONNX GRU to it only as
torch exports one, and two forms that other exporters (or onnxsim) leave go wrong:
- no initial_h input (onnxsim drops torch's zero initial state): pnnx took the bias B for the
  initial state and dropped the bias, a wrong model (speechmos' PLCMOS);
- Y unread and only Y_h read (`_, h = gru(x)`): pnnx left a raw GRU that ncnn cannot load.
So a zero initial_h is written out, and readers of Y_h read the same values from Y: the forward
direction's last step and the backward direction's first.
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


def gru_state_from_sequence(model: onnx.ModelProto) -> int:
    """A GRU whose Y_h is read -> Y_h's readers read Y's steps instead.

    Y [T, dirs, B, H] holds every step: the forward direction ends at step T-1, the backward one at
    step 0. Y goes through torch's merge (Transpose 0,2,1,3 + Reshape [0, 0, -1] to [T, B, dirs*H]; a
    forward GRU's Squeeze of axis 1) and two Slices give the final states, concatenated as Y_h is."""
    from .rewrite import _apply, _Graph, _opset
    gr, plan = _Graph(model), {}
    used = {i for n in gr.g.node for i in n.input} | gr.outputs
    for pos, node in enumerate(gr.g.node):
        if not torch_form_gru(node) or len(node.output) < 2 or not node.output[1]:
            continue
        y, yh = node.output[0], node.output[1]
        x = gr.shapes.get(node.input[0])
        if (y and y in used) or yh in gr.outputs or yh not in used or not x or len(x) != 3 or x[1] != 1:
            continue
        from .rewrite import _attr
        if _attr(node, "direction", b"forward") in (b"reverse", "reverse"):
            continue
        if not y:
            y = gr.fresh(f"{node.name or 'gru'}_y")
            node.output[0] = y
        steps, hidden, dirs = x[0], int(_attr(node, "hidden_size")), _directions(node)

        def const(values):
            return gr.add_const("gru_step", np.array(values, np.int64))

        def step_slice(src, start, cols):
            out = gr.fresh(f"{yh}_dir")
            return out, helper.make_node("Slice", [src, const([start, cols[0]]), const([start + 1, cols[1]]),
                                                   const([0, 2])], [out], name=gr.fresh("gru_state"))
        merged = _merged(gr, y) or gr.fresh(f"{y}_merged")
        if dirs == 2:
            moved = gr.fresh(f"{y}_moved")
            added = [] if _merged(gr, y) else [
                helper.make_node("Transpose", [y], [moved], perm=[0, 2, 1, 3], name=gr.fresh("gru_merge")),
                helper.make_node("Reshape", [moved, const([0, 0, -1])], [merged], name=gr.fresh("gru_merge"))]
            fwd, fwd_node = step_slice(merged, steps - 1, (0, hidden))
            bwd, bwd_node = step_slice(merged, 0, (hidden, 2 * hidden))
            # side by side on the last axis, then Y_h's shape: pnnx drops the unit batch axis of the
            # merged [T, 1, 2H] and of the [1, 1, H] steps, so a Concat on axis 0 is one it mis-reads
            both = gr.fresh(f"{yh}_steps")
            added += [fwd_node, bwd_node, helper.make_node("Concat", [fwd, bwd], [both], axis=2, name=gr.fresh("gru_state"))]
        else:
            added = [helper.make_node("Squeeze", [y, const([1])], [merged], name=gr.fresh("gru_merge"))
                     if _opset(model) >= 13 else
                     helper.make_node("Squeeze", [y], [merged], axes=[1], name=gr.fresh("gru_merge"))]
            both, last = step_slice(merged, steps - 1, (0, hidden))
            added.append(last)
        state = gr.fresh(f"{yh}_state")
        added.append(helper.make_node("Reshape", [both, const([dirs, x[1], hidden])], [state], name=gr.fresh("gru_state")))
        for reader in gr.consumers.get(yh, []):
            reader.input[:] = [state if i == yh else i for i in reader.input]
        node.output[1] = ""
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
