"""Pre/post-processing baked into the artifact, so it takes raw data and answers.

``--preprocess image:size=224x224,layout=nhwc,dtype=uint8,mean=0.485/0.456/0.406,std=0.229/0.224/0.225,resize=bilinear[,letterbox=114]``
``--postprocess softmax,topk=5,labels=labels.txt``  (classifiers)
``--postprocess detect:format=yolov8|yolov5|yolox,conf=0.25,iou=0.45,max_det=100,agnostic=0,labels=FILE``  (detectors)
(or the same in ``MODEL.edgepack.toml`` next to the model)

What goes where:

* In the graph (every backend builds it, verified against onnxruntime like any model): pixel scaling and
  per-channel normalisation (one Mul + one Add), the layout change (Transpose) and the Softmax
  (graph.py). The new graph input is float32 holding raw pixel values: ncnn takes float32 only, so the
  integer -> float step is a lossless conversion in the artifact's common input layer.
* In the artifact's input layer (runtimes/common/ep_image.c, ep_predict.c): decoding PNG/JPEG/PPM and
  the resize or letterbox to the model's size, because the graph's shapes are static while images come
  in any size; image.py is its numpy twin.
* In the artifact's answer: top-k and labels over the (softmaxed) output (TopK is an op ncnn lacks),
  and detection decoding + NMS (runtimes/common/ep_detect.c), after the verified tensors, for every
  backend alike; detect.py is its numpy reference, which the build verifies the artifact against (verify.py).

The configuration travels in the ONNX metadata (key ``edgepack.prepost``) and in the artifact's
manifest under ``"prepost"`` (labels included), where the runtime reads it.
"""
from .detect import detections
from .graph import META_KEY, bake_prepost, prepost_manifest, prepost_of
from .image import boxes_to_image, image_to_input, letterbox_geometry, reference_preprocess, resize_image, topk_answer
from .spec import (DETECT_FORMATS, Detect, ImagePre, Post, config_path, load_config, parse_postprocess,
                   parse_preprocess, prepost_config_exists)

__all__ = ["DETECT_FORMATS", "META_KEY", "Detect", "ImagePre", "Post", "bake_prepost", "boxes_to_image",
           "config_path", "detections", "image_to_input", "letterbox_geometry", "load_config",
           "parse_postprocess", "parse_preprocess", "prepost_config_exists", "prepost_manifest", "prepost_of",
           "reference_preprocess", "resize_image", "topk_answer"]
