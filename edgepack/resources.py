"""Where the data folders (targets/, toolchains/, runtimes/) live.

They sit at the repository root and are mapped into the wheel as ``edgepack._targets`` etc.,
so a plain ``pip install .`` carries them; running from a checkout finds them next to the package.
"""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path

_REPO = Path(__file__).resolve().parent.parent


def _dir(package: str, folder: str) -> Path:
    local = _REPO / folder
    if (local / "__init__.py").is_file() and (_REPO / "pyproject.toml").is_file():
        return local
    return Path(str(files(package)))


def targets_dir() -> Path:
    return _dir("edgepack._targets", "targets")


def toolchains_dir() -> Path:
    return _dir("edgepack._toolchains", "toolchains")


def runtimes_dir() -> Path:
    return _dir("edgepack._runtimes", "runtimes")
