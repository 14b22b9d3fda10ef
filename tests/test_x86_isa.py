"""x86_64 artifacts built with kernels for newer ISAs still run, and agree, on older CPUs.

NCNN: libncnn carries AVX-512 kernels next to SSE2/AVX/FMA/AVX2, dispatched by ncnn at run time;
the artifact runs natively and under qemu-x86_64 on CPU models without AVX-512 (qemu's TCG has no
AVX-512 at all) and without AVX. TVM: the artifact carries kernels for x86-64, x86-64-v3 and
x86-64-v4 and picks by CPUID at start-up; each CPU model gets the level it can run.
"""
from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import onnxruntime as ort
import pytest

from clirun import host_cpu_flags
from conftest import run_edgepack
from edgepack.runner import command_for_cpu

# qemu CPU models: an AVX2 CPU without AVX-512 (v3), and an SSE4.2 one without AVX (baseline here)
CPUS = ["native", "Haswell-noTSX", "Nehalem"]
TVM_LEVEL = {"Haswell-noTSX": "x86-64-v3", "Nehalem": "x86-64"}


def _run(art, cpu, args, env=None):
    return subprocess.run(command_for_cpu(art, cpu) + args, capture_output=True, text=True, timeout=900,
                          env={**os.environ, **(env or {})})


def _outputs(art, cpu, x_path, out_dir, env=None):
    proc = _run(art, cpu, ["run", "--input", f"image={x_path}", "--output", str(out_dir)], env)
    assert proc.returncode == 0, f"{cpu}: {proc.stderr}"
    return np.load(json.loads(proc.stdout)["outputs"]["logits"]["file"]), proc.stderr


def _build(model, backend, out):
    proc = run_edgepack("build", str(model), "--target", "x86_64", "--backend", backend, "--out", str(out),
                        "--json", *(["--tuning-db", "off"] if backend == "tvm" else []))
    report = json.loads(proc.stdout) if proc.stdout.strip() else {}
    assert proc.returncode == 0 and report.get("ok"), proc.stderr[-3000:]
    return report["results"][0], out / f"{model.stem}-x86_64"


@pytest.fixture(scope="module")
def reference(tiny_cnn, tmp_path_factory):
    d = tmp_path_factory.mktemp("x86-input")
    x = np.random.default_rng(7).standard_normal((1, 3, 64, 64)).astype(np.float32)
    np.save(d / "x.npy", x)
    sess = ort.InferenceSession(str(tiny_cnn), providers=["CPUExecutionProvider"])
    return d / "x.npy", sess.run(["logits"], {"image": x})[0]


def test_configure_check_catches_a_dropped_variant():
    from edgepack.backends.ncnn.library import check_x86_archive, check_x86_configure, library_options
    from edgepack.targets import TargetMatrix
    opts = library_options(TargetMatrix.load().get("x86_64"))
    probes = ["AVX", "FMA", "F16C", "AVX2", "AVX512"]
    ok = "".join(f"NCNN_COMPILER_SUPPORT_X86_{p}:INTERNAL=1\n" for p in probes) + "NCNN_AVX512:BOOL=ON\n"
    assert check_x86_configure(ok, opts) == []
    probe_failed = ok.replace("X86_AVX512:INTERNAL=1", "X86_AVX512:INTERNAL=")
    assert check_x86_configure(probe_failed, opts) == ["NCNN_AVX512 (zig's clang failed ncnn's probe "
                                                       "NCNN_COMPILER_SUPPORT_X86_AVX512)"]
    assert check_x86_configure(ok.replace("NCNN_AVX512:BOOL=ON", "NCNN_AVX512:BOOL=OFF"), opts) == [
        "NCNN_AVX512 (configure left it OFF)"]
    have = ["convolution_x86_avx.cpp.o", "convolution_x86_fma.cpp.o", "convolution_x86_avx2.cpp.o"]
    assert check_x86_archive(have, opts) == ["NCNN_AVX512"]
    assert check_x86_archive(have + ["convolution_x86_avx512.cpp.o"], opts) == []


def test_libncnn_x86_64_carries_avx512_kernels():
    from edgepack import proc
    from edgepack.backends.ncnn.library import build_library, library_options
    from edgepack.targets import TargetMatrix
    from edgepack.toolchains import Toolchain
    target, tc = TargetMatrix.load().get("x86_64"), Toolchain.load()
    opts = library_options(target)
    assert opts["NCNN_AVX512"] == "ON" and opts["NCNN_RUNTIME_CPU"] == "ON"
    lib = build_library(target, tc)
    members = proc.run(tc.zig() + ["ar", "t", str(lib.lib)], what="ar t").stdout.split()
    for variant in ("avx512", "avx2", "fma", "avx"):
        assert f"convolution_x86_{variant}.cpp.o" in members, variant
    done = json.loads((lib.root / "done.json").read_text())
    assert done["options"]["NCNN_AVX512"] == "ON"


def test_ncnn_artifact_runs_without_avx512(tiny_cnn, reference, tmp_path):
    res, art = _build(tiny_cnn, "ncnn", tmp_path / "dist")
    assert res["backend"] == "ncnn"
    # the AVX-512 kernels made it into the executable (EVEX-encoded zmm code)
    dis = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(art)], capture_output=True, text=True,
                         timeout=600).stdout
    assert dis.count("%zmm") > 1000
    x_path, want = reference
    for cpu in CPUS:
        st = _run(art, cpu, ["selftest", "--json"])
        assert st.returncode == 0 and json.loads(st.stdout)["result"] == "PASS", f"{cpu}: {st.stdout}{st.stderr}"
        got, _ = _outputs(art, cpu, x_path, tmp_path / f"out-{cpu}")
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * float(np.abs(want).max()))


def test_tvm_artifact_picks_the_isa_by_cpuid(tiny_cnn, reference, tmp_path):
    res, art = _build(tiny_cnn, "tvm", tmp_path / "dist")
    manifest = json.loads((tmp_path / "dist" / "tiny_cnn-x86_64.json").read_text())
    levels = [lv["level"] for lv in manifest["backend"]["isa_levels"]]
    assert levels == ["x86-64", "x86-64-v4", "x86-64-v3"]
    assert all(not lv.get("missing_kernels") for lv in manifest["backend"]["isa_levels"])
    x_path, want = reference
    host = "x86-64-v4" if "avx512f" in host_cpu_flags() else "x86-64-v3"
    for cpu in CPUS:
        st = _run(art, cpu, ["selftest", "--json"])
        assert st.returncode == 0 and json.loads(st.stdout)["result"] == "PASS", f"{cpu}: {st.stdout}{st.stderr}"
        got, err = _outputs(art, cpu, x_path, tmp_path / f"out-{cpu}", {"EDGEPACK_TVM_ISA": "auto"})
        assert f"tvm: kernels for {TVM_LEVEL.get(cpu, host)}" in err, (cpu, err)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    # forcing the baseline natively gives the same answer; forcing a level the CPU lacks is refused
    got, err = _outputs(art, "native", x_path, tmp_path / "out-forced", {"EDGEPACK_TVM_ISA": "x86-64"})
    assert "kernels for x86-64\n" in err
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    bad = _run(art, "Nehalem", ["run", "--input", f"image={x_path}", "--output", str(tmp_path / "o")],
               {"EDGEPACK_TVM_ISA": "x86-64-v3"})
    assert bad.returncode == 2 and "lacks that instruction set" in bad.stderr, bad.stderr
