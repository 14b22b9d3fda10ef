"""Facts about a device, gathered with one shell command, and the check that the artifact fits it."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, replace

from ..errors import DeployError
from .artifact import ArtifactInfo
from .connector import Connector
from .device import Device

DEFAULT_DEST = "~/edgepack"
_ARCH_ALIASES = {"amd64": "x86_64", "x86_64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64",
                 "armv7l": "arm", "armv8l": "arm", "armv7": "arm", "armhf": "arm"}
# e_machine in the last 4 hex digits of an ELF binfmt_misc magic (little endian): which arch it runs
_BINFMT_MACHINES = {"3e00": "x86_64", "b700": "aarch64", "2800": "arm"}


@dataclass(frozen=True)
class DeviceFacts:
    uname: str                       # `uname -m` as the device says it
    arch: str                        # normalised: x86_64 | aarch64 | arm | other
    glibc: str | None                # "2.31"; None on musl/busybox systems
    emulates: tuple[str, ...]        # arches the device runs through binfmt_misc (qemu-user)
    home: str
    dest: str                        # absolute install folder on the device
    free_bytes: int | None           # at dest (or its nearest existing parent)
    current: str | None              # target of DEST/current, e.g. "releases/3f2a..."
    previous: str | None
    files: tuple[tuple[str, str], ...]   # (name, sha256) of the files in DEST/current
    releases: tuple[str, ...] = ()       # folder names under DEST/releases (with .incoming-* leftovers)
    has_releases: bool = False           # DEST/releases exists
    releases_link: str | None = None     # where DEST/releases points when it is a symlink (refused)

    def runs(self, arch: str) -> bool:
        return arch == self.arch or arch in self.emulates

    def arch_label(self) -> str:
        extra = [a for a in self.emulates if a != self.arch]
        return self.uname + (f" (+{','.join(extra)} via binfmt)" if extra else "")

    def current_sha(self, name: str | None = None) -> str | None:
        for fname, sha in self.files:
            if fname != "release.json" and (name is None or fname == name):
                return sha
        return None


def dest_for(device: Device, dest: str | None) -> str:
    return dest or device.dest or DEFAULT_DEST


def shell_path(path: str) -> str:
    """A shell word for ``path``: quoted, with a leading ~ (or a relative path) anchored at $HOME."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    if not path.startswith("/"):
        return '"$HOME"/' + shlex.quote(path)
    return shlex.quote(path)


_FILES = "@files"   # the last section: NUL-terminated "<sha256> <name>" records, any name survives


def _state(expect_current: str | None = None) -> str:
    """What a deploy changes: links, releases, and the hash of each file in current (skipped, with
    @same_current, when current still points at ``expect_current``)."""
    same = "" if expect_current is None else \
        f'if [ "$c" = {shlex.quote(expect_current)} ]; then echo "@same_current"; exit 0; fi\n'
    return f"""c=""
[ -d "$D/releases" ] && echo "@has_releases 1"
[ -L "$D/current" ] && c=$(readlink "$D/current") && echo "@current $c"
[ -L "$D/previous" ] && echo "@previous $(readlink "$D/previous")"
for r in "$D"/releases/*/ "$D"/releases/.incoming-*/; do
  r="${{r%/}}"; r="${{r##*/}}"
  case "$r" in *[!0-9a-z.-]*) continue;; esac
  [ -d "$D/releases/$r" ] && echo "@release $r"
done 2>/dev/null
[ -L "$D/releases" ] && echo "@releases_link $(readlink "$D/releases")"
{same}echo "{_FILES}"
for f in "$D"/current/*; do
  [ -f "$f" ] && [ ! -L "$f" ] && [ "${{f##*/}}" != release.json ] || continue
  h=$(sha256sum < "$f") && printf '%s %s\\000' "${{h%% *}}" "${{f##*/}}"
done 2>/dev/null
exit 0
"""


def probe_script(dest: str) -> str:
    # Only release names edgepack could have made are listed (a foreign name with a newline must not
    # forge probe lines). Files are hashed from stdin because sha256sum escapes names holding a backslash
    # or a newline in its own output; names travel NUL-terminated, so any byte in a file name survives.
    # Few processes on purpose: on slow boards (and under qemu) every fork+exec costs tens of ms, so
    # shell builtins (read, parameter expansion) do what head/grep/sed/dirname/od would.
    return f"""D={shell_path(dest)}
echo "@arch $(uname -m)"
echo "@glibc $(getconf GNU_LIBC_VERSION 2>/dev/null || ldd --version 2>&1)"
echo "@home $HOME"
echo "@dest $D"
for f in /proc/sys/fs/binfmt_misc/*; do
  case "$f" in */register|*/status) continue;; esac
  on=""
  while read -r k v; do
    case "$k" in enabled) on=1;; magic) [ -n "$on" ] && echo "@binfmt magic $v";; esac
  done < "$f"
done 2>/dev/null
d="$D"; n=0
while [ ! -d "$d" ] && [ "$n" -lt 64 ]; do d="${{d%/*}}"; d="${{d:-/}}"; n=$((n + 1)); done
df -Pk "$d" 2>/dev/null | {{ last=""; while read -r l; do last="$l"; done; echo "@df $last"; }}
""" + _state()


def state_script(dest: str, expect_current: str | None) -> str:
    """The part of the probe a deploy changes, for a second look under the lock (on a slow board the
    full probe costs seconds); the files are hashed again only when `current` moved meanwhile."""
    return f"D={shell_path(dest)}\n" + _state(expect_current or "")


def refresh(facts: DeviceFacts, text: str) -> DeviceFacts:
    """``facts`` updated with what :func:`state_script` printed."""
    st = parse_probe(text)
    return replace(facts, current=st.current, previous=st.previous, releases=st.releases,
                   has_releases=st.has_releases, releases_link=st.releases_link,
                   files=facts.files if "@same_current" in text.split("\n") else st.files)


def parse_probe(text: str) -> DeviceFacts:
    vals: dict[str, list[str]] = {}
    text, _, records = text.partition(f"\n{_FILES}\n") if not text.startswith(f"{_FILES}\n") \
        else ("", "", text[len(_FILES) + 1:])
    for line in text.splitlines():
        if line.startswith("@"):
            key, _, rest = line[1:].partition(" ")
            vals.setdefault(key, []).append(rest.strip())
    one = lambda k: (vals.get(k) or [""])[0]  # noqa: E731
    uname = one("arch")
    m = re.search(r"(?:glibc|GLIBC)[^0-9]*(\d+\.\d+)", one("glibc")) or \
        re.search(r"^ldd .* (\d+\.\d+)$", one("glibc"))
    emulates = []
    for magic in vals.get("binfmt", []):
        hexmagic = magic.split()[-1] if magic.split() else ""
        arch = _BINFMT_MACHINES.get(hexmagic[-4:]) if hexmagic.startswith("7f454c46") else None
        if arch and arch not in emulates:
            emulates.append(arch)
    df = one("df").split()
    free = int(df[-3]) * 1024 if len(df) >= 6 and df[-3].isdigit() else None
    files = []
    for f in vals.get("file", []):  # the older `sha256sum` form: kept for probes of older versions
        sha, _, name = f.partition("  ")
        if re.fullmatch(r"[0-9a-f]{64}", sha):
            files.append((name, sha))
    for rec in records.split("\0"):
        sha, _, name = rec.partition(" ")
        if re.fullmatch(r"[0-9a-f]{64}", sha) and name:
            files.append((name, sha))
    return DeviceFacts(uname=uname, arch=_ARCH_ALIASES.get(uname, uname), glibc=m.group(1) if m else None,
                       emulates=tuple(emulates), home=one("home"), dest=one("dest"), free_bytes=free,
                       current=one("current") or None, previous=one("previous") or None, files=tuple(files),
                       releases=tuple(vals.get("release", [])), has_releases=bool(vals.get("has_releases")),
                       releases_link=(vals.get("releases_link") or [None])[0])


def probe(conn: Connector, device: Device, dest: str, timeout: float = 60) -> DeviceFacts:
    res = conn.run(probe_script(dest), timeout)
    facts = parse_probe(res.stdout)
    if not facts.uname or not facts.dest:
        raise DeployError(f"{device.name}: the device's shell did not answer the probe (exit {res.rc}): "
                          f"{res.output[-300:]}", hint="edgepack needs a POSIX shell with uname, df and sha256sum")
    return facts


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split("."))


def check_fits(device: Device, artifact: ArtifactInfo, facts: DeviceFacts) -> None:
    """Refuse, before any upload, an artifact the device cannot run."""
    if not facts.runs(artifact.arch):
        raise DeployError(
            f"{device.name} is {facts.uname}, but {artifact.name} is built for {artifact.arch} "
            f"(target {artifact.target}): wrong architecture, nothing was uploaded",
            hint=f"deploy the artifact built for this device's architecture ({facts.arch}), "
                 f"e.g. dist/{artifact.model}-<target for {facts.arch}>")
    if artifact.link == "dynamic" and artifact.glibc:
        if facts.glibc is None:
            raise DeployError(f"{device.name} has no glibc, but {artifact.name} links glibc "
                              f">= {artifact.glibc} dynamically; nothing was uploaded",
                              hint="build for a static musl target instead (e.g. arm64 or jetson-orin)")
        if _version(facts.glibc) < _version(artifact.glibc):
            raise DeployError(f"{device.name} has glibc {facts.glibc}, but {artifact.name} needs glibc >= "
                              f"{artifact.glibc} (target {artifact.target}); nothing was uploaded",
                              hint=f"build with a gnu.{facts.glibc} baseline or a static musl target "
                                   "(e.g. jetson-orin)")
