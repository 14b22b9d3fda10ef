"""The fake-quant fold's FMA quotient rounds as IEEE division does, for every float32 x
(edgepack/backends/ncnn/fake_quant_patch.py, ep_fq_quot).

The fused Clip divides by the scale with x * (1/y) and two Markstein corrections instead of vdivps, where
the quotient is next rounded half to even and clamped within 2^20. This compiles the very functions the
patch puts into ncnn (taken from its text) with zig's clang and -ffast-math, as ncnn is built, and walks
all 2^32 inputs for a few divisors: 1/3 and 0.1 (inexact reciprocals), smart-turn's first scale, 1/255
(uint8 quantisation) and a divisor whose significand is all ones, each with and without flush-to-zero. The
rounded, clamped values must equal the division's on every input, bit for bit. The AVX-512 kernel runs
where the CPU has it, the AVX2 + FMA one everywhere the tests run (x86_64 hosts with FMA)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from clirun import host_cpu_flags
from edgepack.backends.ncnn import fake_quant_patch
from edgepack.backends.ncnn.exact_div_patch import EXACT_DIV_MACRO

DIVISORS = ("0.33333334", "0.1", "9.61455330e-3", "0.0039215689", "1.99999988")

_DRIVER = r'''
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
%(macro)s
%(defs)s
%(kernel)s
static inline WIDE ep_div_exact(WIDE x, WIDE y) { EP_EXACT_DIV return x / y; }

// all 2^32 float32 x: round-half-even and a clamp to +-2^20 of the FMA quotient against the division's
__attribute__((target(TARGET))) static long ep_walk(float yv, float yrv)
{
    const WIDE y = SET1(yv), yr = SET1(yrv), lo = SET1(-1048576.f), hi = SET1(1048576.f);
    long bad = 0;
    for (uint64_t base = 0; base < (1ull << 32); base += LANES)
    {
        uint32_t bits[LANES];
        for (int i = 0; i < LANES; i++)
            bits[i] = (uint32_t)(base + i);
        WIDE x;
        memcpy(&x, bits, sizeof x);
        const WIDE e = MINMAX(ROUND(ep_div_exact(x, y)), lo, hi);
        const WIDE f = MINMAX(ROUND(ep_fq_quot(x, y, yr)), lo, hi);
        uint32_t be[LANES], bf[LANES];
        memcpy(be, &e, sizeof e);
        memcpy(bf, &f, sizeof f);
        for (int i = 0; i < LANES; i++)
            bad += be[i] != bf[i]; // every bit, a zero's sign too
    }
    return bad;
}

int main(int argc, char** argv)
{
    if (getenv("FTZ"))
        _mm_setcsr(_mm_getcsr() | 0x8040);
    long total = 0;
    for (int a = 1; a < argc; a++)
    {
        const float y = strtof(argv[a], 0);
        volatile float one = 1.f;
        const float yr = ep_fq_div1(one, y);
        const long bad = ep_walk(y, yr);
        printf("%%s %%ld\n", argv[a], bad);
        total += bad;
    }
    return total != 0;
}
'''

# per vector width: the driver's macros, and the compiler flags
_WIDTHS = {
    "avx512": ("#define WIDE __m512\n#define LANES 16\n#define TARGET \"avx512f,avx512dq,fma\"\n"
               "#define SET1 _mm512_set1_ps\n"
               "#define ROUND(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)\n"
               "#define MINMAX(v, l, h) _mm512_min_ps(_mm512_max_ps(v, l), h)\n",
               ["-mavx512f", "-mavx512dq", "-mfma"]),
    "avx2": ("#define WIDE __m256\n#define LANES 8\n#define TARGET \"avx,fma\"\n#define SET1 _mm256_set1_ps\n"
             "#define ROUND(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)\n"
             "#define MINMAX(v, l, h) _mm256_min_ps(_mm256_max_ps(v, l), h)\n",
             ["-mavx", "-mfma"]),
}


def _kernel(width: str) -> str:
    """The patch's own ep_fq_quot for one vector width, as text."""
    text = fake_quant_patch._CPP_HELPERS
    start = "static inline __m512 ep_fq_quot(" if width == "avx512" else \
        '__attribute__((target("avx,fma"))) static inline __m256 ep_fq_quot('
    body = text[text.index(start):]
    return body[:body.index("\n}\n") + 3]


def _walk_exe(width: str, tmp_path: Path) -> Path:
    defs, flags = _WIDTHS[width]
    kernel = _kernel(width)
    assert "_fmadd_ps" in kernel and "_fnmadd_ps" in kernel   # the text found is the FMA kernel
    defs += "static inline float ep_fq_div1(float x, float y) { EP_EXACT_DIV return x / y; }\n"
    src = _DRIVER % {"macro": EXACT_DIV_MACRO, "defs": defs, "kernel": kernel}
    (tmp_path / f"walk_{width}.c").write_text(src)
    exe = tmp_path / f"walk_{width}"
    subprocess.run([sys.executable, "-m", "ziglang", "cc", "-O2", "-ffast-math", *flags, "-o", str(exe),
                    str(tmp_path / f"walk_{width}.c")], check=True, capture_output=True, timeout=300)
    return exe


def test_fma_quotient_rounds_as_division_for_every_float(tmp_path):
    flags = host_cpu_flags()
    # the AVX2 + FMA kernel on every host the tests run on; the AVX-512 one where the CPU has it (an
    # artifact takes each only where its CPU does)
    assert {"avx", "fma"} <= flags, "the x86_64 test hosts have AVX2 and FMA"
    widths = ["avx2"] + (["avx512"] if {"avx512f", "avx512dq"} <= flags else [])
    for width in widths:
        exe = _walk_exe(width, tmp_path)
        for ftz in ("", "1"):
            run = subprocess.run([str(exe), *DIVISORS], capture_output=True, text=True, timeout=900,
                                 env={"FTZ": ftz} if ftz else {})
            counts = dict(line.split() for line in run.stdout.splitlines())
            assert set(counts) == set(DIVISORS), run.stdout + run.stderr
            assert all(c == "0" for c in counts.values()) and run.returncode == 0, (width, ftz, counts)
