"""Headless Chromium (Debian's chromium + chromium-driver, driven by selenium) opens the try-it page,
uploads an image and checks, from the page itself, what it drew: a classifier's top-k as labelled bars,
a detector's boxes on a canvas (pixel colours at the box edges) and its table, JSON for the rest. The
page runs under the server's Content-Security-Policy, so a blocked script or style would show here."""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import time

import pytest

from edgepack.runner import run_artifact
from prepost_fixtures import LABELS, Server, baked_x86, make_images


@pytest.fixture(scope="module")
def server():
    s = Server(baked_x86())
    yield s
    s.close()


def chrome():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    assert browser and driver, "apt-get install chromium chromium-driver (see .ci/deps-serve.sh)"
    opts = webdriver.ChromeOptions()
    opts.binary_location = browser
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              "--no-first-run", "--disable-extensions", "--disable-background-networking",
              "--window-size=1000,900"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # Chromium leaves org.chromium.Chromium.* folders in its temporary folder even after quit(): give it one
    # of its own, removed by quit()
    tmp = tempfile.mkdtemp(prefix="edgepack-chromium-")
    try:
        d = webdriver.Chrome(service=Service(driver, env={**os.environ, "TMPDIR": tmp}), options=opts)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    quit_browser = d.quit

    def quit_and_clean():
        try:
            quit_browser()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    d.quit = quit_and_clean
    return d


def wait_for(fn, timeout=60.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = fn()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError("timed out waiting for the page")


def page_errors(d) -> list[str]:
    """Console errors other than the favicon's 404 (a CSP violation or a script error lands here)."""
    return [e["message"] for e in d.get_log("browser")
            if e["level"] == "SEVERE" and "favicon.ico" not in e["message"]]


def answer_shown(d) -> dict:
    from selenium.webdriver.common.by import By
    text = wait_for(lambda: d.find_element(By.ID, "result").get_attribute("textContent").strip())
    return json.loads(text)


def screenshot(d, path) -> None:
    d.save_screenshot(str(path))
    assert path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_page_files_and_headers(server):
    status, ct, page = server.request("GET", "/")
    assert status == 200 and ct == "text/html; charset=utf-8"
    sizes = {"/": len(page)}
    for path, want in (("/page.js", "text/javascript"), ("/page.css", "text/css")):
        status, ct, body = server.request("GET", path)
        assert status == 200 and ct.startswith(want), (path, status, ct)
        sizes[path] = len(body)
        if path == "/page.js":  # model and label text only ever goes in as text, never parsed as HTML
            assert b"innerHTML" not in body and b"insertAdjacentHTML" not in body and b"document.write" not in body
    assert b"<script>" not in page and b"<style>" not in page and b" style=" not in page  # all from files, no inline
    assert sum(sizes.values()) < 12_000, sizes  # the page stays small
    import http.client
    c = http.client.HTTPConnection("127.0.0.1", server.port, timeout=20)
    c.request("GET", "/")
    csp = c.getresponse().getheader("Content-Security-Policy")
    c.close()
    assert csp and "default-src 'none'" in csp and "script-src 'self'" in csp and "unsafe-inline" not in csp


def test_page_classifier_bars(server, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    img = make_images(tmp_path)["img3.png"]  # 150x200 PNG
    expected = json.loads(run_artifact(baked_x86(), ["run", "--input", str(img)]).stdout)
    d = chrome()
    try:
        d.set_page_load_timeout(60)
        d.get(server.base + "/")
        wait_for(lambda: "tiny_cnn" in d.find_element(By.ID, "title").text)
        io = d.find_element(By.ID, "io").text
        assert "64x64" in io and "classifier" in io
        d.find_element(By.ID, "file").send_keys(str(img))
        shown = answer_shown(d)
        assert d.find_element(By.ID, "status").text == "HTTP 200"
        assert shown["top"] == expected["top"] and shown["top"][0]["label"] in LABELS
        # one labelled bar per class, in order, each as wide as its score
        items = d.find_elements(By.CSS_SELECTOR, "#top li")
        assert len(items) == 3
        for li, t in zip(items, expected["top"]):
            assert li.find_element(By.CLASS_NAME, "lab").text == t["label"]
            assert li.find_element(By.CLASS_NAME, "num").text == f"{t['score']:.3f}"
            track = li.find_element(By.CLASS_NAME, "track").size["width"]
            bar = li.find_element(By.CLASS_NAME, "bar").size["width"]
            assert track > 50 and abs(bar - t["score"] * track) <= 2, (bar, track, t)
        # the uploaded picture is on the canvas at its own size, with nothing drawn over it
        canvas = d.find_element(By.ID, "canvas")
        assert canvas.is_displayed() and canvas.get_attribute("data-boxes") == "0"
        assert d.execute_script("const c=arguments[0];return [c.width,c.height]", canvas) == [150, 200]
        assert not d.find_element(By.ID, "dets").is_displayed()
        assert d.find_element(By.ID, "raw").get_attribute("open") is None  # the JSON is there, folded away
        screenshot(d, tmp_path / "classifier.png")
        assert page_errors(d) == []
        # keyboard: Tab reaches the file picker, the text box and the button; Enter on the button sends
        from selenium.webdriver.common.action_chains import ActionChains
        d.execute_script("document.activeElement.blur()")
        seen = []
        for _ in range(3):
            ActionChains(d).send_keys(Keys.TAB).perform()
            seen.append(d.switch_to.active_element.get_attribute("id"))
        assert seen[:3] == ["file", "text", "send"], seen
        # a pasted bad JSON shows the server's 4xx error on the page, unfolded
        d.find_element(By.ID, "text").send_keys('{"image": [1, 2]}')
        d.find_element(By.ID, "send").send_keys(Keys.ENTER)
        wait_for(lambda: d.find_element(By.ID, "status").text == "HTTP 422")
        assert "error" in json.loads(d.find_element(By.ID, "result").text)
        assert d.find_elements(By.CSS_SELECTOR, "#top li") == [] and not canvas.is_displayed()
    finally:
        d.quit()
    assert server.alive()


def test_page_fits_a_phone(server, tmp_path):
    from selenium.webdriver.common.by import By
    img = make_images(tmp_path)["img1.png"]
    d = chrome()
    try:
        d.set_page_load_timeout(60)
        # a phone's viewport (headless windows have a minimum width, the emulated viewport has none)
        d.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                          {"width": 360, "height": 740, "deviceScaleFactor": 2, "mobile": True})
        d.get(server.base + "/")
        wait_for(lambda: "tiny_cnn" in d.find_element(By.ID, "title").text)
        d.find_element(By.ID, "file").send_keys(str(img))
        wait_for(lambda: d.find_elements(By.CSS_SELECTOR, "#top li"))
        # nothing wider than the screen: no sideways scrolling
        assert d.execute_script("return window.innerWidth") == 360
        assert d.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
        canvas = d.find_element(By.ID, "canvas")
        assert canvas.size["width"] <= d.execute_script("return window.innerWidth")
        screenshot(d, tmp_path / "phone.png")
        assert page_errors(d) == []
    finally:
        d.quit()


# ---- a detector: boxes drawn on the picture ----------------------------------------------------

HOSTILE = "<img src=x onerror=window.pwned=1>"
DET_LABELS = [HOSTILE, "dog", "bee"]
# anchors of the hand-made detector, in its 64x64 input: (cx, cy, w, h, class, score); the rest score 0.01
DET_ANCHORS = [(16, 16, 16, 12, 0, 0.9), (44, 40, 16, 24, 1, 0.8), (20, 48, 20, 10, 2, 0.7)]


def detector_model(d):
    """images [1,3,64,64] -> output0 [1, 4+3, 64] in YOLOv8's layout (cx, cy, w, h, class scores):
    a constant plus a tiny input-dependent term (a strided Conv), so it converts and runs like any model,
    and answers the same three well-separated boxes on every picture."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    n, c = 64, len(DET_LABELS)
    base = np.zeros((1, 4 + c, n), np.float32)
    base[0, :4, :] = np.array([32, 32, 4, 4], np.float32)[:, None]
    base[0, 4:, :] = 0.01
    for a, (cx, cy, w, h, k, s) in enumerate(DET_ANCHORS):
        base[0, :4, a] = (cx, cy, w, h)
        base[0, 4 + k, a] = s
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array((rng.standard_normal((4 + c, 3, 8, 8)) * 1e-6).astype(np.float32), "w"),
             numpy_helper.from_array(np.array([1, 4 + c, n], np.int64), "shape"),
             numpy_helper.from_array(base, "base")]
    nodes = [helper.make_node("Conv", ["images", "w"], ["conv"], strides=[8, 8]),
             helper.make_node("Reshape", ["conv", "shape"], ["flat"]),
             helper.make_node("Add", ["flat", "base"], ["output0"])]
    g = helper.make_graph(nodes, "tiny_det", [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 64, 64])],
                          [helper.make_tensor_value_info("output0", TensorProto.FLOAT, [1, 4 + c, n])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    d.mkdir(parents=True, exist_ok=True)
    onnx.save(m, d / "tiny_det.onnx")
    (d / "labels.txt").write_text("\n".join(DET_LABELS) + "\n")
    return d / "tiny_det.onnx"


@pytest.fixture(scope="module")
def detector(tmp_path_factory):
    from prepost_fixtures import TARGET, build
    model = detector_model(tmp_path_factory.mktemp("tiny_det"))
    art = build(model, TARGET, "--backend", "ncnn", "--fp32",
                "--preprocess", "image:size=64x64,layout=nchw,dtype=float32",
                "--postprocess", f"detect:format=yolov8,conf=0.25,labels={model.parent / 'labels.txt'}")[TARGET]
    s = Server(art)
    yield s
    s.close()


def scene_jpeg(p):
    """A 640x480 JPEG: smooth gradients (no colour of the box palette at the box edges)."""
    import numpy as np
    from PIL import Image
    yy, xx = np.mgrid[0:480, 0:640].astype(np.float32)
    img = np.stack([96 + 60 * np.sin(xx / 40), 120 + 50 * np.cos(yy / 30), 110 + 40 * np.sin((xx + yy) / 50)], -1)
    Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(p, quality=90)
    return p


def test_page_detector_draws_boxes(detector, tmp_path):
    from selenium.webdriver.common.by import By
    img = scene_jpeg(tmp_path / "scene.jpg")
    status, ans = detector.json("POST", "/predict", img.read_bytes(), "image/jpeg")
    assert status == 200, ans
    dets = ans["detections"]
    assert [x["label"] for x in dets] == DET_LABELS and all(x["score"] > 0.5 for x in dets)
    # in the original picture's pixels: 640/64 = 10 across, 480/64 = 7.5 down
    for x, (cx, cy, w, h, _, _) in zip(dets, DET_ANCHORS):
        want = [(cx - w / 2) * 10, (cy - h / 2) * 7.5, (cx + w / 2) * 10, (cy + h / 2) * 7.5]
        assert max(abs(a - b) for a, b in zip(x["box"], want)) < 1.0, (x, want)
    d = chrome()
    try:
        d.set_page_load_timeout(60)
        d.get(detector.base + "/")
        wait_for(lambda: "tiny_det" in d.find_element(By.ID, "title").text)
        assert "detector" in d.find_element(By.ID, "io").text
        d.find_element(By.ID, "file").send_keys(str(img))
        canvas = d.find_element(By.ID, "canvas")
        assert wait_for(lambda: canvas.get_attribute("data-boxes")) == "3"
        assert answer_shown(d)["detections"] == dets
        assert d.execute_script("const c=arguments[0];return [c.width,c.height]", canvas) == [640, 480]
        rows = d.find_elements(By.CSS_SELECTOR, "#dbody tr")
        assert len(rows) == 3 and "3 detections" in d.find_element(By.ID, "dcap").text
        for row, x in zip(rows, dets):
            cells = row.find_elements(By.TAG_NAME, "td")
            assert cells[1].text == x["label"] and cells[2].text == f"{x['score']:.3f}"
            assert cells[3].text == ", ".join(str(math.floor(v + 0.5)) for v in x["box"])  # JS toFixed(0)
            colour = row.get_attribute("data-colour")
            rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
            x1, y1, x2, y2 = x["box"]
            xm, ym = round((x1 + x2) / 2), round((y1 + y2) / 2)
            # each edge of the box, at its middle, is the class colour; the middle of the box is the picture
            for px, py in ((round(x1), ym), (round(x2), ym), (xm, round(y1)), (xm, round(y2)), (xm, ym)):
                got = d.execute_script("return Array.from(arguments[0].getContext('2d')"
                                       ".getImageData(arguments[1], arguments[2], 1, 1).data.slice(0, 3))",
                                       canvas, px, py)
                same = max(abs(a - b) for a, b in zip(got, rgb)) <= 3
                assert same == ((px, py) != (xm, ym)), (x["label"], (px, py), got, colour)
        assert len({r.get_attribute("data-colour") for r in rows}) == 3  # a colour per class
        # the hostile label is text everywhere: in the table, in the canvas's description, never markup
        assert rows[0].find_elements(By.TAG_NAME, "td")[1].text == HOSTILE
        assert HOSTILE in canvas.get_attribute("aria-label")
        assert d.execute_script("return [document.images.length, window.pwned === undefined]") == [0, True]
        screenshot(d, tmp_path / "detector.png")
        assert page_errors(d) == []
        # a phone photo stored sideways with an EXIF rotation: the artifact ignores EXIF, so the page
        # draws the picture as stored (640x480), where the boxes are, not rotated to 480x640
        from PIL import Image
        rotated = tmp_path / "rotated.jpg"
        with Image.open(img) as im:
            exif = Image.Exif()
            exif[0x0112] = 6  # Orientation: rotate 90 CW to display
            im.save(rotated, quality=90, exif=exif)
        d.find_element(By.ID, "file").send_keys(str(rotated))
        assert wait_for(lambda: canvas.get_attribute("data-boxes")) == "3"
        assert d.execute_script("const c=arguments[0];return [c.width,c.height]", canvas) == [640, 480]
        assert answer_shown(d)["detections"] == dets
    finally:
        d.quit()
    assert detector.alive()
