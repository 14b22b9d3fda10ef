"""`edgepack doctor`: each tool found or missing, with the command that installs it."""
from __future__ import annotations

import importlib.metadata
import shutil
from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


def _py(pkg: str, pin: str | None, fix: str) -> Check:
    try:
        v = importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return Check(pkg, False, fix)
    if pin and v != pin:
        return Check(pkg, False, f"{v} installed, edgepack pins {pin}: {fix}")
    return Check(pkg, True, v)


def _exe(name: str, fix: str) -> Check:
    path = shutil.which(name)
    return Check(name, path is not None, path or fix)


def checks() -> list[Check]:
    from .toolchains import Toolchain
    tc = Toolchain.load()
    out = [
        _py(tc.package, tc.version, f"pip install {tc.package}=={tc.version}"),
        _py("onnx", None, "pip install onnx"),
        _py("onnxruntime", None, "pip install onnxruntime"),
        _py("onnxsim", None, "pip install onnxsim"),
        _py("ncnn", None, "pip install ncnn"),
        _py("pnnx", None, "pip install --no-deps pnnx"),
        _exe("cmake", "apt-get install cmake"),
        _exe("ninja", "apt-get install ninja-build"),
        _exe("qemu-aarch64", "apt-get install qemu-user (runs Arm artifacts for verification)"),
    ]
    try:
        out.append(Check("llvm-strip", True, tc.strip_tool()))
    except Exception:
        out.append(Check("llvm-strip", False, "apt-get install llvm"))
    from .backends import all_backends
    for name, backend in sorted(all_backends().items()):
        missing = backend.missing_tools()
        out.append(Check(f"backend {name}", not missing, "; ".join(missing) or "ready"))
    return out
