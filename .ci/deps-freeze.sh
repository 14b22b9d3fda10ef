#!/usr/bin/env bash
# Set-up for tests/test_frozen.py and tests/test_ci_example.py: idempotent, run on a fresh Debian 12 by
# scripts/setup.sh / .ci/run after `pip install -e ".[test]"`.
#   pyinstaller (+ its hooks and altgraph)   scripts/freeze.sh: the one-file Linux edgepack
#   jsonschema (+ its dependencies)          validates `edgepack build --json` against docs/build-result.schema.json
#   pyyaml                                   reads examples/ci/github-actions.yml in the CI-example test
# System tools the CI example and the frozen binary use (cmake, ninja-build, qemu-user, llvm, file) are
# installed by scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m pip install -q \
    "pyinstaller==6.22.0" "pyinstaller-hooks-contrib==2026.9" "altgraph==0.17.5" \
    "jsonschema==4.26.0" "jsonschema-specifications==2025.9.1" "referencing==0.37.0" "rpds-py==0.30.0" \
    "attrs==26.1.0" "pyyaml==6.0.3"
"$PYTHON" -c "import PyInstaller, jsonschema, yaml; print('freeze deps: PyInstaller', PyInstaller.__version__)"
