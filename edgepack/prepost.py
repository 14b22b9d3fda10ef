"""Pre/post-processing baked into the ONNX graph (issue: models that take raw data and answer).

Placeholder hooks until the graph surgery lands: a model without a pre/post config passes through.
"""
from __future__ import annotations

from pathlib import Path

from .errors import UsageError
from .model import LoadedModel


def prepost_config_exists(model_path: Path) -> bool:
    return False


def bake_prepost(model: LoadedModel, model_path: Path, preprocess: str | None, postprocess: str | None) -> LoadedModel:
    raise UsageError("--preprocess/--postprocess are not available yet")
