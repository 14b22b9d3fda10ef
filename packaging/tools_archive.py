"""The frozen edgepack's tools archive: zig (the ``ziglang`` package: executable + lib/, ~410 MB)
and the ``pnnx`` executable (~88 MB) as one deterministic tar.gz.

A one-file PyInstaller binary re-extracts everything it bundles into a temporary folder at *every*
start. Bundled as plain files, these two would cost ~500 MB of decompression and writes per run;
as one pre-compressed archive they cost one copy of the compressed bytes, and edgepack unpacks the
archive once per cache into ``<cache>/tools/<sha256[:16]>/`` (edgepack/toolchains.py,
``frozen_tool_dir``). The archive is byte-for-byte reproducible (sorted entries, fixed mtimes,
owners and gzip header), so a re-freeze with the same package versions reuses the unpacked copy.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import tarfile
from pathlib import Path

FORMAT = 1
MTIME = 1700000000


def package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"freeze: Python package {name!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def members(pkg: str) -> list[tuple[str, Path]]:
    """(name in the archive, file) for what edgepack runs from each package."""
    root = package_dir(pkg)
    if pkg == "ziglang":
        files = [root / "zig", root / "LICENSE"] + sorted(p for p in (root / "lib").rglob("*") if p.is_file())
    elif pkg == "pnnx":
        files = [root / "pnnx"]
    else:
        raise ValueError(pkg)
    for f in files:
        if not f.is_file():
            raise SystemExit(f"freeze: {f} is missing (reinstall {pkg})")
    return [(f"{pkg}/{f.relative_to(root).as_posix()}", f) for f in files]


def build(out_dir: Path, packages=("ziglang", "pnnx"), log=print) -> tuple[Path, Path]:
    """Write ``tools.tar.gz`` and ``tools.json`` into ``out_dir`` (reused when the versions match)."""
    versions = {p: importlib.metadata.version(p) for p in packages}
    out_dir.mkdir(parents=True, exist_ok=True)
    archive, info_path = out_dir / "tools.tar.gz", out_dir / "tools.json"
    if info_path.is_file() and archive.is_file():
        info = json.loads(info_path.read_text())
        if info.get("packages") == versions and info.get("format") == FORMAT:
            log(f"freeze: reusing {archive} ({archive.stat().st_size / 1e6:.0f} MB)")
            return archive, info_path
    log(f"freeze: packing {', '.join(f'{k} {v}' for k, v in versions.items())} into {archive} (about a minute)")
    tmp = archive.with_suffix(".part")
    with open(tmp, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=6, mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        dirs = set()
        for pkg in packages:
            for name, path in members(pkg):
                parts = name.split("/")
                for i in range(1, len(parts)):
                    d = "/".join(parts[:i])
                    if d not in dirs:
                        dirs.add(d)
                        ti = tarfile.TarInfo(d)
                        ti.type, ti.mode, ti.mtime = tarfile.DIRTYPE, 0o755, MTIME
                        tar.addfile(ti)
                ti = tarfile.TarInfo(name)
                ti.size = path.stat().st_size
                ti.mode = 0o755 if path.stat().st_mode & 0o100 else 0o644
                ti.mtime = MTIME
                with open(path, "rb") as f:
                    tar.addfile(ti, f)
    tmp.replace(archive)
    h = hashlib.sha256()
    with open(archive, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    info_path.write_text(json.dumps({"format": FORMAT, "sha256": h.hexdigest(), "packages": versions}, indent=1) + "\n")
    return archive, info_path
