"""deploy / check / smoke / rollback for one device, and bounded parallelism over many.

Each per-device function returns a DeviceResult and never raises for device-side trouble: one device's
failure is that device's row in the table, not the end of the run.
"""
from __future__ import annotations

import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from ..errors import EdgepackError
from . import release
from .artifact import ArtifactInfo
from .connector import ConnectionLost, Connector, Progress, Unreachable
from .device import Device
from .probe import DeviceFacts, check_fits, dest_for, probe
from .release import Links
from .results import (DEPLOYED, FAILED, NO_CHANGE, OK, PASS, ROLLED_BACK, SKIPPED, UNREACHABLE,
                      DeviceResult)
from .selftest import exe_path, run_bench, run_selftest
from .ssh import SSHOptions, connect


@dataclass(frozen=True)
class Options:
    ssh: SSHOptions = field(default_factory=SSHOptions)
    dest: str | None = None            # overrides every device's dest
    parallel: int = 4
    fail_fast: bool = False
    selftest_timeout: float = 300.0    # qemu-emulated devices are slow
    debug: bool = False


def open_connector(device: Device, opts: Options) -> Connector:
    if device.local:
        from .local import LocalConnector
        return LocalConnector()
    return connect(device, opts.ssh)


class _Run:
    """Collects what one device's operation learnt, so an error still yields a full result row."""

    def __init__(self, device: Device, target: str | None = None, command: str = "deploy"):
        self.device, self.target, self.command, self.t0 = device, target, command, time.monotonic()
        self.facts: DeviceFacts | None = None

    def result(self, status: str, message: str = "", **kw) -> DeviceResult:
        f = self.facts
        base = dict(target=self.target, arch=f.arch_label() if f else None, glibc=f.glibc if f else None,
                    free_bytes=f.free_bytes if f else None, dest=f.dest if f else None)
        base.update(kw)
        return DeviceResult(device=self.device.name, address=self.device.address, status=status,
                            seconds=time.monotonic() - self.t0, message=message, command=self.command, **base)

    def error(self, exc: BaseException, debug: bool) -> DeviceResult:
        if isinstance(exc, Unreachable):
            return self.result(UNREACHABLE, exc.message, hint=exc.hint or "")
        if isinstance(exc, EdgepackError):
            return self.result(FAILED, exc.message, hint=exc.hint or "")
        # a bug or an unforeseen library error: still one row, with the traceback only under --debug
        detail = traceback.format_exc() if debug else ""
        return self.result(FAILED, f"{type(exc).__name__}: {exc}", output=detail)


def _current_name(facts: DeviceFacts) -> str | None:
    for name, _ in facts.files:
        if name != "release.json":
            return name
    return None


def deploy_one(device: Device, artifact: ArtifactInfo, opts: Options,
               progress: Progress | None = None) -> DeviceResult:
    run = _Run(device, artifact.target)
    try:
        with open_connector(device, opts) as conn:
            run.facts = facts = probe(conn, device, dest_for(device, opts.dest))
            check_fits(device, artifact, facts)
            dest = facts.dest
            if facts.current_sha() == artifact.sha256:  # compare before acting
                return run.result(NO_CHANGE, f"{artifact.short[:8]} is already current", sha256=artifact.sha256)
            rel = _install(conn, artifact, facts, progress, run)
            if isinstance(rel, DeviceResult):
                return rel
            old = Links(facts.current, facts.previous)
            new = Links(rel, facts.current if facts.current and facts.current != rel else facts.previous)
            release.switch(conn, dest, new)
            test = run_selftest(conn, exe_path(dest, artifact.name), opts.selftest_timeout)
            if test.passed:
                release.prune(conn, dest, new, present=facts.releases + (rel.split("/", 1)[1],))
                return run.result(DEPLOYED, f"{artifact.short[:8]} installed"
                                  + (f", previous {old.current.split('/')[-1][:8]} kept" if old.current else ""),
                                  latency_ms=test.latency_ms, sha256=artifact.sha256)
            # Back to exactly what was there before; the failed release is removed.
            release.switch(conn, dest, old)
            release.prune(conn, dest, old)
            back = f"back to {old.current.split('/')[-1][:8]}" if old.current else "nothing was installed before"
            return run.result(ROLLED_BACK, f"selftest failed on the device (exit {test.rc}); {back}",
                              latency_ms=test.latency_ms, output=test.output,
                              sha256=facts.current_sha(), hint="run the artifact's selftest locally; "
                              "check the target (CPU features, glibc) matches the device")
    except Exception as exc:  # noqa: BLE001 - every failure becomes this device's row
        return run.error(exc, opts.debug)


def _install(conn: Connector, artifact: ArtifactInfo, facts: DeviceFacts, progress: Progress | None,
             run: _Run):
    """Upload unless this exact version is already in releases/ (a roll-forward); returns its path."""
    rel = release.release_dir(artifact)
    dest = facts.dest
    if rel.split("/", 1)[1] in facts.releases:
        res = conn.run(f"sha256sum -- {release.shlex.quote(f'{dest}/{rel}/{artifact.name}')}", 60)
        if res.rc == 0 and res.stdout.split()[:1] == [artifact.sha256]:
            return rel
    # a leftover in releases/<sha16> that is not the artifact: upload() replaces it, unless it is in use
    if rel in (facts.current, facts.previous):
        return run.result(FAILED, f"{dest}/{rel} exists but does not hold {artifact.name} {artifact.short}",
                          hint="remove the damaged release on the device and deploy again")
    need = artifact.size + 64 * 1024
    if facts.free_bytes is not None and facts.free_bytes < need:
        return run.result(FAILED, f"disk full: {dest} has {facts.free_bytes // 1024} KiB free, "
                          f"{artifact.name} needs {need // 1024} KiB; nothing was changed",
                          hint="free space on the device or deploy to a bigger filesystem with --dest")
    try:
        return release.upload(conn, artifact, dest, progress, releases_exist=facts.has_releases)
    except ConnectionLost:
        raise
    except EdgepackError as exc:
        # SFTP reports ENOSPC as a bare "Failure": look at the disk to say what happened
        try:
            again = probe(conn, run.device, dest)
        except EdgepackError:
            raise exc from None
        if again.free_bytes is not None and again.free_bytes < need:
            raise type(exc)(f"disk full while uploading to {dest} ({again.free_bytes // 1024} KiB free, "
                            f"{need // 1024} KiB needed); the previous version is untouched",
                            hint="free space on the device or deploy elsewhere with --dest") from None
        raise


def check_one(device: Device, opts: Options) -> DeviceResult:
    run = _Run(device, device.target, "check")
    try:
        with open_connector(device, opts) as conn:
            run.facts = facts = probe(conn, device, dest_for(device, opts.dest))
            return run.result(OK, facts.dest + ("" if facts.current else " (nothing installed)"),
                              sha256=facts.current_sha())
    except Exception as exc:  # noqa: BLE001
        return run.error(exc, opts.debug)


def smoke_one(device: Device, opts: Options, bench: bool = False) -> DeviceResult:
    run = _Run(device, device.target, "smoke")
    try:
        with open_connector(device, opts) as conn:
            run.facts = facts = probe(conn, device, dest_for(device, opts.dest))
            name = _current_name(facts)
            if name is None:
                return run.result(FAILED, f"nothing installed in {facts.dest}", hint="run `edgepack deploy` first")
            exe = exe_path(facts.dest, name)
            test = run_selftest(conn, exe, opts.selftest_timeout)
            b = run_bench(conn, exe, opts.selftest_timeout) if bench and test.passed else None
            return run.result(PASS if test.passed else FAILED,
                              f"{name} {facts.current_sha()[:8]}: selftest {'passed' if test.passed else 'FAILED'}",
                              latency_ms=test.latency_ms, output="" if test.passed else test.output,
                              sha256=facts.current_sha(),
                              bench={k: getattr(b, k) for k in ("min_ms", "median_ms", "p90_ms", "peak_rss_kb")}
                              if b else None)
    except Exception as exc:  # noqa: BLE001
        return run.error(exc, opts.debug)


def rollback_one(device: Device, opts: Options) -> DeviceResult:
    run = _Run(device, device.target, "rollback")
    try:
        with open_connector(device, opts) as conn:
            run.facts = facts = probe(conn, device, dest_for(device, opts.dest))
            if not facts.previous:
                return run.result(FAILED, f"no previous version in {facts.dest}", hint="nothing to roll back to")
            # swap: rolling back twice rolls forward again
            release.switch(conn, facts.dest, Links(facts.previous, facts.current))
            after = probe(conn, device, facts.dest)
            name = _current_name(after)
            test = run_selftest(conn, exe_path(facts.dest, name), opts.selftest_timeout) if name else None
            ok = test is not None and test.passed
            return run.result(ROLLED_BACK if ok else FAILED,
                              f"current -> {facts.previous}; selftest {'passed' if ok else 'FAILED'}",
                              latency_ms=test.latency_ms if test else None, sha256=after.current_sha(),
                              output="" if ok or test is None else test.output)
    except Exception as exc:  # noqa: BLE001
        return run.error(exc, opts.debug)


def run_all(devices: list[Device], fn: Callable[[Device], DeviceResult], parallel: int,
            fail_fast: bool = False, ok: Callable[[DeviceResult], bool] = lambda r: r.ok) -> list[DeviceResult]:
    """``fn`` on every device, at most ``parallel`` at once; results in the devices' order. With
    ``fail_fast``, devices not yet started when one fails are reported as skipped."""
    stop = threading.Event()

    def one(dev: Device) -> DeviceResult:
        if stop.is_set():
            return DeviceResult(dev.name, dev.address, SKIPPED, 0.0, message="not started: --fail-fast")
        res = fn(dev)
        if fail_fast and not ok(res):
            stop.set()
        return res

    with ThreadPoolExecutor(max_workers=max(1, min(parallel, len(devices)))) as pool:
        return list(pool.map(one, devices))
