"""Indices that come from the input stay inside their tensors in TVM code.

TVM's relax ops read and write where an index says without a bound check (`take` in its default
"fast" mode, gather_elements, gather_nd, scatter_*): an id of 10**9 in a token model segfaults the
artifact, and an id just past the table reads the memory after it into the answer. onnxruntime
refuses such an index. Two layers, so that hostile input can neither crash nor leak memory:

- ``check_extents``: an integer model input whose values reach a Gather / GatherElements /
  ScatterElements index unchanged (through Reshape, Squeeze, Unsqueeze, Flatten, Identity, an integer
  Cast) is checked by the engine before it runs (option ``tvm.in_ids.<i>`` = the smallest extent it
  indexes, ep_engine_tvm.cc): outside -n..n-1 it is refused with the input, element and extent named.
- ``bounded``: every index tensor that is not a constant is taken modulo its extent first (ONNX Mod
  with fmod=0 is a floor modulo, as Python's %): a valid index, negative ones counted from the end,
  lands where ONNX puts it; any other lands somewhere inside. Computed indices (a TopK's, arithmetic
  on input values) get no error, but no read or write outside the tensor either.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ...onnx_index import constants, node_attrs, tensor_infos

# every op here reads its indices at input 1
# the extent is data's axis (attribute "axis", default 0)
_AXIS_INDEXED = frozenset({"Gather", "GatherElements", "ScatterElements", "Scatter"})
# the last index axis holds coordinates into data's leading axes
_COORD_INDEXED = frozenset({"GatherND", "ScatterND"})
_INT_TYPES = {TensorProto.INT32: np.int32, TensorProto.INT64: np.int64}
_SAME_VALUES = ("Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity")


def _extent(node, infos) -> int | None:
    dims = infos.get(node.input[0]).static if node.input[0] in infos else None
    if dims is None:
        return None
    axis = int(node_attrs(node).get("axis", 0))
    return dims[axis % len(dims)] if -len(dims) <= axis < len(dims) else None


def _coord_extents(node, infos) -> tuple[int, ...] | None:
    data, idx = (infos.get(node.input[0]), infos.get(node.input[1]))
    if data is None or idx is None or data.static is None or idx.static is None:
        return None
    batch = int(node_attrs(node).get("batch_dims", 0))
    k = idx.static[-1]
    return tuple(data.static[batch:batch + k]) if batch + k <= len(data.static) else None


def guard(model) -> tuple[dict, dict, str | None]:
    """For a TVM engine build of ``model`` (a LoadedModel): its engine options (tvm.in_ids.<i>), its
    manifest keys and a note (None when there is nothing to say)."""
    names = [s.name for s in model.inputs]
    infos = tensor_infos(model.proto)
    checked = {str(names.index(name)): extent for name, extent in check_extents(model.proto, names, infos).items()}
    plan = _bounds_plan(model.proto, infos)
    wrapped = sum(extents is not None for _, extents in plan)
    unbounded = len(plan) - wrapped
    note = None
    if wrapped or unbounded:
        note = (f"tvm: {wrapped} computed index tensor(s) taken modulo their extents"
                + (f"; {unbounded} with an extent unknown at build time left as they are" if unbounded else ""))
    return ({f"tvm.in_ids.{i}": str(extent) for i, extent in checked.items()},
            {"indices_bounded": wrapped, "indices_unbounded": unbounded, "inputs_id_checked": checked}, note)


def check_extents(proto: onnx.ModelProto, input_names: list[str], infos: dict | None = None) -> dict[str, int]:
    """input name -> the smallest extent its values index directly (see the module's doc); ``infos``:
    tensor_infos(proto) when the caller has it."""
    infos = tensor_infos(proto) if infos is None else infos
    readers: dict[str, list] = {}
    for n in proto.graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    found: dict[str, int] = {}
    for name in input_names:
        if name not in infos or infos[name].elem_type not in _INT_TYPES:
            continue
        todo, seen, extents = [name], set(), []
        while todo:
            value = todo.pop()
            if value in seen:
                continue
            seen.add(value)
            for n in readers.get(value, []):
                if n.op_type in _AXIS_INDEXED and len(n.input) > 1 and n.input[1] == value:
                    extent = _extent(n, infos)
                    if extent:
                        extents.append(extent)
                elif n.op_type in _SAME_VALUES and n.input[0] == value or \
                        n.op_type == "Cast" and node_attrs(n).get("to") in _INT_TYPES:
                    todo.append(n.output[0])
        if extents:
            found[name] = min(extents)
    return found


def _bounds_plan(proto: onnx.ModelProto, infos: dict) -> list[tuple[int, np.ndarray | None]]:
    """(node position, the extents to take its indices modulo, None where unknown at build time) for
    every node that indexes a tensor with indices that are not constants."""
    consts = constants(proto)
    plan = []
    for k, n in enumerate(proto.graph.node):
        if n.op_type not in _AXIS_INDEXED | _COORD_INDEXED or len(n.input) < 2 or n.input[1] in consts:
            continue
        if n.op_type in _AXIS_INDEXED:
            extent = _extent(n, infos)
            plan.append((k, None if not extent else np.array(extent)))
        else:
            coords = _coord_extents(n, infos)
            plan.append((k, None if not coords or 0 in coords else np.array(coords)))
    return plan


def bounded(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, int, int]:
    """(a copy of proto whose non-constant indices are taken modulo their extents, how many were,
    how many could not be: an extent unknown at build time). proto itself where none is computed."""
    infos = tensor_infos(proto)
    plan = dict(_bounds_plan(proto, infos))
    if not plan:
        return proto, 0, 0
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    taken = {o for n in out.graph.node for o in n.output} | {i.name for i in out.graph.initializer}
    nodes, done = [], 0
    for k, n in enumerate(out.graph.node):
        extents = plan.get(k)
        if extents is None:  # not indexed by computed indices, or an extent unknown at build time
            nodes.append(n)
            continue
        idx = n.input[1]
        itype = infos[idx].elem_type if idx in infos else 0
        base = _fresh(f"{idx}_bounded", taken)
        if itype not in _INT_TYPES:  # unknown to inference: as int64, which every indexed op takes
            cast = _fresh(f"{idx}_as_int64", taken)
            nodes.append(helper.make_node("Cast", [idx], [cast], to=TensorProto.INT64, name=cast))
            idx, itype = cast, TensorProto.INT64
        mod_by = _fresh(f"{idx}_extent", taken)
        out.graph.initializer.append(numpy_helper.from_array(extents.astype(_INT_TYPES[itype]), mod_by))
        nodes.append(helper.make_node("Mod", [idx, mod_by], [base], fmod=0, name=base))
        n.input[1] = base
        nodes.append(n)
        done += 1
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out, done, len(plan) - done


def _fresh(base: str, taken: set[str]) -> str:
    name, k = base, 0
    while name in taken:
        k += 1
        name = f"{base}_{k}"
    taken.add(name)
    return name
