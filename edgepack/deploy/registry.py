"""Deploy from an OCI registry: each device gets the index entry for its own target or architecture.

The operator pulls each entry once (cached per manifest digest, checked by sha256), then hands the
artifact to ``engine.deploy_one``: the same fit check, upload, on-device sha256, atomic switch,
selftest and rollback as a local artifact. Which entry a device gets: the inventory's ``target`` when
the index has it, else the platform of the device's ``uname -m`` (generic target first).
"""
from __future__ import annotations

import shlex
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import EdgepackError, RegistryError
from ..oci import layout
from ..oci.client import INDEX, RegistryClient
from ..oci.pull import PullResult, pull_cached
from ..oci.ref import Reference, parse_reference, platform_for_arch
from .artifact import ArtifactInfo, _from_manifest, inspect_artifact
from .connector import Connector, RunResult
from .device import Device
from .engine import Options, deploy_one, open_connector
from .probe import dest_for, probe
from .results import FAILED, UNREACHABLE, DeviceResult


@dataclass
class Source:
    """A registry reference resolved once for the whole run: its entries and the client to fetch them."""
    ref: Reference
    client: RegistryClient
    entries: list[dict]
    index_digest: str
    _lock: threading.Lock

    def pick(self, device: Device, arch: str | None) -> dict:
        where = str(self.ref)
        if len(self.entries) == 1 and layout.entry_platform(self.entries[0]) is None:
            return self.entries[0]  # REF names one manifest, not an index: the engine's fit check decides
        if device.target and any(layout.entry_target(e) == device.target for e in self.entries):
            return layout.choose(self.entries, where, None, device.target)
        if arch is None:
            raise RegistryError(f"{where}: no entry for {device.name}'s target {device.target}")
        return layout.choose(self.entries, where, platform_for_arch(arch), None)

    def fetch(self, entry: dict) -> PullResult:
        with self._lock:  # one download per entry, whichever device asks first
            return pull_cached(self.client, self.ref, entry)

    def describe_remote(self, entry: dict) -> tuple[ArtifactInfo, str]:
        """For --pull-on-device: the artifact's facts from its config and manifest JSON (small blobs,
        digest-checked), without downloading the executable; and the blob URL the device fetches."""
        from ..oci.pull import _blob
        with self._lock, tempfile.TemporaryDirectory(prefix="edgepack-entry-") as t:
            body, _m, digest = self.client.get_manifest(entry["digest"])
            if digest != entry["digest"]:
                raise RegistryError(f"{self.ref}: manifest {entry['digest'][:19]} arrived as {digest[:19]}")
            man = layout.parse_json(body, f"manifest {digest[:19]}")
            layers = [layout._descriptor(d, str(self.ref)) for d in man.get("layers") or []]
            exe = next((d for d in layers if d.get("mediaType") == layout.EXECUTABLE), None)
            side = next((d for d in layers if d.get("mediaType") == layout.SIDECAR), None)
            if exe is None or side is None:
                raise RegistryError(f"{self.ref}: entry {digest[:19]} is not an edgepack artifact "
                                    "(no executable or manifest layer)")
            name = layout.safe_name((exe.get("annotations") or {}).get(layout.TITLE), str(self.ref))
            _blob(self.client, side, Path(t) / "sidecar", f"{self.ref} manifest JSON")
            facts = _from_manifest(layout.parse_json((Path(t) / "sidecar").read_bytes(), "manifest JSON"),
                                   f"{self.ref} {name}.json")
        model = facts["model"] or name
        info = ArtifactInfo(path=Path(f"/registry/{exe['digest']}/{name}"), name=name, sha256=exe["digest"][7:],
                            size=exe["size"], target=facts["target"], arch=facts["arch"], link=facts["link"],
                            glibc=facts["glibc"], model=model)
        return info, f"{self.client.base}/blobs/{exe['digest']}"


def open_source(reference: str, insecure: bool) -> Source:
    """Parse, log in and read the index before any device is touched: a bad reference or credentials
    fail the whole command with one error, not one row per device."""
    ref = parse_reference(reference)
    client = RegistryClient(ref, insecure=insecure)
    body, media, digest = client.get_manifest(ref.reference)
    doc = layout.parse_json(body, str(ref))
    if (doc.get("mediaType") or media) == INDEX:
        entries = layout.entries(doc, str(ref))
    else:
        entries = [{"mediaType": media, "digest": digest, "size": len(body), "annotations": doc.get("annotations")
                    or {}, "platform": None}]
    return Source(ref, client, entries, digest, threading.Lock())


def _device_arch(device: Device, opts: Options) -> str:
    with open_connector(device, opts) as conn:
        return probe(conn, device, dest_for(device, opts.dest)).arch


class DeviceFetch(Connector):
    """A connector whose put() of the registry artifact runs curl (or wget) on the device instead of
    SFTP: everything else, and the engine's sha256 check on the device that follows, is unchanged.
    Registry credentials reach curl in a 0600 config file inside the 0700 upload folder, never argv."""

    def __init__(self, inner: Connector, urls: dict[str, str], creds, timeout: float = 600.0):
        self.inner, self.urls, self.creds, self.timeout = inner, urls, creds, timeout

    def put(self, local, remote, progress=None) -> None:
        url = self.urls.get(str(local))
        if url is None:
            return self.inner.put(local, remote, progress)
        folder, q = remote.rsplit("/", 1)[0], shlex.quote
        cfg = f"{folder}/.edgepack-curl"
        auth = ""
        if self.creds:
            esc = f"{self.creds.username}:{self.creds.password}".replace("\\", "\\\\").replace('"', '\\"')
            self.inner.chmod(folder, 0o700)
            self.inner.write_bytes(f'user = "{esc}"\n'.encode(), cfg)
            auth = f" -K {q(cfg)}"
        t = int(self.timeout)
        wget = "" if self.creds else f"elif command -v wget >/dev/null 2>&1; then wget -q -T {t} -O {q(remote)} {q(url)}\n"
        need = "curl" if self.creds else "curl or wget"
        script = (f"if command -v curl >/dev/null 2>&1; then curl -fsSL --max-time {t}{auth} -o {q(remote)} {q(url)}\n"
                  f"{wget}else echo 'no {need} on the device' >&2; exit 127; fi")
        try:
            res = self.inner.run(script, self.timeout + 30)
        finally:
            if self.creds:
                self.inner.run(f"rm -f -- {q(cfg)}; chmod 755 -- {q(folder)}", 30)
        if res.rc != 0:
            raise OSError(f"the device could not fetch {url}: {res.output.strip()[-300:] or f'exit {res.rc}'}")

    def run(self, command: str, timeout: float) -> RunResult:
        return self.inner.run(command, timeout)

    def write_bytes(self, data: bytes, remote: str) -> None:
        self.inner.write_bytes(data, remote)

    def mkdir(self, remote: str, mode: int = 0o755) -> None:
        self.inner.mkdir(remote, mode)

    def chmod(self, remote: str, mode: int) -> None:
        self.inner.chmod(remote, mode)

    def rename(self, src: str, dst: str) -> None:
        self.inner.rename(src, dst)

    def symlink(self, target: str, link: str) -> None:
        self.inner.symlink(target, link)

    def read_bytes(self, remote: str, limit: int = 65536) -> bytes:
        return self.inner.read_bytes(remote, limit)

    def remove(self, remote: str) -> None:
        self.inner.remove(remote)

    def rmdir(self, remote: str) -> None:
        self.inner.rmdir(remote)

    def close(self) -> None:
        self.inner.close()


def deploy_one_from(device: Device, source: Source, opts: Options, pull_on_device: bool = False) -> DeviceResult:
    t0 = time.monotonic()
    try:
        in_index = device.target and any(layout.entry_target(e) == device.target for e in source.entries)
        arch = None if in_index else _device_arch(device, opts)
        entry = source.pick(device, arch)
        if pull_on_device:
            art, url = source.describe_remote(entry)
            urls = {str(art.path): url}
            opts = replace(opts, connector_wrap=lambda _dev, conn: DeviceFetch(conn, urls, source.client.creds))
        else:
            art = inspect_artifact(source.fetch(entry).executable)
    except EdgepackError as exc:
        from .connector import Unreachable
        return DeviceResult(device.name, device.address, UNREACHABLE if isinstance(exc, Unreachable) else FAILED,
                            time.monotonic() - t0, target=device.target, message=exc.message, hint=exc.hint or "")
    res = deploy_one(device, art, opts)
    return replace(res, seconds=time.monotonic() - t0,
                   message=f"{res.message} (from {source.ref.registry}/{source.ref.repository}"
                           f"@{entry['digest'][:19]})")
