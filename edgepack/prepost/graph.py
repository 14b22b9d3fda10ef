"""Graph surgery: the pixel scaling, normalisation, layout change and Softmax baked into the ONNX graph
(so every backend builds them and the build verifies them), and the settings the runtime needs written
to the graph's metadata (key ``edgepack.prepost``) and from there to the artifact's manifest."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import ModelError, UsageError
from ..model import LoadedModel, _with
from .detect import resolve_detect
from .spec import ImagePre, Post, load_config

META_KEY = "edgepack.prepost"


def _unique(name: str, taken: set[str]) -> str:
    out, i = name, 1
    while out in taken:
        out, i = f"{name}_{i}", i + 1
    taken.add(out)
    return out


def _all_names(g: onnx.GraphProto) -> set[str]:
    names = {v.name for v in list(g.input) + list(g.output) + list(g.value_info)}
    names |= {i.name for i in g.initializer}
    for n in g.node:
        names |= set(n.input) | set(n.output) | {n.name}
    return names


def _bake_pre(model: LoadedModel, proto: onnx.ModelProto, pre: ImagePre) -> ImagePre:
    """Rewrites ``proto``; returns the settings completed from the model (size, channels, input name)."""
    g = proto.graph
    if len(model.inputs) != 1:
        raise UsageError(f"image preprocessing needs a model with one input; {model.name} has {len(model.inputs)}")
    spec = model.inputs[0]
    if spec.dtype != "float32" or len(spec.shape) != 4 or spec.shape[0] != 1:
        raise UsageError(f"image preprocessing needs a float32 1xCxHxW or 1xHxWxC input; {spec.name} is "
                         f"{spec.dtype} {'x'.join(map(str, spec.shape))}")
    if spec.shape[1] in (1, 3):
        model_layout, c, h, w = "nchw", spec.shape[1], spec.shape[2], spec.shape[3]
    elif spec.shape[3] in (1, 3):
        model_layout, h, w, c = "nhwc", spec.shape[1], spec.shape[2], spec.shape[3]
    else:
        raise UsageError(f"input {spec.name} {'x'.join(map(str, spec.shape))} has no 1- or 3-channel axis")
    if pre.size and tuple(pre.size) != (h, w):
        raise UsageError(f"preprocess size={pre.size[0]}x{pre.size[1]} differs from the model's {h}x{w}",
                         hint=f"fix the model's input with --input-shape {spec.name}=... or use size={h}x{w}")
    if pre.channels and pre.channels != c:
        raise UsageError(f"preprocess channels={pre.channels} differs from the model's {c}")
    per_channel = {}
    for what in ("mean", "std"):
        v = getattr(pre, what)
        if len(v) == 1:
            per_channel[what] = tuple(v) * c
        elif len(v) != c:
            raise UsageError(f"preprocess {what} has {len(v)} values; the model has {c} channels")
        else:
            per_channel[what] = tuple(v)
    taken = _all_names(g)
    inner = _unique(spec.name + "_normalized", taken)
    new_in = pre.input if pre.input not in taken or pre.input == spec.name else _unique(pre.input, taken)
    if new_in == spec.name:
        taken.add(new_in)
    pre = dataclasses.replace(pre, size=(h, w), channels=c, input=new_in, **per_channel)
    std = np.array(pre.std, np.float64)
    mean = np.array(pre.mean, np.float64)
    scale = (1.0 / 255.0 if pre.dtype == "uint8" else 1.0) / std
    bias = -mean / std
    bshape = (1, 1, 1, c) if pre.layout == "nhwc" else (1, c, 1, 1)
    raw_shape = (1, h, w, c) if pre.layout == "nhwc" else (1, c, h, w)
    sname, bname = _unique("pre_scale", taken), _unique("pre_bias", taken)
    g.initializer.extend([numpy_helper.from_array(scale.astype(np.float32).reshape(bshape), sname),
                          numpy_helper.from_array(bias.astype(np.float32).reshape(bshape), bname)])
    t1 = _unique("pre_scaled", taken)
    needs_t = pre.layout != model_layout
    t2 = _unique("pre_shifted", taken) if needs_t else inner
    nodes = [helper.make_node("Mul", [new_in, sname], [t1], name=_unique("pre_mul", taken)),
             helper.make_node("Add", [t1, bname], [t2], name=_unique("pre_add", taken))]
    if needs_t:
        perm = [0, 3, 1, 2] if pre.layout == "nhwc" else [0, 2, 3, 1]
        nodes.append(helper.make_node("Transpose", [t2], [inner], perm=perm, name=_unique("pre_transpose", taken)))
    for n in g.node:
        for i, x in enumerate(n.input):
            if x == spec.name:
                n.input[i] = inner
    for o in g.output:
        if o.name == spec.name:
            raise UsageError("the model's input is also an output; nothing to preprocess")
    idx = [i for i, v in enumerate(g.input) if v.name == spec.name][0]
    new_vi = helper.make_tensor_value_info(new_in, onnx.TensorProto.FLOAT, list(raw_shape))
    g.input.remove(g.input[idx])
    g.input.insert(idx, new_vi)
    old_nodes = list(g.node)
    del g.node[:]
    g.node.extend(nodes + old_nodes)
    return pre


def _model_hw(model: LoadedModel, pre: ImagePre | None) -> tuple:
    """(height, width) of the image the model sees: the preprocessing's, else a 4-d input's."""
    if pre is not None:
        return tuple(pre.size)
    for s in model.inputs:
        if len(s.shape) == 4 and all(isinstance(d, int) for d in s.shape):
            return (s.shape[2], s.shape[3]) if s.shape[1] in (1, 3) else (s.shape[1], s.shape[2])
    return ()


def _bake_post(model: LoadedModel, proto: onnx.ModelProto, post: Post, pre: ImagePre | None) -> Post:
    g = proto.graph
    names = [o.name for o in model.outputs]
    out = post.output or names[0]
    if out not in names:
        raise UsageError(f"postprocess output={out!r}: no such output (the model's: {', '.join(names)})")
    spec = model.outputs[names.index(out)]
    if spec.dtype != "float32":
        raise UsageError(f"postprocess needs a float32 output; {out} is {spec.dtype}")
    if post.detect is not None:
        det = resolve_detect(post.detect, out, tuple(spec.shape), _model_hw(model, pre))
        if post.labels and len(post.labels) != det.classes:
            raise UsageError(f"{len(post.labels)} labels for {det.classes} classes in output {out} ({det.format})",
                             hint="one label per line, in class-index order")
        return dataclasses.replace(post, output=out, detect=det)
    dims = [d for d in spec.shape if d != 1]
    if len(dims) != 1 or not isinstance(dims[0], int):
        raise UsageError(f"postprocess (softmax/top-k/labels) needs a class-score output like 1xN; {out} is "
                         f"{'x'.join(map(str, spec.shape))}",
                         hint="a detector? use --postprocess detect:format=yolov8|yolov5|yolox")
    n_classes = dims[0]
    if post.labels and len(post.labels) != n_classes:
        raise UsageError(f"{len(post.labels)} labels for {n_classes} classes in output {out}",
                         hint="one label per line, in class-index order")
    topk = min(post.topk, n_classes)
    if post.softmax:
        taken = _all_names(g)
        new_out = _unique("scores", taken)
        axis = [i for i, d in enumerate(spec.shape) if d == n_classes][-1]
        g.node.append(helper.make_node("Softmax", [out], [new_out], axis=axis, name=_unique("post_softmax", taken)))
        idx = names.index(out)
        old = g.output[idx]
        vi = helper.make_tensor_value_info(new_out, old.type.tensor_type.elem_type, list(spec.shape))
        g.output.remove(old)
        g.output.insert(idx, vi)
        out = new_out
    return dataclasses.replace(post, output=out, topk=topk)


def _post_json(post: Post) -> dict:
    d = dataclasses.asdict(post)
    d["labels"] = list(post.labels)
    if post.detect is None:
        del d["detect"]   # classifier manifests stay as they were
    else:
        d["detect"] |= {"input_size": list(post.detect.input_size), "strides": list(post.detect.strides)}
    return d


def bake_prepost(model: LoadedModel, model_path: Path, preprocess: str | None, postprocess: str | None) -> LoadedModel:
    pre, post = load_config(model_path, preprocess, postprocess)
    if pre is None and post is None:
        return model
    proto = onnx.ModelProto()
    proto.CopyFrom(model.proto)
    if any(p.key == META_KEY for p in proto.metadata_props):
        raise UsageError(f"{model.name} already carries baked pre/post-processing")
    if pre:
        pre = _bake_pre(model, proto, pre)
    if post:
        post = _bake_post(model, proto, post, pre)
    cfg = {}
    if pre:
        cfg["preprocess"] = dataclasses.asdict(pre) | {"size": list(pre.size), "mean": list(pre.mean),
                                                       "std": list(pre.std)}
    if post:
        cfg["postprocess"] = _post_json(post)
    proto.metadata_props.append(onnx.StringStringEntryProto(key=META_KEY, value=json.dumps(cfg)))
    del proto.graph.value_info[:]
    try:
        onnx.checker.check_model(proto)
        proto = onnx.shape_inference.infer_shapes(proto, strict_mode=True)
    except Exception as exc:
        raise ModelError(f"{model.name}: the graph with baked pre/post-processing is invalid: "
                         f"{str(exc).strip().splitlines()[0][:200]}") from exc
    what = ", ".join(filter(None, [
        pre and f"preprocess image {pre.size[0]}x{pre.size[1]} {pre.layout} {pre.dtype}"
                + (f" letterbox={pre.letterbox}" if pre.letterbox >= 0 else ""),
        post and "postprocess " + "+".join(filter(None, [
            post.softmax and "softmax", post.topk and f"top{post.topk}",
            post.detect and f"detect {post.detect.format} ({post.detect.classes} classes)",
            post.labels and f"{len(post.labels)} labels"]))]))
    return _with(model, proto, f"baked {what}")


def prepost_of(proto: onnx.ModelProto) -> dict:
    for p in proto.metadata_props:
        if p.key == META_KEY:
            return json.loads(p.value)
    return {}


def prepost_manifest(model: LoadedModel) -> dict:
    """{"prepost": {...}} for the artifact manifest (the runtime reads it), or {} without."""
    cfg = prepost_of(model.proto)
    return {"prepost": cfg} if cfg else {}
