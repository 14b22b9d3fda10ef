#!/usr/bin/env bash
# Build the one-file Linux x86_64 edgepack with PyInstaller: dist/frozen/edgepack (or $1).
#   bash scripts/freeze.sh [OUT_DIR]
# Needs: pip install -e . (edgepack's own pins), pnnx (--no-deps), pyinstaller==6.22.0 (.ci/deps-freeze.sh).
# The binary needs the glibc of the machine it was built on or newer (see docs/reproducible.md):
# build on the oldest distribution you want to support.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-dist/frozen}"
PYTHON="${PYTHON:-python3}"
want=6.22.0
have="$("$PYTHON" -c 'import PyInstaller; print(PyInstaller.__version__)' 2>/dev/null || true)"
if [ "$have" != "$want" ]; then
    echo "freeze: PyInstaller $want is needed (found: ${have:-none}); run: bash .ci/deps-freeze.sh" >&2
    exit 3
fi
start=$(date +%s)
"$PYTHON" -m PyInstaller packaging/edgepack.spec --distpath "$OUT" --workpath build/pyinstaller --noconfirm \
    --log-level "${FREEZE_LOG_LEVEL:-WARN}"
end=$(date +%s)
size=$(stat -c %s "$OUT/edgepack")
glibc="$("$PYTHON" packaging/glibc_needed.py "$OUT/edgepack")"
echo "freeze: $OUT/edgepack $((size / 1000000)) MB in $((end - start)) s; needs glibc >= $glibc"
