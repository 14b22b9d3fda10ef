"""Soak test for an artifact's `serve` under mixed, partly hostile load (issue #11).

    python bench/soak_serve.py dist/tiny_cnn-x86_64 [--duration 60] [--clients 32] [--slow 8]

Starts the server (ephemeral port on 127.0.0.1), takes the answer to each valid request once, alone,
as the reference, then for --duration seconds runs --clients clients: --slow of them trickle bytes
(a head or a body a byte at a time, so they meet the head/body deadlines), the others send a mix of
valid requests (PNG, JPEG, PPM, .npy, JSON) and invalid ones (16-bit and header-only PNM, truncated
PNG/JPEG, garbage, oversized JSON, malformed heads), on fresh and on kept-alive connections, while a
prober times GET /health. Reports crashes (the server gone), wrong answers (a valid request whose
top-k or outputs differ from its reference; an invalid one answered 2xx or 5xx), connection errors,
p50/p99 of valid requests, /health latency and the server's RSS (start, every 5 s, end), as one JSON
object. Exit 0 only with no crash and no wrong answer. Every loop is bounded in time.
"""
from __future__ import annotations

import argparse
import http.client
import io
import json
import random
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return -1


def valid_bodies(manifest: dict) -> list[tuple[str, bytes, str]]:
    from PIL import Image
    pre = manifest["prepost"]["preprocess"]
    h, w = pre["size"]
    rng = np.random.default_rng(7)
    out = []
    for i, (hh, ww) in enumerate([(h, w), (h * 2, w + 7), (h - 5, w - 3)]):
        img = rng.integers(0, 256, (hh, ww, 3)).astype(np.uint8)
        for fmt, ctype in (("PNG", "image/png"), ("JPEG", "image/jpeg")):
            b = io.BytesIO()
            Image.fromarray(img).save(b, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
            out.append((f"{fmt.lower()}{i}", b.getvalue(), ctype))
        out.append((f"ppm{i}", f"P6\n{ww} {hh}\n255\n".encode() + img.tobytes(), "image/x-portable-pixmap"))
    spec = manifest["inputs"][0]
    x = (rng.standard_normal(spec["shape"]) * 50 + 100).astype(spec["dtype"])
    b = io.BytesIO()
    np.save(b, x)
    out.append(("npy", b.getvalue(), "application/x-npy"))
    out.append(("json", json.dumps({spec["name"]: x.tolist()}).encode(), "application/json"))
    return out


def invalid_bodies(valid: list) -> list[tuple[str, bytes, str]]:
    png = next(b for n, b, _ in valid if n == "png0")
    jpg = next(b for n, b, _ in valid if n == "jpeg0")
    return [("pnm16", b"P5\n2048 2048\n65535\n", "image/x-portable-pixmap"),
            ("pnm-header-only", b"P6\n64 64\n255\n", "image/x-portable-pixmap"),
            ("png-truncated", png[: len(png) // 2], "image/png"),
            ("jpeg-truncated", jpg[:-2], "image/jpeg"),
            ("garbage-png", b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4, "image/png"),
            ("json-bomb", b"[" + b"0," * 200_000 + b"0]", "application/json"),
            ("json-bad", b'{"x": [1, 2', "application/json"),
            ("wrong-type", b"<xml/>", "application/xml")]


RAW_BAD = [b"GARBAGE\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"POST /predict HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
           b"GET /" + b"a" * 2000 + b" HTTP/1.1\r\n\r\n", b"POST /predict HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"]


def answer_key(ans: dict):
    return json.dumps([ans.get("top"), ans.get("outputs")], sort_keys=True)


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.lat: list[float] = []
        self.health: list[float] = []
        self.rss: list[int] = []
        self.counts = {"valid": 0, "invalid": 0, "raw": 0, "slow": 0}
        self.wrong: list = []
        self.conn_errors: list = []

    def add(self, key, lat=None):
        with self.lock:
            self.counts[key] += 1
            if lat is not None:
                self.lat.append(lat)


def post(conn: http.client.HTTPConnection, body: bytes, ctype: str):
    conn.request("POST", "/predict", body=body, headers={"Content-Type": ctype})
    r = conn.getresponse()
    return r.status, r.read(), r.getheader("Connection")


def client(port, valid, invalid, refs, stats: Stats, stop_at: float, seed: int):
    rnd = random.Random(seed)
    conn = None
    while time.monotonic() < stop_at:
        try:
            if conn is None or rnd.random() < 0.3:
                if conn:
                    conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            r = rnd.random()
            if r < 0.6:
                name, body, ctype = rnd.choice(valid)
                t0 = time.perf_counter()
                status, data, keep = post(conn, body, ctype)
                ms = (time.perf_counter() - t0) * 1000
                if status != 200 or answer_key(json.loads(data)) != refs[name]:
                    stats.wrong.append((name, status, data[:200]))
                stats.add("valid", ms)
            elif r < 0.9:
                name, body, ctype = rnd.choice(invalid)
                status, data, keep = post(conn, body, ctype)
                if not 400 <= status < 500 or "error" not in json.loads(data):
                    stats.wrong.append((name, status, data[:200]))
                stats.add("invalid")
            else:
                raw = rnd.choice(RAW_BAD)
                with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
                    s.sendall(raw)
                    s.shutdown(socket.SHUT_WR)
                    got = s.recv(65536)
                if not got.startswith(b"HTTP/1.1 4"):
                    stats.wrong.append(("raw", raw[:40], got[:100]))
                stats.add("raw")
                keep = "keep-alive"
            if keep == "close":
                conn.close()
                conn = None
        except (OSError, http.client.HTTPException) as e:
            stats.conn_errors.append(repr(e)[:200])
            if conn:
                conn.close()
            conn = None
    if conn:
        conn.close()


def slow_client(port, stats: Stats, stop_at: float, seed: int):
    """Trickles a head (or a body) a byte every 0.5-2 s; reconnects when the server ends it (408)."""
    rnd = random.Random(seed)
    while time.monotonic() < stop_at:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
                s.sendall(b"POST /predict HTTP/1.1\r\nContent-Length: 5000\r\n\r\n" if rnd.random() < 0.5
                          else b"GET /health HTTP/1.1\r\n")
                while time.monotonic() < stop_at:
                    r, _, _ = select.select([s], [], [], rnd.uniform(0.5, 2.0))
                    if r:
                        s.recv(65536)  # the 408 (then EOF)
                        break
                    s.send(b"x")
            stats.add("slow")
        except OSError:
            time.sleep(0.2)


def prober(port, stats: Stats, stop_at: float, pid: int):
    """GET /health every 0.25 s on a fresh connection; the server's RSS every 5 s."""
    next_rss = 0.0
    while time.monotonic() < stop_at:
        if time.monotonic() >= next_rss:
            with stats.lock:
                stats.rss.append(rss_kb(pid))
            next_rss = time.monotonic() + 5
        t0 = time.perf_counter()
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            c.request("GET", "/health")
            ok = c.getresponse().status == 200
            c.close()
        except OSError:
            ok = False
        with stats.lock:
            stats.health.append((time.perf_counter() - t0) * 1000 if ok else float("inf"))
        time.sleep(0.25)


def pct(xs, q):
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 2) if xs else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--clients", type=int, default=32, help="all clients, the slow ones included")
    ap.add_argument("--slow", type=int, default=8)
    ap.add_argument("--serve-args", default="--head-timeout 5 --body-timeout 5",
                    help="extra serve options (the deadlines the slow clients run into)")
    a = ap.parse_args(argv)
    from edgepack.runner import command_for
    manifest = json.loads(subprocess.run(command_for(a.artifact) + ["info", "--json"], capture_output=True, text=True,
                                         check=True).stdout)
    if not manifest.get("prepost", {}).get("preprocess"):
        raise SystemExit("soak_serve needs an artifact built with --preprocess image:...")
    srv = subprocess.Popen(command_for(a.artifact) + ["serve", "--port", "0", "--threads", "1", "--idle-timeout",
                                                      str(a.duration + 120), *a.serve_args.split()],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([srv.stdout], [], [], 60)
        if not ready:
            raise SystemExit("server did not start within 60 s")
        port = json.loads(srv.stdout.readline())["port"]
        valid = valid_bodies(manifest)
        invalid = invalid_bodies(valid)
        refs = {}
        for name, body, ctype in valid:  # the reference: each valid request alone, on its own connection
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            status, data, _ = post(c, body, ctype)
            c.close()
            if status != 200:
                raise SystemExit(f"reference request {name} failed: {status} {data[:300]!r}")
            refs[name] = answer_key(json.loads(data))
        rss_start = rss_kb(srv.pid)
        stats = Stats()
        stop_at = time.monotonic() + a.duration
        ts = [threading.Thread(target=client, args=(port, valid, invalid, refs, stats, stop_at, k))
              for k in range(a.clients - a.slow)]
        ts += [threading.Thread(target=slow_client, args=(port, stats, stop_at, 1000 + k)) for k in range(a.slow)]
        ts.append(threading.Thread(target=prober, args=(port, stats, stop_at, srv.pid)))
        t0 = time.monotonic()
        for t in ts:
            t.start()
        for t in ts:
            t.join(a.duration + 120)
        wall = time.monotonic() - t0
        alive = srv.poll() is None
        rss_end = rss_kb(srv.pid) if alive else -1
        result = {
            "duration_s": round(wall, 1), "clients": a.clients, "slow_clients": a.slow,
            "requests": stats.counts, "requests_per_s": round(sum(stats.counts.values()) / wall, 1),
            "crashes": 0 if alive else 1, "server_rc": srv.poll(),
            "wrong_answers": len(stats.wrong), "wrong_examples": [repr(w)[:300] for w in stats.wrong[:5]],
            "connection_errors": len(stats.conn_errors), "connection_error_examples": stats.conn_errors[:3],
            "valid_ms": {"p50": pct(stats.lat, 0.5), "p99": pct(stats.lat, 0.99), "max": pct(stats.lat, 1.0)},
            "health_ms": {"n": len(stats.health), "p50": pct(stats.health, 0.5), "p99": pct(stats.health, 0.99),
                          "max": pct(stats.health, 1.0)},
            "rss_kb": {"start": rss_start, "end": rss_end, "max": max(stats.rss + [rss_end]),
                       "every_5s": stats.rss},
        }
        print(json.dumps(result))
        return 0 if alive and not stats.wrong else 1
    finally:
        if srv.poll() is None:
            srv.terminate()
            try:
                srv.wait(10)
            except subprocess.TimeoutExpired:
                srv.kill()
                srv.wait(10)


if __name__ == "__main__":
    sys.exit(main())
