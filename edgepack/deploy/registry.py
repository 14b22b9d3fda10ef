"""Deploy from an OCI registry: each device gets the index entry for its own target or architecture.

The operator pulls each entry once (cached per manifest digest, checked by sha256), then hands the
artifact to ``engine.deploy_one``: the same fit check, upload, on-device sha256, atomic switch,
selftest and rollback as a local artifact. Which entry a device gets: the inventory's ``target`` when
the index has it, else the platform of the device's ``uname -m`` (generic target first).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, replace

from ..errors import EdgepackError, RegistryError
from ..oci import layout
from ..oci.client import INDEX, RegistryClient
from ..oci.pull import PullResult, pull_cached
from ..oci.ref import Reference, parse_reference, platform_for_arch
from .artifact import inspect_artifact
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


def deploy_one_from(device: Device, source: Source, opts: Options) -> DeviceResult:
    t0 = time.monotonic()
    try:
        in_index = device.target and any(layout.entry_target(e) == device.target for e in source.entries)
        arch = None if in_index else _device_arch(device, opts)
        entry = source.pick(device, arch)
        pulled = source.fetch(entry)
        art = inspect_artifact(pulled.executable)
    except EdgepackError as exc:
        from .connector import Unreachable
        return DeviceResult(device.name, device.address, UNREACHABLE if isinstance(exc, Unreachable) else FAILED,
                            time.monotonic() - t0, target=device.target, message=exc.message, hint=exc.hint or "")
    res = deploy_one(device, art, opts)
    return replace(res, seconds=time.monotonic() - t0,
                   message=f"{res.message} (from {source.ref.registry}/{source.ref.repository}"
                           f"@{entry['digest'][:19]})")
