# shellcheck shell=bash
# Sourced (not run) by the .ci/deps-*.sh set-up scripts: the shared preamble they all need.
# PYTHON is the one interpreter every step installs into (scripts/setup.sh exports it).
# shellcheck disable=SC2034  # PYTHON is used by the scripts that source this file
PYTHON="${PYTHON:-python3}"
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive

# apt_install PKG...: install the Debian packages that are not installed yet (idempotent; the caller's
# set-up ran `apt-get update` first).
apt_install() {
    local need=() pkg
    for pkg in "$@"; do
        dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
    done
    if [ "${#need[@]}" -gt 0 ]; then
        $SUDO apt-get install -y --no-install-recommends "${need[@]}"
    fi
}
