"""The build's detection check: the artifact's boxes against the numpy reference (detect.py) run on
onnxruntime's outputs, on test-made images, matched one to one (same label, IoU >= 0.99). Numeric
checks of the raw tensors stay in pipeline.verify; this adds what they cannot see: the C decoding,
NMS, letterbox and mapping back to image pixels."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import VerificationError
from ..model import LoadedModel
from .detect import detections, match
from .graph import prepost_of
from .image import image_to_input
from .scenes import ppm_bytes, verification_images

MIN_IOU = 0.99
# A box whose score is this close to conf may be kept by one side and not the other: fp16 weights
# move a detector's scores by ~1e-2 (shared/notes/models.md). Such boxes are not required to match.
SCORE_SLACK = 0.02


def _reference(model: LoadedModel, cfg: dict, img: np.ndarray | None, x: dict | None) -> list[dict]:
    from ..reference import run_onnxruntime
    pre, post = cfg.get("preprocess"), cfg["postprocess"]
    feeds = {pre["input"]: image_to_input(img, pre)} if img is not None else x
    out = run_onnxruntime(model, feeds, "detection check")[post["output"]]
    return detections(out, post, pre, img.shape[:2] if img is not None else None)


def _mark_near(dets: list[dict], conf: float) -> list[dict]:
    return [d | {"_near": abs(d["score"] - conf) < SCORE_SLACK} for d in dets]


def check_detections(artifact: Path, model: LoadedModel, cpus, workdir: Path, inputs: dict | None = None,
                     log: Callable[[str], None] = lambda m: None, checks: tuple = ()) -> dict:
    """{} for a model without detection; else {"inputs", "reference_boxes", "matched"} on the first CPU.
    Raises VerificationError naming the CPU, the image and the first box that differs."""
    from ..runner import run_artifact
    cfg = prepost_of(model.proto)
    post = cfg.get("postprocess") or {}
    if not post.get("detect"):
        return {}
    conf = float(post["detect"]["conf"])
    cases: dict[str, list[dict]] = {}
    indir = workdir / "in"
    indir.mkdir(parents=True, exist_ok=True)
    if cfg.get("preprocess"):
        for name, img in verification_images().items():
            (indir / f"{name}.ppm").write_bytes(ppm_bytes(img))
            cases[f"{name}.ppm"] = _reference(model, cfg, img, None)
    else:  # a tensor input: boxes stay in input pixels
        np.save(indir / "realistic.npy", inputs[model.inputs[0].name])
        cases["realistic.npy"] = _reference(model, cfg, None, inputs)
    total = {"inputs": 0, "reference_boxes": 0, "matched": 0}
    # On the first verification CPU only: decoding and NMS are plain C with no per-CPU code path, and the
    # model's numbers on every CPU were checked before this; under qemu each image costs a minute.
    for k, cpu in enumerate(list(cpus)[:1]):
        # one process for every image (under qemu, loading the model costs seconds)
        out = workdir / f"detections-{k}.jsonl"
        try:
            proc = run_artifact(artifact, ["run", "--threads", "1", "--input-dir", str(indir), "--output", str(out)],
                                cpu=cpu, timeout=3600)
        except subprocess.TimeoutExpired:
            raise _failed(f"{artifact.name} gave no detections on CPU {cpu} within an hour", checks) from None
        answers = {}
        if proc.returncode == 0 and out.is_file():
            for line in out.read_text().splitlines():
                try:
                    a = json.loads(line)
                    answers[a["file"]] = a["detections"]
                except (ValueError, KeyError, TypeError):
                    pass
        for name, want in cases.items():
            got = answers.get(name)
            if got is None:
                raise _failed(f"{artifact.name} gave no detections on CPU {cpu} for {name} (exit "
                              f"{proc.returncode}): {(proc.stderr or proc.stdout).strip()[-200:]}", checks)
            n, problems = match(_mark_near(got, conf), _mark_near(want, conf), MIN_IOU)
            total["inputs"] += 1
            total["reference_boxes"] += len(want)
            total["matched"] += n
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                raise _failed(f"{artifact.name} detections differ from the reference on CPU {cpu}, image {name}: "
                              f"{problems[0]}{more}", checks)
            log(f"{cpu}, {name}: {n} of {len(want)} reference boxes matched (IoU >= {MIN_IOU}, same label)")
    return total


def _failed(message: str, checks: tuple) -> VerificationError:
    exc = VerificationError(message, hint="the decoding/NMS inside the artifact or its numbers disagree with "
                                          "onnxruntime + the numpy reference; edgepack tries the next precision")
    exc.checks = tuple(checks)
    return exc
