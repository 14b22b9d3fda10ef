"""Where the data folders (targets/, toolchains/, runtimes/) live once installed.

They sit at the repository root and are mapped into the wheel as ``edgepack._targets`` etc.,
so a plain ``pip install .`` carries them.
"""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path


def _dir(package: str) -> Path:
    return Path(str(files(package)))


def targets_dir() -> Path:
    return _dir("edgepack._targets")


def toolchains_dir() -> Path:
    return _dir("edgepack._toolchains")


def runtimes_dir() -> Path:
    return _dir("edgepack._runtimes")
