"""Detection settings (--postprocess detect:..., letterbox) parse strictly into frozen specs; the output
format is recognised from its shape or refused with one clear error; the numpy reference of decoding,
NMS and the mapping back to image pixels is checked against hand-worked cases."""
import dataclasses

import numpy as np
import pytest

from edgepack.errors import UsageError
from edgepack.prepost import (Detect, boxes_to_image, detections, image_to_input, letterbox_geometry, load_config,
                              parse_postprocess, parse_preprocess)
from edgepack.prepost.detect import decode, match, nms, resolve_detect


def test_detect_string_and_table_agree(tmp_path):
    (tmp_path / "classes.txt").write_text("person\ncar\n")
    a = parse_postprocess("detect:format=yolov5,conf=0.3,iou=0.5,max_det=20,agnostic=1,labels=classes.txt", tmp_path)
    b = parse_postprocess({"kind": "detect", "format": "yolov5", "conf": 0.3, "iou": 0.5, "max_det": 20,
                           "agnostic": True, "labels": "classes.txt"}, tmp_path)
    assert a == b
    assert a.detect == Detect(format="yolov5", conf=0.3, iou=0.5, max_det=20, agnostic=True)
    assert a.labels == ["person", "car"] and not a.softmax and a.topk == 0


def test_detect_defaults_and_frozen(tmp_path):
    post = parse_postprocess("detect", tmp_path)
    assert post.detect == Detect() and (post.detect.conf, post.detect.iou, post.detect.max_det) == (0.25, 0.45, 100)
    with pytest.raises(dataclasses.FrozenInstanceError):
        post.detect.conf = 0.5
    with pytest.raises(dataclasses.FrozenInstanceError):
        parse_preprocess("image:letterbox=114", tmp_path).letterbox = 0


def test_sidecar_detect_section(tmp_path):
    model = tmp_path / "m.onnx"
    model.write_bytes(b"")
    (tmp_path / "m.edgepack.toml").write_text('[preprocess]\nletterbox = 114\n'
                                              '[postprocess]\nkind = "detect"\nformat = "yolox"\nconf = 0.5\n')
    pre, post = load_config(model, None, None)
    assert pre.letterbox == 114 and post.detect.format == "yolox" and post.detect.conf == 0.5


@pytest.mark.parametrize("spec,needle", [
    ("detect:format=yolov9", "format='yolov9' is not known"),
    ("detect:conf=1.5", "conf='1.5': expected a number in 0..1"),
    ("detect:iou=x", "iou='x'"),
    ("detect:max_det=0", "max_det='0': expected 1..10000"),
    ("detect:topk=3", "cannot be combined with softmax/topk"),
    ("softmax,conf=0.3", "setting 'conf' belongs to detection"),
    ("segment:format=yolov8", "kind 'segment' is not supported"),
])
def test_detect_rejects(tmp_path, spec, needle):
    with pytest.raises(UsageError, match=needle):
        parse_postprocess(spec, tmp_path)


@pytest.mark.parametrize("spec,needle", [("image:letterbox=300", "letterbox='300': expected 0..255"),
                                         ("image:letterbox=114,resize=none", "letterbox needs a resize")])
def test_letterbox_rejects(tmp_path, spec, needle):
    with pytest.raises(UsageError, match=needle):
        parse_preprocess(spec, tmp_path)


@pytest.mark.parametrize("shape,hw,fmt,classes,anchors,cf", [
    ((1, 22, 2100), (320, 320), "yolov8", 18, 2100, True),      # NudeNet 320n
    ((1, 84, 8400), (640, 640), "yolov8", 80, 8400, True),      # ultralytics yolov8n
    ((1, 3549, 6), (416, 416), "yolox", 1, 3549, False),        # ddddocr common_det
    ((1, 25200, 85), (640, 640), "yolov5", 80, 25200, False),   # yolov5s: 3 anchors per cell
])
def test_format_recognised_from_shape(shape, hw, fmt, classes, anchors, cf):
    d = resolve_detect(Detect(), "out", shape, hw)
    assert (d.format, d.classes, d.anchors, d.channels_first, d.input_size) == (fmt, classes, anchors, cf, hw)
    assert d.grid == (fmt == "yolox")


@pytest.mark.parametrize("det,shape,needle", [
    (Detect(), (1, 1000), "is 1x1000, which fits no detector format"),  # a classifier's output
    (Detect(), (1, 500, 7), "cannot tell the format"),                  # anchors-first, fits no grid
    (Detect(format="yolov8"), (1, 4, 100), "expected \\[1, 4\\+classes, anchors\\]"),
    (Detect(format="yolox"), (1, 3000, 6), "has 3000 anchors, but a 416x416 input"),
    (Detect(), (1, "N", 85), "is 1xNx85"),
])
def test_shapes_that_fit_no_format_fail_clearly(det, shape, needle):
    with pytest.raises(UsageError, match=needle):
        resolve_detect(det, "out", shape, (416, 416))


def test_yolox_already_decoded_needs_no_grid():
    d = resolve_detect(Detect(format="yolox", grid=False), "out", (1, 3000, 6), (416, 416))
    assert not d.grid and d.anchors == 3000


def _v8(boxes_cxcywh, scores):
    """A [1, 4+C, N] yolov8 output from per-anchor boxes and class scores."""
    return np.concatenate([np.asarray(boxes_cxcywh, np.float32), np.asarray(scores, np.float32)], 1).T[None]


V8 = dict(format="yolov8", classes=2, anchors=4, channels_first=True, grid=False, input_size=[100, 100],
          strides=[8, 16, 32], conf=0.25, iou=0.45, max_det=100, agnostic=False)


def test_nms_class_aware_and_agnostic():
    out = _v8([[50, 50, 20, 20], [51, 50, 20, 20], [52, 50, 20, 20], [10, 10, 4, 4]],
              [[0.9, 0.0], [0.8, 0.0], [0.0, 0.85], [0.1, 0.2]])
    post = {"detect": V8, "labels": ["cat", "dog"]}
    got = detections(out, post)
    # anchor 1 overlaps anchor 0 (same class) and goes; anchor 2 is another class and stays; anchor 3 under conf
    assert [(d["label"], round(d["score"], 2)) for d in got] == [("cat", 0.9), ("dog", 0.85)]
    assert got[0]["box"] == [40.0, 40.0, 60.0, 60.0] and got[0]["index"] == 0
    got = detections(out, {"detect": V8 | {"agnostic": True}})
    assert [d["label"] for d in got] == ["0"]                     # no labels: the index as a string
    assert len(detections(out, {"detect": V8 | {"max_det": 1, "iou": 1.0}})) == 1


def test_nms_ties_keep_the_lower_anchor_and_iou_is_strict():
    boxes = np.array([[0, 0, 10, 10], [0, 0, 10, 10], [5, 0, 15, 10]], np.float32)
    scores = np.array([0.5, 0.5, 0.4], np.float32)
    assert nms(boxes, scores, np.zeros(3, np.int64), 0.45, 10, False) == [0, 2]   # IoU(0, 2) = 1/3
    assert nms(boxes, scores, np.zeros(3, np.int64), 1 / 3 - 1e-3, 10, False) == [0]


def test_yolox_grid_decoding():
    det = dict(format="yolox", classes=1, anchors=21, channels_first=False, grid=True, input_size=[32, 32],
               strides=[8, 16, 32], conf=0.25, iou=0.45, max_det=100, agnostic=False)
    out = np.zeros((1, 21, 6), np.float32)
    out[0, 6] = [0.5, 0.25, np.log(2), 0, 0.9, 1.0]       # stride 8, 4x4 grid: cell (col 2, row 1)
    out[0, 17] = [0, 0, 0, 0, 0.8, 0.5]                   # stride 16, 2x2 grid: cell (col 1, row 0); score 0.4
    boxes, scores, cls = decode(out, det)
    np.testing.assert_allclose(boxes, [[12, 6, 28, 14], [8, -8, 24, 8]], atol=1e-5)  # cx = (x + col) * stride
    np.testing.assert_allclose(scores, [0.9, 0.4], atol=1e-6)


@pytest.mark.parametrize("ih,iw,want", [(480, 640, (240, 320, 40, 0)), (640, 480, (320, 240, 0, 40)),
                                        (100, 100, (320, 320, 0, 0)), (321, 999, (103, 320, 108, 0))])
def test_letterbox_geometry(ih, iw, want):
    assert letterbox_geometry(ih, iw, 320, 320) == want


def test_letterboxed_image_and_boxes_map_back():
    """A 200x100 (w x h) image with a known rectangle: letterboxed into 64x64, the rectangle's box in
    input pixels maps back to its pixels in the image."""
    img = np.zeros((100, 200, 3), np.uint8)
    img[20:60, 50:150] = 255
    pre = {"size": [64, 64], "channels": 3, "resize": "bilinear", "dtype": "uint8", "layout": "nhwc",
           "letterbox": 114}
    x = image_to_input(img, pre)[0]
    assert x.shape == (64, 64, 3) and (x[:16] == 114).all() and (x[48:] == 114).all()
    ys, xs = np.nonzero(x[..., 0] > 200)
    box_in = [xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]     # 16..48 scaled: [16, 22.4, 48, 35.2]
    back = boxes_to_image(np.array([box_in], np.float32), pre, (100, 200))[0]
    np.testing.assert_allclose(back, [50, 20, 150, 60], atol=200 / 64)
    stretch = boxes_to_image(np.array([[16, 16, 48, 48]], np.float32), pre | {"letterbox": -1}, (100, 200))[0]
    np.testing.assert_allclose(stretch, [50, 25, 150, 75])
    clipped = boxes_to_image(np.array([[-10, 0, 70, 64]], np.float32), pre, (100, 200))[0]
    np.testing.assert_allclose(clipped, [0, 0, 200, 100])


def test_match_is_one_to_one_with_label_and_iou():
    ref = [{"label": "a", "index": 0, "score": 0.9, "box": [0, 0, 100, 100]},
           {"label": "a", "index": 0, "score": 0.8, "box": [200, 0, 300, 100]}]
    same = [dict(d) for d in ref]
    assert match(same, ref) == (2, [])
    moved = [ref[0] | {"box": [2, 0, 102, 100]}, ref[1]]           # IoU 0.96
    n, problems = match(moved, ref)
    assert n == 1 and "best IoU 0.96" in problems[0]
    relabelled = [ref[0] | {"index": 1, "label": "b"}, ref[1]]
    assert match(relabelled, ref)[0] == 1
    n, problems = match(ref + [ref[0]], ref)
    assert n == 2 and problems[0].startswith("extra box")
    near = [ref[0], ref[1] | {"_near": True}]
    assert match([ref[0]], near) == (1, [])                       # a box at the threshold may be missing
