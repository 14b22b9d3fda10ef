"""A Scan that cuts a signal into overlapping frames, as one Gather: neither backend runs Scan.

onnx-asr's WeSpeaker front end (OnnxScript) frames its waveform with a Scan whose state is the last
P samples and whose scanned input is the signal in hops of H: each step emits frame = prev ++ curr
(P + H samples) and keeps frame[H:] as the next state. So frame t is samples t*H .. t*H + P + H - 1 of
signal = X0 ++ X (the initial state, then the hops in order), and the scan output [B, T, P + H] is one
Gather of that signal with constant indices t*H + j. Exact: the same samples, copied.

Lowered only for that body (Concat on the last axis, then Slice from H to the end of that axis), with
one state, one scanned input and one scan output, the scan and output axes 1, rank-2 steps and
static shapes; the final state must be unused. Any other Scan stays, and the backends refuse it by name.
"""
from __future__ import annotations

import numpy as np
from onnx import helper, numpy_helper

from .model import LoadedModel, _with
from .onnx_index import node_attrs
from .signal_lowering import replace_nodes


def lower_framing_scans(model: LoadedModel) -> LoadedModel:
    """The model with each framing Scan as Concat + Reshape + Gather; unchanged without one."""
    if "Scan" not in model.ops():
        return model
    read = {i for n in model.proto.graph.node for i in n.input} | {o.name for o in model.proto.graph.output}
    proto, lowered, _kept = replace_nodes(model, "Scan", lambda node, k, graph, consts, infos:
                                          _as_gather(node, k, graph, _form(node, consts, infos, read)))
    return model if proto is None else _with(model, proto, f"Scan framing as a Gather: {lowered} node(s)")


def _form(node, consts, infos, read: set[str]) -> tuple[int, int, int] | None:
    """(P, H, T) of a framing Scan, else None."""
    attrs = node_attrs(node)
    body = attrs.get("body")
    if body is None or attrs.get("num_scan_inputs") != 1 or len(node.input) != 2 or len(node.output) != 2:
        return None
    if list(attrs.get("scan_input_axes", [0])) != [1] or list(attrs.get("scan_output_axes", [0])) != [1]:
        return None
    if attrs.get("scan_input_directions", [0]) != [0] or attrs.get("scan_output_directions", [0]) != [0]:
        return None
    if node.output[0] in read or len(body.node) != 2 or body.initializer:
        return None
    state, scanned = (infos.get(name) for name in node.input)
    if state is None or scanned is None or state.dims is None or scanned.dims is None:
        return None
    if len(state.dims) != 2 or len(scanned.dims) != 3 or state.dims[0] != scanned.dims[0]:
        return None
    (_, p), (_, t, h) = state.dims, scanned.dims
    prev, curr = (i.name for i in body.input)
    nxt, frame = (o.name for o in body.output)
    cat, cut = body.node
    if cat.op_type != "Concat" or list(cat.input) != [prev, curr] or list(cat.output) != [frame]:
        return None
    if node_attrs(cat).get("axis") not in (1, -1):
        return None
    if cut.op_type != "Slice" or list(cut.output) != [nxt] or cut.input[0] != frame or len(cut.input) < 3:
        return None
    args = [consts.get(name) if name else None for name in list(cut.input[1:]) + [""] * (5 - len(cut.input))]
    starts, ends, axes, steps = args
    if starts is None or ends is None or starts.size != 1 or ends.size != 1:
        return None
    if (axes is not None and int(axes.reshape(-1)[0]) not in (1, -1)) or (steps is not None and int(steps.reshape(-1)[0]) != 1):
        return None
    if int(starts.reshape(-1)[0]) != h or int(ends.reshape(-1)[0]) < p + h:
        return None  # the state would not stay P samples long
    return p, h, t


def _as_gather(node, k: int, graph, form: tuple[int, int, int] | None) -> list | None:
    if form is None:
        return None
    p, h, t = form
    base = f"{node.name or f'scan{k}'}__ep_frames"
    index = np.arange(t)[:, None] * h + np.arange(p + h)[None, :]
    graph.initializer.extend([
        numpy_helper.from_array(np.array([0, t * h], np.int64), f"{base}_flat"),
        numpy_helper.from_array(index.astype(np.int64), f"{base}_index")])
    state, scanned = node.input
    return [helper.make_node("Reshape", [scanned, f"{base}_flat"], [f"{base}_hops"]),
            helper.make_node("Concat", [state, f"{base}_hops"], [f"{base}_signal"], axis=1),
            helper.make_node("Gather", [f"{base}_signal", f"{base}_index"], [node.output[1]], axis=1)]
