from edgepack.targets import TargetMatrix
from edgepack.toolchains import Toolchain, rewrite_march


def test_rewrite_march_for_zig():
    assert rewrite_march("-march=armv8.2-a+fp16") == "-mcpu=generic+v8_2a+fullfp16"
    assert rewrite_march("-march=armv8.2-a+fp16+dotprod") == "-mcpu=generic+v8_2a+fullfp16+dotprod"
    assert rewrite_march("-march=armv8.4-a+bf16") == "-mcpu=generic+v8_4a+bf16"
    assert rewrite_march("-march=armv8-a") == "-mcpu=generic"
    assert rewrite_march("-O3") == "-O3"
    assert rewrite_march("-mavx2") == "-mavx2"


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


def test_wrappers_bake_the_target(tmp_path):
    tc, t = Toolchain.load(), TargetMatrix.load().get("arm64")
    w = tc.write_wrappers(tmp_path, t, "generic")
    text = w["c++"].read_text()
    assert "aarch64-linux-musl" in text and "-mcpu=generic" in text
    assert "-target" not in w["ar"].read_text()
