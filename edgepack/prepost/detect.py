"""YOLO-family detectors: the output format recognised at build time, and the numpy reference of the
decoding + NMS that runtimes/common/ep_detect.c does inside the artifact (same order of operations, in
float32), used by the build's verification and the SDK's ONNX path.

Formats (C classes, N anchors):
  yolov8  [1, 4+C, N] (or [1, N, 4+C]): cx, cy, w, h in input pixels, then C class scores
  yolov5  [1, N, 5+C]: cx, cy, w, h, objectness, C class scores (score = objectness x class)
  yolox   [1, N, 5+C]: like yolov5, but boxes as grid offsets (cx = (x + col) * stride,
          w = exp(w) * stride, strides 8/16/32 from the input size) unless grid=0 (export decoded them)
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from ..errors import UsageError
from .image import boxes_to_image
from .spec import Detect


def grid_cells(hw: tuple, strides: tuple) -> int:
    return sum(math.ceil(hw[0] / s) * math.ceil(hw[1] / s) for s in strides)


def resolve_detect(det: Detect, out: str, shape: tuple, hw: tuple) -> Detect:
    """The settings completed from the output's shape (format when not given, classes, anchors, layout);
    a shape that fits no format is one UsageError naming the output and what was expected."""
    shown = "x".join(map(str, shape))
    dims = shape[1:] if len(shape) == 3 and shape[0] == 1 else shape if len(shape) == 2 else None
    if dims is None or not all(isinstance(d, int) and d > 0 for d in dims):
        raise UsageError(f"postprocess detect: output {out} is {shown}; a detector's output is [1, 4+classes, "
                         f"anchors] (yolov8) or [1, anchors, 5+classes] (yolov5, yolox)",
                         hint="name the box output with detect:output=NAME; fix symbolic sizes with --input-shape")
    a, b = dims
    channels_first = a < b
    feat, n = (a, b) if channels_first else (b, a)
    cells = grid_cells(hw, det.strides) if hw else 0
    fmt = det.format
    if not fmt:
        if channels_first:
            fmt = "yolov8"
        elif cells and n == cells:
            fmt = "yolox"
        elif cells and n == 3 * cells:
            fmt = "yolov5"
        else:
            raise UsageError(f"postprocess detect: cannot tell the format of output {out} ({shown}) from its shape",
                             hint="name it: detect:format=yolov8|yolov5|yolox")
    need = 5 if fmt == "yolov8" else 6
    if (feat < need or n <= feat) and not det.format:
        raise UsageError(f"postprocess detect: output {out} is {shown}, which fits no detector format (yolov8 "
                         f"[1, 4+classes, anchors], yolov5/yolox [1, anchors, 5+classes])",
                         hint="name the box output with detect:output=NAME, or use softmax,topk=K for a classifier")
    if feat < need or n <= feat:
        want = "[1, 4+classes, anchors]" if fmt == "yolov8" else "[1, anchors, 5+classes]"
        raise UsageError(f"postprocess detect format={fmt}: output {out} is {shown}, expected {want} with "
                         f"more anchors than values per anchor",
                         hint="check the format (yolov8, yolov5, yolox) and detect:output=NAME")
    grid = det.grid and fmt == "yolox"
    if grid and n != cells:
        raise UsageError(f"postprocess detect format=yolox: output {out} has {n} anchors, but a "
                         f"{hw[0] if hw else '?'}x{hw[1] if hw else '?'} input with strides 8/16/32 has {cells} "
                         f"grid cells", hint="if the export already decodes boxes, add grid=0")
    return dataclasses.replace(det, format=fmt, classes=feat - (4 if fmt == "yolov8" else 5), anchors=n,
                               channels_first=channels_first, input_size=tuple(hw), grid=grid)


def _grid(det: dict) -> tuple[np.ndarray, np.ndarray]:
    """Per anchor (col, row) and stride, in YOLOX's order: stride by stride, row-major."""
    h, w = det["input_size"]
    xy, st = [], []
    for s in det["strides"]:
        gh, gw = math.ceil(h / s), math.ceil(w / s)
        ys, xs = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
        xy.append(np.stack([xs.ravel(), ys.ravel()], 1))
        st.append(np.full(gh * gw, s))
    return np.concatenate(xy).astype(np.float32), np.concatenate(st).astype(np.float32)


def decode(out: np.ndarray, det: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw output -> candidates with score > conf: (xyxy boxes in input pixels, scores, classes)."""
    n, c = int(det["anchors"]), int(det["classes"])
    feat = c + (4 if det["format"] == "yolov8" else 5)
    a = np.asarray(out, np.float32).reshape(-1)
    if a.size != n * feat:
        raise ValueError(f"detector output has {a.size} values, expected {n}x{feat}")
    a = a.reshape(feat, n).T if det["channels_first"] else a.reshape(n, feat)
    box = a[:, :4].copy()
    if det["format"] == "yolov8":
        cls = a[:, 4:]
    else:
        cls = a[:, 5:] * a[:, 4:5]
        if det.get("grid"):
            g, s = _grid(det)
            box[:, :2] = (box[:, :2] + g) * s[:, None]
            box[:, 2:] = np.exp(box[:, 2:]) * s[:, None]
    cid = np.argmax(cls, axis=1)          # the first best class, as the C loop keeps it
    score = cls[np.arange(n), cid]
    keep = score > np.float32(det["conf"])
    box, score, cid = box[keep], score[keep], cid[keep]
    half = box[:, 2:] * np.float32(0.5)
    xyxy = np.concatenate([box[:, :2] - half, box[:, :2] + half], 1).astype(np.float32)
    return xyxy, score.astype(np.float32), cid.astype(np.int64)


def iou_one(b: np.ndarray, others: np.ndarray) -> np.ndarray:
    ix = np.maximum(np.minimum(b[2], others[:, 2]) - np.maximum(b[0], others[:, 0]), 0)
    iy = np.maximum(np.minimum(b[3], others[:, 3]) - np.maximum(b[1], others[:, 1]), 0)
    inter = ix * iy
    union = (b[2] - b[0]) * (b[3] - b[1]) + (others[:, 2] - others[:, 0]) * (others[:, 3] - others[:, 1]) - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0)


def nms(boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, iou: float, max_det: int,
        agnostic: bool) -> list[int]:
    """Greedy NMS: best score first (ties: lower index first), a box is dropped when its IoU with a kept
    box of the same class (any class when agnostic) is > iou; at most max_det kept."""
    order = np.argsort(-scores, kind="stable")
    kept: list[int] = []
    for i in order:
        if len(kept) >= max_det:
            break
        if kept:
            k = np.array(kept)
            same = np.ones(len(k), bool) if agnostic else classes[k] == classes[i]
            if np.any(same & (iou_one(boxes[i], boxes[k]) > iou)):
                continue
        kept.append(int(i))
    return kept


def detections(out: np.ndarray, post: dict, pre: dict | None = None, image_hw: tuple | None = None) -> list[dict]:
    """The artifact's answer for one image: [{"label", "index", "score", "box": [x1, y1, x2, y2]}],
    boxes in the original image's pixels when image_hw (height, width) is given."""
    det = post["detect"]
    boxes, scores, cls = decode(out, det)
    keep = nms(boxes, scores, cls, det["iou"], det["max_det"], det["agnostic"])
    mapped = boxes_to_image(boxes[keep], pre, image_hw)
    labels = post.get("labels") or []
    return [{"label": labels[c] if c < len(labels) else str(c), "index": int(c), "score": float(scores[i]),
             "box": [float(v) for v in mapped[j]]} for j, (i, c) in enumerate((i, int(cls[i])) for i in keep)]


def box_iou(a, b) -> float:
    return float(iou_one(np.asarray(a, np.float32), np.asarray([b], np.float32))[0])


def match(got: list[dict], want: list[dict], min_iou: float = 0.99, slack: float = 0.0) -> tuple[int, list[str]]:
    """One-to-one matching (greedy by the reference's score): same label, IoU >= min_iou. Returns the
    number matched and what did not match; a box whose score is within ``slack`` of the threshold that
    decided it may be missing on either side (a float16 model moves scores by that much)."""
    free = list(range(len(got)))
    matched, problems = 0, []
    for w in sorted(want, key=lambda d: -d["score"]):
        best, bi = -1.0, None
        for j in free:
            if got[j]["index"] == w["index"]:
                v = box_iou(got[j]["box"], w["box"])
                if v > best:
                    best, bi = v, j
        if bi is not None and best >= min_iou:
            free.remove(bi)
            matched += 1
        elif not w.get("_near"):
            problems.append(f"reference box {w['label']} {w['score']:.3f} {[round(v, 1) for v in w['box']]} "
                            f"has no match (best IoU {max(best, 0):.3f})")
    for j in free:
        if not got[j].get("_near"):
            problems.append(f"extra box {got[j]['label']} {got[j]['score']:.3f} "
                            f"{[round(v, 1) for v in got[j]['box']]}")
    return matched, problems
