#!/usr/bin/env bash
# Install everything edgepack needs on a fresh Debian/Ubuntu machine (run as root or with sudo).
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
# cmake+ninja build libncnn; qemu-user runs Arm artifacts for verification; llvm gives llvm-strip.
$SUDO apt-get install -y --no-install-recommends cmake ninja-build qemu-user llvm file ca-certificates
python3 -m pip install -e ".[test]"
# pnnx's wheel declares torch, but edgepack only calls its standalone executable.
python3 -m pip install --no-deps "pnnx==20261020"
for extra in .ci/deps-*.sh; do
    [ -f "$extra" ] && bash "$extra"
done
echo "edgepack set up: $(python3 -m edgepack --version)"
