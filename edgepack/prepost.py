"""Pre/post-processing baked into the ONNX graph, so the artifact takes raw data and answers.

``--preprocess image:size=224x224,layout=nhwc,dtype=uint8,mean=0.485/0.456/0.406,std=0.229/0.224/0.225,resize=bilinear``
``--postprocess softmax,topk=5,labels=labels.txt``  (or the same in ``MODEL.edgepack.toml`` next to the model)

What goes where:

* In the graph (every backend builds it, verified against onnxruntime like any model): the pixel scaling
  and per-channel normalisation (one Mul + one Add with constants), the layout change (Transpose
  NHWC -> NCHW when the raw layout differs from the model's) and the Softmax. The new graph input is
  float32 holding raw pixel values (0..255 for dtype=uint8, 0..1 for dtype=float32): ncnn takes float32
  only, so the integer -> float step is a lossless conversion in the artifact's common input layer
  (runtimes/common/ep_image.c), identical for every backend.
* In the artifact's common input layer: decoding PNG/JPEG/PPM (stb_image, Debian libstb-dev) and the
  resize to the model's size (bilinear or nearest, half-pixel centres; same arithmetic as
  :func:`resize_image` here), because the graph's shapes are static while images come in any size.
* In the artifact's answer formatting: top-k and labels over the (softmaxed) output. TopK is an op
  ncnn lacks and its int64 indices are no float tensor, so it is lowered out of the graph into the
  runtime, which sorts the verified scores.

The configuration travels in the ONNX metadata (key ``edgepack.prepost``) and in the artifact's
manifest under ``"prepost"`` (labels included), where the runtime reads it.
"""
from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .errors import ModelError, UsageError
from .model import LoadedModel, _with

META_KEY = "edgepack.prepost"
_LAYOUTS = ("nhwc", "nchw")
_RESIZES = ("bilinear", "nearest", "none")


@dataclass
class ImagePre:
    kind: str = "image"
    input: str = "image"                 # name of the new graph input
    size: tuple = ()                     # (height, width); default: the model's
    channels: int = 0                    # default: the model's
    layout: str = "nhwc"                 # layout of the raw input the artifact takes
    dtype: str = "uint8"                 # raw pixel type: uint8 (0..255) or float32 (0..1)
    mean: tuple = (0.0,)
    std: tuple = (1.0,)
    resize: str = "bilinear"


@dataclass
class Post:
    output: str = ""                     # the model output it applies to (default: the first)
    softmax: bool = False
    topk: int = 0
    labels: list = field(default_factory=list)
    labels_file: str = ""


def config_path(model_path: Path) -> Path:
    model_path = Path(model_path)
    return model_path.with_name(model_path.stem + ".edgepack.toml")


def prepost_config_exists(model_path: Path) -> bool:
    return config_path(model_path).is_file()


# ---- parsing ---------------------------------------------------------------------------------

def _floats(v, what: str) -> tuple:
    if isinstance(v, (int, float)):
        return (float(v),)
    items = v if isinstance(v, (list, tuple)) else str(v).replace(",", "/").split("/")
    try:
        return tuple(float(x) for x in items)
    except (TypeError, ValueError):
        raise UsageError(f"preprocess {what}={v!r}: expected numbers like 0.485/0.456/0.406") from None


def _size(v) -> tuple:
    if isinstance(v, (list, tuple)) and len(v) == 2:
        items = v
    else:
        items = str(v).lower().replace(",", "x").split("x")
        if len(items) == 1:
            items = items * 2
    try:
        h, w = (int(x) for x in items)
    except (TypeError, ValueError):
        raise UsageError(f"preprocess size={v!r}: expected HEIGHTxWIDTH, e.g. 224x224") from None
    if not (0 < h <= 16384 and 0 < w <= 16384):
        raise UsageError(f"preprocess size={v!r}: out of range")
    return (h, w)


def _kv_string(s: str, what: str) -> tuple[str, dict]:
    """'image:size=224x224,mean=...' -> ('image', {...}); bare words become True."""
    head, _, rest = s.partition(":") if ":" in s.split(",")[0] else ("", "", s)
    out: dict = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        k, eq, v = part.partition("=")
        out[k.strip().lower()] = v.strip() if eq else True
    return head.strip().lower(), out


def parse_preprocess(spec, base: Path) -> ImagePre:
    if isinstance(spec, str):
        kind, kv = _kv_string(spec, "preprocess")
        kv.setdefault("kind", kind or "image")
    else:
        kv = {str(k).lower(): v for k, v in dict(spec).items()}
    kind = str(kv.pop("kind", "image")).lower()
    if kind != "image":
        raise UsageError(f"--preprocess kind {kind!r} is not supported", hint="use image:size=HxW,... "
                         "(tabular CSV and .npy/JSON tensors need no preprocessing)")
    pre = ImagePre()
    for k, v in kv.items():
        if k == "size":
            pre.size = _size(v)
        elif k == "layout":
            pre.layout = str(v).lower()
            if pre.layout not in _LAYOUTS:
                raise UsageError(f"preprocess layout={v!r}: expected nhwc or nchw")
        elif k == "dtype":
            pre.dtype = str(v).lower()
            if pre.dtype not in ("uint8", "float32"):
                raise UsageError(f"preprocess dtype={v!r}: expected uint8 or float32")
        elif k in ("mean", "std"):
            setattr(pre, k, _floats(v, k))
        elif k == "resize":
            pre.resize = str(v).lower()
            if pre.resize not in _RESIZES:
                raise UsageError(f"preprocess resize={v!r}: expected one of {', '.join(_RESIZES)}")
        elif k == "channels":
            pre.channels = int(v)
            if pre.channels not in (1, 3):
                raise UsageError(f"preprocess channels={v!r}: expected 1 or 3")
        elif k == "input":
            pre.input = str(v)
        else:
            raise UsageError(f"unknown preprocess setting {k!r}",
                             hint="settings: size, layout, dtype, mean, std, resize, channels, input")
    if any(s == 0 for s in pre.std):
        raise UsageError("preprocess std must not contain 0")
    return pre


_LABELS_MAX = 16 << 20   # bytes: far above any real class list, far below what would stall a build


def _labels_path(v, base: Path, sidecar: Path | None) -> Path:
    """The labels file named by ``v``. From a sidecar (``sidecar`` set) it must resolve, symlinks
    included, to a plain file inside the model's folder: a model folder from elsewhere must not pull
    e.g. ~/.ssh/id_ed25519 into the manifest that /info serves. On the command line it is the user's choice."""
    p = Path(str(v))
    p = p if p.is_absolute() else base / p
    if sidecar is not None:
        folder = base.resolve()
        real = p.resolve()
        if not real.is_relative_to(folder):
            raise UsageError(f"{sidecar}: labels = {str(v)!r} resolves to {real}, outside the model's folder {folder}",
                             hint=f"copy the labels file into {folder} and name it there, or pass it explicitly: "
                                  f"--postprocess labels=PATH")
        p = real
    if not p.exists():
        raise UsageError(f"labels file {p} not found")
    if not p.is_file():
        raise UsageError(f"labels file {p} is not a plain file", hint="give a text file with one label per line")
    if p.stat().st_size > _LABELS_MAX:
        raise UsageError(f"labels file {p} is {p.stat().st_size >> 20} MiB (limit {_LABELS_MAX >> 20} MiB)",
                         hint="one label per line, one line per class")
    return p


def parse_postprocess(spec, base: Path, sidecar: Path | None = None) -> Post:
    kv = _kv_string(spec, "postprocess")[1] if isinstance(spec, str) else \
        {str(k).lower(): v for k, v in dict(spec).items()}
    post = Post()
    for k, v in kv.items():
        if k == "softmax":
            post.softmax = v is True or str(v).lower() in ("1", "true", "yes")
        elif k == "topk":
            try:
                post.topk = int(v)
            except (TypeError, ValueError):
                raise UsageError(f"postprocess topk={v!r}: expected a number") from None
            if not 0 < post.topk <= 1000:
                raise UsageError(f"postprocess topk={v!r}: expected 1..1000")
        elif k == "labels":
            if isinstance(v, list):
                post.labels = [str(x) for x in v]
            else:
                p = _labels_path(v, base, sidecar)
                lines = p.read_text(encoding="utf-8", errors="replace").splitlines()
                while lines and not lines[-1].strip():
                    lines.pop()
                post.labels = [ln.strip() for ln in lines]
                post.labels_file = p.name
        elif k == "output":
            post.output = str(v)
        else:
            raise UsageError(f"unknown postprocess setting {k!r}", hint="settings: softmax, topk=K, labels=FILE, output=NAME")
    return post


def load_config(model_path: Path, preprocess, postprocess) -> tuple[ImagePre | None, Post | None]:
    """The TOML next to the model, with --preprocess/--postprocess (strings) taking precedence."""
    model_path = Path(model_path)
    pre_src, post_src, toml_base = None, None, model_path.parent
    cfg = config_path(model_path)
    if cfg.is_file():
        try:
            data = tomllib.loads(cfg.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise UsageError(f"{cfg}: invalid TOML: {exc}") from None
        unknown = set(data) - {"preprocess", "postprocess"}
        if unknown:
            raise UsageError(f"{cfg}: unknown section(s) {sorted(unknown)}", hint="sections: [preprocess], [postprocess]")
        pre_src, post_src = data.get("preprocess"), data.get("postprocess")
    pre = parse_preprocess(preprocess, Path.cwd()) if preprocess else (
        parse_preprocess(pre_src, toml_base) if pre_src else None)
    post = parse_postprocess(postprocess, Path.cwd()) if postprocess else (
        parse_postprocess(post_src, toml_base, sidecar=cfg) if post_src else None)
    return pre, post


# ---- graph surgery ---------------------------------------------------------------------------

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


def _bake_pre(model: LoadedModel, proto: onnx.ModelProto, pre: ImagePre) -> None:
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
    pre.size, pre.channels = (h, w), c
    for what in ("mean", "std"):
        v = getattr(pre, what)
        if len(v) == 1:
            setattr(pre, what, tuple(v) * c)
        elif len(v) != c:
            raise UsageError(f"preprocess {what} has {len(v)} values; the model has {c} channels")
    taken = _all_names(g)
    inner = _unique(spec.name + "_normalized", taken)
    new_in = pre.input if pre.input not in taken or pre.input == spec.name else _unique(pre.input, taken)
    if new_in == spec.name:
        taken.add(new_in)
    pre.input = new_in
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


def _bake_post(model: LoadedModel, proto: onnx.ModelProto, post: Post) -> None:
    g = proto.graph
    names = [o.name for o in model.outputs]
    out = post.output or names[0]
    if out not in names:
        raise UsageError(f"postprocess output={out!r}: no such output (the model's: {', '.join(names)})")
    spec = model.outputs[names.index(out)]
    if spec.dtype != "float32":
        raise UsageError(f"postprocess needs a float32 output; {out} is {spec.dtype}")
    dims = [d for d in spec.shape if d != 1]
    if len(dims) != 1 or not isinstance(dims[0], int):
        raise UsageError(f"postprocess (softmax/top-k/labels) needs a class-score output like 1xN; {out} is "
                         f"{'x'.join(map(str, spec.shape))}")
    n_classes = dims[0]
    if post.labels and len(post.labels) != n_classes:
        raise UsageError(f"{len(post.labels)} labels for {n_classes} classes in output {out}",
                         hint="one label per line, in class-index order")
    if post.topk > n_classes:
        post.topk = n_classes
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
    post.output = out


def bake_prepost(model: LoadedModel, model_path: Path, preprocess: str | None, postprocess: str | None) -> LoadedModel:
    pre, post = load_config(model_path, preprocess, postprocess)
    if pre is None and post is None:
        return model
    proto = onnx.ModelProto()
    proto.CopyFrom(model.proto)
    if any(p.key == META_KEY for p in proto.metadata_props):
        raise UsageError(f"{model.name} already carries baked pre/post-processing")
    if pre:
        _bake_pre(model, proto, pre)
    if post:
        _bake_post(model, proto, post)
    cfg = {}
    if pre:
        cfg["preprocess"] = asdict(pre) | {"size": list(pre.size), "mean": list(pre.mean), "std": list(pre.std)}
    if post:
        cfg["postprocess"] = asdict(post)
    proto.metadata_props.append(onnx.StringStringEntryProto(key=META_KEY, value=json.dumps(cfg)))
    del proto.graph.value_info[:]
    try:
        onnx.checker.check_model(proto)
        proto = onnx.shape_inference.infer_shapes(proto, strict_mode=True)
    except Exception as exc:
        raise ModelError(f"{model.name}: the graph with baked pre/post-processing is invalid: "
                         f"{str(exc).strip().splitlines()[0][:200]}") from exc
    what = ", ".join(filter(None, [pre and f"preprocess image {pre.size[0]}x{pre.size[1]} {pre.layout} {pre.dtype}",
                                   post and "postprocess " + "+".join(filter(None, [
                                       post.softmax and "softmax", post.topk and f"top{post.topk}",
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


# ---- the numpy side (the SDK's ONNX path and the tests' reference) --------------------------

def resize_image(img: np.ndarray, h: int, w: int, mode: str) -> np.ndarray:
    """HxWxC (any dtype) -> float32 hxwxC with half-pixel centres, no antialiasing: the arithmetic of
    runtimes/common/ep_image.c."""
    img = np.asarray(img)
    if img.ndim == 2:
        img = img[:, :, None]
    ih, iw = img.shape[:2]
    src = img.astype(np.float32)
    if (ih, iw) == (h, w):
        return src
    if mode == "none":
        raise UsageError(f"image is {iw}x{ih}, the model takes {w}x{h} (resize=none)")
    if mode == "nearest":
        ys = np.minimum(((np.arange(h) + 0.5) * ih / h).astype(np.int64), ih - 1)
        xs = np.minimum(((np.arange(w) + 0.5) * iw / w).astype(np.int64), iw - 1)
        return src[ys][:, xs]

    def axis(n_out, n_in):
        s = np.maximum((np.arange(n_out, dtype=np.float32) + 0.5) * np.float32(n_in / n_out) - 0.5, 0)
        i0 = np.minimum(np.floor(s).astype(np.int64), n_in - 1)
        i1 = np.minimum(i0 + 1, n_in - 1)
        return i0, i1, (s - i0).astype(np.float32)
    y0, y1, fy = axis(h, ih)
    x0, x1, fx = axis(w, iw)
    top = src[y0][:, x0] * (1 - fx)[None, :, None] + src[y0][:, x1] * fx[None, :, None]
    bot = src[y1][:, x0] * (1 - fx)[None, :, None] + src[y1][:, x1] * fx[None, :, None]
    return (top * (1 - fy)[:, None, None] + bot * fy[:, None, None]).astype(np.float32)


def image_to_input(img: np.ndarray, pre: dict) -> np.ndarray:
    """A decoded HxWxC uint8 image -> the baked graph's raw input (resized, float32, raw layout)."""
    img = np.asarray(img)
    if img.ndim == 2:
        img = img[:, :, None]
    c = int(pre["channels"])
    if img.shape[2] != c:
        if c == 3 and img.shape[2] == 1:
            img = np.repeat(img, 3, axis=2)
        elif c == 3 and img.shape[2] == 4:
            img = img[:, :, :3]
        elif c == 1:
            img = np.round(img[:, :, :3].astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32))[:, :, None]
    h, w = pre["size"]
    x = resize_image(img, h, w, pre["resize"])
    if pre["dtype"] == "float32":
        x = x / np.float32(255.0)
    x = x[None]
    if pre["layout"] == "nchw":
        x = x.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(x, np.float32)


def reference_preprocess(img: np.ndarray, pre: dict, nchw: bool = True) -> np.ndarray:
    """What the original (unbaked) model wants: resized, scaled, normalised, 1xCxHxW float32."""
    x = image_to_input(img, pre | {"layout": "nhwc", "dtype": "float32"})[0]
    x = (x - np.array(pre["mean"], np.float32)) / np.array(pre["std"], np.float32)
    x = x[None]
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2) if nchw else x, np.float32)


def topk_answer(scores: np.ndarray, post: dict) -> list[dict]:
    s = np.asarray(scores, np.float32).reshape(-1)
    k = int(post.get("topk") or 0) or min(5, s.size)
    order = sorted(range(s.size), key=lambda i: (-float(s[i]), i))[:k]
    labels = post.get("labels") or []
    return [{"index": int(i), "label": labels[i] if i < len(labels) else str(i), "score": float(s[i])} for i in order]
