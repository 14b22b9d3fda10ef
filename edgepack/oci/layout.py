"""How an edgepack build looks in a registry: one OCI image index per model and tag, one OCI artifact
manifest per target (its platform in the index), our own media types, and exact, deterministic JSON
bytes (the same build always gives the same digests, so a second push uploads nothing).

    index   application/vnd.oci.image.index.v1+json   artifactType application/vnd.edgepack.artifact.v1
      manifests[i]: platform {os, architecture, variant}, annotations org.edgepack.target / .model
    manifest application/vnd.oci.image.manifest.v1+json  artifactType application/vnd.edgepack.artifact.v1
      config  application/vnd.edgepack.artifact.config.v1+json  {model, target, arch, platform, files}
      layers  the executable (.executable), its manifest JSON (.manifest+json), SHA256SUMS (.sha256sums),
              each with org.opencontainers.image.title = its file name (so `oras pull` names them too)
"""
from __future__ import annotations

import json
import re

from ..errors import PlatformNotFound, RegistryError
from .client import INDEX, MANIFEST
from .ref import Platform

ARTIFACT_TYPE = "application/vnd.edgepack.artifact.v1"
CONFIG = "application/vnd.edgepack.artifact.config.v1+json"
EXECUTABLE = "application/vnd.edgepack.artifact.v1.executable"
SIDECAR = "application/vnd.edgepack.artifact.v1.manifest+json"
SUMS = "application/vnd.edgepack.artifact.v1.sha256sums"
TITLE = "org.opencontainers.image.title"
A_TARGET, A_MODEL, A_ARCH = "org.edgepack.target", "org.edgepack.model", "org.edgepack.arch"

GENERIC_TARGETS = {"x86_64", "arm64"}   # the plain target of an arch: picked when only a platform is asked
MAX_ENTRIES, MAX_LAYERS = 256, 16
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]{0,254}$")  # a plain file name: no '/', no '..', no dotfile


def dumps(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=True).encode()


def safe_name(name, where: str) -> str:
    """File names come from the registry: only plain names may be written (no path, no dotfile)."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in ("SHA256SUMS.tmp",):
        raise RegistryError(f"{where}: refusing file name {name!r} (not a plain file name)",
                            hint="this entry was not pushed by edgepack, or it was tampered with")
    return name


def sums_text(files: list[tuple[str, str]]) -> bytes:
    """`sha256sum` format, sorted by name: `sha256sum -c SHA256SUMS` checks a pulled folder."""
    return "".join(f"{sha}  {name}\n" for name, sha in sorted(files)).encode()


def parse_json(body: bytes, what: str) -> dict:
    try:
        obj = json.loads(body)
    except ValueError:
        raise RegistryError(f"{what} is not JSON") from None
    if not isinstance(obj, dict):
        raise RegistryError(f"{what} is not a JSON object")
    return obj


def _descriptor(d, where: str) -> dict:
    if not isinstance(d, dict) or not isinstance(d.get("digest"), str) or \
            not re.fullmatch(r"sha256:[0-9a-f]{64}", d["digest"]) or not isinstance(d.get("size"), int) \
            or d["size"] < 0:
        raise RegistryError(f"{where}: malformed descriptor (needs a sha256 digest and a size)")
    return d


def entries(index: dict, where: str) -> list[dict]:
    ms = index.get("manifests")
    if not isinstance(ms, list) or not ms:
        raise RegistryError(f"{where}: the index lists no manifests")
    if len(ms) > MAX_ENTRIES:
        raise RegistryError(f"{where}: the index lists {len(ms)} manifests (at most {MAX_ENTRIES})")
    return [_descriptor(m, where) for m in ms]


def entry_platform(entry: dict) -> Platform | None:
    p = entry.get("platform")
    if not isinstance(p, dict) or not isinstance(p.get("os"), str) or not isinstance(p.get("architecture"), str):
        return None
    v = p.get("variant")
    return Platform(p["os"], p["architecture"], v if isinstance(v, str) else None)


def entry_target(entry: dict) -> str | None:
    a = entry.get("annotations")
    t = a.get(A_TARGET) if isinstance(a, dict) else None
    return t if isinstance(t, str) else None


def describe(entry: dict) -> str:
    p, t = entry_platform(entry), entry_target(entry)
    return f"{p or 'no platform'}" + (f" ({t})" if t else "")


def choose(ms: list[dict], where: str, platform: Platform | None, target: str | None) -> dict:
    """The entry for ``target`` (by annotation), else for ``platform``; among several of one platform
    (arm64, jetson-orin, android-arm64 are all linux/arm64/v8) the generic target wins."""
    have = ", ".join(describe(m) for m in ms)
    if target:
        hits = [m for m in ms if entry_target(m) == target]
        if platform:
            hits = [m for m in hits if (entry_platform(m) and entry_platform(m).matches(platform))]
        if not hits:
            raise PlatformNotFound(f"{where} has no entry for target {target}"
                                   + (f" on {platform}" if platform else "") + f"; it has: {have}",
                                   hint="push a build for that target, or pick one of those")
        return hits[0]
    hits = [m for m in ms if entry_platform(m) and entry_platform(m).matches(platform)]
    if not hits:
        raise PlatformNotFound(f"{where} has no entry for platform {platform}; it has: {have}",
                               hint="build and push that architecture, or pass --platform/--target for one listed")
    if len(hits) > 1:
        generic = [m for m in hits if entry_target(m) in GENERIC_TARGETS]
        if len(generic) != 1:
            raise PlatformNotFound(f"{where} has several entries for {platform}: "
                                   + ", ".join(describe(m) for m in hits), hint="pick one with --target NAME")
        return generic[0]
    return hits[0]


def index_json(manifests: list[tuple[dict, Platform, str, str]], model: str) -> bytes:
    """manifests: (descriptor, platform, target, model) per entry, already uploaded."""
    return dumps({"schemaVersion": 2, "mediaType": INDEX, "artifactType": ARTIFACT_TYPE,
                  "manifests": [{**d, "platform": p.to_json(), "annotations": {A_TARGET: t, A_MODEL: m}}
                                for d, p, t, m in manifests],
                  "annotations": {A_MODEL: model}})


def manifest_json(config: dict, layers: list[dict], annotations: dict) -> bytes:
    return dumps({"schemaVersion": 2, "mediaType": MANIFEST, "artifactType": ARTIFACT_TYPE, "config": config,
                  "layers": layers, "annotations": annotations})
