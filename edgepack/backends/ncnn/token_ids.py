"""Integer inputs that are embedding ids, for NCNN.

Text and token models take int64 ids that index an embedding table (ONNX Gather on a constant
[rows, dim] table, axis 0). ncnn's Embed layer does that lookup, reading its input's 32-bit words as
int32 ids, and pnnx writes one for such a Gather (its ONNX pattern is a Gather with no attributes:
an explicit axis=0 kept pnnx on a Gather layer ncnn does not have). So an integer input whose every
use is such a lookup can enter an NCNN artifact: the engine (ep_engine_ncnn.c) turns the ids into
int32 words, counts a negative id from the table's end and refuses one outside the table, as
onnxruntime's Gather does (Embed alone would clamp it to the first or last row).

Any other use of an integer input (a mask, a length, a position computed from it) keeps the model
off NCNN with a message naming the op: those need integer arithmetic ncnn's float layers lack.
"""
from __future__ import annotations

import onnx
from onnx import helper

from ...errors import UnsupportedOpError

INTEGER_IDS = ("int64", "int32")


def id_inputs(proto: onnx.ModelProto, specs, model_name: str) -> dict[str, int]:
    """input name -> rows of the table it indexes, for every integer input of ``specs`` (TensorSpec);
    raises UnsupportedOpError naming the first use that is not an embedding lookup."""
    tables = {t.name: t for t in proto.graph.initializer}
    found: dict[str, int] = {}
    for s in specs:
        if s.dtype not in INTEGER_IDS:
            continue
        refuse = f"{model_name}: input {s.name} is {s.dtype}; ncnn artifacts take float32, or integer ids"
        if sum(int(d) != 1 for d in s.shape) > 1:
            raise UnsupportedOpError(f"{refuse} of one row (it is {list(s.shape)})", hint="use --backend tvm")
        users = [n for n in proto.graph.node if s.name in n.input]
        rows = set()
        for n in users:
            table = tables.get(n.input[0]) if n.op_type == "Gather" else None
            axis = next((helper.get_attribute_value(a) for a in n.attribute if a.name == "axis"), 0)
            if table is None or list(n.input) != [n.input[0], s.name] or axis != 0 or len(table.dims) != 2 \
                    or table.data_type != onnx.TensorProto.FLOAT:
                raise UnsupportedOpError(f"{refuse} that index an embedding table; it feeds {n.op_type} "
                                         f"(node {n.name or n.output[0]})", hint="use --backend tvm")
            rows.add(int(table.dims[0]))
        if len(rows) != 1:
            raise UnsupportedOpError(f"{refuse} that index one embedding table size; it indexes "
                                     f"{sorted(rows) or 'none'}", hint="use --backend tvm")
        found[s.name] = rows.pop()
    return found


def as_pnnx_embeddings(proto: onnx.ModelProto, ids: dict[str, int]) -> onnx.ModelProto:
    """A copy of proto whose lookups on ``ids`` carry no axis attribute (0 is the default), the form
    pnnx turns into ncnn's Embed; proto itself where there is nothing to change."""
    if not ids:
        return proto
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    for n in out.graph.node:
        if n.op_type == "Gather" and len(n.input) == 2 and n.input[1] in ids:
            del n.attribute[:]
    return out


def embed_only(param_text: str, blob: str) -> bool:
    """Whether every layer of the .param that reads ``blob`` (through Splits) is an Embed: only
    Embed reads the int32 words the engine feeds, any other layer would take them for floats."""
    readers: dict[str, list[tuple[str, list[str]]]] = {}
    for line in param_text.strip().splitlines()[2:]:
        parts = line.split()
        if len(parts) < 4:
            continue
        n_in, n_out = int(parts[2]), int(parts[3])
        bottoms, tops = parts[4:4 + n_in], parts[4 + n_in:4 + n_in + n_out]
        for b in bottoms:
            readers.setdefault(b, []).append((parts[0], tops))
    todo, seen = [blob], set()
    while todo:
        b = todo.pop()
        if b in seen:
            continue
        seen.add(b)
        for ltype, tops in readers.get(b, []):
            if ltype == "Split":
                todo.extend(tops)
            elif ltype != "Embed":
                return False
    return bool(readers.get(blob))
