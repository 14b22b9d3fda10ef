"""The on-device layout, and the only ways edgepack changes it.

    DEST/releases/<sha16>/<artifact>      one folder per version, never modified once in place
    DEST/releases/<sha16>/release.json    what it is (artifact name, sha256, target, time)
    DEST/current  -> releases/<sha16>     what runs; replaced atomically by rename(2)
    DEST/previous -> releases/<sha16>     what `rollback` and a failed selftest go back to

    DEST/releases/<sha16>/.edgepack-release   the marker: edgepack made this folder (prune needs it)

A new version is uploaded into DEST/releases/.incoming-<random>/, verified by sha256 on the device and
only then renamed to releases/<sha16>: a cut connection or a full disk leaves an .incoming folder
(removed by the next deploy) but never a half-written release, and never touches `current`.
`current` only ever points at a release whose selftest passed on the device (engine.py tests a release
in place before switching). Pruning removes only marked folders, never through a symlinked `releases`.
"""
from __future__ import annotations

import json
import secrets
import shlex
import time
from dataclasses import dataclass

from ..errors import DeployError
from .artifact import ArtifactInfo
from .connector import Connector, Progress

RELEASES = "releases"
MARKER = ".edgepack-release"
# A shell function: is folder $1 a release edgepack made? A real folder (not a symlink) with the marker,
# or, for releases made before the marker existed, named <sha16> with a release.json recording that sha.
OURS_SH = (f'ours() {{ [ -d "$1" ] && [ ! -L "$1" ] || return 1; '
           f'[ -f "$1/{MARKER}" ] && [ ! -L "$1/{MARKER}" ] && return 0; n="${{1##*/}}"; '
           'case "$n" in *[!0-9a-f]*) return 1;; esac; [ "${#n}" -eq 16 ] && [ ! -L "$1/release.json" ] && '
           'grep -q "\\"sha256\\": \\"$n" "$1/release.json" 2>/dev/null; }\n')


@dataclass(frozen=True)
class Links:
    current: str | None      # "releases/<sha16>" or None
    previous: str | None


def release_dir(artifact: ArtifactInfo) -> str:
    return f"{RELEASES}/{artifact.short}"


def set_link(conn: Connector, dest: str, name: str, target: str | None, timeout: float = 60) -> None:
    """Point DEST/<name> at ``target`` atomically (a fresh link renamed over the old one), or remove it."""
    link = f"{dest}/{name}"
    if target is None:
        res = conn.run(f"rm -f -- {shlex.quote(link)}", timeout)
        if res.rc != 0:
            raise DeployError(f"cannot remove {link}: {res.output}")
        return
    tmp = f"{dest}/.{name}.{secrets.token_hex(4)}"
    conn.symlink(target, tmp)
    conn.rename(tmp, link)


def switch(conn: Connector, dest: str, new: Links) -> None:
    """previous first, then current: if we stop in between, both point at working versions."""
    set_link(conn, dest, "previous", new.previous)
    set_link(conn, dest, "current", new.current)


def upload(conn: Connector, artifact: ArtifactInfo, dest: str, progress: Progress | None,
           timeout: float = 120, releases_exist: bool = False) -> str:
    """Upload, verify on the device, and move into releases/<sha16>. Returns that relative path."""
    rel = release_dir(artifact)
    incoming = f"{dest}/{RELEASES}/.incoming-{secrets.token_hex(6)}"
    q = shlex.quote
    if releases_exist:
        try:
            conn.mkdir(incoming)  # one SFTP request instead of a remote process
        except OSError as exc:
            raise DeployError(f"cannot create {incoming} on the device: {exc.strerror or exc}",
                              hint="check the permissions of --dest (or `dest` in the inventory)") from None
    else:
        res = conn.run(f"mkdir -p -- {q(dest + '/' + RELEASES)} && mkdir -- {q(incoming)}", timeout)
        if res.rc != 0:
            raise DeployError(f"cannot create {dest}/{RELEASES} on the device: {res.output}",
                              hint="pick a writable --dest (or `dest` in the inventory)")
    remote = f"{incoming}/{artifact.name}"
    try:
        conn.write_bytes(artifact.sha256.encode() + b"\n", f"{incoming}/{MARKER}")  # first: prune may clean up
        conn.put(artifact.path, remote, progress)
        conn.write_bytes(json.dumps({"artifact": artifact.name, "sha256": artifact.sha256,
                                     "target": artifact.target, "model": artifact.model,
                                     "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode() + b"\n",
                         f"{incoming}/release.json")
        conn.chmod(remote, 0o755)
    except OSError as exc:
        conn.run(f"rm -rf -- {q(incoming)}", timeout)
        raise DeployError(f"upload to {dest} failed: {exc.strerror or exc or 'SFTP failure'}") from None
    # The device computes the hash itself (what runs is exactly what we built); verify and move in one
    # round trip: only a verified upload becomes releases/<sha16>.
    final = f"{dest}/{rel}"
    res = conn.run(f"h=$(sha256sum < {q(remote)}); h=${{h%% *}}\n"
                   f"if [ \"$h\" = {q(artifact.sha256)} ]; then rm -rf -- {q(final)} && mv -- {q(incoming)} {q(final)}"
                   f" && echo VERIFIED; else echo \"MISMATCH $h\"; rm -rf -- {q(incoming)}; fi", timeout)
    if "VERIFIED" not in res.stdout:
        got = res.stdout.split()[1] if res.stdout.startswith("MISMATCH") and len(res.stdout.split()) > 1 else None
        if got:
            raise DeployError(f"upload corrupted: sha256 on the device is {got[:16]}…, expected "
                              f"{artifact.short}…; the upload was discarded")
        raise DeployError(f"cannot verify/move the upload into {final}: {res.output or 'no sha256sum?'}")
    return rel


def releases_symlink_error(dest: str, target: str) -> DeployError:
    return DeployError(f"{dest}/{RELEASES} is a symlink (-> {target}); edgepack neither installs nor prunes "
                       "through it, so nothing was changed",
                       hint=f"make {dest}/{RELEASES} a real folder (move its contents), or deploy to another "
                            "--dest")


def release_sha(conn: Connector, dest: str, rel: str, name: str, timeout: float = 60) -> str | None:
    """sha256 of DEST/<rel>/<name> when <rel> is a real, marked release folder; else None."""
    q = shlex.quote
    r = f"{dest}/{rel}"
    res = conn.run(f"{OURS_SH}r={q(r)}; ours \"$r\" && "
                   f"h=$(sha256sum < {q(r + '/' + name)}) && echo \"@sha ${{h%% *}}\"", timeout)
    for line in res.stdout.splitlines():
        if line.startswith("@sha ") and len(line) == 5 + 64:
            return line[5:]
    return None


def read_release(conn: Connector, dest: str, rel: str, timeout: float = 60) -> dict | None:
    """release.json of a real, marked release folder, with the sha256 the device computes for its
    artifact now (``sha_now``); None when the folder is missing, a symlink or not edgepack's."""
    q = shlex.quote
    r = f"{dest}/{rel}"
    res = conn.run(f"{OURS_SH}r={q(r)}; ours \"$r\" || exit 0\n"
                   f"echo \"@json $(head -c 65536 \"$r/release.json\" | tr -d '\\n')\"", timeout)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("@json ")), None)
    if line is None:
        return None
    try:
        info = json.loads(line[6:])
    except ValueError:
        info = None
    if not isinstance(info, dict) or not isinstance(info.get("artifact"), str) or "/" in info["artifact"]:
        return {}
    info["sha_now"] = release_sha(conn, dest, rel, info["artifact"], timeout)
    return info


def prune(conn: Connector, dest: str, keep: Links, present: tuple[str, ...] | None = None,
          timeout: float = 120) -> None:
    """Remove edgepack's releases other than current and previous, and leftover .incoming folders.
    Only real folders edgepack made (OURS_SH) are removed (an empty .incoming folder is rmdir'ed): anything
    else a user keeps in DEST/releases stays. Called with the device's lock held."""
    names = [link.split("/", 1)[1] for link in (keep.current, keep.previous) if link and "/" in link]
    if present is not None and not set(present) - set(names):
        return  # nothing to remove: save the round trip
    pattern = "|".join(shlex.quote(n) for n in names) or "''"
    res = conn.run(f"{OURS_SH}R={shlex.quote(dest + '/' + RELEASES)}\n"
                   f"[ -L \"$R\" ] && {{ echo '@symlink'; exit 0; }}\n"
                   f"cd -- \"$R\" 2>/dev/null || exit 0\n"
                   f"for r in * .incoming-*; do\n"
                   f"  case \"$r\" in {pattern}) continue;; esac\n"
                   f"  if ours \"$r\"; then rm -rf -- \"$r\"\n"
                   f"  elif [ -d \"$r\" ] && [ ! -L \"$r\" ]; then\n"
                   f"    case \"$r\" in .incoming-*) rmdir -- \"$r\" 2>/dev/null;; esac\n"
                   f"  fi\n"
                   f"done\ntrue", timeout)
    if "@symlink" in res.stdout:
        raise releases_symlink_error(dest, "?")
