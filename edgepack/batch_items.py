"""A batch run one item at a time: the same model prepared at batch 1, for backends without a batch axis.

ncnn has no batch axis: pnnx drops axis 0 of every tensor, so a model built for a fixed batch N > 1
(`--input-shape x=6x3x48x320`: PP-OCR's recogniser takes six text lines at once in rapidocr, MTCNN's
R-Net and O-Net every face candidate of a frame) came out of pnnx with one item's answer and went to
TVM. Such a model is prepared a second time with every input's batch dim at 1; a backend that says
`runs_items` compiles that graph, and its engine runs it once per item, each on its slice of axis 0
of every input and output (the tensors are contiguous along axis 0, so item k is the k-th 1/N of
each buffer).

That is right only for a model that computes each item from that item alone. Two checks say so:
here, the batch-1 graph must answer the first of N distinct random items as the batch-N graph
answers it (within the verification bound); and the artifact is verified, as every build, against onnxruntime
on the whole batch of distinct random items, so a model that mixes items (a Reshape folding the
batch into another axis, a sum over it) fails verification at that backend and the next is tried.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from .model import LoadedModel, resolve_output_shapes
from .reference import POLICY, compare, random_inputs, run_onnxruntime

ITEMS_SEED = 11


def batch_size(model: LoadedModel) -> int:
    """N where every input and output of ``model`` has the static leading dim N > 1; else 1."""
    specs = [*model.inputs, *model.outputs]
    firsts = {s.shape[0] if s.shape and isinstance(s.shape[0], int) else None for s in specs}
    if len(firsts) != 1 or any(s.trim for s in model.outputs):
        return 1
    n = firsts.pop()
    return n if n is not None and n > 1 else 1


def _item_shape(shape: tuple) -> tuple:
    return (1, *shape[1:])


def per_item_model(model: LoadedModel, given: LoadedModel,
                   prepare_at: Callable[[dict], LoadedModel]) -> LoadedModel | None:
    """``model`` (batch N) prepared again at batch 1 by ``prepare_at(input shapes)``, the input
    shapes being ``given``'s (the model's own inputs, before pre-processing was baked) at batch 1;
    None where the model has no batch N > 1, does not prepare at batch 1 (a batch fixed inside the
    file), or answers the first of N distinct random items otherwise at batch 1 (the golden input
    repeats one item N times, which cannot show a model that mixes them)."""
    n = batch_size(model)
    if n == 1 or any(not s.shape or s.shape[0] != n for s in given.inputs):
        return None
    try:
        item = prepare_at({s.name: _item_shape(tuple(s.shape)) for s in given.inputs})
    except Exception:  # noqa: BLE001  (a failure here costs the per-item path only, never the build)
        return None
    if ([(s.name, s.dtype, _item_shape(tuple(s.shape))) for s in model.inputs]
            != [(s.name, s.dtype, tuple(s.shape)) for s in item.inputs]
            or [s.name for s in model.outputs] != [s.name for s in item.outputs]):
        return None
    items = random_inputs(model.inputs, ITEMS_SEED)
    first = {k: np.ascontiguousarray(v[:1]) for k, v in items.items()}
    try:
        whole = run_onnxruntime(model, items, f"{n} seeded random items")
        answer = run_onnxruntime(item, first, "the first of them alone")
    except Exception:  # noqa: BLE001
        return None
    item = resolve_output_shapes(item, answer)
    if ([(s.dtype, _item_shape(tuple(s.shape))) for s in model.outputs]
            != [(s.dtype, tuple(s.shape)) for s in item.outputs]):
        return None
    want = {k: v[:1] for k, v in whole.items()}
    return item if all(c.ok for c in compare(answer, want, POLICY)) else None
