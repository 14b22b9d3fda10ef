#!/usr/bin/env bash
# Machine set-up for issue #5 (baked pre/post-processing, serve, batch, SDK): idempotent, run as root on a
# fresh Debian 12 by scripts/setup.sh / .ci/run after `apt-get update` and `pip install -e .`.
#   libstb-dev       stb_image.h: the artifact's PNG/JPEG/PPM decoder, compiled into every artifact from
#                    /usr/include/stb (not vendored)
#   chromium         headless browser for tests/test_serve_browser.py (the try-it page)
#   chromium-driver  its WebDriver, used by selenium (no browser download)
#   wrk              optional HTTP load tool to cross-check bench/bench_serve.py
#   gcc              host compiler for the ASan/UBSan parser fuzzers (tests/test_fuzz_*.py)
#   g++              host C++ compiler for the arena stress driver (tests/test_arena_pool.py)
#   selenium         drives chromium from Python (pinned; 4.52.0 needs a newer certifi than available)
#   pillow           the tests' independent image decoder for the onnxruntime + numpy reference
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=.ci/lib.sh
source .ci/lib.sh  # after the cd above: paths are from the repository root
apt_install libstb-dev chromium chromium-driver wrk gcc g++
"$PYTHON" -m pip install "selenium==4.50.0" "pillow==13.0.0"
