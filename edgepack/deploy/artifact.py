"""What is being pushed: an edgepack artifact's hash and the target facts the device check needs."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..cache import sha256_file
from ..elf import read_elf
from ..errors import ArtifactError, EdgepackError, TargetError
from ..triple import parse_triple


@dataclass(frozen=True)
class ArtifactInfo:
    path: Path
    name: str             # file name; the name it gets on the device
    sha256: str
    size: int
    target: str           # edgepack target name (or the ELF machine when no manifest says)
    arch: str             # x86_64 | aarch64 | arm
    link: str             # static | static-pie | dynamic
    glibc: str | None     # glibc baseline of a dynamically linked artifact ("2.31")
    model: str

    @property
    def short(self) -> str:
        return self.sha256[:16]


def _from_manifest(manifest: dict, where: str) -> dict:
    t = manifest.get("target")
    if not isinstance(t, dict) or not isinstance(t.get("triple"), str):
        raise ArtifactError(f"{where}: no target.triple in the manifest")
    try:
        triple = parse_triple(t["triple"])
    except TargetError as exc:
        raise ArtifactError(f"{where}: {exc.message}") from None
    model = manifest.get("model")
    name = model.get("name") if isinstance(model, dict) else None
    return {"target": str(t.get("name") or triple.arch), "arch": triple.arch,
            "link": str(t.get("link") or ("dynamic" if triple.is_glibc else "static")),
            "glibc": triple.glibc, "model": str(name) if name else None}


def _from_info(path: Path) -> dict | None:
    """Run ``ARTIFACT info`` here (under qemu for Arm) to learn a dynamic artifact's glibc baseline."""
    from ..runner import run_artifact
    try:
        proc = run_artifact(path, ["info", "--json"], timeout=120)
        return _from_manifest(json.loads(proc.stdout), f"{path} info") if proc.returncode == 0 else None
    except (EdgepackError, OSError, ValueError, Exception):  # best effort: the ELF header already gave the arch
        return None


def inspect_artifact(path: Path) -> ArtifactInfo:
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(f"artifact {path} does not exist", hint="build it first: edgepack build MODEL -t TARGET")
    sidecar = Path(str(path) + ".json")
    facts: dict | None = None
    if sidecar.is_file():
        try:
            facts = _from_manifest(json.loads(sidecar.read_text()), str(sidecar))
        except ValueError as exc:
            raise ArtifactError(f"{sidecar} is not valid JSON: {exc}") from None
    head = path.open("rb").read(4)
    if head == b"\x7fELF":
        elf = read_elf(path)
        if facts is not None and facts["arch"] != elf.machine:
            raise ArtifactError(f"{path.name} is an {elf.machine} executable but {sidecar.name} says "
                                f"{facts['arch']} (target {facts['target']})",
                                hint="the sidecar belongs to another build; rebuild the artifact")
        if facts is None:
            facts = (_from_info(path) if elf.has_interp else None) or {
                "target": elf.machine, "arch": elf.machine,
                "link": "dynamic" if elf.has_interp else ("static-pie" if elf.static_pie else "static"),
                "glibc": None, "model": None}
    elif facts is None:
        raise ArtifactError(f"{path} is not an edgepack artifact (no ELF header and no {sidecar.name})",
                            hint="pass the executable from dist/, e.g. dist/<model>-<target>")
    model = facts["model"] or re.sub(rf"-{re.escape(facts['target'])}$", "", path.name)
    return ArtifactInfo(path=path, name=path.name, sha256=sha256_file(path), size=path.stat().st_size,
                        target=facts["target"], arch=facts["arch"], link=facts["link"], glibc=facts["glibc"],
                        model=model)
