"""Devices from a TOML inventory and from ~/.ssh/config aliases.

devices.toml::

    known_hosts = "~/.ssh/known_hosts"      # optional
    [defaults]                              # optional: user, port, key, dest, target
    user = "edge"
    [devices.cam-01]
    host = "192.0.2.10"                     # required
    port = 22
    user = "edge"
    key = "~/.ssh/id_ed25519"               # or a list; none: SSH agent / default keys
    target = "jetson-orin"
    dest = "/opt/edgepack/tiny"
    tags = ["jetson", "line-1"]

Explicit values win over ~/.ssh/config (HostName, User, Port, IdentityFile), as with ssh itself.
"""
from __future__ import annotations

import difflib
import os
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

import paramiko

from ..errors import UsageError
from .device import LOCAL, Device, local_device, parse_spec

_DEVICE_KEYS = {"host", "port", "user", "key", "target", "dest", "tags"}
_TOP_KEYS = {"known_hosts", "defaults", "devices"}


@dataclass(frozen=True)
class Inventory:
    path: Path | None
    devices: dict
    known_hosts: str | None = None

    def names(self) -> list[str]:
        return sorted(self.devices)


def _unknown(keys, known, where: str) -> None:
    bad = set(keys) - known
    if bad:
        detail = ", ".join(f"{k!r}" + (f" (did you mean {c[0]!r}?)" if (c := difflib.get_close_matches(k, known, n=1))
                                       else "") for k in sorted(bad))
        raise UsageError(f"{where}: unknown key(s) {detail}", hint=f"known keys: {', '.join(sorted(known))}")


def _str_list(value, where: str, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise UsageError(f"{where}: {key!r} must be a string or a list of strings")


def _device_from_table(name: str, data: dict, defaults: dict, where: str, known_hosts: str | None) -> Device:
    if not isinstance(data, dict):
        raise UsageError(f"{where}: must be a table ([devices.{name}])")
    _unknown(data, _DEVICE_KEYS, where)
    merged = {**defaults, **data}
    host = merged.get("host")
    if not isinstance(host, str) or not host:
        raise UsageError(f"{where}: 'host' is required (an address, DNS name or ~/.ssh/config alias)")
    port = merged.get("port")
    if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
        raise UsageError(f"{where}: 'port' must be an integer 1-65535, got {port!r}")
    for key in ("user", "target", "dest"):
        if key in merged and not isinstance(merged[key], str):
            raise UsageError(f"{where}: {key!r} must be a string")
    keys = _str_list(merged["key"], where, "key") if "key" in merged else ()
    tags = _str_list(merged.get("tags", []), where, "tags")
    return Device(name=name, host=host, port=port or 0, user=merged.get("user"),
                  keys=tuple(os.path.expanduser(k) for k in keys), target=merged.get("target"),
                  dest=merged.get("dest"), tags=tags, known_hosts=known_hosts)


def load_inventory(path: Path) -> Inventory:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise UsageError(f"inventory {path} does not exist", hint="pass --inventory PATH to a devices.toml") from None
    except OSError as exc:
        raise UsageError(f"cannot read inventory {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"inventory {path} is not valid TOML: {exc}") from None
    _unknown(data, _TOP_KEYS, str(path))
    known_hosts = data.get("known_hosts")
    if known_hosts is not None and not isinstance(known_hosts, str):
        raise UsageError(f"{path}: 'known_hosts' must be a path string")
    known_hosts = os.path.expanduser(known_hosts) if known_hosts else None
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        raise UsageError(f"{path}: [defaults] must be a table")
    _unknown(defaults, _DEVICE_KEYS - {"host"}, f"{path} [defaults]")
    tables = data.get("devices", {})
    if not isinstance(tables, dict) or not tables:
        raise UsageError(f"{path}: no [devices.NAME] tables", hint="see `edgepack deploy --help` for the format")
    devices = {name: _device_from_table(name, t, defaults, f"{path} [devices.{name}]", known_hosts)
               for name, t in tables.items()}
    return Inventory(path=path, devices=devices, known_hosts=known_hosts)


def _ssh_config(path: Path | None) -> paramiko.SSHConfig | None:
    if path is None or not Path(path).is_file():
        return None
    try:
        return paramiko.SSHConfig.from_path(str(path))
    except Exception as exc:  # paramiko raises several types for bad syntax
        raise UsageError(f"cannot parse ssh config {path}: {exc}") from None


def apply_ssh_config(dev: Device, cfg: paramiko.SSHConfig | None) -> Device:
    """Fill what the device record leaves open from ~/.ssh/config (HostName, User, Port, IdentityFile)."""
    if dev.local:
        return dev
    found = cfg.lookup(dev.host) if cfg is not None else {}
    host = found.get("hostname", dev.host)
    user = dev.user or found.get("user")
    port = dev.port or int(found.get("port", 22))
    keys = dev.keys or tuple(os.path.expanduser(k) for k in found.get("identityfile", []))
    return replace(dev, host=host, user=user, port=port, keys=keys)


def _could_be_a_host(name: str, cfg: paramiko.SSHConfig | None) -> bool:
    """A bare word that no inventory names is a device only if ~/.ssh/config or /etc/hosts knows it, or it
    looks like a DNS name or an address: otherwise a typo would surface later as a DNS error."""
    if "." in name or ":" in name or name == "localhost":
        return True
    if cfg is not None and name in cfg.get_hostnames():
        return True
    try:
        hosts = Path("/etc/hosts").read_text(errors="replace")
    except OSError:
        return False
    return any(name in line.split("#", 1)[0].split()[1:] for line in hosts.splitlines())


def select_devices(specs: list[str], tags: list[str], inventory: Inventory | None,
                   ssh_config: Path | None) -> list[Device]:
    """Devices named on the command line (inventory names, ssh aliases, user@host[:port], `local`) plus
    every inventory device carrying one of ``tags``; in the order given, without duplicates."""
    cfg = _ssh_config(ssh_config)
    out: list[Device] = []
    for spec in specs:
        for item in (s.strip() for s in spec.split(",")):
            if not item:
                continue
            if inventory is not None and item in inventory.devices:
                dev = inventory.devices[item]
            elif item == LOCAL:
                dev = local_device()
            else:
                user, host, port = parse_spec(item)
                if user is None and port is None and not _could_be_a_host(host, cfg):
                    where = f"{inventory.path}" if inventory is not None else "no inventory given"
                    raise UsageError(f"device {item!r} is neither in the inventory ({where}) nor a Host in "
                                     f"{ssh_config or '~/.ssh/config'}",
                                     hint=(f"inventory names: {', '.join(inventory.names())}; " if inventory else "")
                                     + "or write user@host[:port] for a machine known to neither")
                dev = Device(name=item, host=host, port=port or 0, user=user)
            out.append(dev)
    for tag in tags:
        if inventory is None:
            raise UsageError(f"--tag {tag} needs an inventory", hint="pass --inventory devices.toml")
        hits = [d for n, d in sorted(inventory.devices.items()) if tag in d.tags]
        if not hits:
            known = sorted({t for d in inventory.devices.values() for t in d.tags})
            raise UsageError(f"no device in {inventory.path} has tag {tag!r}",
                             hint=f"tags there: {', '.join(known) or 'none'}")
        out += hits
    if not out:
        names = f" (inventory has: {', '.join(inventory.names())})" if inventory else ""
        raise UsageError(f"no device selected{names}", hint="pass --device NAME|user@host[:port] or --tag TAG")
    unique, seen = [], set()
    for d in out:
        if d.name not in seen:
            seen.add(d.name)
            unique.append(apply_ssh_config(d, cfg))
    return unique
