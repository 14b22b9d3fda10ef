"""The CI example (examples/ci/github-actions.yml) run locally: every `run:` step of the workflow, in
its order, with its env, against the warm default edgepack cache; the caches it restores and the
folder it uploads must be what edgepack and the script really use; `build --json` is validated
against docs/build-result.schema.json.

Numbers it prints (pytest -s): the whole-matrix build time on a warm cache.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import yaml

from edgepack.cache import cache_root, sha256_file

from conftest import REPO, run_edgepack
from models import topk_model

WORKFLOW = REPO / "examples" / "ci" / "github-actions.yml"
SCRIPT = REPO / "examples" / "ci" / "run_ci_example.sh"
SCHEMA = json.loads((REPO / "docs" / "build-result.schema.json").read_text())
MATRIX = {"x86_64", "arm64", "jetson-orin", "jetson-xavier", "android-arm64"}


def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def job_steps() -> list[dict]:
    (job,) = workflow()["jobs"].values()
    return job["steps"]


def local_env(out: Path) -> dict[str, str]:
    """The workflow's env with GitHub's expressions replaced by this machine's values."""
    env = dict(os.environ)
    for key, value in workflow()["env"].items():
        env[key] = str(value)
    env["EDGEPACK_CACHE"] = str(cache_root())   # ${{ github.workspace }}/.edgepack-cache on GitHub
    env["OUT"] = str(out)
    env.pop("EDGEPACK_SPEC")                     # edgepack is installed (pip install -e .) here
    env["EDGEPACK"] = str(Path(sys.executable).parent / "edgepack")
    assert not [v for v in env.values() if "${{" in v]
    return env


def test_workflow_runs_the_script_steps_in_order_and_caches_what_edgepack_writes(tmp_path):
    wf = workflow()
    assert (wf.get("on") or wf.get(True)) is not None   # YAML 1.1 reads the key `on` as true
    steps = job_steps()
    runs = [s["run"] for s in steps if "run" in s]
    assert runs == [f"bash examples/ci/run_ci_example.sh {s}" for s in ("install", "doctor", "build", "selftest",
                                                                          "collect")]
    uses = [s["uses"].split("@")[0] for s in steps if "uses" in s]
    assert uses == ["actions/checkout", "actions/setup-python", "actions/cache", "actions/cache",
                    "actions/upload-artifact"]
    # every cached folder is one edgepack fills (the default cache is warm after the other tests)
    assert wf["env"]["EDGEPACK_CACHE"].endswith("/.edgepack-cache")
    cached = [p.strip() for s in steps if s.get("uses", "").startswith("actions/cache")
              for p in s["with"]["path"].splitlines() if p.strip()]
    assert {p.split("/")[1] for p in cached} >= {"ncnn", "src", "zig-global"}
    for p in cached:
        assert p.startswith(".edgepack-cache/"), p
        assert (cache_root() / p.split("/", 1)[1]).is_dir(), f"{p}: edgepack wrote no such folder"
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["with"]["path"] == wf["env"]["OUT"] + "/upload"
    assert wf["env"]["TARGETS"] == "--all" and (REPO / wf["env"]["MODEL"]).is_file()


def test_ci_steps_locally_build_the_whole_matrix(tmp_path):
    out = tmp_path / "out"
    env = local_env(out)
    timings = {}
    for step in job_steps():
        if "run" not in step:
            continue
        t0 = time.monotonic()
        proc = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=5400)
        timings[step["run"].split()[-1]] = time.monotonic() - t0
        assert proc.returncode == 0, f"{step['run']}:\n{(proc.stdout + proc.stderr)[-4000:]}"
    print("\nCI example, warm cache: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))

    report = json.loads((out / "build.json").read_text())
    jsonschema.validate(report, SCHEMA)
    assert report["ok"] and {r["target"] for r in report["results"]} == MATRIX
    selftests = (out / "selftest.txt").read_text().splitlines()
    assert sorted(re.search(r"target=(\S+)", line).group(1) for line in selftests) == ["arm64", "x86_64"]
    assert all(line.startswith("PASS ") for line in selftests)

    up = out / "upload"
    sums = dict(reversed(line.split()) for line in (up / "SHA256SUMS").read_text().splitlines())
    assert set(sums) == {f"tiny_cnn-{t}" for t in MATRIX}
    for r in report["results"]:
        name = Path(r["file"]).name
        assert sha256_file(up / name) == sums[name] == r["sha256"]
        assert json.loads((up / f"{name}.json").read_text())["target"]["name"] == r["target"]


def test_build_step_passes_edgepack_exit_codes_through(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_text("not onnx")
    env = local_env(tmp_path / "out") | {"MODEL": str(bad)}
    proc = subprocess.run(["bash", str(SCRIPT), "build"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 4, proc.stderr
    assert "no JSON on stdout" in proc.stderr and "Traceback" not in proc.stderr
    proc = subprocess.run(["bash", str(SCRIPT), "deploy"], cwd=REPO, env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown step 'deploy'" in proc.stderr


def test_failed_target_json_matches_the_schema(tmp_path):
    model = topk_model(tmp_path / "topk.onnx")
    proc = run_edgepack("build", str(model), "--target", "x86_64", "--backend", "ncnn", "--out",
                        str(tmp_path / "d"), "--json")
    assert proc.returncode == 5, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    jsonschema.validate(report, SCHEMA)
    (r,) = report["results"]
    assert not report["ok"] and not r["ok"] and r["exit_code"] == 5 and r["sha256"] is None and "TopK" in r["error"]


def test_schema_rejects_what_ci_must_not_accept():
    good = {"schema_version": 1, "edgepack_version": "0.1.0", "model": "m.onnx", "ok": True, "results": [
        {"target": "x86_64", "ok": True, "backend": "ncnn", "file": "d/m-x86_64", "size": 10, "runtime_bytes": 5,
         "max_abs_err": 0.0, "bound": 0.1, "seconds": 1.0, "error": None, "hint": None, "exit_code": 0,
         "notes": [], "sha256": "0" * 64}]}
    jsonschema.validate(good, SCHEMA)
    bad_variants = [
        {**good, "schema_version": 2},
        {**good, "results": []},
        {**good, "surprise": 1},
        {**good, "results": [{**good["results"][0], "sha256": None}]},          # ok without a hash
        {**good, "results": [{**good["results"][0], "ok": False}]},             # failed without an error
        {**good, "results": [{**good["results"][0], "exit_code": 10}]},
    ]
    for bad in bad_variants:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, SCHEMA)
