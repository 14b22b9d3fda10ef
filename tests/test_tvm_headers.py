"""edgepack's own versions of the headers the TVM runtime sources need (runtimes/tvm/include,
runtimes/tvm/src/support): compiled with zig into a small program linked with the real
tvm-ffi archive, then checked against numpy (fp16 conversions, every half value and a spread
of floats/doubles incl. rounding ties, subnormals, overflow, NaN) and against the byte layout
the executables written by the apache-tvm compiler use (serializer)."""
from __future__ import annotations

import subprocess
import textwrap

import numpy as np
import pytest

from edgepack.backends.tvm.runtime_lib import build_runtime
from edgepack.resources import runtimes_dir
from edgepack.targets import TargetMatrix
from edgepack.toolchains import Toolchain

PROGRAM = textwrap.dedent(r"""
    #define TVM_FFI_CMAKE_LITTLE_ENDIAN 1
    #include <builtin_fp16.h>
    #include <tvm/support/io.h>
    #include "src/support/bytes_io.h"
    #include "src/support/base64.h"
    #include "src/support/utils.h"
    #include <cstdio>
    #include <vector>
    #include <unordered_map>
    #include <dlpack/dlpack.h>

    using namespace tvm;
    static std::vector<char> slurp(const char* p) {
      FILE* f = fopen(p, "rb"); std::vector<char> v; char b[4096]; size_t n;
      while ((n = fread(b, 1, sizeof b, f)) > 0) v.insert(v.end(), b, b + n);
      fclose(f); return v;
    }
    static void dump(const char* p, const void* d, size_t n) { FILE* f = fopen(p, "wb"); fwrite(d, 1, n, f); fclose(f); }
    #define CHECK(c) do { if (!(c)) { printf("FAIL %s:%d %s\n", __FILE__, __LINE__, #c); return 1; } } while (0)

    int main() {
      std::vector<float> h2f(65536);
      for (uint32_t i = 0; i < 65536; i++)
        h2f[i] = __extendXfYf2__<uint16_t, uint16_t, 10, float, uint32_t, 23>((uint16_t)i);
      dump("h2f.bin", h2f.data(), h2f.size() * 4);
      auto f32 = slurp("f32.bin"); size_t nf = f32.size() / 4; std::vector<uint16_t> f2h(nf);
      for (size_t i = 0; i < nf; i++) {
        float x; memcpy(&x, &f32[i * 4], 4);
        f2h[i] = __truncXfYf2__<float, uint32_t, 23, uint16_t, uint16_t, 10>(x);
      }
      dump("f2h.bin", f2h.data(), nf * 2);
      auto f64 = slurp("f64.bin"); size_t nd = f64.size() / 8; std::vector<uint16_t> d2h(nd);
      for (size_t i = 0; i < nd; i++) {
        double x; memcpy(&x, &f64[i * 8], 8);
        d2h[i] = __truncXfYf2__<double, uint64_t, 52, uint16_t, uint16_t, 10>(x);
      }
      dump("d2h.bin", d2h.data(), nd * 2);

      // Serializer: exact bytes of a vector of strings, then round trips.
      std::string buf;
      support::BytesOutStream out(&buf);
      std::vector<std::string> names{"ab", "c"};
      out.Write(names);
      const char want[] = "\x02\0\0\0\0\0\0\0" "\x02\0\0\0\0\0\0\0" "ab" "\x01\0\0\0\0\0\0\0" "c";
      CHECK(buf.size() == sizeof(want) - 1 && memcmp(buf.data(), want, buf.size()) == 0);
      std::unordered_map<int64_t, std::string> scopes{{3, "global"}, {7, "local"}};
      std::vector<int64_t> words{1, -2, 3};
      ffi::Array<ffi::String> arr{"x", "yz"};
      DLDataType dt{kDLFloat, 16, 1};
      out.Write(scopes); out.Write(words); out.Write(arr); out.Write(dt); out.WriteArray(words.data(), 3);
      support::BytesInStream in(buf);
      std::vector<std::string> names2; std::unordered_map<int64_t, std::string> scopes2; std::vector<int64_t> words2;
      ffi::Array<ffi::String> arr2; DLDataType dt2; int64_t raw[3];
      CHECK(in.Read(&names2) && names2 == names);
      CHECK(in.Read(&scopes2) && scopes2 == scopes);
      CHECK(in.Read(&words2) && words2 == words);
      CHECK(in.Read(&arr2) && arr2.size() == 2 && arr2[1] == "yz");
      CHECK(in.Read(&dt2) && dt2.code == kDLFloat && dt2.bits == 16 && dt2.lanes == 1);
      CHECK(in.ReadArray(raw, 3) && raw[1] == -2);
      int64_t extra; CHECK(!in.Read(&extra));  // the end
      // Base64 streams round-trip through tvm-ffi's codec.
      std::string text; support::BytesOutStream tout(&text); support::Base64OutStream b64(&tout);
      b64.Write(names); b64.Finish();
      CHECK(text.find('\0') == std::string::npos && text.size() % 4 == 0);
      support::BytesInStream tin(text); support::Base64InStream b64in(&tin); b64in.InitPosition();
      std::vector<std::string> names3; CHECK(b64in.Read(&names3) && names3 == names);
      CHECK(support::IsNumber("042") && !support::IsNumber("4a") && !support::IsNumber(""));
      printf("OK\n");
      return 0;
    }
""")


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    tc = Toolchain.load()
    target = TargetMatrix.load().get("x86_64")
    rt = build_runtime(target, tc)
    wd = tmp_path_factory.mktemp("headers")
    src = wd / "t.cc"
    src.write_text(PROGRAM)
    exe = wd / "t"
    own = runtimes_dir() / "tvm"
    flags = ["-std=c++17", "-O1", f"-I{own / 'include'}", f"-I{own}"] + [f"-I{d}" for d in rt.include_dirs]
    tc.compile(src, wd / "t.o", target, cxx=True, extra=flags)
    tc.link([wd / "t.o"], exe, target, extra=["-Wl,--whole-archive", str(rt.archives[1]), "-Wl,--no-whole-archive"])
    return exe, wd


def test_fp16_and_serializer(program):
    exe, wd = program
    rng = np.random.default_rng(0)
    halves = np.arange(65536, dtype=np.uint16).view(np.float16)
    # Every half value, midpoints between neighbours (ties to even), and a wide spread.
    h32 = halves.astype(np.float32)
    finite = np.sort(h32[np.isfinite(h32)])
    mids = ((finite[1:].astype(np.float64) + finite[:-1]) / 2).astype(np.float32)
    spread = np.concatenate([rng.standard_normal(20000) * s for s in (1e-8, 1e-6, 1e-3, 1, 1e3, 7e4, 1e6)])
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65519.99, 65520, 6e-8, 3e-8, 1e-45])
    f32 = np.concatenate([h32, mids, spread.astype(np.float32), specials.astype(np.float32)]).astype(np.float32)
    f64 = np.concatenate([spread, specials, finite.astype(np.float64) * (1 + 1e-12)]).astype(np.float64)
    f32.tofile(wd / "f32.bin")
    f64.tofile(wd / "f64.bin")
    proc = subprocess.run([str(exe)], cwd=wd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "OK", proc.stdout + proc.stderr

    got = np.fromfile(wd / "h2f.bin", np.float32)
    nan = np.isnan(h32)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), h32[~nan].view(np.uint32))

    for name, src in (("f2h.bin", f32), ("d2h.bin", f64)):
        got = np.fromfile(wd / name, np.uint16).view(np.float16)
        with np.errstate(over="ignore"):
            want = src.astype(np.float16)
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan), name
        bad = np.flatnonzero(got[~nan].view(np.uint16) != want[~nan].view(np.uint16))
        assert bad.size == 0, (name, src[~nan][bad[:5]], got[~nan][bad[:5]], want[~nan][bad[:5]])
