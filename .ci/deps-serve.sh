#!/usr/bin/env bash
# Machine set-up for issue #5 (baked pre/post-processing, serve, batch, SDK): idempotent, run as root on a
# fresh Debian 12 by scripts/setup.sh / .ci/run after `apt-get update` and `pip install -e .`.
#   libstb-dev       stb_image.h: the artifact's PNG/JPEG/PPM decoder, compiled into every artifact from
#                    /usr/include/stb (not vendored)
#   chromium         headless browser for tests/test_serve_browser.py (the try-it page)
#   chromium-driver  its WebDriver, used by selenium (no browser download)
#   wrk              optional HTTP load tool to cross-check bench/bench_serve.py
#   gcc              host compiler for the ASan/UBSan parser fuzzers (tests/test_fuzz_*.py)
#   selenium         drives chromium from Python (pinned; 4.52.0 needs a newer certifi than available)
#   pillow           the tests' independent image decoder for the onnxruntime + numpy reference
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
need=()
for pkg in libstb-dev chromium chromium-driver wrk gcc; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
done
if [ "${#need[@]}" -gt 0 ]; then
    $SUDO apt-get install -y --no-install-recommends "${need[@]}"
fi
"$PYTHON" -m pip install "selenium==4.50.0" "pillow==13.0.0"
