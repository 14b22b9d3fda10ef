"""What the graph rewrites ask of an ONNX graph before they change it: its constants and each
tensor's dims and element type, as onnx's shape inference sees them.

One place for it because the rewrites (LSTM unrolling, the quantised-op lowering, the NCNN
rewrites) each need the same two tables and differ only in what they do with unknowns.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper


@dataclass(frozen=True)
class TensorInfo:
    dims: tuple[int | None, ...] | None  # None: rank unknown; a None dim: symbolic or unknown
    elem_type: int                       # onnx.TensorProto enum; 0 where inference left it undefined

    @property
    def static(self) -> tuple[int, ...] | None:
        """The dims when every one is known, else None."""
        if self.dims is None or any(d is None for d in self.dims):
            return None
        return tuple(int(d) for d in self.dims)

    @property
    def np_dtype(self) -> np.dtype:
        """numpy's dtype; float32 where onnx left the type undefined."""
        return helper.tensor_dtype_to_np_dtype(self.elem_type) if self.elem_type else np.dtype(np.float32)


def node_attrs(node) -> dict:
    """A node's attributes by name, as Python values."""
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Initializers and the outputs of Constant nodes that carry a tensor (`value`)."""
    out = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    for n in model.graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            out[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    return out


def tensor_infos(model: onnx.ModelProto, infer: bool = True, strict: bool = False,
                 initializers: bool = True) -> dict[str, TensorInfo]:
    """tensor name -> TensorInfo for graph inputs, outputs, value_info (after shape inference when
    `infer`) and, with `initializers`, the initializers. With `strict` False a graph onnx cannot infer (contrib ops make it
    give up on some models) keeps what it already records rather than raising."""
    graph = model.graph
    if infer:
        try:
            graph = onnx.shape_inference.infer_shapes(model).graph
        except Exception:  # noqa: BLE001  (onnx raises several types; the caller decides what unknown means)
            if strict:
                raise
    out: dict[str, TensorInfo] = {}
    for v in [*graph.value_info, *graph.input, *graph.output]:
        tt = v.type.tensor_type
        dims = tuple(int(d.dim_value) if d.HasField("dim_value") else None for d in tt.shape.dim) \
            if tt.HasField("shape") else None
        out[v.name] = TensorInfo(dims, tt.elem_type)
    for t in model.graph.initializer if initializers else ():
        out[t.name] = TensorInfo(tuple(int(d) for d in t.dims), t.data_type)
    return out


def remove_dead_nodes(model: onnx.ModelProto) -> int:
    """Drop nodes and initializers nothing reads (what a rewrite bypassed); how many nodes went. A kept
    node's subgraphs (If, Loop, Scan) may read outer values by name: those count as read too."""
    g = model.graph
    needed = {o.name for o in g.output}
    keep = []
    for node in reversed(list(g.node)):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
            needed.update(_subgraph_reads(node))
    removed = len(g.node) - len(keep)
    if removed:
        del g.node[:]
        g.node.extend(reversed(keep))
    inits = [i for i in g.initializer if i.name in needed]
    if len(inits) != len(g.initializer):
        del g.initializer[:]
        g.initializer.extend(inits)
    return removed


def _subgraph_reads(node) -> set[str]:
    """Every input name mentioned inside a node's subgraphs, nested ones included."""
    names: set[str] = set()
    for a in node.attribute:
        for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
            for n in sub.node:
                names.update(n.input)
                names |= _subgraph_reads(n)
    return names
