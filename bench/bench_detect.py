"""Detectors with decoding + NMS inside the artifact (issue 13), measured side by side with
onnxruntime + the numpy reference, on the real detectors of the corpus (NudeNet 320n, ddddocr det).

    python3 bench/bench_detect.py [--models nudenet_320n,ddddocr_det] [--duration 20] [--out DIR]

Per model (x86_64, built here from the corpus cache with letterbox=114 and detect):
  matched       the artifact's boxes vs the numpy reference on onnxruntime's outputs, one to one
                (same label, IoU >= 0.99), over the build check's test-made scenes
  detect_ms     decode + NMS time the artifact states in its answers ("detect_ms"), at the built conf,
                and on a second build with conf=0.001, max_det=100 (100 boxes kept from every anchor)
  serve         bench/bench_serve.py --detect: requests/s POSTing a 640x480 JPEG, 1 client, 1 thread
  micro         bench_detect_micro.c: decode + NMS alone on a YOLOv8n-sized [1, 84, 8400] output, 100 boxes kept
  onnxruntime   the same JPEG through Pillow decode + the numpy letterbox + onnxruntime (1 thread) +
                the numpy decoding/NMS, images/s in this process
Prints one JSON object. Timing on a shared machine is noisy: run it on a quiet one for the record.
"""
from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests"))

import numpy as np  # noqa: E402

import corpus  # noqa: E402
from bench_serve import main as bench_serve, scene_jpeg  # noqa: E402

SETTINGS = {  # what the two detectors want, as MODEL.edgepack.toml (tests/test_detect.py uses the same)
    "nudenet_320n": ([1, 3, 320, 320], '[preprocess]\nletterbox = 114\n[postprocess]\nkind = "detect"\nconf = 0.1\n'),
    "ddddocr_det": ([1, 3, 416, 416], '[preprocess]\nletterbox = 114\nstd = [0.00392156862745098]\n'
                                      '[postprocess]\nkind = "detect"\n'),
}


def build(model: Path, out: Path, *extra: str) -> Path:
    proc = subprocess.run([sys.executable, "-m", "edgepack", "build", str(model), "--target", "x86_64", "--out",
                           str(out), "--json", *extra],
                          capture_output=True, text=True, timeout=7200)
    if proc.returncode != 0:
        raise SystemExit(f"build of {model.name} failed: {proc.stderr[-1500:]}")
    return out / f"{model.stem}-x86_64"


def answers(artifact: Path, jpeg: Path, runs: int) -> tuple[list[float], int]:
    from edgepack.runner import run_artifact
    ms, boxes = [], 0
    for _ in range(runs):
        proc = run_artifact(artifact, ["run", "--threads", "1", "--input", str(jpeg)])
        a = json.loads(proc.stdout)
        ms.append(a["detect_ms"])
        boxes = len(a["detections"])
    return ms, boxes


def onnxruntime_rate(model: Path, artifact: Path, jpeg: bytes, seconds: float) -> float:
    """Images/s through Pillow + numpy letterbox + onnxruntime + numpy decoding/NMS, 1 thread."""
    import onnxruntime as ort
    from PIL import Image

    from edgepack.prepost import detections, image_to_input
    from edgepack.runner import Artifact
    cfg = Artifact(artifact).manifest()["prepost"]
    pre, post = cfg["preprocess"], cfg["postprocess"]
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(model), opts, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    std, mean = np.array(pre["std"], np.float32), np.array(pre["mean"], np.float32)

    def once():
        img = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"))
        x = image_to_input(img, pre | {"layout": "nchw"})
        scale = (1 / 255 if pre["dtype"] == "uint8" else 1) / std
        x = (x - 0) * scale.reshape(1, -1, 1, 1) - (mean / std).reshape(1, -1, 1, 1)
        return detections(sess.run(None, {name: x.astype(np.float32)})[0], post, pre, img.shape[:2])
    for _ in range(5):
        once()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        once()
        n += 1
    return n / (time.perf_counter() - t0)


def matched(model: Path, artifact: Path) -> dict:
    import edgepack
    from edgepack.prepost.detect import match
    from edgepack.prepost.scenes import verification_images
    from edgepack.prepost.verify import SCORE_SLACK
    art, ref = edgepack.load(artifact), edgepack.load(model)   # the ONNX path bakes the same sidecar
    conf = art.prepost["postprocess"]["detect"]["conf"]
    total = {"reference_boxes": 0, "matched": 0, "near_threshold": 0}
    for img in verification_images().values():
        want = [d | {"_near": abs(d["score"] - conf) < SCORE_SLACK} for d in ref.detect(img)["detections"]]
        n, problems = match(art.detect(img)["detections"], want)
        total["reference_boxes"] += len(want)
        total["matched"] += n
        total["near_threshold"] += sum(d["_near"] for d in want)
        if problems:
            total.setdefault("problems", []).extend(problems)
    return total


def micro(kept: int = 100, runs: int = 200) -> dict:
    """bench_detect_micro.c: decode + NMS alone on a YOLOv8n-sized output with `kept` boxes, at -O2."""
    import shutil
    cc = shutil.which("gcc") or shutil.which("cc")
    common = REPO / "runtimes" / "common"
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "micro"
        subprocess.run([cc, "-O2", "-std=c11", "-D_POSIX_C_SOURCE=200809L", f"-I{common}",
                        str(REPO / "bench" / "bench_detect_micro.c"), str(common / "ep_detect.c"),
                        str(common / "ep_util.c"), "-lm", "-o", str(exe)], check=True)
        return json.loads(subprocess.run([str(exe), str(kept), str(runs)], capture_output=True, text=True,
                                         check=True).stdout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(SETTINGS))
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of serve load and of onnxruntime")
    ap.add_argument("--runs", type=int, default=20, help="artifact runs for detect_ms")
    ap.add_argument("--out", type=Path, help="where artifacts go (default: a temporary folder)")
    a = ap.parse_args(argv)
    out = a.out or Path(tempfile.mkdtemp(prefix="edgepack-bench-detect-"))
    jpeg = scene_jpeg()
    (out / "scene-640x480.jpg").parent.mkdir(parents=True, exist_ok=True)
    (out / "scene-640x480.jpg").write_bytes(jpeg)
    from detect_fixtures import fixed_copy
    report = {"decode_nms_yolov8n_sized": micro()}
    for name in filter(None, a.models.split(",")):
        shape, toml = SETTINGS[name]
        entry = next(e for e in corpus.load_table() if e.name == name)
        model = fixed_copy(corpus.fetch(entry), out / name / f"{name}.onnx", shape)
        model.with_name(f"{name}.edgepack.toml").write_text(toml)
        art = build(model, out / name / "dist")
        many = build(model, out / name / "dist-100", "--postprocess", "detect:conf=0.001,max_det=100", "--no-verify")
        ms, boxes = answers(art, out / "scene-640x480.jpg", a.runs)
        ms100, boxes100 = answers(many, out / "scene-640x480.jpg", a.runs)
        buf = io.StringIO()
        stdout, sys.stdout = sys.stdout, buf
        try:
            bench_serve([str(art), "--detect", "--duration", str(a.duration), "--concurrency", "1"])
        finally:
            sys.stdout = stdout
        serve = json.loads(buf.getvalue())
        report[name] = {
            "matched": matched(model, art),
            "detect_ms_median": round(statistics.median(ms), 4), "boxes": boxes,
            "detect_ms_median_100_boxes": round(statistics.median(ms100), 4), "boxes_low_conf": boxes100,
            "serve_rps_640x480_jpeg": serve["rps"], "serve_p50_ms": serve["p50_ms"],
            "onnxruntime_numpy_images_per_s": round(onnxruntime_rate(model, art, jpeg, a.duration), 1)}
        print(json.dumps({name: report[name]}), file=sys.stderr)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
