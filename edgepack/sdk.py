"""One Python API over every kind of model edgepack knows:

    import edgepack
    m = edgepack.load("dist/tiny_cnn-x86_64")    # an artifact (any backend; Arm ones run under qemu)
    m = edgepack.load("tiny_cnn.onnx")            # the ONNX file, through onnxruntime (the reference)
    m.inputs, m.outputs                           # TensorSpec(name, shape, dtype) tuples
    m.predict(array | {name: array} | "cat.png")  # -> {output name: np.ndarray}
    m.predict_batch([...])                        # -> list of those dicts
    m.top(result)                                 # labelled top-k when the model has baked postprocessing
    m.detect("street.jpg" | image_uint8_hwc)      # {"detections": [{label, index, score, box}]} (baked detect)

An ONNX file with a ``MODEL.edgepack.toml`` next to it gets the same baked pre/post-processing as its
artifacts. Arrays fed to a float32 input may be uint8 (raw pixels): they are converted like the
artifact's runtime does. Files: images (when built with image preprocessing), .npy and JSON tensors.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Iterable

import numpy as np

from .errors import ArtifactError, InputError, UsageError
from .model import TensorSpec
from .runner import Artifact

__all__ = ["load", "Model", "OnnxModel", "ArtifactModel", "InputError"]

_DTYPES = {"float32", "float64", "int32", "int64", "uint8", "int8", "bool", "float16"}


def load(path, *, threads: int = 1, qemu_cpu: str | None = None) -> "Model":
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"\x7fELF":
        return ArtifactModel(path, threads=threads, qemu_cpu=qemu_cpu)
    return OnnxModel(path)


class Model:
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    prepost: dict
    kind: str
    backend: str

    def __repr__(self) -> str:
        ins = ", ".join(f"{s.name}:{'x'.join(map(str, s.shape))}:{s.dtype}" for s in self.inputs)
        return f"<edgepack {self.kind} model {self.path.name} ({self.backend}) inputs [{ins}]>"

    # -- inputs -----------------------------------------------------------------------------
    def _as_dict(self, x) -> dict:
        if isinstance(x, dict):
            unknown = set(x) - {s.name for s in self.inputs}
            if unknown:
                raise InputError(f"unknown input(s) {sorted(unknown)}; the model's inputs: "
                                 f"{[s.name for s in self.inputs]}")
            missing = [s.name for s in self.inputs if s.name not in x]
            if missing:
                raise InputError(f"missing input(s) {missing}")
            return {k: self._coerce(self._spec(k), v) for k, v in x.items()}
        if len(self.inputs) != 1:
            raise InputError(f"the model has {len(self.inputs)} inputs: pass a dict {{name: array}}")
        return {self.inputs[0].name: self._coerce(self.inputs[0], x)}

    def _spec(self, name: str) -> TensorSpec:
        return next(s for s in self.inputs if s.name == name)

    def _coerce(self, spec: TensorSpec, v) -> np.ndarray:
        """The declared shape (a missing leading batch dim of 1 is added, nothing else is reshaped) and
        dtype (integers become floats only as raw pixels of an input with image preprocessing)."""
        a = np.asarray(v)
        want = tuple(int(d) for d in spec.shape)
        pre = self.prepost.get("preprocess")
        pixels = bool(pre) and spec.name == pre["input"]
        if pixels and a.dtype == np.uint8 and a.ndim in (2, 3) and a.shape != want[1:]:
            from .prepost import image_to_input
            return image_to_input(a, pre)  # a decoded HxWxC image of any size
        if a.shape != want and not (want and want[0] == 1 and a.shape == want[1:]):
            raise InputError(f"input {spec.name}: got shape {list(a.shape)}, the model takes {list(want)}",
                             hint="only a missing leading batch dim of 1 is added; reorder or reshape the data")
        target = np.dtype(spec.dtype)
        same_kind = a.dtype.kind == target.kind or (a.dtype.kind in "iu" and target.kind in "iu")
        if a.dtype != target and not same_kind and not (pixels and a.dtype == np.uint8 and target.kind == "f"):
            raise InputError(f"input {spec.name}: got dtype {a.dtype}, the model takes {spec.dtype}",
                             hint=f"convert it first (array.astype(np.{target.name}))")
        return np.ascontiguousarray(a.reshape(want).astype(target, copy=False))

    def _top(self, result: dict) -> list[dict]:
        from .prepost import topk_answer
        post = self.prepost.get("postprocess")
        if not post:
            raise UsageError("this model has no baked postprocessing (build with --postprocess softmax,topk=K,...)")
        return topk_answer(result[post["output"]], post)

    def top(self, result: dict) -> list[dict]:
        """[{index, label, score}, ...] for a predict() result of a model with baked postprocessing."""
        return self._top(result)

    def predict(self, x) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def _detect_post(self) -> dict:
        post = self.prepost.get("postprocess") or {}
        if not post.get("detect"):
            raise UsageError("this model has no baked detection (build with --postprocess detect:format=...)")
        return post

    def detect(self, x) -> dict:
        """{"detections": [{"label", "index", "score", "box": [x1, y1, x2, y2]}, ...]} for an image file or
        a decoded HxWxC uint8 image (boxes in its pixels), or an input-shaped tensor (boxes in input pixels)."""
        raise NotImplementedError

    def predict_batch(self, xs: Iterable) -> list[dict[str, np.ndarray]]:
        return [self.predict(x) for x in xs]


class OnnxModel(Model):
    """The reference: onnxruntime on the prepared graph (the same baking as the artifacts')."""
    kind = "onnx"
    backend = "onnxruntime"

    def __init__(self, path: Path):
        from .model import fix_input_shapes, load_model
        from .prepost import bake_prepost, prepost_config_exists, prepost_of
        self.path = path
        model = fix_input_shapes(load_model(path), {})
        if prepost_config_exists(path):
            model = bake_prepost(model, path, None, None)
        self.model = model
        self.inputs, self.outputs = model.inputs, model.outputs
        self.prepost = prepost_of(model.proto)
        import onnxruntime as ort
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        self._sess = ort.InferenceSession(model.proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])

    def predict(self, x) -> dict[str, np.ndarray]:
        if isinstance(x, (str, Path)):
            x = self._read_file(Path(x))
        feeds = self._as_dict(x)
        names = [o.name for o in self.outputs]
        return dict(zip(names, self._sess.run(names, feeds)))

    def detect(self, x) -> dict:
        from .prepost import detections
        post = self._detect_post()
        if isinstance(x, (str, Path)):
            x = self._read_file(Path(x))
        a = x if isinstance(x, dict) else np.asarray(x)
        pre = self.prepost.get("preprocess")
        image_hw = a.shape[:2] if pre and not isinstance(a, dict) and a.dtype == np.uint8 and a.ndim in (2, 3) \
            and a.shape != tuple(self.inputs[0].shape[1:]) else None
        out = self.predict(a)[post["output"]]
        return {"detections": detections(out, post, pre, image_hw)}

    def _read_file(self, p: Path):
        data = p.read_bytes()
        if data[:6] == b"\x93NUMPY":
            return np.load(p, allow_pickle=False)
        if data.lstrip()[:1] in (b"[", b"{"):
            obj = json.loads(data)
            obj = obj.get("inputs", obj) if isinstance(obj, dict) else obj
            # JSON numbers carry no dtype: they take the input's, as in the artifact's runtime
            dt = {s.name: s.dtype for s in self.inputs}
            if isinstance(obj, dict):
                return {k: np.asarray(v, dtype=dt.get(k)) for k, v in obj.items()}
            return np.asarray(obj, dtype=self.inputs[0].dtype if len(self.inputs) == 1 else None)
        if not self.prepost.get("preprocess"):
            raise InputError(f"{p}: not .npy or JSON, and the model has no image preprocessing")
        try:
            from PIL import Image
        except ImportError:
            raise InputError("decoding images for the ONNX reference needs Pillow (pip install pillow)") from None
        c = int(self.prepost["preprocess"]["channels"])
        with Image.open(p) as im:
            return np.asarray(im.convert("RGB" if c == 3 else "L"))


class ArtifactModel(Model):
    """An edgepack artifact, run here as a subprocess (under qemu-user for Arm)."""
    kind = "artifact"

    def __init__(self, path: Path, threads: int = 1, qemu_cpu: str | None = None):
        self.path = path.resolve()
        self.threads = threads
        sidecar = self.path.with_name(self.path.name + ".json")
        if qemu_cpu is None and sidecar.is_file():
            try:
                qemu_cpu = json.loads(sidecar.read_text()).get("target", {}).get("qemu_cpu")
            except (ValueError, AttributeError):
                qemu_cpu = None
        self.artifact = Artifact(self.path, qemu_cpu=qemu_cpu)
        self.manifest = self.artifact.manifest()
        spec = lambda d: TensorSpec(d["name"], tuple(d["shape"]), d["dtype"])  # noqa: E731
        self.inputs = tuple(spec(d) for d in self.manifest["inputs"])
        self.outputs = tuple(spec(d) for d in self.manifest["outputs"])
        self.prepost = self.manifest.get("prepost", {})
        self.backend = self.manifest.get("backend", {}).get("name", "?")

    def predict(self, x) -> dict[str, np.ndarray]:
        with tempfile.TemporaryDirectory(prefix="edgepack-sdk-") as tmp:
            if isinstance(x, (str, Path)):
                return self.artifact.predict(None, Path(tmp), threads=self.threads, files=[str(Path(x).resolve())])
            return self.artifact.predict(self._as_dict(x), Path(tmp), threads=self.threads)

    def detect(self, x) -> dict:
        """The artifact's own answer (its C decoding + NMS); an image array goes in as a PPM file."""
        self._detect_post()
        with tempfile.TemporaryDirectory(prefix="edgepack-sdk-") as tmp:
            if isinstance(x, (str, Path)):
                path = Path(x).resolve()
            elif not isinstance(x, dict) and np.asarray(x).dtype == np.uint8 and np.asarray(x).ndim == 3 \
                    and np.asarray(x).shape[2] == 3 and self.prepost.get("preprocess"):
                from .prepost.scenes import ppm_bytes
                path = Path(tmp) / "image.ppm"
                path.write_bytes(ppm_bytes(np.asarray(x)))
            else:
                path = Path(tmp) / "input.npy"
                np.save(path, self._as_dict(x)[self.inputs[0].name])
            proc = self.artifact.run(["run", "--threads", str(self.threads), "--input", str(path)], check=False)
            if proc.returncode != 0:
                raise self.artifact.error(proc)
        answer = json.loads(proc.stdout)
        return {"detections": answer["detections"]}

    def predict_batch(self, xs: Iterable) -> list[dict[str, np.ndarray]]:
        """One artifact process for the whole batch (run --input-dir), for single-input models."""
        xs = list(xs)
        if (self.prepost.get("postprocess") or {}).get("detect"):
            return super().predict_batch(xs)   # a detector's JSONL lines carry boxes, not tensors
        if len(self.inputs) != 1 or not xs:
            return super().predict_batch(xs)
        with tempfile.TemporaryDirectory(prefix="edgepack-sdk-") as tmp:
            tmp = Path(tmp)
            (tmp / "in").mkdir()
            for i, x in enumerate(xs):
                if isinstance(x, (str, Path)):
                    src = Path(x)
                    (tmp / "in" / f"{i:08d}{src.suffix.lower()}").write_bytes(src.read_bytes())
                else:
                    np.save(tmp / "in" / f"{i:08d}.npy", self._as_dict(x)[self.inputs[0].name])
            proc = self.artifact.run(["run", "--threads", str(self.threads), "--input-dir", str(tmp / "in"),
                                      "--output", str(tmp / "out.jsonl")], check=False)
            # exit 3 with error lines: some items failed, reported per item below
            if proc.returncode not in (0, 3) or not (tmp / "out.jsonl").is_file():
                raise self.artifact.error(proc)
            lines = [json.loads(ln) for ln in (tmp / "out.jsonl").read_text().splitlines() if ln.strip()]
        if len(lines) != len(xs):
            raise ArtifactError(f"{self.path.name}: {len(lines)} results for {len(xs)} inputs")
        out = []
        for i, ln in enumerate(lines):
            if "error" in ln:
                raise InputError(f"batch item {i}: {ln['error']}")
            out.append({name: np.array([np.nan if v is None else v for v in o["values"]], dtype=o["dtype"])
                        .reshape(o["shape"]) for name, o in ln["outputs"].items()})
        return out
