#!/usr/bin/env bash
# Install everything edgepack needs on a fresh Debian/Ubuntu machine (run as root or with sudo).
set -euo pipefail
cd "$(dirname "$0")/.."
# Every set-up step installs into this one Python (a virtual environment's python3 when it is first on PATH).
PYTHON="${PYTHON:-python3}"
export PYTHON
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
# cmake+ninja build libncnn; qemu-user runs Arm artifacts for verification; llvm gives llvm-strip;
# strace counts the patched libncnn's system calls in tests/test_ncnn_threads.py.
$SUDO apt-get install -y --no-install-recommends cmake ninja-build qemu-user llvm file ca-certificates strace
"$PYTHON" -m pip install -e ".[test]"
# pnnx's wheel declares torch, but edgepack only calls its standalone executable.
"$PYTHON" -m pip install --no-deps "pnnx==20261020"
# EDGEPACK_PREFETCH=x86_64,arm64: start the one-time libncnn builds now, so they overlap with the
# downloads below (CI sets it; the build log goes to $TMPDIR/edgepack-prefetch.log).
prefetch_pid=""
prefetch_log="${TMPDIR:-/tmp}/edgepack-prefetch.log"
if [ -n "${EDGEPACK_PREFETCH:-}" ]; then
    "$PYTHON" -m edgepack prefetch --target "$EDGEPACK_PREFETCH" >"$prefetch_log" 2>&1 &
    prefetch_pid=$!
fi
for extra in .ci/deps-*.sh; do
    [ -f "$extra" ] && bash -euo pipefail "$extra"
done
if [ -n "$prefetch_pid" ]; then
    if ! wait "$prefetch_pid"; then
        tail -n 40 "$prefetch_log"
        echo "edgepack prefetch failed (log: $prefetch_log)" >&2
        exit 1
    fi
    tail -n 3 "$prefetch_log"
fi
echo "edgepack set up: $("$PYTHON" -m edgepack --version)"
