#!/usr/bin/env bash
# Machine set-up for the deploy tests (tests/test_deploy*.py, tests/lab/): idempotent, run as root on a
# fresh Debian 12 by scripts/setup.sh / .ci/run after `apt-get update`.
#   openssh-server   sshd, started by the tests themselves with their own configs (never the system one)
#   openssh-client   ssh-keygen for the lab's host and client keys
#   debootstrap      the Jetson-like arm64 Debian 11 (glibc 2.31) root filesystem
#   qemu-user        qemu-aarch64 for the arm64 (binfmt) devices; qemu-user-static is only *extracted*
#                    (its package conflicts with qemu-user-binfmt)
#   util-linux       unshare (user + mount namespaces)
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=.ci/lib.sh
source .ci/lib.sh  # after the cd above: paths are from the repository root
apt_install openssh-server openssh-client debootstrap qemu-user util-linux coreutils
# The bullseye arm64 rootfs (~30-60 s, 200 MB) and a static qemu-aarch64, cached in
# ${EDGEPACK_LAB_CACHE:-/var/cache/edgepack-lab}; the mirror comes from this machine's apt sources.
$SUDO env EDGEPACK_LAB_CACHE="${EDGEPACK_LAB_CACHE:-/var/cache/edgepack-lab}" "$(command -v "$PYTHON")" tests/lab/rootfs.py
