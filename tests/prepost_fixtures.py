"""Shared, built-once helpers for the pre/post-processing, serve, batch and SDK tests.

Artifacts are built once per test session (module-level cache, so every test file importing this
gets the same build): the example CNN with baked image pre/post-processing (from a TOML next to
the model) and a small tabular MLP for CSV.
"""
from __future__ import annotations

import atexit
import io
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from conftest import EXAMPLES, run_edgepack

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
LABELS = ["cat", "dog", "fox", "owl", "elk", "yak", "emu", "gnu", "ant", "bee"]
TOML = f"""[preprocess]
size = "64x64"
layout = "nhwc"
dtype = "uint8"
mean = {list(MEAN)}
std = {list(STD)}
resize = "bilinear"

[postprocess]
softmax = true
topk = 3
labels = "labels.txt"
"""
_ROOT = Path(tempfile.mkdtemp(prefix="edgepack-prepost-tests-"))
atexit.register(shutil.rmtree, _ROOT, True)
_CACHE: dict = {}


def classifier_dir() -> Path:
    """tiny_cnn.onnx + labels.txt + tiny_cnn.edgepack.toml in one folder."""
    d = _ROOT / "classifier"
    if not d.exists():
        d.mkdir(parents=True)
        shutil.copy(EXAMPLES / "tiny_cnn.onnx", d / "tiny_cnn.onnx")
        (d / "labels.txt").write_text("\n".join(LABELS) + "\n")
        (d / "tiny_cnn.edgepack.toml").write_text(TOML)
    return d


def build(model: Path, targets: str, *extra: str, key: str | None = None) -> dict[str, Path]:
    key = key or f"{model}|{targets}|{extra}"
    if key not in _CACHE:
        dist = _ROOT / f"dist{len(_CACHE)}"
        proc = run_edgepack("build", str(model), "--target", targets, "--out", str(dist), "--json", *extra)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        _CACHE[key] = {t: dist / f"{model.stem}-{t}" for t in targets.split(",")}
    return _CACHE[key]


# x86_64 normally; EDGEPACK_TEST_SERVE_TARGET=arm64 runs the same tests on an Arm build under qemu.
TARGET = os.environ.get("EDGEPACK_TEST_SERVE_TARGET", "x86_64")


def baked_x86() -> Path:
    """The classifier with baked pre/post-processing, NCNN, x86_64, fp32."""
    return build(classifier_dir() / "tiny_cnn.onnx", TARGET, "--backend", "ncnn", "--fp32")[TARGET]


def tabular_model() -> Path:
    """x [1,4] float32 -> Gemm(8) -> Relu -> Gemm(3) -> y [1,3]: a tabular classifier for CSV."""
    p = _ROOT / "tabular" / "mlp.onnx"
    if not p.exists():
        p.parent.mkdir(parents=True)
        rng = np.random.default_rng(5)
        inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
                 for n, s in (("w1", (4, 8)), ("b1", (8,)), ("w2", (8, 3)), ("b2", (3,)))]
        nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
                 helper.make_node("Gemm", ["r", "w2", "b2"], ["y"])]
        g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])], inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
        m.ir_version = 8
        onnx.save(m, p)
    return p


def tabular_x86() -> Path:
    return build(tabular_model(), TARGET, "--backend", "ncnn", "--fp32")[TARGET]


def make_images(d: Path) -> dict[str, Path]:
    """Seeded images of several sizes and formats (smooth, so the decoders agree), written with Pillow."""
    from PIL import Image
    d.mkdir(parents=True, exist_ok=True)
    out = {}
    rng = np.random.default_rng(11)
    for i, (h, w, fmt) in enumerate([(64, 64, "png"), (90, 120, "png"), (48, 40, "ppm"), (200, 150, "png"),
                                     (77, 64, "jpg"), (128, 128, "jpg")]):
        yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
        base = np.stack([np.sin(xx / (5 + 3 * c + i) + c) * np.cos(yy / (7 + 2 * c)) for c in range(3)], -1)
        img = np.clip(127.5 + 110 * base + rng.normal(0, 4, (h, w, 3)), 0, 255).astype(np.uint8)
        p = d / f"img{i}.{fmt}"
        Image.fromarray(img).save(p, **({"quality": 95} if fmt == "jpg" else {}))
        out[p.name] = p
    return out


def decode(p: Path) -> np.ndarray:
    from PIL import Image
    with Image.open(p) as im:
        return np.asarray(im.convert("RGB"))


# ---- a served artifact ------------------------------------------------------------------------

class Server:
    """An artifact's `serve` on 127.0.0.1 with an ephemeral port; stopped (bounded) on close."""

    def __init__(self, artifact: Path, *args: str, idle: float = 300):
        from edgepack.runner import command_for
        self.proc = subprocess.Popen(command_for(artifact) + ["serve", "--port", "0", "--idle-timeout", str(idle),
                                                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        assert ready, "serve printed nothing within 60 s"
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()[-2000:]
        self.hello = json.loads(line)
        self.port = self.hello["port"]
        self.base = f"http://127.0.0.1:{self.port}"

    def raw(self, data: bytes, shut: bool = True, timeout: float = 20) -> bytes:
        """Send raw bytes, read the whole answer (the server closes each connection)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            try:
                s.sendall(data)
                if shut:
                    s.shutdown(socket.SHUT_WR)
            except (BrokenPipeError, ConnectionResetError):
                pass
            chunks = []
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    c = s.recv(65536)
                except ConnectionResetError:
                    break
                if not c:
                    break
                chunks.append(c)
            return b"".join(chunks)

    def request(self, method: str, path: str, body: bytes | None = None, ctype: str | None = None,
                timeout: float = 60):
        import http.client
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        headers = {"Content-Type": ctype} if ctype else {}
        c.request(method, path, body=body, headers=headers)
        r = c.getresponse()
        data = r.read()
        c.close()
        return r.status, r.getheader("Content-Type"), data

    def json(self, method: str, path: str, body: bytes | None = None, ctype: str | None = None):
        status, ct, data = self.request(method, path, body, ctype)
        assert ct == "application/json", (status, ct, data[:300])
        return status, json.loads(data)

    def alive(self) -> bool:
        status, j = self.json("GET", "/health")
        return status == 200 and j["status"] == "ok" and self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for f in (self.proc.stdout, self.proc.stderr):
            f.close()


def npy_bytes(a: np.ndarray) -> bytes:
    b = io.BytesIO()
    np.save(b, a, allow_pickle=False)
    return b.getvalue()
