"""edgepack pull: one platform's (or target's) entry of an index -> the artifact folder exactly as built.

Every blob is checked against its digest and size, every file against the sha256 in the entry's config
and in its SHA256SUMS, all in a scratch folder inside DIR; only then are the files renamed into place.
"""
from __future__ import annotations

import os
import platform as host_platform
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..cache import cache_root, locked, sha256_file
from ..errors import IntegrityError, RegistryError
from . import layout
from .client import INDEX, MANIFEST, RegistryClient, Stats
from .ref import Platform, Reference, parse_reference, platform_for_arch

MAX_BLOB = 2 << 30   # an artifact past 2 GiB is not one of ours


@dataclass
class PullResult:
    reference: str
    digest: str                    # the entry's manifest digest
    target: str
    platform: Platform
    out_dir: Path
    files: dict[str, str] = field(default_factory=dict)   # name -> sha256
    executable: Path | None = None
    stats: Stats = field(default_factory=Stats)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"reference": self.reference, "digest": self.digest, "target": self.target,
                "platform": str(self.platform), "dir": str(self.out_dir), "files": self.files,
                "executable": str(self.executable) if self.executable else None,
                "downloaded_bytes": self.stats.downloaded_bytes, "seconds": self.seconds}


def host_platform_default() -> Platform:
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(host_platform.machine().lower(), host_platform.machine())
    return platform_for_arch(arch)


def resolve(client: RegistryClient, ref: Reference, platform: Platform | None, target: str | None) -> dict:
    """The descriptor of the entry to fetch (an index entry, or the manifest itself when REF names one)."""
    body, media, digest = client.get_manifest(ref.reference)
    if ref.digest and digest != ref.digest:
        raise IntegrityError(f"{ref}: the registry returned content with digest {digest}")
    doc = layout.parse_json(body, f"{ref}")
    media = doc.get("mediaType") or media
    if media == MANIFEST:
        return {"mediaType": MANIFEST, "digest": digest, "size": len(body), "annotations": doc.get("annotations")}
    if media != INDEX:
        raise RegistryError(f"{ref} is a {media or 'manifest of unknown type'}, not an OCI image index",
                            hint="push it with edgepack push")
    ms = layout.entries(doc, str(ref))
    return layout.choose(ms, str(ref), platform or (None if target else host_platform_default()), target)


def _blob(client: RegistryClient, desc: dict, out: Path, what: str) -> None:
    if desc["size"] > MAX_BLOB:
        raise RegistryError(f"{what} is {desc['size']} bytes (more than {MAX_BLOB})")
    client.get_blob(desc["digest"], out)
    got = sha256_file(out)
    if "sha256:" + got != desc["digest"] or out.stat().st_size != desc["size"]:
        raise IntegrityError(f"{what}: the registry sent {out.stat().st_size} bytes with sha256 {got[:16]}, "
                             f"expected {desc['size']} bytes {desc['digest'][7:23]}", hint="nothing was written")


def fetch_entry(client: RegistryClient, ref: Reference, entry: dict, out_dir: Path) -> PullResult:
    t0 = time.monotonic()
    body, _media, digest = client.get_manifest(entry["digest"])
    if digest != entry["digest"] or len(body) != entry["size"]:
        raise IntegrityError(f"{ref}: manifest {entry['digest'][:19]} arrived as {digest[:19]}")
    man = layout.parse_json(body, f"manifest {digest[:19]}")
    layers = man.get("layers")
    if not isinstance(layers, list) or not 0 < len(layers) <= layout.MAX_LAYERS:
        raise RegistryError(f"{ref}: manifest {digest[:19]} has no usable layer list")
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".edgepack-pull-", dir=out_dir))
    try:
        cdesc = layout._descriptor(man.get("config"), f"{ref} config")
        _blob(client, cdesc, scratch / ".config", f"{ref} config")
        config = layout.parse_json((scratch / ".config").read_bytes(), f"{ref} config")
        want = {layout.safe_name(f.get("name"), f"{ref} config"): f for f in config.get("files") or []
                if isinstance(f, dict)}
        names = []
        for d in layers:
            d = layout._descriptor(d, f"{ref} layer")
            name = layout.safe_name((d.get("annotations") or {}).get(layout.TITLE), f"{ref} layer")
            if name in names:
                raise RegistryError(f"{ref}: two layers named {name}")
            _blob(client, d, scratch / name, f"{ref} {name}")
            names.append(name)
        files = {}
        for name, f in want.items():
            if name not in names or sha256_file(scratch / name) != f.get("sha256"):
                raise IntegrityError(f"{ref}: {name} is missing or does not match the sha256 in the entry's config")
            files[name] = f["sha256"]
        if "SHA256SUMS" in names:
            listed = {ln.split()[1]: ln.split()[0] for ln in (scratch / "SHA256SUMS").read_text().splitlines()
                      if len(ln.split()) == 2}
            if any(listed.get(n) != s for n, s in files.items()):
                raise IntegrityError(f"{ref}: SHA256SUMS disagrees with the files")
        for name in names:  # only now does anything appear in DIR
            mode = 0o755 if want.get(name, {}).get("mode") == "0755" else 0o644
            os.chmod(scratch / name, mode)
            os.replace(scratch / name, out_dir / name)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    exe = next((out_dir / n for n, f in want.items() if f.get("mode") == "0755"), None)
    return PullResult(str(ref), digest, str(config.get("target") or layout.entry_target(entry) or "?"),
                      layout.entry_platform(entry) or Platform("linux", str(config.get("arch"))),
                      out_dir, files, exe, client.stats, time.monotonic() - t0)


def pull(reference: str, out_dir: Path, *, platform: Platform | None = None, target: str | None = None,
         insecure: bool = False) -> PullResult:
    ref = parse_reference(reference)
    client = RegistryClient(ref, insecure=insecure)
    entry = resolve(client, ref, platform, target)
    return fetch_entry(client, ref, entry, Path(out_dir))


def pull_cached(client: RegistryClient, ref: Reference, entry: dict) -> PullResult:
    """The entry in the operator's cache, one folder per manifest digest (pulled once for every device);
    a cached copy is used only when its files still have their sha256."""
    folder = cache_root() / "oci" / entry["digest"].split(":", 1)[1]
    with locked(folder.with_suffix(".lock")):
        done = folder / ".edgepack-pulled"
        if done.is_file():
            import json
            res = json.loads(done.read_text())
            if all((folder / n).is_file() and sha256_file(folder / n) == s for n, s in res["files"].items()):
                done.touch()  # last used: `edgepack cache prune` judges pulls by age
                return PullResult(str(ref), entry["digest"], res["target"], layout.entry_platform(entry)
                                  or Platform("linux", "?"), folder, res["files"], folder / res["executable"])
        shutil.rmtree(folder, ignore_errors=True)
        res = fetch_entry(client, ref, entry, folder)
        import json
        done.write_text(json.dumps({"target": res.target, "files": res.files, "executable": res.executable.name}))
        return res
