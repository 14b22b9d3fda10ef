"""The on-device half of the Ansible roll-out: one POSIX shell script, run with Ansible's `script`
module (no Python needed on the device), doing what deploy/engine.py, release.py and lock.py do over
paramiko, with the same layout, marker, lock folder and owner format.

    sh edgepack-step.sh STEP DEST [ARGS...]

Steps print `@key value` lines (parsed on the controller by filter_plugins/edgepack.py); a step exits
non-zero only when the device itself failed (a full disk, a corrupted upload), with one line saying why.
"""
from __future__ import annotations

import json
import shlex

from .artifact import ArtifactInfo
from .lock import LOCK
from .release import MARKER, OURS_SH, RELEASES

_SCRIPT = r"""#!/bin/sh
# edgepack on-device steps for Ansible: written by `edgepack fleet export-ansible` for @@NAME@@.
# Needs only a POSIX shell with uname, df, sha256sum, mkdir, mv, ln (busybox and toybox have them).
set -u
NAME=@@QNAME@@
SHA=@@SHA@@
SHORT=@@SHORT@@
ARCH=@@ARCH@@
LINK=@@LINK@@
GLIBC=@@GLIBC@@
RELJSON=@@RELJSON@@
step=$1; dest=$2; shift 2
case "$dest" in
  "~") D=$HOME ;;
  "~/"*) D="$HOME/${dest#"~/"}" ;;
  /*) D=$dest ;;
  *) D="$HOME/$dest" ;;
esac
L="$D/@@LOCK@@"
R="$D/@@RELEASES@@"
REL="@@RELEASES@@/$SHORT"
@@OURS@@
arch_of() {
  case "$1" in amd64|x86_64) echo x86_64 ;; aarch64|arm64) echo aarch64 ;;
    armv7l|armv8l|armv7|armhf) echo arm ;; *) echo "$1" ;; esac
}
# point DEST/$1 at $2 by renaming a fresh link over it (rename(2) is atomic); busybox mv lacks -T:
# there the old link is removed first, a short window edgepack's own path (SFTP rename) does not have
relink() {
  t="$D/.$1.$$"
  rm -f -- "$t"; ln -s -- "$2" "$t" || return 1
  mv -T -f -- "$t" "$D/$1" 2>/dev/null || { rm -f -- "$D/$1" && mv -f -- "$t" "$D/$1"; }
}
prune() {
  c=$(readlink "$D/current" 2>/dev/null); p=$(readlink "$D/previous" 2>/dev/null)
  [ -L "$R" ] && return 0
  cd -- "$R" 2>/dev/null || return 0
  for r in * .incoming-*; do
    [ "releases/$r" = "$c" ] || [ "releases/$r" = "$p" ] && continue
    if ours "$r"; then rm -rf -- "$r"
    elif [ -d "$r" ] && [ ! -L "$r" ]; then case "$r" in .incoming-*) rmdir -- "$r" 2>/dev/null ;; esac
    fi
  done
  cd / || true
}
lock_try() {  # $1 token; the rest: owner lines
  tok=$1; shift
  if mkdir -- "$L" 2>/dev/null; then
    printf '%s\n' "$@" > "$L/owner"; cp -- "$0" "$L/step.sh" 2>/dev/null; echo "@locked $tok"; return 0
  fi
  return 1
}
lock_held() {
  now=$(date +%s); mt=$(stat -c %Y -- "$L" 2>/dev/null)
  echo "@held"; echo "@now $now"; echo "@mtime $mt"
  [ -f "$L/owner" ] && while IFS= read -r l; do echo "@owner $l"; done < "$L/owner"
}
case "$step" in
probe)
  m=$(uname -m); a=$(arch_of "$m")
  echo "@arch $m"; echo "@dest $D"
  emu=""
  for f in /proc/sys/fs/binfmt_misc/*; do
    case "$f" in */register|*/status) continue ;; esac
    on=""
    while read -r k v; do
      case "$k" in enabled) on=1 ;; magic) [ -n "$on" ] || continue
        case "$v" in 7f454c46*3e00) emu="$emu x86_64" ;; 7f454c46*b700) emu="$emu aarch64" ;;
          7f454c46*2800) emu="$emu arm" ;; esac ;; esac
    done < "$f"
  done 2>/dev/null
  [ -n "$emu" ] && echo "@emulates$emu"
  g=$(getconf GNU_LIBC_VERSION 2>/dev/null); g=${g##* }
  [ -n "$g" ] && echo "@glibc $g"
  case " $a $emu " in *" $ARCH "*) ;; *)
    echo "@refuse the device is $m, but $NAME is built for $ARCH: wrong architecture, nothing was uploaded"
    exit 0 ;; esac
  if [ "$LINK" = dynamic ] && [ -n "$GLIBC" ]; then
    if [ -z "$g" ]; then echo "@refuse the device has no glibc, but $NAME links glibc >= $GLIBC dynamically; nothing was uploaded"; exit 0; fi
    hm=${g%%.*}; hn=${g#*.}; hn=${hn%%.*}; nm=${GLIBC%%.*}; nn=${GLIBC#*.}; nn=${nn%%.*}
    if [ "$hm" -lt "$nm" ] || { [ "$hm" -eq "$nm" ] && [ "$hn" -lt "$nn" ]; }; then
      echo "@refuse the device has glibc $g, but $NAME needs glibc >= $GLIBC; nothing was uploaded"; exit 0
    fi
  fi
  if [ -L "$R" ]; then echo "@refuse $R is a symlink; edgepack neither installs nor prunes through it, so nothing was changed"; exit 0; fi
  d="$D"; n=0
  while [ ! -d "$d" ] && [ "$n" -lt 64 ]; do d="${d%/*}"; d="${d:-/}"; n=$((n + 1)); done
  df -Pk "$d" 2>/dev/null | { last=""; while read -r l; do last="$l"; done; set -- $last; echo "@free_kb ${4:-}"; }
  [ -L "$D/current" ] && echo "@current $(readlink "$D/current")"
  [ -L "$D/previous" ] && echo "@previous $(readlink "$D/previous")"
  if [ -f "$D/current/$NAME" ]; then h=$(sha256sum < "$D/current/$NAME"); echo "@current_sha ${h%% *}"; fi
  if ours "$R/$SHORT" && [ -f "$R/$SHORT/$NAME" ]; then
    h=$(sha256sum < "$R/$SHORT/$NAME"); [ "${h%% *}" = "$SHA" ] && echo "@have_release 1"
  fi
  exit 0 ;;
lock)  # TOKEN WAIT STALE OWNER-LINES...: take DEST's lock, waiting up to WAIT s (bounded)
  tok=$1; wait=$2; stale=$3; shift 3
  [ -d "$D" ] || mkdir -p -- "$D" || { echo "cannot create $D" >&2; exit 3; }
  start=$(date +%s)
  while :; do
    lock_try "$tok" "$@" && exit 0
    now=$(date +%s); mt=$(stat -c %Y -- "$L" 2>/dev/null)
    if [ -n "$mt" ] && [ $((now - mt)) -gt "$stale" ]; then  # stale by the device's clock: take it over
      g="$L.stale-$$"; mv -- "$L" "$g" 2>/dev/null && rm -rf -- "$g"; continue
    fi
    [ $((now - start)) -ge "$wait" ] && { lock_held; exit 0; }
    sleep 1
  done ;;
takeover)  # OLD-TOKEN: remove the lock only if it is still the one judged stale
  t=""
  [ -f "$L/owner" ] && while IFS='=' read -r k v; do [ "$k" = token ] && t="$v"; done < "$L/owner"
  if [ "$t" = "$1" ]; then g="$L.stale-$$"; mv -- "$L" "$g" && rm -rf -- "$g"; echo "@taken_over"; fi
  exit 0 ;;
unlock)  # TOKEN
  grep -qx "token=$1" "$L/owner" 2>/dev/null && rm -f -- "$L/owner" "$L/step.sh" && rmdir -- "$L"
  exit 0 ;;
prepare)  # INCOMING NEED_KB: a fresh upload folder with edgepack's marker first (so prune may clean it up)
  d="$D"; [ -d "$d" ] || d="${d%/*}"
  free=$(df -Pk "$d" 2>/dev/null | { last=""; while read -r l; do last="$l"; done; set -- $last; echo "${4:-}"; })
  if [ -n "$free" ] && [ "$free" -lt "$2" ] 2>/dev/null; then
    echo "disk full: $D has $free KiB free, $NAME needs $2 KiB; nothing was changed" >&2; exit 4
  fi
  mkdir -p -- "$R" && mkdir -- "$R/$1" && printf '%s\n' "$SHA" > "$R/$1/@@MARKER@@" || exit 3
  echo "@incoming $R/$1"; exit 0 ;;
install)  # INCOMING: verify the sha256 on the device, then move into releases/<sha16>
  i="$R/$1"; f="$i/$NAME"
  printf '%s\n' "$RELJSON" | sed "s/@@WHEN@@/$(date +%Y-%m-%dT%H:%M:%S%z)/" > "$i/release.json" && chmod 755 -- "$f" || {
    echo "cannot write into $i (disk full?)" >&2; rm -rf -- "$i"; exit 4; }
  h=$(sha256sum < "$f"); h=${h%% *}
  if [ "$h" != "$SHA" ]; then
    rm -rf -- "$i"; echo "upload corrupted: sha256 on the device is $h, expected $SHA; the upload was discarded" >&2; exit 5
  fi
  rm -rf -- "$R/$SHORT" && mv -- "$i" "$R/$SHORT" && echo "@installed $REL"; exit $? ;;
selftest)  # TIMEOUT: the new release is tested where it lies, before anything points at it
  to=$1; exe="$R/$SHORT/$NAME"
  if command -v timeout >/dev/null 2>&1; then timeout "$to" "$exe" selftest --json 2>&1; rc=$?
  else "$exe" selftest --json 2>&1; rc=$?; fi
  echo "@rc $rc"; exit 0 ;;
switch)  # previous first, then current: stopped in between, both point at tested versions
  c=$(readlink "$D/current" 2>/dev/null)
  if [ -n "$c" ] && [ "$c" != "$REL" ]; then relink previous "$c" || exit 6; fi
  relink current "$REL" || exit 6
  prune; echo "@switched $REL"; echo "@previous $(readlink "$D/previous" 2>/dev/null)"; exit 0 ;;
discard)  # after a failed selftest or upload: the new release goes, current never moved
  prune; exit 0 ;;
*) echo "unknown step $step" >&2; exit 2 ;;
esac
"""


def step_script(art: ArtifactInfo) -> str:
    q = shlex.quote
    rel = json.dumps({"artifact": art.name, "sha256": art.sha256, "target": art.target, "model": art.model,
                      "installed_at": "@@WHEN@@"})
    values = {"NAME": art.name, "QNAME": q(art.name), "SHA": q(art.sha256), "SHORT": q(art.short),
              "ARCH": q(art.arch), "LINK": q(art.link), "GLIBC": q(art.glibc or ""), "RELJSON": q(rel),
              "LOCK": LOCK, "RELEASES": RELEASES, "MARKER": MARKER, "OURS": OURS_SH.strip()}
    text = _SCRIPT
    for k, v in values.items():
        text = text.replace(f"@@{k}@@", v)
    return text


def extractor(art: ArtifactInfo) -> bytes:
    """A shell script whose last ``size`` bytes are the artifact: Ansible's `script` module uploads and
    runs it without Python on the device, and it writes the artifact into the incoming folder."""
    head = (f"#!/bin/sh\n# edgepack: unpacks {art.name} ({art.sha256}) into the folder given\n"
            f"tail -c {art.size} \"$0\" > \"$1\"/{shlex.quote(art.name)} || exit 4\nexit 0\n")
    return head.encode() + art.path.read_bytes()
