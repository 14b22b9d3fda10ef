"""Ansible filter plugin written as filter_plugins/edgepack.py next to an exported playbook.

It runs on the controller inside Ansible and imports nothing from edgepack (teams run the playbook
without edgepack installed). It reads what edgepack-step.sh prints (`@key value` lines), names this
machine as the owner of a device's lock in the format of edgepack/deploy/lock.py, and applies lock.py's
rule that a lock whose holder ran on this machine (same boot, same PID namespace) and has ended is stale.
"""
from __future__ import annotations

import json
import os
import re
import socket

_TEXT_RE = re.compile(r"^(PASS|FAIL)\b", re.M)
_LAT_RE = re.compile(r"latency_ms=([0-9.]+)")


def _read(path):
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _pidns():
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def edgepack_parse(text):
    """`@key value` lines -> {key: value} (the last wins); `@owner k=v` lines -> owner_k keys."""
    out = {}
    for line in str(text or "").splitlines():
        line = line.strip()
        if not line.startswith("@"):
            continue
        key, _, value = line[1:].partition(" ")
        if key == "owner":
            k, _, v = value.partition("=")
            out["owner_" + k.strip()] = v.strip()
        else:
            out[key] = value.strip()
    return out


def edgepack_owner(device, token, op):
    """The lock's owner lines: who we are, precisely enough to tell later whether we still run. The
    pid is the ansible-playbook process (the parent of the worker that templates this)."""
    me = {"host": socket.gethostname(), "pid": str(os.getppid()),
          "boot": _read("/proc/sys/kernel/random/boot_id"), "pidns": _pidns(), "token": str(token),
          "device": str(device).replace("\n", " "), "op": str(op)}
    return [f"{k}={v}" for k, v in me.items()]


def edgepack_lock_stale(text, stale_after):
    p = edgepack_parse(text)
    if "held" not in p:
        return False
    now, mtime = p.get("now", ""), p.get("mtime", "")
    if now.isdigit() and mtime.isdigit() and int(now) - int(mtime) > float(stale_after):
        return True
    boot, pidns = _read("/proc/sys/kernel/random/boot_id"), _pidns()
    if not (boot and pidns and p.get("owner_boot") == boot and p.get("owner_pidns") == pidns):
        return False  # another machine or PID namespace: only its age can tell
    pid = p.get("owner_pid", "")
    if not pid.isdigit() or int(pid) == os.getppid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass
    return False


def edgepack_holder(text):
    p = edgepack_parse(text)
    who = (f"{p.get('owner_op', 'deploy')} of device {p.get('owner_device', '?')} from "
           f"{p.get('owner_host', '?')} pid {p.get('owner_pid', '?')}")
    now, mtime = p.get("now", ""), p.get("mtime", "")
    return who + (f", {int(now) - int(mtime)} s ago" if now.isdigit() and mtime.isdigit() else "")


def _json_object(text):
    for candidate in [text.strip()] + [ln for ln in reversed(text.splitlines()) if ln.strip().startswith("{")]:
        try:
            obj = json.loads(candidate)
        except ValueError:
            continue
        if isinstance(obj, dict):
            return obj
    return None


def edgepack_selftest(text, timeout=None):
    """The artifact's verdict, as deploy/selftest.py reads it: exit 0 AND a PASS verdict."""
    text = str(text or "")
    rc_lines = [ln for ln in text.splitlines() if ln.startswith("@rc ")]
    rc = int(rc_lines[-1][4:]) if rc_lines and rc_lines[-1][4:].strip().lstrip("-").isdigit() else -1
    output = "\n".join(ln for ln in text.splitlines() if not ln.startswith("@rc ")).strip()
    obj = _json_object(output)
    latency = None
    if obj is not None:
        verdict = str(obj.get("result", "")).upper()
        try:
            latency = float(obj.get("latency_ms"))
        except (TypeError, ValueError):
            latency = None
    else:
        m = _TEXT_RE.search(output)
        verdict = m.group(1) if m else ""
        lat = _LAT_RE.search(output)
        latency = float(lat.group(1)) if lat else None
    passed = rc == 0 and verdict == "PASS"
    if rc == 124 and timeout is not None:
        message = f"selftest did not finish within {float(timeout):g} s on the device"
        hint = ("raise --selftest-timeout for slow (emulated) devices, or run the artifact's selftest on the "
                "device to see where it hangs")
    else:
        message = f"selftest failed on the device (exit {rc})"
        hint = "run the artifact's selftest locally; check the target (CPU features, glibc) matches the device"
    return {"passed": passed, "rc": rc, "latency_ms": latency, "output": output[-4000:],
            "message": message, "hint": "" if passed else hint}


def edgepack_failure(result):
    """One line for a failed task: our step's own message, else Ansible's."""
    if not isinstance(result, dict):
        return str(result)
    for key in ("stderr", "stdout"):
        lines = [ln.strip() for ln in str(result.get(key) or "").splitlines()
                 if ln.strip() and not ln.startswith("@")]
        if lines and result.get("rc") not in (None, 0):
            return lines[-1]
    return str(result.get("msg") or "failed")


class FilterModule:
    def filters(self):
        return {f.__name__: f for f in (edgepack_parse, edgepack_owner, edgepack_lock_stale, edgepack_holder,
                                        edgepack_selftest, edgepack_failure)}
