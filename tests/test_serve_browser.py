"""Headless Chromium (Debian's chromium + chromium-driver, driven by selenium) opens the try-it page,
uploads an image and checks, from the page itself, what it drew: a classifier's top-k as labelled bars,
a detector's boxes on a canvas (pixel colours at the box edges) and its table, JSON for the rest. The
page runs under the server's Content-Security-Policy, so a blocked script or style would show here."""
from __future__ import annotations

import json
import shutil
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
    return webdriver.Chrome(service=Service(driver), options=opts)


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
