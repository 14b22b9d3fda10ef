#!/usr/bin/env bash
# Machine set-up for the TVM backend and its tests (tests/test_tvm*.py, bench/bench_tvm*.py):
# idempotent, run as root on a fresh Debian 12 by scripts/setup.sh / .ci/run after `apt-get update`
# and `pip install .`.
#   apache-tvm 0.27.0.post1      relax compiler (LLVM inside) + the runtime sources edgepack builds
#   apache-tvm-ffi 0.1.14.post1  exact pin: 0.1.15.post2 segfaults serialising functions (shared notes)
#   psutil, cloudpickle,         MetaSchedule (`edgepack tune`): worker pools and the XGBoost cost model
#   xgboost-cpu (+ scipy)
# No apt packages beyond the base set-up (qemu-user, llvm): the TVM runtime is compiled with zig,
# without CMake. The apache-tvm-ffi sdist itself is fetched (sha256-pinned) on first use through
# pip's configured index, like the ncnn sdist.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
want=(
    "apache-tvm==0.27.0.post1"
    "apache-tvm-ffi==0.1.14.post1"
    "psutil==7.2.2"
    "cloudpickle==2.1.0"
    "xgboost-cpu==3.2.0"
    "scipy==1.17.1"
)
missing=()
for req in "${want[@]}"; do
    name="${req%%==*}"; version="${req##*==}"
    have="$("$PYTHON" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)"
    [ "$have" = "$version" ] || missing+=("$req")
done
if [ "${#missing[@]}" -gt 0 ]; then
    # All pins in one resolver run, so apache-tvm's ">=0.1.14.post0" cannot pull a newer tvm-ffi.
    "$PYTHON" -m pip install "${want[@]}"
fi
"$PYTHON" - <<'PY'
import importlib.metadata as md
assert md.version("apache-tvm-ffi") == "0.1.14.post1", md.version("apache-tvm-ffi")
import tvm  # noqa: F401
from pathlib import Path
assert (Path(tvm.__file__).parent / "src" / "runtime" / "vm" / "vm.cc").is_file(), "wheel without runtime sources"
print("TVM backend dependencies ready")
PY
