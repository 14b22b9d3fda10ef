"""Pinned source archives fetched through the package index pip is configured to use.

``pip download --no-binary`` cannot fetch the ncnn sdist (its setup.py stamps today's date as the
version), so edgepack asks the index's JSON simple API for the file and checks its sha256. No host
name is written here: the index comes from pip's own configuration or pip's default.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .cache import cache_root, lock_file, locked, sha256_file
from .errors import BuildError


@dataclass(frozen=True)
class PinnedSource:
    project: str
    filename: str
    sha256: str
    size: int


NCNN_SDIST = PinnedSource("ncnn", "ncnn-1.0.20261020.tar.gz",
                          "ad8cdd63e9755cfa8e23b9b6d9ce46156077d80298a89e7c3ba325ffccfca200", 5485264)


def index_url() -> str:
    for var in ("EDGEPACK_INDEX_URL", "PIP_INDEX_URL"):
        if os.environ.get(var):
            return os.environ[var]
    if getattr(sys, "frozen", False):
        # A frozen edgepack has no pip: read pip's configuration files the way pip does.
        found = _pip_config_index_url()
        if found:
            return found
        raise BuildError("no package index configured to download the ncnn source from",
                         hint="set EDGEPACK_INDEX_URL (or PIP_INDEX_URL) to your index's simple URL, or "
                              f"EDGEPACK_NCNN_SDIST=/path/to/{NCNN_SDIST.filename}")
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.strip().endswith("index-url") and not key.strip().endswith("extra-index-url"):
            return value.strip().strip("'\"")
    from pip._internal.models.index import PyPI  # pip's own default, never a literal host here
    return PyPI.simple_url


def _pip_config_index_url() -> str | None:
    """``index-url`` from pip's config files (site, user, PIP_CONFIG_FILE; later ones win)."""
    import configparser
    home = Path.home()
    xdg = os.environ.get("XDG_CONFIG_HOME") or str(home / ".config")
    files = [Path("/etc/pip.conf")]
    files += [Path(d) / "pip" / "pip.conf" for d in os.environ.get("XDG_CONFIG_DIRS", "/etc/xdg").split(":") if d]
    files += [home / ".pip" / "pip.conf", Path(xdg) / "pip" / "pip.conf"]
    if os.environ.get("PIP_CONFIG_FILE"):
        files.append(Path(os.environ["PIP_CONFIG_FILE"]))
    found = None
    for f in files:
        cp = configparser.RawConfigParser()
        try:
            cp.read(f)
        except (OSError, configparser.Error):
            continue
        for section in ("global", "download", "install"):
            if cp.has_option(section, "index-url"):
                found = cp.get(section, "index-url").strip().strip("'\"")
    return found


def fetch(src: PinnedSource) -> Path:
    """The archive in the cache, downloading it once and verifying its sha256."""
    dest = cache_root() / "src" / src.filename
    override = os.environ.get(f"EDGEPACK_{src.project.upper().replace('-', '_')}_SDIST")
    if override:
        dest = Path(override)
    with locked(lock_file("source", src.filename)):
        if dest.is_file() and sha256_file(dest) == src.sha256:
            return dest
        if override:
            raise BuildError(f"{dest}: sha256 does not match the pinned {src.filename}")
        base = index_url().rstrip("/")
        listing_url = f"{base}/{src.project}/"
        req = urllib.request.Request(listing_url, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                listing = json.load(resp)
            entry = next((f for f in listing.get("files", []) if f.get("filename") == src.filename), None)
            if entry is None:
                raise BuildError(f"{src.filename} is not listed by the package index ({listing_url})")
            url = urllib.parse.urljoin(listing_url, entry["url"])
            with urllib.request.urlopen(url, timeout=600) as resp:
                data = resp.read()
        except OSError as exc:
            raise BuildError(f"cannot download {src.filename} from the package index: {exc}",
                             hint=f"download it by hand and set EDGEPACK_{src.project.upper()}_SDIST=/path/to/"
                                  f"{src.filename}") from exc
        import hashlib
        digest = hashlib.sha256(data).hexdigest()
        if digest != src.sha256:
            raise BuildError(f"{src.filename}: sha256 {digest} does not match the pinned {src.sha256}")
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_suffix(".part")
        tmp.write_bytes(data)
        tmp.replace(dest)
        return dest
