"""Stand-in artifacts: shell scripts that answer `info`, `selftest [--json]` and `bench [--json]` like a
real artifact, with a sidecar manifest naming their target. They make the fault tests fast and let a
test choose the selftest verdict (also later, on the device: $HOME/.standin-fail-VERSION makes that
version fail, $HOME/.standin-sleep holding N makes every selftest touch $HOME/.standin-started and
sleep N seconds); the end-to-end tests use real artifacts (the tiny_artifacts fixture)."""
from __future__ import annotations

import json
from pathlib import Path

_TRIPLES = {"x86_64": ("x86_64-linux-musl", "static"), "arm64": ("aarch64-linux-musl", "static"),
            "jetson-orin": ("aarch64-linux-musl", "static"), "glibc235-arm64": ("aarch64-linux-gnu.2.35", "dynamic")}


def make_standin(folder: Path, target: str = "x86_64", *, version: str = "1", verdict: str = "PASS",
                 latency_ms: float = 1.25, pad_kb: int = 0, model: str = "tiny_cnn", exit_code: int | None = None) -> Path:
    triple, link = _TRIPLES[target]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{model}-{target}"
    manifest = {"model": {"name": model}, "target": {"name": target, "triple": triple, "link": link},
                "standin_version": version}
    code = exit_code if exit_code is not None else (0 if verdict == "PASS" else 1)
    line = f"{verdict} model={model} target={target} backend=standin max_abs_err=1e-06 bound=1e-03 " \
           f"latency_ms={latency_ms} threads=1"
    js = json.dumps({"result": verdict, "latency_ms": latency_ms, "max_abs_err": 1e-6})
    fail_js = json.dumps({"result": "FAIL", "latency_ms": latency_ms, "max_abs_err": 1.0})
    script = f"""#!/bin/sh
# edgepack stand-in artifact, version {version}
case "$1" in
  info) cat <<'EOF_INFO'
{json.dumps(manifest)}
EOF_INFO
    ;;
  selftest)
    # test hooks (files in the device's home): fail this version, or hang like a stuck device
    if [ -f "$HOME/.standin-fail-{version}" ]; then echo '{fail_js}'; exit 1; fi
    if [ -f "$HOME/.standin-sleep" ]; then : > "$HOME/.standin-started"; sleep "$(cat "$HOME/.standin-sleep")"; fi
    if [ "${{2:-}}" = "--json" ]; then printf '%s\n' '{js}'; else printf '%s\n' '{line}'; fi
    exit {code} ;;
  bench) echo '{{"min_ms": 1.0, "median_ms": 1.1, "p90_ms": 1.3, "peak_rss_kb": 2048}}' ;;
  *) echo "usage: $0 info|selftest|bench" >&2; exit 2 ;;
esac
exit 0
"""
    if pad_kb:
        script += ("# " + "p" * 1021 + "\n") * pad_kb
    path.write_text(script)
    path.chmod(0o755)
    Path(str(path) + ".json").write_text(json.dumps(manifest))
    return path
