"""Constant operands read last: a two-input BinaryOp whose first input is a constant gets it second.

ncnn makes a layer's inputs depth-first, in their order (NetPrivate::forward_layer). Ultralytics' detection
heads compute `anchors - x` and `anchors + x` with the anchor grid (a MemoryData) first, so ncnn makes that
constant before the backbone runs and keeps it through the whole run. In the arena it is a small block that
sits between the input's hole and the stem's: YOLO11s-seg's first C3k2 output (13.1 MB) then fits in neither
hole, and the arena grows by it. Written with the constant second (`-x + anchors` as ncnn's reversed
subtraction, RSUB), ncnn makes it when the head needs it. The values are the same: each op computes the same
expression on the same operands, ncnn broadcasts either operand.
"""
from __future__ import annotations

from .param_graph import Graph, join_param, split_param

# ncnn BinaryOp op_type with its operands swapped: add, mul, max, min keep theirs; sub <-> rsub, div <-> rdiv,
# pow <-> rpow, atan2 <-> ratan2
_SWAPPED = {"0": "0", "2": "2", "4": "4", "5": "5", "1": "7", "7": "1", "3": "8", "8": "3", "6": "9", "9": "6",
            "10": "11", "11": "10"}


def constants_last(param_text: str) -> tuple[str, int]:
    """The .param with each two-input BinaryOp that reads a constant (MemoryData, through Splits) first
    and a computed blob second written the other way round, and how many were."""
    parts = split_param(param_text)
    if parts is None:
        return param_text, 0
    magic, layers = parts
    graph = Graph(layers)

    def constant(blob: str) -> bool:
        i = graph.producer.get(graph.value(blob))
        return i is not None and layers[i].type == "MemoryData"

    texts, swapped = [], 0
    for layer in layers:
        op = layer.fields.get("0", "0")
        if (layer.type == "BinaryOp" and len(layer.bottoms) == 2 and layer.fields.get("1", "0") == "0"
                and op in _SWAPPED and constant(layer.bottoms[0]) and not constant(layer.bottoms[1])):
            layer.bottoms.reverse()
            layer.fields["0"] = _SWAPPED[op]
            texts.append(layer.render())
            swapped += 1
        else:
            texts.append(layer.text)
    return (join_param(magic, layers, texts), swapped) if swapped else (param_text, 0)
