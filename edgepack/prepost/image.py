"""The numpy twin of the artifact's image input layer (runtimes/common/ep_predict.c): the same resize,
letterbox and pixel arithmetic, for the SDK's ONNX path and as the tests' reference."""
from __future__ import annotations

import math

import numpy as np

from ..errors import UsageError


def resize_image(img: np.ndarray, h: int, w: int, mode: str) -> np.ndarray:
    """HxWxC (any dtype) -> float32 hxwxC with half-pixel centres, no antialiasing: the arithmetic of
    runtimes/common/ep_predict.c (ep_image_to_input)."""
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


def letterbox_geometry(ih: int, iw: int, h: int, w: int) -> tuple[int, int, int, int]:
    """(nh, nw, top, left): the image scaled by min(h/ih, w/iw) and centred like ultralytics'
    LetterBox (the odd pixel of padding goes to the bottom/right). Same integer arithmetic in C."""
    r = min(h / ih, w / iw)
    nh = min(h, max(1, math.floor(ih * r + 0.5)))
    nw = min(w, max(1, math.floor(iw * r + 0.5)))
    return nh, nw, (h - nh) // 2, (w - nw) // 2


def _channels(img: np.ndarray, c: int) -> np.ndarray:
    if img.ndim == 2:
        img = img[:, :, None]
    if img.shape[2] != c:
        if c == 3 and img.shape[2] == 1:
            img = np.repeat(img, 3, axis=2)
        elif c == 3 and img.shape[2] == 4:
            img = img[:, :, :3]
        elif c == 1:
            img = np.round(img[:, :, :3].astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32))[:, :, None]
    return img


def image_to_input(img: np.ndarray, pre: dict) -> np.ndarray:
    """A decoded HxWxC uint8 image -> the baked graph's raw input (resized or letterboxed, float32, raw layout)."""
    img = _channels(np.asarray(img), int(pre["channels"]))
    h, w = pre["size"]
    pad = int(pre.get("letterbox", -1))
    if pad >= 0:
        nh, nw, top, left = letterbox_geometry(img.shape[0], img.shape[1], h, w)
        x = np.full((h, w, img.shape[2]), np.float32(pad), np.float32)
        x[top:top + nh, left:left + nw] = resize_image(img, nh, nw, pre["resize"])
    else:
        x = resize_image(img, h, w, pre["resize"])
    if pre["dtype"] == "float32":
        x = x / np.float32(255.0)
    x = x[None]
    if pre["layout"] == "nchw":
        x = x.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(x, np.float32)


def boxes_to_image(boxes: np.ndarray, pre: dict | None, image_hw: tuple | None) -> np.ndarray:
    """xyxy boxes in model-input pixels -> the original image's pixels (padding and scale undone,
    clipped to the image). Without an image (a tensor input) they stay in model-input pixels."""
    b = np.asarray(boxes, np.float32).reshape(-1, 4).copy()
    if not pre or not image_hw:
        return b
    ih, iw = image_hw
    h, w = pre["size"]
    if int(pre.get("letterbox", -1)) >= 0:
        nh, nw, top, left = letterbox_geometry(ih, iw, h, w)
    else:
        nh, nw, top, left = h, w, 0, 0
    b[:, [0, 2]] = (b[:, [0, 2]] - np.float32(left)) * np.float32(iw / nw)
    b[:, [1, 3]] = (b[:, [1, 3]] - np.float32(top)) * np.float32(ih / nh)
    b[:, [0, 2]] = np.clip(b[:, [0, 2]], 0, iw)
    b[:, [1, 3]] = np.clip(b[:, [1, 3]], 0, ih)
    return b


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
