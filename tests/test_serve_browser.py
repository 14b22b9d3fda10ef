"""Headless Chromium (Debian's chromium + chromium-driver, driven by selenium) opens the try-it page,
uploads an image and reads the JSON the page shows: no code needed to try a model."""
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
              "--no-first-run", "--disable-extensions", "--disable-background-networking"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(driver), options=opts)


def wait_for(fn, timeout=60.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        v = fn()
        if v:
            return v
        time.sleep(0.2)
    raise AssertionError("timed out waiting for the page")


def test_page_upload_image_shows_json(server, tmp_path):
    from selenium.webdriver.common.by import By
    img = make_images(tmp_path)["img3.png"]
    expected = json.loads(run_artifact(baked_x86(), ["run", "--input", str(img)]).stdout)
    d = chrome()
    try:
        d.set_page_load_timeout(60)
        d.get(server.base + "/")
        wait_for(lambda: "tiny_cnn" in d.find_element(By.ID, "title").text)
        assert "64x64" in d.find_element(By.ID, "io").text
        d.find_element(By.ID, "file").send_keys(str(img))
        text = wait_for(lambda: d.find_element(By.ID, "result").text.strip())
        shown = json.loads(text)
        assert d.find_element(By.ID, "status").text == "HTTP 200"
        assert shown["top"] == expected["top"]
        assert shown["top"][0]["label"] in LABELS
        items = d.find_elements(By.CSS_SELECTOR, "#top li")
        assert len(items) == 3 and items[0].text.startswith(expected["top"][0]["label"])
        # a pasted bad JSON shows the server's 4xx error on the page
        d.find_element(By.ID, "text").send_keys('{"image": [1, 2]}')
        d.find_element(By.ID, "send").click()
        wait_for(lambda: d.find_element(By.ID, "status").text == "HTTP 422")
        assert "error" in json.loads(d.find_element(By.ID, "result").text)
    finally:
        d.quit()
    assert server.alive()
