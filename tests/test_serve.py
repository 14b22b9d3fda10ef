"""`serve` over real HTTP: predictions from images, .npy, JSON and CSV; every kind of bad request
answered 4xx with a JSON error while the server stays up; loopback by default; idle shutdown."""
from __future__ import annotations

import json
import subprocess
import time

import numpy as np
import pytest

from edgepack.runner import run_artifact
from prepost_fixtures import LABELS, Server, baked_x86, make_images, npy_bytes, tabular_x86


@pytest.fixture(scope="module")
def server():
    s = Server(baked_x86(), "--max-body", "1000000")
    yield s
    s.close()


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_images(tmp_path_factory.mktemp("images"))


def test_binds_loopback_and_serves_page_info_health(server):
    assert server.hello["listening"].startswith("http://127.0.0.1:")
    status, ct, page = server.request("GET", "/")
    assert status == 200 and ct.startswith("text/html") and b'<input type=file id=file>' in page
    status, info = server.json("GET", "/info")
    assert status == 200 and info["model"]["name"] == "tiny_cnn" and info["prepost"]["postprocess"]["labels"] == LABELS
    assert server.alive()


def test_predict_image_npy_json_agree(server, images):
    art = baked_x86()
    p = images["img1.png"]
    status, ans = server.json("POST", "/predict", p.read_bytes(), "image/png")
    assert status == 200, ans
    assert [t["label"] for t in ans["top"]] and ans["top"][0]["label"] == LABELS[ans["top"][0]["index"]]
    cli = json.loads(run_artifact(art, ["run", "--input", str(p)]).stdout)
    assert ans["top"] == cli["top"] and ans["outputs"] == cli["outputs"]
    # the same picture as an already-resized float32 tensor: .npy and JSON give the same answer
    from edgepack.prepost import image_to_input
    from prepost_fixtures import decode
    info = json.loads(run_artifact(art, ["info", "--json"]).stdout)
    x = image_to_input(decode(p), info["prepost"]["preprocess"])
    s1, a1 = server.json("POST", "/predict", npy_bytes(x), "application/x-npy")
    s2, a2 = server.json("POST", "/predict", json.dumps({"image": x.tolist()}).encode(), "application/json")
    s3, a3 = server.json("POST", "/predict", npy_bytes(x.astype(np.float32)), None)  # sniffed
    assert s1 == s2 == s3 == 200
    assert a1["top"] == a2["top"] == a3["top"]
    np.testing.assert_allclose(a1["outputs"]["scores"]["values"], ans["outputs"]["scores"]["values"], atol=1e-6)


def test_csv_rows_for_a_tabular_model():
    s = Server(tabular_x86())
    try:
        rows = np.random.default_rng(3).standard_normal((5, 4)).astype(np.float32)
        body = "a,b,c,d\n" + "\n".join(",".join(f"{v:.6f}" for v in r) for r in rows) + "\n"
        status, ans = s.json("POST", "/predict", body.encode(), "text/csv")
        assert status == 200, ans
        assert [r["row"] for r in ans["rows"]] == list(range(5))
        from edgepack.model import load_model
        from edgepack.reference import run_onnxruntime
        from prepost_fixtures import tabular_model
        m = load_model(tabular_model())
        for r, got in zip(rows, ans["rows"]):
            ref = run_onnxruntime(m, {"x": np.round(r, 6)[None].astype(np.float32)})["y"]
            np.testing.assert_allclose(got["outputs"]["y"]["values"], ref.reshape(-1), rtol=1e-4, atol=1e-4)
        status, err = s.json("POST", "/predict", b"1,2,3\n", "text/csv")
        assert status == 422 and "3 values" in err["error"]
        assert s.alive()
    finally:
        s.close()


BAD_RAW = [
    (b"GARBAGE\r\n\r\n", 400),
    (b"GET nopath HTTP/1.1\r\n\r\n", 400),
    (b"GET / HTTP/9.9\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nBad Header\r\n\r\n", 400),
    (b"GET /\x01 HTTP/1.1\r\n\r\n", 400),
    (b"POST /predict HTTP/1.1\r\nContent-Type: image/png\r\n\r\n", 411),
    (b"POST /predict HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 411),
    (b"POST /predict HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello", 400),
    (b"POST /predict HTTP/1.1\r\nContent-Length: -5\r\n\r\n", 400),
    (b"POST /predict HTTP/1.1\r\nContent-Length: 99999999999999\r\n\r\n", 413),
    (b"POST /predict HTTP/1.1\r\nContent-Length: 100\r\nContent-Type: image/png\r\n\r\n\x89PNG", 400),  # truncated
    (b"GET / HTTP/1.1\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", 431),
    (b"GET /" + b"a" * 1000 + b" HTTP/1.1\r\n\r\n", 414),
    (b"DELETE /predict HTTP/1.1\r\n\r\n", 405),
    (b"GET /predict HTTP/1.1\r\n\r\n", 405),
    (b"GET /nope HTTP/1.1\r\n\r\n", 404),
    (b"POST /predict HTTP/1.1\r\nExpect: something\r\nContent-Length: 1\r\n\r\nx", 417),
]


@pytest.mark.parametrize("raw,code", BAD_RAW, ids=[f"{c}-{i}" for i, (_, c) in enumerate(BAD_RAW)])
def test_malformed_requests_get_4xx_json_and_the_server_lives(server, raw, code):
    ans = server.raw(raw)
    head, _, body = ans.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {code} ".encode()), ans[:300]
    assert b"Content-Type: application/json" in head
    assert json.loads(body)["status"] == code
    assert server.alive()


BAD_BODIES = [
    (b"not json at all", "application/json", 422),
    (b'{"image": [1, 2', "application/json", 422),
    (b'{"other": [1]}', "application/json", 422),
    (b'[[1, 2], [3]]', "application/json", 422),
    (b"[" * 5000 + b"]" * 5000, "application/json", 422),
    (b"hello", "image/png", 415),
    (b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, "image/png", 422),
    (b"\xff\xd8\xff" + b"\x13" * 500, "image/jpeg", 422),
    (b"P6\n99999 99999\n255\n" + b"\x00" * 100, "image/x-portable-pixmap", 422),
    (b"<xml/>", "application/xml", 415),
    (b"--b\r\nContent-Disposition: form-data\r\n\r\nx\r\n--b--", "multipart/form-data; boundary=b", 415),
    (b"\x93NUMPY\x01\x00\xff\xff{'descr", "application/x-npy", 422),
    (b"\x93NUMPY", "application/json", 415),
    (b"", "image/png", 400),
    (b"1,2\n3\n", "text/csv", 422),
]


@pytest.mark.parametrize("body,ctype,code", BAD_BODIES, ids=[f"{c}-{i}" for i, (_, _, c) in enumerate(BAD_BODIES)])
def test_bad_bodies_and_content_types_get_4xx(server, body, ctype, code):
    status, err = server.json("POST", "/predict", body, ctype)
    assert status == code, err
    assert err["error"] and err["status"] == code
    assert server.alive()


def test_huge_body_is_refused_without_reading_it(server):
    big = b"\x00" * 50_000_000  # 50 MB against --max-body 1 MB
    t0 = time.monotonic()
    ans = server.raw(b"POST /predict HTTP/1.1\r\nContent-Type: application/octet-stream\r\nContent-Length: "
                     + str(len(big)).encode() + b"\r\n\r\n" + big)
    assert ans.startswith(b"HTTP/1.1 413 "), ans[:200]
    assert time.monotonic() - t0 < 30
    assert server.alive()


def test_stalled_and_dropped_clients_do_not_stop_the_server(server):
    import socket
    for payload in (b"", b"POST /predict HTTP/1.1\r\nContent-Length: 50\r\n\r\nabc", b"GET / HT"):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(payload)  # then vanish mid-request
    assert server.alive()


def test_idle_timeout_shuts_the_server_down():
    s = Server(baked_x86(), idle=1.5)
    try:
        assert s.alive()
        rc = s.proc.wait(timeout=30)
        assert rc == 0
        assert "idle" in s.proc.stderr.read()
    finally:
        s.close()


def test_bad_serve_options_exit_2():
    from edgepack.runner import command_for
    for args in (["--port", "70000"], ["--host", "localhost"], ["--idle-timeout", "-1"]):
        proc = subprocess.run(command_for(baked_x86()) + ["serve", *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and proc.stderr.startswith("error: "), (args, proc.stderr)
