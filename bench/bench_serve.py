"""Load test for an artifact's `serve`: N client threads POST /predict for a fixed time on 127.0.0.1.

    python bench/bench_serve.py dist/tiny_cnn-x86_64 --duration 30 --concurrency 4 [--input cat.png]
    python bench/bench_serve.py dist/yolo-x86_64 --detect          # a detector: 640x480 JPEG POSTs

Starts the server itself (ephemeral port, idle timeout as a safety net), warms it up, then reports
requests/s, p50/p90/p99/max latency, errors (non-200 or connection failures) and the server's RSS
before and after, as one JSON object. With --detect every answer must carry "detections"; the report
adds boxes per answer and the decode+NMS time the artifact states in each answer ("detect_ms"). Every loop is bounded in time; the server is stopped at the end.
"""
from __future__ import annotations

import argparse
import http.client
import json
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


def default_body(manifest: dict) -> tuple[bytes, str]:
    """A PNG for image models (Pillow if installed, else a .npy), a .npy tensor otherwise."""
    import io
    pre = manifest.get("prepost", {}).get("preprocess")
    rng = np.random.default_rng(0)
    if pre:
        img = rng.integers(0, 256, (pre["size"][0] * 2, pre["size"][1] * 2, pre["channels"])).astype(np.uint8)
        try:
            from PIL import Image
            buf = io.BytesIO()
            Image.fromarray(img.squeeze()).save(buf, format="PNG")
            return buf.getvalue(), "image/png"
        except ImportError:
            pass
    spec = manifest["inputs"][0]
    buf = io.BytesIO()
    np.save(buf, rng.standard_normal(spec["shape"]).astype(spec["dtype"]))
    return buf.getvalue(), "application/x-npy"


def scene_jpeg(width: int = 640, height: int = 480) -> bytes:
    """A seeded 640x480 JPEG: soft gradients with a few filled rectangles and discs (objects to find)."""
    import io
    from PIL import Image, ImageDraw
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    bg = np.stack([100 + 60 * np.sin(xx / 53), 120 + 50 * np.cos(yy / 41), 110 + 40 * np.sin((xx + yy) / 67)], -1)
    im = Image.fromarray(bg.clip(0, 255).astype(np.uint8))
    draw, rng = ImageDraw.Draw(im), np.random.default_rng(7)
    for _ in range(12):
        x, y = int(rng.integers(0, width - 80)), int(rng.integers(0, height - 80))
        w, h = int(rng.integers(30, 200)), int(rng.integers(30, 200))
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([x, y, x + w, y + h], fill=fill)
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--input", type=Path, help="file to POST (default: a generated PNG / .npy)")
    ap.add_argument("--threads", type=int, default=1, help="the server's inference threads")
    ap.add_argument("--detect", action="store_true",
                    help="a detector: POST a 640x480 JPEG (unless --input) and check each answer has detections")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from edgepack.runner import command_for
    manifest = json.loads(subprocess.run(command_for(a.artifact) + ["info", "--json"], capture_output=True, text=True,
                                         check=True).stdout)
    if a.input:
        body = a.input.read_bytes()
        ctype = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".npy": "application/x-npy",
                 ".json": "application/json", ".csv": "text/csv"}.get(a.input.suffix.lower(), "application/octet-stream")
    elif a.detect:
        body, ctype = scene_jpeg(), "image/jpeg"
    else:
        body, ctype = default_body(manifest)
    srv = subprocess.Popen(command_for(a.artifact) + ["serve", "--port", "0", "--threads", str(a.threads),
                                                      "--idle-timeout", str(a.duration + 120)],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        ready, _, _ = select.select([srv.stdout], [], [], 60)
        if not ready:
            raise SystemExit("server did not start within 60 s")
        port = json.loads(srv.stdout.readline())["port"]

        boxes: list[int] = []
        detect_ms: list[float] = []

        def post() -> int:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            try:
                c.request("POST", "/predict", body=body, headers={"Content-Type": ctype})
                r = c.getresponse()
                data = r.read()
            finally:
                c.close()
            if a.detect and r.status == 200:  # a detector's answer must be boxes, not tensors
                ans = json.loads(data)
                if not isinstance(ans.get("detections"), list):
                    return -1
                boxes.append(len(ans["detections"]))  # list.append is atomic: threads share these
                if isinstance(ans.get("detect_ms"), (int, float)):
                    detect_ms.append(float(ans["detect_ms"]))
            return r.status

        for _ in range(20):  # warm-up
            st = post()
            if st != 200:
                raise SystemExit("warm-up request failed: " + ("the answer has no detections (not a detector?)"
                                                               if st == -1 else f"HTTP {st}"))
        boxes.clear()
        detect_ms.clear()
        rss_before = rss_kb(srv.pid)
        lat: list[float] = []
        errors = [0]
        lock = threading.Lock()
        stop_at = time.monotonic() + a.duration

        def worker():
            mine, bad = [], 0
            while time.monotonic() < stop_at:
                t0 = time.perf_counter()
                try:
                    ok = post() == 200
                except OSError:
                    ok = False
                if ok:
                    mine.append((time.perf_counter() - t0) * 1000)
                else:
                    bad += 1
            with lock:
                lat.extend(mine)
                errors[0] += bad

        t0 = time.monotonic()
        ts = [threading.Thread(target=worker) for _ in range(a.concurrency)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(a.duration + 60)
        wall = time.monotonic() - t0
        rss_after = rss_kb(srv.pid)
        alive = srv.poll() is None
    finally:
        srv.terminate()
        try:
            srv.wait(10)
        except subprocess.TimeoutExpired:
            srv.kill()
    q = np.percentile(lat, [50, 90, 99]) if lat else [float("nan")] * 3
    report = {"artifact": str(a.artifact), "backend": manifest["backend"]["name"], "target": manifest["target"]["name"],
              "body": ctype, "body_bytes": len(body), "duration_s": round(wall, 2), "concurrency": a.concurrency,
              "requests": len(lat), "errors": errors[0], "rps": round(len(lat) / wall, 1),
              "p50_ms": round(float(q[0]), 3), "p90_ms": round(float(q[1]), 3), "p99_ms": round(float(q[2]), 3),
              "max_ms": round(max(lat), 3) if lat else None, "rss_kb_before": rss_before, "rss_kb_after": rss_after,
              "server_alive_after": alive}
    if a.detect:
        report |= {"mode": "detect", "boxes_per_answer": round(float(np.mean(boxes)), 2) if boxes else None,
                   "detect_ms_p50": round(float(np.median(detect_ms)), 4) if detect_ms else None}
    print(json.dumps(report, indent=1))
    return 0 if errors[0] == 0 and alive else 1


if __name__ == "__main__":
    raise SystemExit(main())
