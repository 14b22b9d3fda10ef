from edgepack.targets import TargetMatrix
from edgepack.toolchains import Toolchain, rewrite_march


def test_rewrite_march_for_zig():
    assert rewrite_march("-march=armv8.2-a+fp16") == "-mcpu=generic+v8_2a+fullfp16"
    assert rewrite_march("-march=armv8.2-a+fp16+dotprod") == "-mcpu=generic+v8_2a+fullfp16+dotprod"
    assert rewrite_march("-march=armv8.4-a+bf16") == "-mcpu=generic+v8_4a+bf16"
    assert rewrite_march("-march=armv8-a") == "-mcpu=generic"
    assert rewrite_march("-O3") == "-O3"
    assert rewrite_march("-mavx2") == "-mavx2"
    assert rewrite_march("-march=x86-64-v3") == "-mcpu=x86_64_v3"
    assert rewrite_march("-march=x86-64") == "-mcpu=x86_64"
    assert rewrite_march("-march=haswell") == "-march=haswell"  # zig knows clang's CPU names


def test_x86_wrappers_compile_avx512_and_level_spellings(tmp_path):
    """ncnn's AVX-512 probe flags reach zig's clang; psABI level spellings are translated."""
    import subprocess
    tc, t = Toolchain.load(), TargetMatrix.load().get("x86_64")
    w = tc.write_wrappers(tmp_path, t, "x86_64")
    src = tmp_path / "f.c"
    src.write_text("#include <immintrin.h>\n__m512i f(__m512i a, __m512i b) { return _mm512_madd_epi16(a, b); }\n"
                   "#ifndef __AVX2__\nint no_avx2[-1];\n#endif\n")
    avx512 = ["-mfma", "-mf16c", "-mavx512f", "-mavx512cd", "-mavx512bw", "-mavx512dq", "-mavx512vl"]
    subprocess.run([str(w["cc"]), *avx512, "-c", str(src), "-o", str(tmp_path / "a.o")], check=True)
    subprocess.run([str(w["cc"]), "-march=x86-64-v4", "-c", str(src), "-o", str(tmp_path / "b.o")], check=True)
    # without the flags the same file must not compile (the probe is real)
    bad = subprocess.run([str(w["cc"]), "-c", str(src), "-o", str(tmp_path / "c.o")], capture_output=True)
    assert bad.returncode != 0


def test_flags_per_target():
    m, tc = TargetMatrix.load(), Toolchain.load()
    orin = tc.compile_flags(m.get("jetson-orin"))
    assert orin[:3] == ["-target", "aarch64-linux-musl", "-mcpu=cortex_a78ae"]
    link = tc.link_flags(m.get("jetson-orin"))
    assert "-static" in link and "-mcpu=generic" in link  # libc built once per triple
    android = tc.link_flags(m.get("android-arm64"))
    assert {"-static", "-fPIE", "-pie", "-Wl,-z,max-page-size=16384"} <= set(android)
    assert "-fPIE" in tc.compile_flags(m.get("android-arm64"))
    x86 = tc.link_flags(m.get("x86_64"))
    assert "-target" in x86 and "x86_64-linux-musl" in x86


def test_wrappers_bake_the_target_and_translate_march(tmp_path):
    import subprocess
    from edgepack.elf import read_elf
    tc, t = Toolchain.load(), TargetMatrix.load().get("arm64")
    w = tc.write_wrappers(tmp_path, t, "generic", {"-march=armv8.2-a+fp16"})
    text = w["c++"].read_text()
    assert "aarch64-linux-musl" in text and "-mcpu=generic" in text
    assert "-target" not in w["ar"].read_text()
    src = tmp_path / "f.c"
    # compiles only when the fp16 rewrite reached zig
    src.write_text("#include <arm_neon.h>\nfloat16x8_t f(float16x8_t a, float16x8_t b) { return vaddq_f16(a, b); }\n")
    subprocess.run([str(w["cc"]), "-march=armv8.2-a+fp16", "-c", str(src), "-o", str(tmp_path / "f.o")], check=True)
    assert read_elf(tmp_path / "f.o").machine == "aarch64"
    bad = subprocess.run([str(w["cc"]), "-march=armv9.9-a+magic", "-c", str(src), "-o", str(tmp_path / "g.o")],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "no zig spelling" in bad.stderr
