"""The ncnn engine's arena (runtimes/ncnn/ep_ncnn_pool.cc, the default pool for blobs and workspace)
under AddressSanitizer + UBSan: tests/fuzz/arena_pool_stress.cc walks seeded random requests and
frees, sizes up to past the arena's end, and fails if a block is misaligned, overlaps another, is
handed out again differently on a second identical walk, or if the freed blocks do not merge back
into one; then an arena given a plan (the offsets first fit took) must place every request as planned,
and one given random offsets must refuse those that are not free. The artifacts themselves run on the arena in every other NCNN test."""
from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from edgepack.resources import runtimes_dir

from fuzz_targets import FUZZ, sanitizer_findings


@pytest.fixture(scope="module")
def stress_exe(tmp_path_factory):
    from edgepack.backends.ncnn import library
    from edgepack.targets import TargetMatrix
    from edgepack.toolchains import Toolchain
    cxx = shutil.which("g++") or shutil.which("c++")
    assert cxx, "a host C++ compiler is needed (apt-get install g++)"
    lib = library.build_library(TargetMatrix.load().get("x86_64"), Toolchain.load())  # ncnn's headers
    exe = tmp_path_factory.mktemp("arena") / "arena_pool_stress"
    subprocess.run([cxx, "-O1", "-g", "-std=c++17", "-fsanitize=address,undefined", "-fno-sanitize-recover=all",
                    f"-I{lib.include}", f"-I{lib.include / 'ncnn'}", f"-I{runtimes_dir() / 'ncnn'}",
                    str(FUZZ / "arena_pool_stress.cc"), "-lpthread", "-o", str(exe)], check=True)
    return exe


@pytest.mark.parametrize("seed", [1, 7, 2026])
def test_arena_blocks_never_overlap_and_merge_back(stress_exe, seed):
    proc = subprocess.run([str(stress_exe), "30000", str(seed)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not sanitizer_findings(proc.stderr), proc.stderr[-3000:]
    out = proc.stdout.split()
    # "arena stress: 30000 steps, N blocks from the arena, M past it, top T bytes": both paths taken
    from_arena, past = int(out[4]), int(out[9])
    assert from_arena > 1000 and past > 10, proc.stdout
    # the plans' walks (followed to the same places, random places refused, malformed blobs refused)
    assert re.search(r"arena plans: [1-9]\d* requests followed", proc.stdout), proc.stdout
