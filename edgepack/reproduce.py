"""`edgepack verify-build`: rebuild an artifact from its manifest and compare the bytes."""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .cache import sha256_file
from .errors import ArtifactError, ModelError, TargetError
from .runner import Artifact
from .thread_policy import recorded_option


@dataclass(frozen=True)
class Rebuild:
    artifact: Path
    original_sha256: str
    rebuilt_sha256: str
    rebuilt_path: Path | None  # kept only when the bytes differ, for a diff; None when identical

    @property
    def identical(self) -> bool:
        return self.original_sha256 == self.rebuilt_sha256


def read_manifest(artifact: Path) -> dict:
    """The sidecar dist/<name>.json when present, else the artifact's own `info`."""
    artifact = Path(artifact)
    if not artifact.is_file():
        raise ArtifactError(f"{artifact}: no such file")
    sidecar = artifact.with_name(artifact.name + ".json")
    if sidecar.is_file():
        return json.loads(sidecar.read_text())
    return Artifact(artifact).manifest()


def _tuning_db(manifest: dict, given: Path | None) -> str | None:
    """The tuning database to rebuild with: the one given, else the one the build used; refused
    when its content is not what the artifact was built with (a database accumulates)."""
    b, backend = manifest["build"], manifest.get("backend") or {}
    want = backend.get("tuning_db_sha256")
    choice = str(given) if given else b.get("tuning_db")
    if not want:  # built untuned (or before hashes were recorded): rebuild the same way
        return choice
    from .backends.tvm.tuning import database_sha256, default_db_dir, is_database
    from .targets import TargetMatrix
    path = Path(choice) if choice and choice != "off" else default_db_dir(TargetMatrix.load().get(manifest["target"]["name"]))
    if not is_database(path) or database_sha256(path) != want:
        raise ArtifactError(f"the TVM tuning database the artifact was built with (sha256 {want[:16]}…) "
                            f"is not at {path} any more",
                            hint="pass the database it was built with: edgepack verify-build ARTIFACT MODEL "
                                 "--tuning-db PATH (a target's database grows with every `edgepack tune`)")
    return str(path)


def _carried_plan(artifact: Path, manifest: dict) -> bytes:
    """The arena plan the artifact carries (b"": none), pinned: another machine records other requests."""
    from .backends.ncnn.arena_plan import carried_plan
    try:
        return carried_plan(artifact.read_bytes(), manifest)
    except ValueError as exc:
        raise ArtifactError(f"{artifact}: {exc}", hint="rebuild it; its bytes and manifest disagree") from exc


def verify_build(artifact: Path, model: Path, clean_cache: bool = False, log=print,
                 tuning_db: Path | None = None) -> Rebuild:
    from .model import parse_shape_args
    from .pipeline import BuildOptions, build
    from .targets import TargetMatrix

    manifest = read_manifest(artifact)
    if "build" not in manifest:
        raise ArtifactError(f"{artifact}: its manifest predates reproducible builds (no 'build' section)")
    want_sha = manifest["model"]["sha256"]
    if sha256_file(model) != want_sha:
        raise ModelError(f"{model} is not the model {artifact.name} was built from (sha256 differs)",
                         hint=f"the artifact was built from {manifest['model']['file']} with sha256 {want_sha[:16]}…")
    b = manifest["build"]
    target = TargetMatrix.load().get(manifest["target"]["name"])
    if b.get("target_file_sha256") and sha256_file(Path(target.source)) != b["target_file_sha256"]:
        raise TargetError(f"target file {target.source} changed since {artifact.name} was built",
                          hint="rebuild with the target file the artifact was made with")
    tuning = _tuning_db(manifest, tuning_db)
    shapes = parse_shape_args([f"{k}={'x'.join(str(d) for d in v)}" for k, v in b.get("input_shapes", {}).items()])
    with tempfile.TemporaryDirectory(prefix="edgepack-rebuild-") as tmp:
        old_cache = os.environ.get("EDGEPACK_CACHE")
        if clean_cache:
            os.environ["EDGEPACK_CACHE"] = str(Path(tmp) / "cache")
        try:
            opts = BuildOptions(backend=b["backend"], precision=b["precision"], input_shapes=shapes,
                                out_dir=Path(tmp) / "dist", verify=False, simplify=b.get("simplify", True),
                                preprocess=b.get("preprocess"), postprocess=b.get("postprocess"), tuning_db=tuning,
                                memory=b.get("memory", "fast"), verify_on=tuple(b.get("verify_on") or ()),
                                default_threads=recorded_option(manifest),
                                arena_plan=_carried_plan(artifact, manifest))
            results = build(model, [target], opts, log=log)
        finally:
            if clean_cache:
                if old_cache is None:
                    os.environ.pop("EDGEPACK_CACHE", None)
                else:
                    os.environ["EDGEPACK_CACHE"] = old_cache
        res = results[0]
        if not res.ok:
            raise ArtifactError(f"rebuilding {artifact.name} failed: {res.error}")
        original, rebuilt = sha256_file(artifact), sha256_file(res.path)
        if original == rebuilt:  # nothing to look at: the rebuild goes with the temporary folder
            return Rebuild(Path(artifact), original, rebuilt, None)
        keep = Path(tempfile.mkdtemp(prefix="edgepack-rebuilt-")) / res.path.name
        res.path.replace(keep)
        return Rebuild(Path(artifact), original, rebuilt, keep)
