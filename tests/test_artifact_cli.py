"""The artifact's own CLI as a person meets it: a short `info`, `--json` for tools, `--version`, `CMD --help`."""
import json
import subprocess


def _run(art, *args):
    return subprocess.run([str(art), *args], capture_output=True, text=True, timeout=120)


def test_info_is_short_and_human_and_json_is_the_manifest(tiny_artifacts):
    art = tiny_artifacts["x86_64"]
    info = _run(art, "info")
    assert info.returncode == 0
    lines = info.stdout.splitlines()
    assert lines[:3] == ["model   tiny_cnn", "target  x86_64", "backend ncnn"]
    assert any(ln.startswith("precision fp16") for ln in lines)
    assert "input   image: float32 [1,3,64,64]" in lines and "output  logits: float32 [1,10]" in lines
    manifest = json.loads(_run(art, "info", "--json").stdout)
    assert manifest["target"]["name"] == "x86_64" and manifest["inputs"][0]["name"] == "image"


def test_version_and_help_per_command(tiny_artifacts):
    art = tiny_artifacts["x86_64"]
    v = _run(art, "--version")
    assert v.returncode == 0 and v.stdout.startswith("tiny_cnn for x86_64 (ncnn), built by edgepack ")
    for cmd in ("run", "serve", "bench", "selftest", "info"):
        h = _run(art, cmd, "--help")
        assert h.returncode == 0 and "usage:" in h.stdout and f"  {cmd}" in h.stdout, (cmd, h.stdout, h.stderr)
    bad = _run(art, "frobnicate")
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown command frobnicate")
