"""`edgepack deploy --via ansible`: run the exported playbook with ansible-runner and turn its events into
the same per-device results (deploy/results.py) as the paramiko path."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from ..errors import DeployError, ToolMissingError
from .ansible import AnsibleOptions, Export
from .artifact import ArtifactInfo
from .device import Device
from .results import DEPLOYED, FAILED, NO_CHANGE, ROLLED_BACK, SKIPPED, UNREACHABLE, DeviceResult

_STATUSES = {DEPLOYED, NO_CHANGE, ROLLED_BACK, FAILED}
RESULT_TASK = "edgepack result"


def _playbook_binary() -> str:
    # next to this Python first: a virtual environment need not be on PATH
    here = Path(sys.executable).parent / "ansible-playbook"
    found = str(here) if here.is_file() else shutil.which("ansible-playbook")
    if not found:
        raise ToolMissingError("ansible-playbook not found", hint="install Ansible: bash .ci/deps-ansible.sh "
                               "(ansible-core and ansible-runner, pinned)")
    return found


def _float(v) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _arch_label(r: dict) -> str | None:
    arch = r.get("arch")
    extra = [a for a in str(r.get("emulates") or "").split() if a and a != arch]
    return (arch + (f" (+{','.join(extra)} via binfmt)" if extra else "")) if arch else None


class Collector:
    """Keeps what the run said about each device: its `edgepack result` line, or that it was unreachable."""

    def __init__(self, on_result: Callable[[DeviceResult], None] | None = None):
        self.lines: dict[str, dict] = {}
        self.unreachable: dict[str, str] = {}
        self.on_result = on_result
        self.devices: dict[str, Device] = {}
        self.art: ArtifactInfo | None = None

    def __call__(self, event: dict) -> bool:
        data = event.get("event_data") or {}
        host, kind = data.get("host"), event.get("event")
        if kind == "runner_on_ok" and data.get("task") == RESULT_TASK and host:
            try:
                self.lines[host] = json.loads((data.get("res") or {}).get("msg", ""))
            except (TypeError, ValueError):
                pass
            self._live(host)
        elif kind == "runner_on_unreachable" and host:
            msg = str((data.get("res") or {}).get("msg", "")).strip().splitlines()
            self.unreachable.setdefault(host, msg[-1] if msg else "unreachable")
            self._live(host)
        return True  # keep the event in the runner's own artifacts too

    def _live(self, host: str) -> None:
        if self.on_result and host in self.devices and self.art is not None:
            self.on_result(self.result(self.devices[host], self.art))

    def result(self, dev: Device, art: ArtifactInfo) -> DeviceResult:
        r = self.lines.get(dev.name)
        if r is None and dev.name in self.unreachable:
            why = self.unreachable[dev.name]
            hint = ("the device's host key is unknown or changed: check its fingerprint, then add it to "
                    "known_hosts (or rerun with --accept-new-host-key for a new device)"
                    if "Host key verification failed" in why else
                    "check the address, the port and that sshd runs on the device")
            return DeviceResult(dev.name, dev.address, UNREACHABLE, 0.0, target=art.target, hint=hint,
                                message=f"{dev.name}: cannot reach {dev.address} through Ansible: {why}")
        if r is None:
            return DeviceResult(dev.name, dev.address, SKIPPED, 0.0, target=art.target,
                                message="not started: the roll-out stopped at the failure threshold (--max-fail)")
        status = r.get("status") if r.get("status") in _STATUSES else FAILED
        message = str(r.get("message") or "")
        if r.get("raw"):
            message += " (no Python >= 3.8 on the device: raw/script modules only)"
        return DeviceResult(dev.name, dev.address, status, _float(r.get("seconds")) or 0.0, target=art.target,
                            arch=_arch_label(r), latency_ms=_float(r.get("latency_ms")), message=message,
                            hint=str(r.get("hint") or ""), output=str(r.get("output") or ""),
                            sha256=r.get("sha256") or None, dest=r.get("dest"), glibc=r.get("glibc"))


def run(ex: Export, art: ArtifactInfo, devices: list[Device], opts: AnsibleOptions,
        on_result: Callable[[DeviceResult], None] | None = None, keep: bool = False) -> list[DeviceResult]:
    """Run the exported playbook; one DeviceResult per device, in the devices' order."""
    try:
        import ansible_runner
    except ImportError:
        raise ToolMissingError("ansible-runner is not installed", hint="bash .ci/deps-ansible.sh installs "
                               "ansible-core and ansible-runner (pinned)") from None
    binary = _playbook_binary()
    col = Collector(on_result)
    col.devices, col.art = {d.name: d for d in devices}, art
    # bounded: every batch may wait for a lock, connect, upload and run its selftest
    per_batch = opts.lock_wait + opts.selftest_timeout + 10 * opts.connect_timeout + 120
    limit = int(per_batch * max(1, len(ex.batches)))
    work = Path(tempfile.mkdtemp(prefix="edgepack-ansible-"))
    t0 = time.monotonic()
    try:
        r = ansible_runner.run(private_data_dir=str(work), project_dir=str(ex.folder), playbook=ex.playbook.name,
                               inventory=str(ex.inventory), quiet=True, event_handler=col,
                               # runner runs `ansible-playbook` from PATH (a `binary` would drop the playbook)
                               # runner would set ANSIBLE_HOST_KEY_CHECKING=False by default
                               envvars={"ANSIBLE_CONFIG": str(ex.config), "ANSIBLE_FORCE_COLOR": "0",
                                        "ANSIBLE_HOST_KEY_CHECKING": "True",
                                        "PATH": str(Path(binary).parent) + os.pathsep + os.environ.get("PATH", "")},
                               timeout=limit, suppress_env_files=True)
        stdout = r.stdout.read() if r.stdout else ""
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)
    if r.status == "timeout":
        raise DeployError(f"the Ansible roll-out did not finish within {limit} s; devices not yet switched "
                          "keep their previous version", hint="raise --selftest-timeout / --lock-wait, or look "
                          f"at the run with: cd {ex.folder} && ansible-playbook site.yml")
    if not col.lines and not col.unreachable:
        tail = "\n".join(stdout.strip().splitlines()[-8:])
        raise DeployError(f"ansible-playbook ended ({r.status}, exit {r.rc}) without a result for any device "
                          f"after {time.monotonic() - t0:.0f} s: {tail}",
                          hint=f"run it yourself to see why: cd {ex.folder} && ansible-playbook site.yml")
    return [col.result(d, art) for d in devices]
