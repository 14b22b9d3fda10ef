"""--preprocess / --postprocess specs and the MODEL.edgepack.toml sidecar, parsed strictly into frozen
dataclasses: every error names the setting and what would be accepted."""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UsageError

_LAYOUTS = ("nhwc", "nchw")
_RESIZES = ("bilinear", "nearest", "none")
DETECT_FORMATS = ("yolov8", "yolov5", "yolox")
_LABELS_MAX = 16 << 20   # bytes: far above any real class list, far below what would stall a build


@dataclass(frozen=True)
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
    letterbox: int = -1                  # pad value 0..255 (aspect kept, centred); -1: stretch to the size


@dataclass(frozen=True)
class Detect:
    """YOLO-family decoding + NMS, done by the artifact's runtime (runtimes/common/ep_detect.c)."""
    format: str = ""                     # yolov8 | yolov5 | yolox; "": recognised from the output shape
    conf: float = 0.25                   # keep candidates whose score is > conf
    iou: float = 0.45                    # NMS: drop a box whose IoU with a kept one is > iou
    max_det: int = 100
    agnostic: bool = False               # NMS across classes (else per class)
    grid: bool = True                    # yolox: outputs are grid offsets (False: already decoded)
    # filled in when baked, from the model's output and input shapes:
    classes: int = 0
    anchors: int = 0
    channels_first: bool = False         # [1, 4(+1)+C, N] (yolov8's export) instead of [1, N, ...]
    input_size: tuple = ()               # (height, width) of the model input boxes are measured in
    strides: tuple = (8, 16, 32)


@dataclass(frozen=True)
class Post:
    output: str = ""                     # the model output it applies to (default: the first)
    softmax: bool = False
    topk: int = 0
    labels: list = field(default_factory=list)   # a list: callers compare it with lists
    labels_file: str = ""
    detect: Detect | None = None


def config_path(model_path: Path) -> Path:
    model_path = Path(model_path)
    return model_path.with_name(model_path.stem + ".edgepack.toml")


def prepost_config_exists(model_path: Path) -> bool:
    return config_path(model_path).is_file()


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


def _kv_string(s: str) -> tuple[str, dict]:
    """'image:size=224x224,mean=...' -> ('image', {...}); bare words become True."""
    head, _, rest = s.partition(":") if ":" in s.split(",")[0] else ("", "", s)
    out: dict = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        k, eq, v = part.partition("=")
        out[k.strip().lower()] = v.strip() if eq else True
    return head.strip().lower(), out


def _flag(v) -> bool:
    return v is True or str(v).lower() in ("1", "true", "yes")


def parse_preprocess(spec, base: Path) -> ImagePre:
    if isinstance(spec, str):
        kind, kv = _kv_string(spec)
        kv.setdefault("kind", kind or "image")
    else:
        kv = {str(k).lower(): v for k, v in dict(spec).items()}
    kind = str(kv.pop("kind", "image")).lower()
    if kind != "image":
        raise UsageError(f"--preprocess kind {kind!r} is not supported", hint="use image:size=HxW,... "
                         "(tabular CSV and .npy/JSON tensors need no preprocessing)")
    s: dict = {}
    for k, v in kv.items():
        if k == "size":
            s["size"] = _size(v)
        elif k == "layout":
            s["layout"] = str(v).lower()
            if s["layout"] not in _LAYOUTS:
                raise UsageError(f"preprocess layout={v!r}: expected nhwc or nchw")
        elif k == "dtype":
            s["dtype"] = str(v).lower()
            if s["dtype"] not in ("uint8", "float32"):
                raise UsageError(f"preprocess dtype={v!r}: expected uint8 or float32")
        elif k in ("mean", "std"):
            s[k] = _floats(v, k)
        elif k == "resize":
            s["resize"] = str(v).lower()
            if s["resize"] not in _RESIZES:
                raise UsageError(f"preprocess resize={v!r}: expected one of {', '.join(_RESIZES)}")
        elif k == "channels":
            s["channels"] = int(v)
            if s["channels"] not in (1, 3):
                raise UsageError(f"preprocess channels={v!r}: expected 1 or 3")
        elif k == "letterbox":
            s["letterbox"] = 114 if v is True else _int(v, "preprocess letterbox", 0, 255)
        elif k == "input":
            s["input"] = str(v)
        else:
            raise UsageError(f"unknown preprocess setting {k!r}",
                             hint="settings: size, layout, dtype, mean, std, resize, letterbox, channels, input")
    pre = ImagePre(**s)
    if any(x == 0 for x in pre.std):
        raise UsageError("preprocess std must not contain 0")
    if pre.letterbox >= 0 and pre.resize == "none":
        raise UsageError("preprocess letterbox needs a resize (bilinear or nearest), not resize=none")
    return pre


def _int(v, what: str, lo: int, hi: int) -> int:
    try:
        n = int(v)
    except (TypeError, ValueError):
        raise UsageError(f"{what}={v!r}: expected a whole number {lo}..{hi}") from None
    if not lo <= n <= hi:
        raise UsageError(f"{what}={v!r}: expected {lo}..{hi}")
    return n


def _unit(v, what: str) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise UsageError(f"postprocess {what}={v!r}: expected a number in 0..1") from None
    if not 0.0 <= x <= 1.0:
        raise UsageError(f"postprocess {what}={v!r}: expected a number in 0..1")
    return x


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


_DETECT_KEYS = ("format", "conf", "iou", "max_det", "agnostic", "grid")


def _parse_detect(kv: dict) -> Detect:
    s: dict = {}
    for k, v in kv.items():
        if k == "format":
            s["format"] = str(v).lower()
            if s["format"] not in DETECT_FORMATS + ("auto",):
                raise UsageError(f"postprocess detect format={v!r} is not known",
                                 hint=f"formats: {', '.join(DETECT_FORMATS)} (or leave it out to recognise it "
                                      f"from the output shape)")
            if s["format"] == "auto":
                s["format"] = ""
        elif k in ("conf", "iou"):
            s[k] = _unit(v, k)
        elif k == "max_det":
            s["max_det"] = _int(v, "postprocess max_det", 1, 10000)
        elif k in ("agnostic", "grid"):
            s[k] = _flag(v)
    return Detect(**s)


def parse_postprocess(spec, base: Path, sidecar: Path | None = None) -> Post:
    if isinstance(spec, str):
        head, kv = _kv_string(spec)
    else:
        kv = {str(k).lower(): v for k, v in dict(spec).items()}
        head = str(kv.pop("kind", "")).lower()
    if head not in ("", "detect", "classify"):
        raise UsageError(f"--postprocess kind {head!r} is not supported",
                         hint="use softmax,topk=K,labels=FILE (classifiers) or detect:format=yolov8,... (detectors)")
    detect = head == "detect" or _flag(kv.pop("detect", False))
    s: dict = {}
    for k, v in kv.items():
        if k == "softmax":
            s["softmax"] = _flag(v)
        elif k == "topk":
            try:
                s["topk"] = int(v)
            except (TypeError, ValueError):
                raise UsageError(f"postprocess topk={v!r}: expected a number") from None
            if not 0 < s["topk"] <= 1000:
                raise UsageError(f"postprocess topk={v!r}: expected 1..1000")
        elif k == "labels":
            if isinstance(v, list):
                s["labels"] = [str(x) for x in v]
            else:
                p = _labels_path(v, base, sidecar)
                lines = p.read_text(encoding="utf-8", errors="replace").splitlines()
                while lines and not lines[-1].strip():
                    lines.pop()
                s["labels"] = [ln.strip() for ln in lines]
                s["labels_file"] = p.name
        elif k == "output":
            s["output"] = str(v)
        elif detect and k in _DETECT_KEYS:
            continue
        elif k in _DETECT_KEYS:
            raise UsageError(f"postprocess setting {k!r} belongs to detection",
                             hint=f"write --postprocess detect:{k}=...")
        else:
            raise UsageError(f"unknown postprocess setting {k!r}",
                             hint="settings: softmax, topk=K, labels=FILE, output=NAME; detectors: "
                                  "detect:format=yolov8|yolov5|yolox,conf=,iou=,max_det=,agnostic=0|1,labels=FILE")
    if detect:
        if s.get("softmax") or s.get("topk"):
            raise UsageError("postprocess detect cannot be combined with softmax/topk",
                             hint="detectors answer with boxes: detect:format=...,conf=...,labels=FILE")
        s["detect"] = _parse_detect({k: v for k, v in kv.items() if k in _DETECT_KEYS})
    return Post(**s)


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
