"""edgepack push: the per-target artifacts of one model -> one OCI image index under one tag."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ..cache import sha256_file
from ..deploy.artifact import ArtifactInfo, inspect_artifact
from ..errors import ArtifactError, IntegrityError, UsageError
from . import layout
from .client import INDEX, MANIFEST, RegistryClient, Stats
from .ref import Platform, parse_reference, platform_for_arch


@dataclass
class PushedEntry:
    target: str
    platform: Platform
    digest: str
    files: dict[str, str]          # name -> sha256


@dataclass
class PushResult:
    reference: str
    digest: str                    # the index's digest: pin it with REF@DIGEST
    model: str
    entries: list[PushedEntry] = field(default_factory=list)
    stats: Stats = field(default_factory=Stats)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"reference": self.reference, "digest": self.digest, "model": self.model, "seconds": self.seconds,
                "uploaded_blobs": self.stats.uploaded, "uploaded_bytes": self.stats.uploaded_bytes,
                "already_present": self.stats.skipped,
                "entries": [{"target": e.target, "platform": str(e.platform), "digest": e.digest, "files": e.files}
                            for e in self.entries]}


def _is_artifact(p: Path) -> bool:
    if not p.is_file() or p.suffix == ".json" or p.name == "SHA256SUMS":
        return False
    with p.open("rb") as fh:
        return fh.read(4) == b"\x7fELF"


def collect(paths: list[Path]) -> list[ArtifactInfo]:
    """Artifacts named directly, or every artifact in a named folder (dist/); all of one model, one per target."""
    found: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            inside = sorted(f for f in p.iterdir() if _is_artifact(f))
            if not inside:
                raise ArtifactError(f"{p} holds no edgepack artifact", hint="build one: edgepack build MODEL -t TARGET")
            found += inside
        else:
            found.append(p)
    arts = [inspect_artifact(p) for p in dict.fromkeys(found)]
    models = sorted({a.model for a in arts})
    if len(models) > 1:
        raise UsageError(f"these artifacts are of {len(models)} models ({', '.join(models)}); one tag holds one model",
                         hint="push each model's artifacts to its own tag (name the files instead of the folder)")
    seen: dict[str, Path] = {}
    for a in arts:
        if a.target in seen:
            raise UsageError(f"two artifacts for target {a.target}: {seen[a.target]} and {a.path}",
                             hint="push one build per target")
        seen[a.target] = a.path
    return arts


def _check_build_sums(art: ArtifactInfo, files: list[tuple[Path, str]]) -> None:
    """When the build folder has a SHA256SUMS (CI collects one), what we push must match it."""
    sums = art.path.parent / "SHA256SUMS"
    if not sums.is_file():
        return
    listed = {}
    for line in sums.read_text(errors="replace").splitlines():
        parts = line.split()
        if len(parts) == 2:
            listed[parts[1].lstrip("*")] = parts[0]
    for path, sha in files:
        if path.name in listed and listed[path.name] != sha:
            raise IntegrityError(f"{path} does not match its line in {sums} (sha256 {sha[:16]} vs "
                                 f"{listed[path.name][:16]})", hint="rebuild, or regenerate SHA256SUMS")


def _push_entry(client: RegistryClient, art: ArtifactInfo) -> tuple[PushedEntry, dict]:
    files = [(art.path, art.sha256)]
    sidecar = Path(str(art.path) + ".json")
    if sidecar.is_file():
        files.append((sidecar, sha256_file(sidecar)))
    _check_build_sums(art, files)
    platform = platform_for_arch(art.arch)
    sums = layout.sums_text([(p.name, sha) for p, sha in files])
    layers = []
    for path, _sha in files:
        media = layout.EXECUTABLE if path == art.path else layout.SIDECAR
        desc = client.put_blob(path, None, media)
        layers.append({**desc, "annotations": {layout.TITLE: path.name}})
    layers.append({**client.put_blob(None, sums, layout.SUMS), "annotations": {layout.TITLE: "SHA256SUMS"}})
    config = {"edgepack": 1, "model": art.model, "target": art.target, "arch": art.arch,
              "platform": platform.to_json(),
              "files": [{"name": p.name, "sha256": sha, "size": p.stat().st_size,
                         "mode": "0755" if p == art.path else "0644"} for p, sha in files]}
    cdesc = client.put_blob(None, layout.dumps(config), layout.CONFIG)
    body = layout.manifest_json(cdesc, layers, {layout.A_MODEL: art.model, layout.A_TARGET: art.target,
                                                layout.A_ARCH: art.arch})
    digest = client.put_manifest(body, MANIFEST)
    return PushedEntry(art.target, platform, digest, {p.name: sha for p, sha in files}), \
        {"mediaType": MANIFEST, "digest": digest, "size": len(body)}


def push(paths: list[Path], reference: str, *, insecure: bool = False, log=None) -> PushResult:
    t0 = time.monotonic()
    ref = parse_reference(reference, need_tag=True)
    arts = sorted(collect(paths), key=lambda a: a.target)
    client = RegistryClient(ref, insecure=insecure)
    pushed = []
    for art in arts:
        entry, desc = _push_entry(client, art)
        if log:
            log(f"{art.target}: {entry.platform} {entry.digest[:19]}")
        pushed.append((entry, desc))
    index = layout.index_json([(d, e.platform, e.target, arts[0].model) for e, d in pushed], arts[0].model)
    digest = client.put_manifest(index, INDEX, ref.tag)
    return PushResult(str(ref), digest, arts[0].model, [e for e, _ in pushed], client.stats,
                      time.monotonic() - t0)
