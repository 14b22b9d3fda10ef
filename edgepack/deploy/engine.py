"""deploy / check / smoke / rollback for one device, and bounded parallelism over many.

Each per-device function returns a DeviceResult and never raises for device-side trouble: one device's
failure is that device's row in the table, not the end of the run.
"""
from __future__ import annotations

import re
import shlex
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

from ..errors import EdgepackError
from . import lock, release
from .artifact import ArtifactInfo
from .connector import CommandTimeout, ConnectionLost, Connector, Progress, Unreachable
from .device import Device
from .probe import DeviceFacts, check_fits, dest_for, probe, refresh, state_script
from .release import Links
from .results import (DEPLOYED, FAILED, NO_CHANGE, OK, PASS, ROLLED_BACK, SKIPPED, UNREACHABLE,
                      DeviceResult)
from .selftest import exe_path, run_bench, run_selftest
from .ssh import SSHOptions, connect

_RELEASE_RE = re.compile(rf"{release.RELEASES}/[0-9a-f]{{16}}")


@dataclass(frozen=True)
class Options:
    ssh: SSHOptions = field(default_factory=SSHOptions)
    dest: str | None = None            # overrides every device's dest
    parallel: int = 16                 # the CLI's -j default (docs/deploy.md: numbers)
    fail_fast: bool = False
    selftest_timeout: float = 300.0    # qemu-emulated devices are slow
    lock_wait: float = 120.0           # seconds to wait for another run's lock on the same DEST
    lock_stale: float = 3600.0         # a lock older than this (device clock) is taken over
    debug: bool = False
    # wraps each device's connector (deploy from a registry with --pull-on-device: the device fetches)
    connector_wrap: Callable[[Device, Connector], Connector] | None = None


def open_connector(device: Device, opts: Options) -> Connector:
    if device.local:
        from .local import LocalConnector
        conn: Connector = LocalConnector()
    else:
        conn = connect(device, opts.ssh)
    return opts.connector_wrap(device, conn) if opts.connector_wrap else conn


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


def _refuse_layout(facts: DeviceFacts) -> None:
    if facts.releases_link is not None:
        raise release.releases_symlink_error(facts.dest, facts.releases_link)


@contextmanager
def _locked(conn: Connector, device: Device, dest: str, opts: Options, op: str, run: _Run):
    """Hold DEST's lock and look again in the same round trip: act on what is there now, not on what
    was there before another run finished."""
    with lock.held(conn, dest, device=device.name, op=op, wait=opts.lock_wait, stale_after=opts.lock_stale,
                   then=state_script(dest, run.facts.current)) as out:
        run.facts = facts = refresh(run.facts, out)
        _refuse_layout(facts)
        yield facts


def deploy_one(device: Device, artifact: ArtifactInfo, opts: Options,
               progress: Progress | None = None) -> DeviceResult:
    run = _Run(device, artifact.target)
    try:
        with open_connector(device, opts) as conn:
            run.facts = facts = probe(conn, device, dest_for(device, opts.dest))
            check_fits(device, artifact, facts)
            _refuse_layout(facts)
            if facts.current_sha() == artifact.sha256:  # compare before acting (current is always tested)
                return run.result(NO_CHANGE, f"{artifact.short[:8]} is already current", sha256=artifact.sha256)
            with _locked(conn, device, facts.dest, opts, "deploy", run) as facts:
                if facts.current_sha() == artifact.sha256:  # another run installed it while we waited
                    return run.result(NO_CHANGE, f"{artifact.short[:8]} is already current",
                                      sha256=artifact.sha256)
                return _deploy_locked(conn, artifact, facts, opts, progress, run)
    except Exception as exc:  # noqa: BLE001 - every failure becomes this device's row
        return run.error(exc, opts.debug)


def _short(link: str | None) -> str:
    return link.split("/")[-1][:8] if link else "nothing"


def _deploy_locked(conn: Connector, artifact: ArtifactInfo, facts: DeviceFacts, opts: Options,
                   progress: Progress | None, run: _Run) -> DeviceResult:
    dest = facts.dest
    rel = _install(conn, artifact, facts, progress, run)
    if isinstance(rel, DeviceResult):
        return rel
    old = Links(facts.current, facts.previous)
    present = facts.releases + (rel.split("/", 1)[1],)
    # The new release is tested where it lies, before `current` moves: a cut or a timeout during the
    # selftest leaves the previous, tested version current, and the next run tests this one again.
    exe = shlex.quote(f"{dest}/{rel}/{artifact.name}")
    back = f"{_short(old.current)} stays current" if old.current else "nothing was installed before"
    try:
        test = run_selftest(conn, exe, opts.selftest_timeout)
    except CommandTimeout:
        release.prune(conn, dest, old, present)
        return run.result(ROLLED_BACK, f"selftest did not finish within {opts.selftest_timeout:g} s on the "
                          f"device; {back}", sha256=facts.current_sha(),
                          hint="raise --selftest-timeout for slow (emulated) devices, or run the artifact's "
                               "selftest on the device to see where it hangs")
    except ConnectionLost as exc:
        raise ConnectionLost(f"{exc.message.rstrip('.')} (during the on-device selftest of "
                             f"{artifact.short[:8]}); {back}",
                             hint="rerun the deploy when the device is back: the uploaded version is "
                                  "selftested again before it becomes current") from None
    if not test.passed:
        release.prune(conn, dest, old, present)  # the failed release goes; current never moved
        return run.result(ROLLED_BACK, f"selftest failed on the device (exit {test.rc}); "
                          + (f"back to {_short(old.current)}" if old.current else back),
                          latency_ms=test.latency_ms, output=test.output,
                          sha256=facts.current_sha(), hint="run the artifact's selftest locally; "
                          "check the target (CPU features, glibc) matches the device")
    new = Links(rel, facts.current if facts.current and facts.current != rel else facts.previous)
    release.switch(conn, dest, new)
    release.prune(conn, dest, new, present)
    return run.result(DEPLOYED, f"{artifact.short[:8]} installed"
                      + (f", previous {_short(old.current)} kept" if old.current else ""),
                      latency_ms=test.latency_ms, sha256=artifact.sha256)


def _install(conn: Connector, artifact: ArtifactInfo, facts: DeviceFacts, progress: Progress | None,
             run: _Run):
    """Upload unless this exact version is already in releases/ (a roll-forward); returns its path."""
    rel = release.release_dir(artifact)
    dest = facts.dest
    if rel.split("/", 1)[1] in facts.releases and release.release_sha(conn, dest, rel, artifact.name) \
            == artifact.sha256:
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
                              bench={k: getattr(b, k) for k in ("min_ms", "median_ms", "p90_ms", "peak_rss_kb", "emulated")}
                              if b else None)
    except Exception as exc:  # noqa: BLE001
        return run.error(exc, opts.debug)


def rollback_one(device: Device, opts: Options) -> DeviceResult:
    """Swap current and previous, after checking previous is a whole edgepack release whose artifact
    still has its recorded sha256 and passes its selftest where it lies; otherwise change nothing."""
    run = _Run(device, device.target, "rollback")
    try:
        with open_connector(device, opts) as conn:
            run.facts = facts = probe(conn, device, dest_for(device, opts.dest))
            _refuse_layout(facts)
            if not facts.previous:
                return run.result(FAILED, f"no previous version in {facts.dest}", hint="nothing to roll back to")
            with _locked(conn, device, facts.dest, opts, "rollback", run) as facts:
                return _rollback_locked(conn, facts, opts, run)
    except Exception as exc:  # noqa: BLE001
        return run.error(exc, opts.debug)


def _rollback_locked(conn: Connector, facts: DeviceFacts, opts: Options, run: _Run) -> DeviceResult:
    dest, target = facts.dest, facts.previous
    unchanged = "nothing was changed" + (f", {_short(facts.current)} stays current" if facts.current else "")
    if not target:
        return run.result(FAILED, f"no previous version in {dest}", hint="nothing to roll back to")
    info = release.read_release(conn, dest, target) if _RELEASE_RE.fullmatch(target) else None
    if info is None:
        return run.result(FAILED, f"{dest}/previous -> {target}, which is not an edgepack release on the "
                          f"device (missing, or not made by edgepack); {unchanged}", sha256=facts.current_sha(),
                          hint="deploy the version you want instead: edgepack deploy ARTIFACT")
    if not info or info.get("sha_now") is None or info["sha_now"] != info.get("sha256"):
        return run.result(FAILED, f"{dest}/{target} is damaged (its artifact is missing or does not match "
                          f"the sha256 in its release.json); {unchanged}", sha256=facts.current_sha(),
                          hint="deploy the version you want instead: edgepack deploy ARTIFACT")
    test = run_selftest(conn, shlex.quote(f"{dest}/{target}/{info['artifact']}"), opts.selftest_timeout)
    if not test.passed:
        return run.result(FAILED, f"the previous version {_short(target)} fails its selftest on the device "
                          f"(exit {test.rc}); {unchanged}", latency_ms=test.latency_ms, output=test.output,
                          sha256=facts.current_sha(), hint="deploy a version that works instead")
    # swap: rolling back twice rolls forward again
    release.switch(conn, dest, Links(target, facts.current))
    return run.result(ROLLED_BACK, f"current -> {target}; selftest passed", latency_ms=test.latency_ms,
                      sha256=info["sha_now"])


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
