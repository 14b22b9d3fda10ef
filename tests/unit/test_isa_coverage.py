"""What an x86_64 verification could not run is said, never implied by "verified"."""
from __future__ import annotations

import dataclasses

from edgepack.isa_coverage import host_cpu_flags, kernels_not_run
from edgepack.targets import TargetMatrix


def test_avx512_and_vnni_are_not_run_without_them_on_the_build_machine():
    x86 = TargetMatrix.load().get("x86_64")
    avx2 = frozenset({"sse2", "avx", "fma", "f16c", "avx2"})
    assert kernels_not_run(x86, avx2) == ("AVX-512", "AVX-512 VNNI", "AVX-VNNI")
    assert kernels_not_run(x86, avx2 | {"avx512f", "avx512_vnni"}) == ("AVX-VNNI",)
    assert kernels_not_run(x86, avx2 | {"avx512f", "avx512_vnni", "avx_vnni"}) == ()


def test_qemu_only_verification_runs_none_of_them_whatever_this_machine_has():
    x86 = TargetMatrix.load().get("x86_64")
    qemu_only = dataclasses.replace(x86, verify_cpus=("Haswell-noTSX", "Denverton"))
    assert kernels_not_run(qemu_only, frozenset({"avx512f", "avx512_vnni", "avx_vnni"})) == \
        ("AVX-512", "AVX-512 VNNI", "AVX-VNNI")


def test_arm_targets_have_no_x86_families():
    assert kernels_not_run(TargetMatrix.load().get("arm64"), frozenset()) == ()


def test_host_flags_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert host_cpu_flags(info) == {"fpu", "sse2", "avx2", "avx512f"}
    assert host_cpu_flags(tmp_path / "absent") == frozenset()
