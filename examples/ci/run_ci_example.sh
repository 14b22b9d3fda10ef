#!/usr/bin/env bash
# The CI example's steps (examples/ci/github-actions.yml runs exactly these), runnable locally:
#   bash examples/ci/run_ci_example.sh install doctor build selftest collect     (or: all)
# Environment (defaults in brackets):
#   MODEL          ONNX model to build                        [examples/tiny_cnn.onnx]
#   OUT            output folder                              [dist/edgepack]
#   TARGETS        edgepack target options                    [--all]
#   EDGEPACK       the edgepack command                       [edgepack; e.g. a frozen binary's path]
#   EDGEPACK_SPEC  what `install` pip-installs when edgepack is missing    [the checkout this script is in]
#   EDGEPACK_CACHE edgepack's cache (libncnn, zig's libc, ...) [~/.cache/edgepack]
# Outputs: $OUT/build.json (`edgepack build --json`, schema docs/build-result.schema.json),
#          $OUT/selftest.txt, $OUT/upload/ (artifacts, their .json manifests, build.json, SHA256SUMS).
# Exit status: the failing step's; `build` exits with edgepack's own code (docs/build-json.md).
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
MODEL="${MODEL:-examples/tiny_cnn.onnx}"
OUT="${OUT:-dist/edgepack}"
TARGETS="${TARGETS:---all}"
EDGEPACK="${EDGEPACK:-edgepack}"
PY="${PYTHON:-python3}"
PNNX_PIN="pnnx==20261020"
QEMU_CPU="${QEMU_CPU:-cortex-a53}"

say() { printf '== %s\n' "$*" >&2; }

step_install() {
    local sudo="" need=() pkg
    [ "$(id -u)" = 0 ] || sudo="sudo"
    # cmake + ninja build libncnn on a cold cache, qemu-user runs Arm artifacts, llvm gives llvm-strip.
    for pkg in cmake ninja-build qemu-user llvm file; do
        dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
    done
    if [ "${#need[@]}" -gt 0 ]; then
        say "apt-get install ${need[*]}"
        $sudo apt-get update -q
        DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${need[@]}"
    fi
    if command -v "$EDGEPACK" >/dev/null 2>&1 && "$EDGEPACK" --version >/dev/null 2>&1; then
        say "edgepack present: $("$EDGEPACK" --version)"
    else
        say "pip install ${EDGEPACK_SPEC:-$HERE/../..}"
        "$PY" -m pip install -q "${EDGEPACK_SPEC:-$HERE/../..}"
        # pnnx's wheel declares torch; edgepack only runs its standalone executable
        "$PY" -m pip install -q --no-deps "$PNNX_PIN"
    fi
}

step_doctor() {
    "$EDGEPACK" doctor
}

step_build() {
    mkdir -p "$OUT"
    local rc=0 t0 t1
    t0=$(date +%s)
    # shellcheck disable=SC2086  # TARGETS is a list of options
    "$EDGEPACK" build "$MODEL" $TARGETS --out "$OUT" --json > "$OUT/build.json" || rc=$?
    t1=$(date +%s)
    say "edgepack build: exit $rc in $((t1 - t0)) s"
    if [ ! -s "$OUT/build.json" ]; then
        say "no JSON on stdout: edgepack stopped before building (bad model, unknown target or usage)"
        return "$rc"
    fi
    "$PY" - "$OUT/build.json" <<'PYEOF'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["schema_version"] == 1, d["schema_version"]
for r in d["results"]:
    if r["ok"]:
        err = "-" if r["max_abs_err"] is None else f"{r['max_abs_err']:.2e} <= {r['bound']:.1e}"
        print(f"PASS {r['target']:<14} {r['backend']:<5} {r['size'] / 1e6:6.2f} MB  err {err}  {r['seconds']:.0f} s  {r['file']}")
    else:
        print(f"FAIL {r['target']:<14} exit {r['exit_code']}: {r['error']}" + (f" (hint: {r['hint']})" if r["hint"] else ""))
PYEOF
    return "$rc"
}

# "<target> <file>" for each artifact that built.
_built() {
    "$PY" -c 'import json,sys; [print(r["target"], r["file"]) for r in json.load(open(sys.argv[1]))["results"] if r["ok"]]' \
        "$OUT/build.json"
}

step_selftest() {
    local ran=0 target file line
    : > "$OUT/selftest.txt"
    while read -r target file; do
        case "$target" in
            x86_64) line="$("$file" selftest --threads 1)" ;;
            arm64) line="$(qemu-aarch64 -cpu "$QEMU_CPU" "$file" selftest --threads 1)" ;;
            *) continue ;;   # other targets were verified under qemu by the build itself
        esac
        echo "$line" | tee -a "$OUT/selftest.txt"
        case "$line" in PASS*) ran=$((ran + 1)) ;; *) say "selftest of $target failed"; return 1 ;; esac
    done < <(_built)
    if [ "$ran" -eq 0 ]; then
        say "no x86_64 or arm64 artifact to selftest"
        return 1
    fi
}

step_collect() {
    local up="$OUT/upload" target file
    rm -rf "$up"
    mkdir -p "$up"
    cp "$OUT/build.json" "$up/"
    [ -f "$OUT/selftest.txt" ] && cp "$OUT/selftest.txt" "$up/"
    while read -r target file; do
        cp "$file" "$up/"
        [ -f "$file.json" ] && cp "$file.json" "$up/"
    done < <(_built)
    # SHA256SUMS itself is excluded by name, so writing it while listing the folder is safe.
    # shellcheck disable=SC2094
    (cd "$up" && find . -maxdepth 1 -type f ! -name SHA256SUMS ! -name '*.json' ! -name '*.txt' -printf '%f\n' \
        | sort | xargs -r sha256sum > SHA256SUMS)
    # the sums must match what edgepack reported
    "$PY" - "$up" <<'PYEOF'
import json, os, sys
up = sys.argv[1]
sums = dict(reversed(l.split()) for l in open(os.path.join(up, "SHA256SUMS")) if l.strip())
for r in json.load(open(os.path.join(up, "build.json")))["results"]:
    if r["ok"]:
        name = os.path.basename(r["file"])
        assert sums.get(name) == r["sha256"], f"{name}: sha256 differs from build.json"
print(f"collected {len(sums)} artifacts in {up}")
PYEOF
}

steps=("$@")
[ "${#steps[@]}" -gt 0 ] || { echo "usage: $0 install|doctor|build|selftest|collect|all ..." >&2; exit 2; }
[ "${steps[*]}" = all ] && steps=(install doctor build selftest collect)
for s in "${steps[@]}"; do
    case "$s" in
        install|doctor|build|selftest|collect) ;;
        *) echo "$0: unknown step '$s' (install, doctor, build, selftest, collect, all)" >&2; exit 2 ;;
    esac
done
for s in "${steps[@]}"; do
    say "step $s"
    "step_$s"
done
