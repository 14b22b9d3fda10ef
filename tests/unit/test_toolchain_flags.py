"""The zig wrappers' flag translation: ncnn's -march spellings become zig -mcpu forms (pure function)."""
import pytest

from edgepack.toolchains import rewrite_march


@pytest.mark.parametrize("arg,want", [
    ("-march=armv8.2-a+fp16", "-mcpu=generic+v8_2a+fullfp16"),
    ("-march=armv8.2-a+fp16+dotprod", "-mcpu=generic+v8_2a+fullfp16+dotprod"),
    ("-march=armv8.4-a+bf16+i8mm", "-mcpu=generic+v8_4a+bf16+i8mm"),
    ("-march=armv8-a+simd", "-mcpu=generic+neon"),
    ("-O2", "-O2"),
    ("-mavx2", "-mavx2"),
])
def test_rewrite_march(arg, want):
    assert rewrite_march(arg) == want
