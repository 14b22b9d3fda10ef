"""onnxruntime as the reference, seeded inputs, and the precision-aware comparison."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .model import LoadedModel, TensorSpec


def random_inputs(specs: tuple[TensorSpec, ...], seed: int) -> dict[str, np.ndarray]:
    """Seeded inputs: floats ~ N(0,1) clipped, ints small and non-negative (ids, indices)."""
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
        else:
            out[s.name] = rng.integers(0, 10, shape).astype(s.dtype)
    return out


def run_onnxruntime(model: LoadedModel, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model.proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, inputs)))


@dataclass(frozen=True)
class Tolerance:
    """Pass when max|a-b| <= atol + rtol * max|ref| (per output): scale-aware, so logits in the
    hundreds and probabilities in [0,1] get comparable treatment."""
    atol: float
    rtol: float

    def bound(self, ref: np.ndarray) -> float:
        scale = float(np.max(np.abs(ref))) if ref.size else 0.0
        return self.atol + self.rtol * scale

    def to_json(self) -> dict:
        return {"atol": self.atol, "rtol": self.rtol}


# fp32 weights and math; fp16 weights with fp32 math; fp16 math on fp16-capable CPUs (Orin, Xavier).
TOLERANCES = {
    "fp32": Tolerance(atol=1e-4, rtol=1e-3),
    "fp16": Tolerance(atol=1e-3, rtol=1e-2),
    "fp16-arith": Tolerance(atol=5e-3, rtol=5e-2),
}


@dataclass(frozen=True)
class Comparison:
    name: str
    max_abs_err: float
    bound: float
    shape_ok: bool

    @property
    def ok(self) -> bool:
        return self.shape_ok and self.max_abs_err <= self.bound


def compare(got: dict[str, np.ndarray], ref: dict[str, np.ndarray], tol: Tolerance) -> list[Comparison]:
    out = []
    for name, r in ref.items():
        g = got.get(name)
        if g is None or g.shape != r.shape:
            out.append(Comparison(name, float("inf"), tol.bound(r), False))
            continue
        err = float(np.max(np.abs(g.astype(np.float64) - r.astype(np.float64)))) if r.size else 0.0
        if np.isnan(err):
            err = float("inf")
        out.append(Comparison(name, err, tol.bound(r), True))
    return out
