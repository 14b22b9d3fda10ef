"""Backends behind one small interface, in a registry keyed by name.

A backend turns a prepared (static-shape) ONNX model into what the bundle stage links: engine
sources implementing ``runtimes/common/ep_runtime.h``'s ep_engine_*, libraries, and the model
blobs to embed. Adding a backend = one module that calls ``register``.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

from ..errors import UsageError
from ..model import LoadedModel
from ..reference import Tolerance
from ..targets import Target
from ..toolchains import Toolchain


@dataclass(frozen=True)
class CompileRequest:
    model: LoadedModel          # static shapes, simplified
    target: Target
    precision: str              # "fp16" or "fp32"
    workdir: Path
    toolchain: Toolchain
    log: Callable[[str], None] = print
    tuning_db: str | None = None  # TVM: None the target's database (if any), "off", or a database folder
    items: int = 1                # >1: `model` is one item of a batch of that many, run once per item (batch_items.py)


@dataclass(frozen=True)
class EngineBuild:
    """A backend's contribution to one artifact."""
    backend: str
    sources: tuple[Path, ...]
    include_dirs: tuple[Path, ...]
    link_inputs: tuple[Path, ...]      # objects and archives, in link order
    model_blobs: tuple[Path, ...]
    options: dict = field(default_factory=dict)
    tolerance: Tolerance = Tolerance(1e-4, 1e-3)
    manifest: dict = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    weight_bytes: int = 0              # bytes of weights inside the artifact (for runtime-size reports)
    link_flags: tuple[str, ...] = ()   # e.g. ("-Wl,--whole-archive", ...) placed around link_inputs
    segments: tuple = ()               # bundle.BundleSegment per segment of a partitioned build (partition_build)
    body: object = None                # a loop segment's bundle.LoopBody (edgepack/loops.py)
    parts: tuple = ()                  # builds linked with this one (a loop segment's body)


class Backend(Protocol):
    name: str
    # False (the default when absent): the pipeline never runs two compiles of it at once
    thread_safe: bool

    def unsupported_ops(self, model: LoadedModel) -> dict[str, list[str]]:
        """op type -> node names this backend cannot build."""

    def missing_tools(self) -> list[str]:
        """Human-readable list of what is not installed (empty when ready)."""

    def compile(self, req: CompileRequest) -> EngineBuild:
        ...


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    _REGISTRY[backend.name] = backend
    return backend


def get_backend(name: str) -> Backend:
    _load_builtin()
    if name == "ncnn+tvm":  # not registered: `auto` offers it when NCNN cannot take the whole graph
        from ..partition_build import SPLIT_BACKEND
        return SPLIT_BACKEND
    if name not in _REGISTRY:
        raise UsageError(f"unknown backend {name!r}", hint=f"available: {', '.join(sorted(_REGISTRY))}, auto")
    return _REGISTRY[name]


def all_backends() -> dict[str, Backend]:
    _load_builtin()
    return dict(_REGISTRY)


_LOADED = False
_LOAD_LOCK = threading.RLock()  # targets build in threads: none may see a half-filled registry


def _load_builtin() -> None:
    # not "if _REGISTRY": importing edgepack.backends.ncnn.<module> first registers NCNN alone,
    # and TVM would then never load in that process
    global _LOADED
    if _LOADED:
        return
    with _LOAD_LOCK:
        if not _LOADED:
            _import_builtin()
            _LOADED = True


def _import_builtin() -> None:
    from . import ncnn  # noqa: F401  (registers itself)
    try:
        from . import tvm  # noqa: F401
    except ImportError:
        pass
