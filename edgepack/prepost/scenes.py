"""Test-made images for the build's detection check: scenes with things detectors tend to fire on
(blocky glyphs like captcha characters, a face-like figure, plain rectangles), drawn with numpy only
and of non-square sizes, so the letterbox and the mapping back to image pixels are exercised."""
from __future__ import annotations

import numpy as np

# 5x7 glyphs: enough strokes for character detectors; '#' is ink
_GLYPHS = {
    "A": [".###.", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"],
    "7": ["#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."],
    "K": ["#...#", "#..#.", "#.#..", "##...", "#.#..", "#..#.", "#...#"],
    "3": ["####.", "....#", "....#", ".###.", "....#", "....#", "####."],
    "X": ["#...#", "#...#", ".#.#.", "..#..", ".#.#.", "#...#", "#...#"],
    "9": [".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."],
}


def _ellipse(img, cy, cx, ry, rx, colour):
    h, w = img.shape[:2]
    y, x = np.ogrid[:h, :w]
    img[((y - cy) / ry) ** 2 + ((x - cx) / rx) ** 2 <= 1] = colour


def _text(img, text, top, left, scale, colour):
    for k, ch in enumerate(text):
        g = np.array([[c == "#" for c in row] for row in _GLYPHS[ch]])
        cell = np.kron(g, np.ones((scale, scale), bool))
        y0, x0 = top, left + k * 6 * scale
        region = img[y0:y0 + cell.shape[0], x0:x0 + cell.shape[1]]
        region[cell[:region.shape[0], :region.shape[1]]] = colour


def glyph_scene(h: int = 160, w: int = 300) -> np.ndarray:
    """Captcha-like: two rows of blocky characters about a quarter of the height tall."""
    img = np.full((h, w, 3), (232, 228, 215), np.uint8)
    scale = max(2, h // 27)
    _text(img, "A7K", h // 8, w // 12, scale, (30, 40, 190))
    _text(img, "3X9", h // 2 + h // 10, w // 3, scale, (180, 30, 30))
    return img


def figure_scene(h: int = 320, w: int = 320) -> np.ndarray:
    """A face over shoulders on a flat sky, sized by the shorter side."""
    img = np.full((h, w, 3), (120, 160, 200), np.uint8)
    u = min(h, w) / 320
    cx, cy = w / 2, h / 2 - 20 * u
    skin, dark = (224, 172, 140), (40, 30, 20)
    y0, x0, x1 = int(cy + 80 * u), int(cx - 80 * u), int(cx + 80 * u)
    img[y0:, max(x0, 0):x1] = skin                                        # shoulders and body
    _ellipse(img, cy, cx, 80 * u, 60 * u, skin)                            # face
    _ellipse(img, cy - 22 * u, cx - 20 * u, 7 * u, 10 * u, dark)           # eyes
    _ellipse(img, cy - 22 * u, cx + 20 * u, 7 * u, 10 * u, dark)
    _ellipse(img, cy + 30 * u, cx, 6 * u, 22 * u, (150, 40, 40))           # mouth
    return img


def verification_images() -> dict[str, np.ndarray]:
    """name -> HxWx3 uint8: landscape, portrait and square scenes."""
    return {"glyphs-300x160": glyph_scene(160, 300), "figure-300x400": figure_scene(400, 300),
            "glyphs-400x140": glyph_scene(140, 400), "figure-320x320": figure_scene(320, 320)}


def ppm_bytes(img: np.ndarray) -> bytes:
    """Binary PPM, which every artifact with image preprocessing decodes (no image library needed)."""
    h, w = img.shape[:2]
    return b"P6\n%d %d\n255\n" % (w, h) + np.ascontiguousarray(img[:, :, :3], np.uint8).tobytes()
