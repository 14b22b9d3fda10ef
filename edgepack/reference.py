"""onnxruntime as the reference, the inputs artifacts are checked on, and the one comparison policy.

One bound for every backend and precision: the question is not "is this what fp16 usually
costs" but "would a user notice", so a 1% error of an output's scale fails whatever the cause.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import ModelError, UnsupportedOpError
from .cut_outputs import apply_trims
from .model import LoadedModel, TensorSpec

# Verification feeds every input at once; a declared 1x3x50000x50000 input must be refused
# before numpy tries to allocate it.
MAX_INPUT_BYTES = 1 << 30


def check_input_sizes(specs: tuple[TensorSpec, ...], model_name: str) -> None:
    total = 0
    for s in specs:
        n = 1
        for d in s.shape:
            n *= int(d)
        nbytes = n * np.dtype(s.dtype).itemsize
        total += nbytes
        if total > MAX_INPUT_BYTES:
            raise ModelError(f"{model_name}: input {s.name} of shape {'x'.join(map(str, s.shape))} {s.dtype} "
                             f"needs {nbytes / 2**30:.1f} GiB; edgepack builds models whose inputs fit in "
                             f"{MAX_INPUT_BYTES >> 30} GiB", hint=f"fix a smaller shape: --input-shape {s.name}=...")


def random_inputs(specs: tuple[TensorSpec, ...], seed: int) -> dict[str, np.ndarray]:
    """Seeded inputs: floats ~ N(0,1) clipped, ints small and non-negative (ids, indices), a
    sequence length between half and all of the sequence."""
    rng = np.random.default_rng(seed)
    out = {}
    for s in specs:
        shape = tuple(int(d) for d in s.shape)
        if s.dtype.startswith("float"):
            out[s.name] = np.clip(rng.standard_normal(shape), -3, 3).astype(s.dtype)
        elif s.dtype == "bool":
            out[s.name] = rng.integers(0, 2, shape).astype(bool)
        elif s.dtype == "uint8":
            out[s.name] = rng.integers(0, 256, shape).astype(np.uint8)
        elif (full := _sequence_length(s, specs)) is not None:
            out[s.name] = rng.integers(max(1, full // 2), full + 1, shape).astype(s.dtype)
        else:
            out[s.name] = rng.integers(0, 10, shape).astype(s.dtype)
        # a 0-d input (Gemm's scalar bias) comes back from numpy as a scalar, not an array
        out[s.name] = np.asarray(out[s.name], dtype=s.dtype)
    return out


def _sequence_length(s: TensorSpec, specs: tuple[TensorSpec, ...]) -> int | None:
    """For an integer input that gives sequence lengths (onnx-asr's `waveforms_lens`, a text
    encoder's `lengths`): the longest non-batch axis of the float inputs. A small random id there
    masks almost the whole sequence, and an all-zero output is matched by any artifact."""
    if s.dtype.startswith(("float", "bool", "uint8")) or "len" not in s.name.lower() or len(s.shape) > 1:
        return None
    axes = [int(d) for f in specs if f.dtype.startswith("float") for d in (f.shape[1:] or f.shape)]
    return max(axes) if axes else None


_IMAGENET_MEAN, _IMAGENET_STD = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])


def _synthetic_image(h: int, w: int, c: int, rng) -> np.ndarray:
    """HxWxC in [0,1], a synthetic scene: a smooth background (low-frequency waves, soft blobs),
    a few sharp-edged shapes and rows of small glyph-like strokes. Random noise drives activations
    into ranges real images never reach, and a smooth image alone leaves detectors silent (a
    PP-OCR detector answers ~0 to both); edges and text-like strokes make them respond."""
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    y, x = y / max(h, 1), x / max(w, 1)
    img = np.empty((h, w, c))
    for ch in range(c):
        fx, fy, ph = rng.uniform(0.5, 3.0), rng.uniform(0.5, 3.0), rng.uniform(0, 2 * np.pi)
        v = 0.55 + 0.2 * np.sin(2 * np.pi * (fx * x + fy * y) + ph)
        for _ in range(3):
            cx, cy, r, a = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.3), rng.uniform(-0.3, 0.3)
            v += a * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))
        img[:, :, ch] = v
    for _ in range(3):  # sharp-edged shapes
        y0, x0 = int(rng.integers(0, h)), int(rng.integers(0, w))
        y1, x1 = min(h, y0 + int(rng.integers(1, max(2, h // 3)))), min(w, x0 + int(rng.integers(1, max(2, w // 3))))
        img[y0:y1, x0:x1] = rng.uniform(0, 1, c)
    line = max(3, h // 20)  # rows of glyph-like strokes, dark on the background
    for row in range(max(1, min(5, h // (3 * line)))):
        y0 = int(rng.integers(0, max(1, h - line)))
        xx = int(rng.integers(0, max(1, w // 8)))
        while xx < w - 2:
            gw = int(rng.integers(max(2, line // 2), max(3, line + 1)))
            glyph = rng.random((min(line, h - y0), min(gw, w - xx))) < 0.45
            img[y0:y0 + glyph.shape[0], xx:xx + glyph.shape[1]][glyph] = 0.08
            xx += gw + int(rng.integers(1, max(2, line // 3 + 1)))
    return np.clip(img, 0.0, 1.0)


def _image_axes(shape: tuple) -> str | None:
    if len(shape) == 4 and shape[1] in (1, 3, 4) and shape[2] > 4 and shape[3] > 4:
        return "nchw"
    if len(shape) == 4 and shape[3] in (1, 3, 4) and shape[1] > 4 and shape[2] > 4:
        return "nhwc"
    return None


def realistic_inputs(specs: tuple[TensorSpec, ...], seed: int, prepost: dict | None = None) -> dict[str, np.ndarray]:
    """A second kind of input, in the range real data has: a synthetic scene as the baked
    preprocessing's raw pixels (0..255 or 0..1) for its image input, ImageNet-normalised for other
    image-shaped float inputs; a smooth signal in [-1, 1] for other floats; a sequence length the
    whole sequence; other integers stay random (ids)."""
    rng = np.random.default_rng(seed)
    pre = (prepost or {}).get("preprocess") or {}
    out = random_inputs(specs, seed + 1)
    for s in specs:
        shape = tuple(int(d) for d in s.shape)
        layout = _image_axes(shape)
        if (full := _sequence_length(s, specs)) is not None:
            out[s.name] = np.full(shape, full, s.dtype)   # the whole signal, as one unpadded clip has
            continue
        if not s.dtype.startswith("float") and s.dtype != "uint8":
            continue
        if layout:
            n, c = shape[0], shape[1] if layout == "nchw" else shape[3]
            h, w = shape[2:] if layout == "nchw" else shape[1:3]
            imgs = np.stack([_synthetic_image(h, w, c, rng) for _ in range(n)])   # NHWC in [0,1]
            if s.name == pre.get("input") or s.dtype == "uint8":
                scale = 1.0 if pre.get("dtype") == "float32" and s.dtype != "uint8" else 255.0
                imgs = np.round(imgs * 255.0) / 255.0 * scale
            elif c == 3:
                imgs = (imgs - _IMAGENET_MEAN) / _IMAGENET_STD
            else:
                imgs = (imgs - 0.5) / 0.25
            if layout == "nchw":
                imgs = imgs.transpose(0, 3, 1, 2)
            out[s.name] = np.ascontiguousarray(imgs).astype(s.dtype)
        elif s.dtype.startswith("float"):
            t = np.linspace(0, 1, shape[-1] if shape else 1)
            sig = sum(rng.uniform(0.1, 0.4) * np.sin(2 * np.pi * (rng.uniform(1, 8) * t + rng.uniform(0, 1)))
                      for _ in range(3))
            sig = np.clip(sig, -1, 1)
            out[s.name] = np.asarray(np.broadcast_to(sig, shape) if shape else sig[0], dtype=s.dtype).copy()
    return out


def run_onnxruntime(model: LoadedModel, inputs: dict[str, np.ndarray], what: str = "seeded random") -> dict[str, np.ndarray]:
    """onnxruntime's answer; a model it cannot load or run is a clear ModelError, never a traceback."""
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 4  # its own error lines would print beside ours: we report the exception
    if runs_qdq(model.proto):
        # The QDQ ops as the ONNX spec defines them, not fused into integer kernels: on AVX2 CPUs
        # without VNNI, onnxruntime's u8s8 kernels add byte products in pairs into int16, which
        # saturates (an MLAS trait its docs name; 3.6% of scale off on a test CNN), and other CPUs
        # compute them otherwise. The unfused ops give the same answer on every CPU.
        opts.add_session_config_entry("session.disable_quant_qdq", "1")
    try:
        sess = ort.InferenceSession(model.proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph/NotImplemented classes
        reason = _first_line(exc)
        if "NOT_IMPLEMENTED" in reason or "Could not find an implementation" in reason or "domain" in reason:
            raise UnsupportedOpError(f"{model.path.name}: onnxruntime, the reference every build is checked "
                                     f"against, has no implementation for an op in it: {reason}",
                                     hint="see `edgepack inspect MODEL` for op support per backend") from exc
        raise ModelError(f"{model.path.name}: onnxruntime, the reference every build is checked against, "
                         f"cannot load it: {reason}", hint="re-export the model with a standard opset") from exc
    names = [o.name for o in sess.get_outputs()]
    run_opts = ort.RunOptions()
    run_opts.log_severity_level = 4
    try:
        # a decoder loop's outputs cut to the length the model computed, as the artifact gives them
        return apply_trims(model.proto, dict(zip(names, sess.run(names, inputs, run_opts))))
    except Exception as exc:
        raise ModelError(f"{model.path.name}: onnxruntime, the reference, fails on a {what} input "
                         f"({', '.join(f'{k} {v.dtype}{list(v.shape)}' for k, v in inputs.items())}): "
                         f"{_first_line(exc)}",
                         hint="the model may need particular input values or shapes; fix shapes with "
                              "--input-shape NAME=1x3x224x224") from exc


def runs_qdq(proto) -> bool:
    """Whether `proto` holds QuantizeLinear/DequantizeLinear (static quantisation, the QDQ format)."""
    return any(n.op_type in ("QuantizeLinear", "DequantizeLinear") and n.domain in ("", "ai.onnx")
               for n in proto.graph.node)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]


@dataclass(frozen=True)
class Tolerance:
    """Pass when max|a-b| <= atol + rtol * max|ref| (per output): scale-aware, so logits in the
    hundreds and probabilities in [0,1] get comparable treatment; and, where the output is not
    ~0, when the cosine similarity of a and ref is >= min_cosine, which catches an error spread
    over many elements that each stay under the bound."""
    atol: float
    rtol: float
    min_cosine: float = 0.999

    def bound(self, ref: np.ndarray) -> float:
        scale = output_scale(ref)
        return self.atol + self.rtol * scale

    def to_json(self) -> dict:
        return {"atol": self.atol, "rtol": self.rtol, "min_cosine": self.min_cosine}


# The one policy (every backend, every precision): 0.5% of the output's scale, so that an error
# of 1% fails; a floor of 1e-5 for outputs that are ~0. The selftest inside the artifact uses the
# same atol/rtol.
POLICY = Tolerance(atol=1e-5, rtol=5e-3, min_cosine=0.999)
# Older names, one policy behind them all (backends ask for their precision's entry).
TOLERANCES = {"fp32": POLICY, "fp16": POLICY, "fp16-arith": POLICY}


@dataclass(frozen=True)
class Comparison:
    name: str
    max_abs_err: float
    bound: float
    shape_ok: bool
    scale: float = 0.0              # max|ref|
    cosine: float | None = None     # None where the output is ~0 (cosine would be noise)
    min_cosine: float = 0.0

    @property
    def rel_err(self) -> float:
        """max|a-b| relative to the output's scale (what "1% off" means)."""
        return self.max_abs_err / self.scale if self.scale > 0 else (0.0 if self.max_abs_err == 0 else float("inf"))

    @property
    def ok(self) -> bool:
        return (self.shape_ok and self.max_abs_err <= self.bound
                and (self.cosine is None or self.cosine >= self.min_cosine))

    def why(self) -> str:
        if not self.shape_ok:
            return "missing or of the wrong shape"
        if self.max_abs_err > self.bound:
            return (f"max abs error {self.max_abs_err:.3g} > bound {self.bound:.3g} "
                    f"({self.rel_err:.2%} of its scale {self.scale:.3g})")
        return f"cosine similarity {self.cosine:.6f} < {self.min_cosine}"


def output_scale(ref: np.ndarray) -> float:
    finite = np.asarray(ref, np.float64)
    finite = finite[np.isfinite(finite)]
    return float(np.max(np.abs(finite))) if finite.size else 0.0


def uninformative_outputs(refs: list[dict[str, np.ndarray]]) -> list[str]:
    """The float outputs that are 0 everywhere on every reference answer given: any artifact that
    writes zeros matches them, so a check on them cannot fail (a length input set to almost nothing
    masked a whole NeMo spectrogram until random_inputs learned lengths)."""
    names = {n for ref in refs for n, a in ref.items() if np.asarray(a).dtype.kind == "f"}
    return sorted(n for n in names if all(output_scale(ref[n]) == 0.0 for ref in refs if n in ref))


def compare(got: dict[str, np.ndarray], ref: dict[str, np.ndarray], tol: Tolerance,
            scales: dict[str, float] | None = None) -> list[Comparison]:
    """Per output: the error against ``tol``. An output's scale is max|ref| on this input, or the
    larger one it shows on other inputs (``scales``): a detector answers ~1e-5 to noise and ~1 to
    a scene, and its error on the noise is judged against the ~1 it can produce."""
    out = []
    for name, r in ref.items():
        g = got.get(name)
        own = output_scale(r)
        scale = max(own, (scales or {}).get(name, 0.0))
        bound = tol.atol + tol.rtol * scale
        if g is None or g.shape != r.shape:
            out.append(Comparison(name, float("inf"), bound, False, scale, None, tol.min_cosine))
            continue
        g64, r64 = np.asarray(g, np.float64).reshape(-1), np.asarray(r, np.float64).reshape(-1)
        fin = np.isfinite(r64)
        # where the reference itself is inf/nan (log of a negative input...) the artifact must agree exactly
        same_nonfinite = bool(np.all((g64[~fin] == r64[~fin]) | (np.isnan(g64[~fin]) & np.isnan(r64[~fin]))))
        diff = np.abs(g64[fin] - r64[fin])
        err = float(np.max(diff)) if diff.size else 0.0
        if np.isnan(err) or not same_nonfinite:
            err = float("inf")
        cos = None
        # the cosine only where this input carries the output's signal (not ~0 next to its scale)
        if own > tol.atol and own >= 0.1 * scale and np.isfinite(err):
            a, b = g64[fin], r64[fin]
            na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
            cos = float(np.dot(a, b) / (na * nb)) if na > 0 and nb > 0 else 0.0
        out.append(Comparison(name, err, bound, True, scale, cos, tol.min_cosine))
    return out
