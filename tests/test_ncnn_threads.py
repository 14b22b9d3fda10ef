"""ncnn's OpenMP emulation as edgepack builds it (simpleomp, patched to spin before it sleeps:
edgepack/backends/ncnn/source_patch.py) keeps every parallel region's hand-off exact.

The spin lets the caller see its workers finish without taking the lock first, so a wrong memory
order there would let a region return before a worker's writes land. A stress program linked
against the real libncnn.a runs many short parallel regions whose slower half belongs to the workers
and checks every slot after every region: spinning (ncnn's 20 ms block time) and passive (0), 2 to 4
threads (more than this machine's cores: queued, not lost), natively on x86_64 and under
qemu-aarch64 for arm64. Speed is bench/bench_threads.py's job."""
from __future__ import annotations

import subprocess

import pytest

from edgepack.backends.ncnn.library import build_library
from edgepack.backends.ncnn.source_patch import _EDITS
from edgepack.runner import command_for_cpu
from edgepack.targets import TargetMatrix
from edgepack.toolchains import Toolchain

STRESS = r"""
#include <stdio.h>
#include <stdlib.h>

extern "C" void kmp_set_blocktime(int);
extern "C" int kmp_get_blocktime(void);

static volatile long sink;

int main(int argc, char **argv) {
    int regions = argc > 1 ? atoi(argv[1]) : 1000;
    static long slots[64];
    long checked = 0;
    for (int bt = 0; bt < 2; bt++) {
        kmp_set_blocktime(bt ? 20 : 0);
        if (kmp_get_blocktime() != (bt ? 20 : 0)) { printf("block time not kept\n"); return 2; }
        for (int threads = 2; threads <= 4; threads++) {
            for (int r = 0; r < regions; r++) {
#pragma omp parallel for num_threads(threads)
                for (int i = 0; i < 64; i++) {
                    long acc = 0;  // the upper slots (the workers' share) take longer
                    for (int k = 0; k < i * 8; k++) acc += k;
                    sink = acc;
                    slots[i] = (long)r * 64 + i;
                }
                for (int i = 0; i < 64; i++) {
                    if (slots[i] != (long)r * 64 + i) {
                        printf("slot %d of region %d stale (block time %d, %d threads)\n", i, r, bt ? 20 : 0, threads);
                        return 1;
                    }
                }
                checked++;
            }
        }
    }
    printf("ok: %ld regions checked\n", checked);
    return 0;
}
"""


def test_the_built_libncnn_carries_the_patch():
    target = TargetMatrix.load().get("x86_64")
    lib = build_library(target, Toolchain.load())
    text = (lib.source / "src" / "simpleomp.cpp").read_text()
    for what, _old, new, _count in _EDITS:
        assert new in text, what


@pytest.mark.parametrize("name", ["x86_64", "arm64"])
def test_parallel_regions_hand_off_exactly(name, tmp_path):
    target, tc = TargetMatrix.load().get(name), Toolchain.load()
    lib = build_library(target, tc)
    src = tmp_path / "stress.cpp"
    src.write_text(STRESS)
    obj = tc.compile(src, tmp_path / "stress.o", target, cxx=True, extra=["-O2", "-fopenmp"])
    exe = tc.link([obj, lib.lib], tmp_path / "stress", target)
    regions = "3000" if name == "x86_64" else "300"  # qemu-user runs it ~10x slower
    proc = subprocess.run(command_for_cpu(exe, "native" if name == "x86_64" else target.verify_cpus[0]) + [regions],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == f"ok: {int(regions) * 6} regions checked", proc.stdout
