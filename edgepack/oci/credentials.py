"""Registry credentials from the places Docker, Podman and skopeo keep them, never from argv.

Order: ``EDGEPACK_REGISTRY_USER`` + ``EDGEPACK_REGISTRY_PASSWORD``; ``$REGISTRY_AUTH_FILE``;
``$XDG_RUNTIME_DIR/containers/auth.json``; ``$DOCKER_CONFIG/config.json``; ``~/.docker/config.json``.
In a file, an ``auths`` entry (``auth`` = base64 user:password, or ``username``/``password``) wins over
``credHelpers`` / ``credsStore`` (``docker-credential-NAME get``, the host name on its stdin). The secret
only ever lives in this object's fields: its repr hides it, and nothing here logs it.
"""
from __future__ import annotations

import base64
import binascii
import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import RegistryAuthError


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)
    source: str = ""          # where they came from, for messages ("EDGEPACK_REGISTRY_USER", a file path)

    def __repr__(self) -> str:
        return f"Credentials(username={self.username!r}, source={self.source!r})"


def auth_files() -> list[Path]:
    files = []
    if os.environ.get("REGISTRY_AUTH_FILE"):
        files.append(Path(os.environ["REGISTRY_AUTH_FILE"]).expanduser())
    if os.environ.get("XDG_RUNTIME_DIR"):
        files.append(Path(os.environ["XDG_RUNTIME_DIR"]) / "containers" / "auth.json")
    if os.environ.get("DOCKER_CONFIG"):
        files.append(Path(os.environ["DOCKER_CONFIG"]).expanduser() / "config.json")
    files.append(Path("~/.docker/config.json").expanduser())
    return files


def _keys(registry: str) -> list[str]:
    """The spellings a config file may use for one registry (Docker writes URLs for its own hub)."""
    return [registry, f"https://{registry}", f"http://{registry}", f"https://{registry}/v2/",
            f"https://{registry}/v1/", f"http://{registry}/v2/"]


def _from_entry(entry: dict, where: str) -> tuple[str, str] | None:
    if entry.get("auth"):
        try:
            user, sep, pw = base64.b64decode(entry["auth"], validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            raise RegistryAuthError(f"{where}: the `auth` value is not base64 of USER:PASSWORD",
                                    hint="log in again (docker login / podman login) or fix the file") from None
        if not sep:
            raise RegistryAuthError(f"{where}: the `auth` value has no ':' between user and password")
        return user, pw
    if entry.get("username") and entry.get("password"):
        return str(entry["username"]), str(entry["password"])
    return None


def _helper(name: str, registry: str, where: str) -> tuple[str, str] | None:
    exe = f"docker-credential-{name}"
    try:
        proc = subprocess.run([exe, "get"], input=registry, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        raise RegistryAuthError(f"{where} names the credential helper {exe}, which could not be run",
                                hint=f"install {exe} or remove it from the file") from None
    if proc.returncode != 0:
        return None  # "credentials not found": the helper's stdout is not shown (it may hold a secret)
    try:
        data = json.loads(proc.stdout)
        return str(data["Username"]), str(data["Secret"])
    except (ValueError, KeyError, TypeError):
        raise RegistryAuthError(f"{exe} answered something that is not credentials JSON") from None


def _from_file(path: Path, registry: str) -> Credentials | None:
    try:
        conf = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise RegistryAuthError(f"{path}: cannot read registry credentials ({exc})",
                                hint="fix or remove the file") from None
    if not isinstance(conf, dict):
        raise RegistryAuthError(f"{path}: not a JSON object")
    auths = conf.get("auths") or {}
    for key in _keys(registry):
        if isinstance(auths.get(key), dict):
            got = _from_entry(auths[key], f"{path} (auths.{key})")
            if got:
                return Credentials(*got, source=str(path))
    helper = (conf.get("credHelpers") or {}).get(registry) or conf.get("credsStore")
    if helper:
        got = _helper(str(helper), registry, str(path))
        if got:
            return Credentials(*got, source=f"{path} (docker-credential-{helper})")
    return None


def find_credentials(registry: str) -> Credentials | None:
    user, pw = os.environ.get("EDGEPACK_REGISTRY_USER"), os.environ.get("EDGEPACK_REGISTRY_PASSWORD")
    if user and pw:
        return Credentials(user, pw, source="EDGEPACK_REGISTRY_USER/EDGEPACK_REGISTRY_PASSWORD")
    if user or pw:
        raise RegistryAuthError("only one of EDGEPACK_REGISTRY_USER and EDGEPACK_REGISTRY_PASSWORD is set",
                                hint="set both, or neither (then the Docker/Podman credential files are read)")
    for path in auth_files():
        creds = _from_file(path, registry)
        if creds:
            return creds
    return None
