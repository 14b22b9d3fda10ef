"""libncnn built from the pinned ncnn sdist with the zig toolchain, once per (arch, libc, options).

The library is shared by every target of an architecture (arm64, jetson-*, android-arm64 use
one build): ncnn dispatches its fp16/dotprod kernels at run time, so the target's own -mcpu
only needs to reach the runtime sources. The cache key hashes the source archive, the zig
version, the triple and every CMake option.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from ... import proc
from ...progress import StepProgress
from ...cache import cache_root, key_of, lock_file, locked, touch_used
from ...elf import check_archive_arch
from ...errors import BuildError
from ...sources import NCNN_SDIST, fetch
from ...targets import Target
from ...toolchains import WRAPPER_VERSION, Toolchain, generic_cpu
from .batch_reshape_patch import BATCH_RESHAPE_PATCH_KEY, patch_batch_reshape
from .binaryop_inplace_patch import (BINARYOP_INPLACE_ARM_PATCH_KEY, BINARYOP_INPLACE_PATCH_KEY, patch_binaryop_inplace,
                                     patch_binaryop_inplace_arm)
from .deconv_strips_patch import (DECONV_STRIPS_ARM_PATCH_KEY, DECONV_STRIPS_PATCH_KEY, patch_deconv_strips,
                                  patch_deconv_strips_arm)
from .direct_conv_patch import DIRECT_CONV_PATCH_KEY, patch_direct_conv
from .dw_block_patch import DW_BLOCK_ARM_PATCH_KEY, DW_BLOCK_PATCH_KEY, patch_dw_block, patch_dw_block_arm
from .exact_div_patch import EXACT_DIV_PATCH_KEY, patch_exact_div
from .fake_quant_patch import FAKE_QUANT_PATCH_KEY, patch_fake_quant
from .fp16_weights_patch import FP16_WEIGHTS_PATCH_KEY, patch_fp16_weights
from .gelu_erf_patch import GELU_ERF_PATCH_KEY, patch_gelu_erf
from .gemm_conv_fp16_patch import GEMM_CONV_FP16_PATCH_KEY, patch_gemm_conv_fp16
from .gemm_fp16_b_patch import GEMM_FP16_B_PATCH_KEY, patch_gemm_fp16_b
from .gemm_pair16_patch import GEMM_PAIR16_PATCH_KEY, patch_gemm_pair16
from .gemm_pair_patch import GEMM_PAIR_PATCH_KEY, patch_gemm_pair
from .gru_patch import GRU_PATCH_KEY, patch_gru
from .int8_gemm_patch import INT8_GEMM_PATCH_KEY, patch_int8_gemm
from .int8_gemv_patch import INT8_GEMV_PATCH_KEY, patch_int8_gemv
from .flush_denormals_patch import FLUSH_DENORMALS_PATCH_KEY, patch_flush_denormals
from .integer_winograd_patch import INTEGER_WINOGRAD_PATCH_KEY, patch_integer_winograd
from .isa_cap_patch import ISA_CAP_PATCH_KEY, patch_isa_cap
from .load_reuse_patch import LOAD_REUSE_PATCH_KEY, patch_load_reuse
from .lstm_patch import LSTM_PATCH_KEY, patch_lstm
from .shared_weights_patch import (SHARED_WEIGHTS_ARM_PATCH_KEY, SHARED_WEIGHTS_PATCH_KEY, patch_shared_weights,
                                   patch_shared_weights_arm)
from .source_patch import PATCH_KEY, patch_source
from .thread_split_patch import THREAD_SPLIT_PATCH_KEY, patch_thread_split
from .winograd_fp16_patch import WINOGRAD_FP16_PATCH_KEY, patch_winograd_fp16
from .winograd_strips_patch import (WINOGRAD_STRIPS_ARM_PATCH_KEY, WINOGRAD_STRIPS_PATCH_KEY, patch_winograd_strips,
                                    patch_winograd_strips_arm)

RECIPE_VERSION = 2  # 2: x86_64 gains AVX-512 kernels (and checks them)


def _arch_patches(target: Target) -> tuple:
    """(cache-key name, version-digest, apply) of the source patches this arch's build applies (exact
    division, buffers reused while loading and batch reshapes copied by rows everywhere; shared
    InnerProduct kernels, depthwise blocks, convolution and deconvolution strips on x86 and Arm; the x86 kernels only
    on x86): one list for the key and the build, so they cannot disagree."""
    every_arch = (("exact_div_patch", EXACT_DIV_PATCH_KEY, patch_exact_div),
                  ("load_reuse_patch", LOAD_REUSE_PATCH_KEY, patch_load_reuse),
                  ("batch_reshape_patch", BATCH_RESHAPE_PATCH_KEY, patch_batch_reshape))
    if target.arch == "aarch64":
        return every_arch + (("shared_weights_patch", SHARED_WEIGHTS_ARM_PATCH_KEY, patch_shared_weights_arm),
                             ("dw_block_patch", DW_BLOCK_ARM_PATCH_KEY, patch_dw_block_arm),
                             ("winograd_strips_patch", WINOGRAD_STRIPS_ARM_PATCH_KEY, patch_winograd_strips_arm),
                             ("deconv_strips_patch", DECONV_STRIPS_ARM_PATCH_KEY, patch_deconv_strips_arm),
                             ("binaryop_inplace_patch", BINARYOP_INPLACE_ARM_PATCH_KEY, patch_binaryop_inplace_arm))
    if target.arch != "x86_64":
        return every_arch
    return every_arch + (
        ("lstm_patch", LSTM_PATCH_KEY, patch_lstm), ("gru_patch", GRU_PATCH_KEY, patch_gru),
        ("thread_split_patch", THREAD_SPLIT_PATCH_KEY, patch_thread_split),
        ("binaryop_inplace_patch", BINARYOP_INPLACE_PATCH_KEY, patch_binaryop_inplace),
        ("gemm_pair_patch", GEMM_PAIR_PATCH_KEY, patch_gemm_pair),
        ("gemm_pair16_patch", GEMM_PAIR16_PATCH_KEY, patch_gemm_pair16),
        ("direct_conv_patch", DIRECT_CONV_PATCH_KEY, patch_direct_conv), ("isa_cap_patch", ISA_CAP_PATCH_KEY, patch_isa_cap),
        ("integer_winograd_patch", INTEGER_WINOGRAD_PATCH_KEY, patch_integer_winograd),
        ("shared_weights_patch", SHARED_WEIGHTS_PATCH_KEY, patch_shared_weights),
        ("fp16_weights_patch", FP16_WEIGHTS_PATCH_KEY, patch_fp16_weights),
        ("int8_gemm_patch", INT8_GEMM_PATCH_KEY, patch_int8_gemm),
        ("int8_gemv_patch", INT8_GEMV_PATCH_KEY, patch_int8_gemv),
        ("gemm_fp16_b_patch", GEMM_FP16_B_PATCH_KEY, patch_gemm_fp16_b),
        ("dw_block_patch", DW_BLOCK_PATCH_KEY, patch_dw_block), ("gelu_erf_patch", GELU_ERF_PATCH_KEY, patch_gelu_erf),
        ("fake_quant_patch", FAKE_QUANT_PATCH_KEY, patch_fake_quant),
        ("winograd_strips_patch", WINOGRAD_STRIPS_PATCH_KEY, patch_winograd_strips),
        ("deconv_strips_patch", DECONV_STRIPS_PATCH_KEY, patch_deconv_strips),
        ("winograd_fp16_patch", WINOGRAD_FP16_PATCH_KEY, patch_winograd_fp16),
        ("gemm_conv_fp16_patch", GEMM_CONV_FP16_PATCH_KEY, patch_gemm_conv_fp16),
        ("flush_denormals_patch", FLUSH_DENORMALS_PATCH_KEY, patch_flush_denormals))


BASE_OPTIONS = {
    "CMAKE_BUILD_TYPE": "Release",
    "NCNN_VULKAN": "OFF", "NCNN_BUILD_TOOLS": "OFF", "NCNN_BUILD_EXAMPLES": "OFF",
    "NCNN_BUILD_BENCHMARK": "OFF", "NCNN_BUILD_TESTS": "OFF", "NCNN_PYTHON": "OFF",
    "NCNN_SHARED_LIB": "OFF", "NCNN_INSTALL_SDK": "ON", "NCNN_SIMPLEOCV": "ON",
    "NCNN_PIXEL_ROTATE": "OFF", "NCNN_PIXEL_AFFINE": "OFF", "NCNN_PIXEL_DRAWING": "OFF",
    # zig ships no OpenMP runtime: ncnn's own minimal one.
    "NCNN_OPENMP": "ON", "NCNN_SIMPLEOMP": "ON",
    # edgepack builds float models (fp32/fp16): int8/bf16 kernels only cost build time and bytes.
    "NCNN_INT8": "OFF", "NCNN_BF16": "OFF", "NCNN_WEIGHT_QUANT": "OFF",
    "NCNN_RUNTIME_CPU": "ON",
}
# Which run-time dispatched ISA variants to build, per architecture. Each variant compiles the
# layers again and ncnn picks one per layer at run time by CPUID (NCNN_RUNTIME_CPU), so a
# variant the CPU lacks costs build time and bytes but is never executed.
# x86_64: SSE2/AVX/FMA/F16C/AVX2 as before plus AVX-512 (F/CD/BW/DQ/VL): on AVX-512 CPUs it took a
# YOLOv8-class model from 1.70x to 1.05x onnxruntime (issue 10). FMA4/XOP are AMD-only families of
# 2011-2015, absent from edge boxes. AVX512FP16: this sdist has no x86 avx512fp16 kernels.
ARCH_OPTIONS = {
    "x86_64": {"NCNN_AVX512": "ON", "NCNN_AVX512FP16": "OFF", "NCNN_AVXVNNIINT8": "OFF",
               "NCNN_AVXVNNIINT16": "OFF", "NCNN_FMA4": "OFF", "NCNN_XOP": "OFF"},
    "aarch64": {"NCNN_ARM86SVE": "OFF", "NCNN_ARM84I8MM": "OFF", "NCNN_ARM84BF16": "OFF"},
    "arm": {},
}
# Variants whose kernels exist only for one numeric type: their sources are wrapped in
# `#if NCNN_INT8` / `#if NCNN_BF16`, so they are built exactly when that type is (a target's
# [ncnn.cmake] may turn NCNN_INT8 or NCNN_BF16 on); otherwise they would compile to nothing.
_X86_TYPED_VARIANTS = {"NCNN_INT8": ("NCNN_AVX512VNNI", "NCNN_AVXVNNI"),
                       "NCNN_BF16": ("NCNN_AVX512BF16", "NCNN_AVXNECONVERT")}
# option -> the CMake cache variable that says zig's clang compiled ncnn's probe for it. ncnn
# only warns when a probe fails and builds without the variant; edgepack fails instead.
X86_COMPILER_PROBES = {
    "NCNN_AVX": "NCNN_COMPILER_SUPPORT_X86_AVX", "NCNN_FMA": "NCNN_COMPILER_SUPPORT_X86_FMA",
    "NCNN_F16C": "NCNN_COMPILER_SUPPORT_X86_F16C", "NCNN_AVX2": "NCNN_COMPILER_SUPPORT_X86_AVX2",
    "NCNN_AVX512": "NCNN_COMPILER_SUPPORT_X86_AVX512",
    "NCNN_AVX512VNNI": "NCNN_COMPILER_SUPPORT_X86_AVX512_VNNI",
    "NCNN_AVX512BF16": "NCNN_COMPILER_SUPPORT_X86_AVX512_BF16",
    "NCNN_AVXVNNI": "NCNN_COMPILER_SUPPORT_X86_AVX_VNNI",
    "NCNN_AVXNECONVERT": "NCNN_COMPILER_SUPPORT_X86_AVX_NE_CONVERT",
}
# The object-name suffix each x86 variant leaves in libncnn.a (checked after the build).
X86_VARIANT_OBJECTS = {"NCNN_AVX": "_x86_avx.cpp", "NCNN_FMA": "_x86_fma.cpp", "NCNN_AVX2": "_x86_avx2.cpp",
                       "NCNN_AVX512": "_x86_avx512.cpp"}
_PROCESSOR = {"x86_64": "x86_64", "aarch64": "aarch64", "arm": "armv7"}


@dataclass(frozen=True)
class NcnnLibrary:
    root: Path          # cache entry
    lib: Path           # libncnn.a
    include: Path       # folder holding ncnn/*.h
    build: Path         # build folder kept for generated headers and compile_commands.json
    source: Path        # extracted sdist
    key: str
    options: tuple[tuple[str, str], ...]

    def manifest(self) -> dict:
        return {"sdist": NCNN_SDIST.filename, "sdist_sha256": NCNN_SDIST.sha256, "cache_key": self.key,
                "options": dict(self.options)}


def library_options(target: Target) -> dict[str, str]:
    opts = dict(BASE_OPTIONS)
    opts.update(ARCH_OPTIONS.get(target.arch, {}))
    own = {k: str(v) for k, v in target.backend_options.get("ncnn", {}).get("cmake", {}).items()}
    if target.arch == "x86_64":
        for numeric, variants in _X86_TYPED_VARIANTS.items():
            wanted = own.get(numeric, opts[numeric])
            for v in variants:
                base = "NCNN_AVX512" if "512" in v else "NCNN_AVX2"
                opts[v] = "ON" if wanted == "ON" and own.get(base, opts.get(base, "ON")) == "ON" else "OFF"
    opts.update(own)
    return opts


def check_x86_configure(cache_text: str, opts: dict[str, str]) -> list[str]:
    """Variants requested ON that the configure step silently dropped (probe failed or option OFF)."""
    cache = {}
    for line in cache_text.splitlines():
        m = re.match(r"([A-Za-z0-9_]+):[A-Z]+=(.*)$", line)
        if m:
            cache[m.group(1)] = m.group(2).strip()
    on = {"1", "ON", "TRUE", "YES"}
    dropped = []
    for opt, probe in X86_COMPILER_PROBES.items():
        if opts.get(opt, "ON") != "ON":
            continue
        if cache.get(probe, "").upper() not in on:
            dropped.append(f"{opt} (zig's clang failed ncnn's probe {probe})")
        elif cache.get(opt, "ON").upper() not in on:
            dropped.append(f"{opt} (configure left it OFF)")
    return dropped


def check_x86_archive(members: list[str], opts: dict[str, str]) -> list[str]:
    """Variants requested ON with no object in libncnn.a."""
    return [opt for opt, suffix in X86_VARIANT_OBJECTS.items()
            if opts.get(opt, "ON") == "ON" and not any(m.endswith(suffix + ".o") for m in members)]


def _toolchain_file(path: Path, target: Target, wrappers: dict[str, Path]) -> None:
    path.write_text("\n".join([
        "set(CMAKE_SYSTEM_NAME Linux)",
        f"set(CMAKE_SYSTEM_PROCESSOR {_PROCESSOR[target.arch]})",
        f"set(CMAKE_C_COMPILER {wrappers['cc']})",
        f"set(CMAKE_CXX_COMPILER {wrappers['c++']})",
        f'set(CMAKE_AR {wrappers["ar"]} CACHE FILEPATH "")',
        f'set(CMAKE_RANLIB {wrappers["ranlib"]} CACHE FILEPATH "")',
        "set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)",
        "set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)",
        "set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)",
        "",
    ]))


def library_key(target: Target, toolchain: Toolchain) -> tuple[str, dict]:
    opts = library_options(target)
    recipe = {"sdist": NCNN_SDIST.sha256, "zig": toolchain.version, "triple": target.triple.zig,
              "cpu": generic_cpu(target), "options": opts, "wrapper": WRAPPER_VERSION,
              "recipe": RECIPE_VERSION, "source_patch": PATCH_KEY}
    recipe.update({name: patch_key for name, patch_key, _ in _arch_patches(target)})
    key = key_of(recipe)
    return key, opts


def build_library(target: Target, toolchain: Toolchain, *, jobs: int | None = None, log=None) -> NcnnLibrary:
    key, opts = library_key(target, toolchain)
    root = cache_root() / "ncnn" / f"{target.triple.zig}-{key}"
    lib = root / "install" / "lib" / "libncnn.a"
    result = NcnnLibrary(root, lib, root / "install" / "include", root / "build", root / "src", key,
                         tuple(sorted(opts.items())))
    with locked(lock_file("ncnn", key)):
        if (root / "done.json").is_file() and lib.is_file():
            touch_used(root)  # `edgepack cache prune` judges use by this stamp
            # Link-time pruning recompiles layer.cpp through these wrappers: keep them pointing at
            # the zig of the edgepack running now (a pip install, a frozen binary, a moved checkout).
            toolchain.write_wrappers(root / "toolchain", target, generic_cpu(target), march_flags(root / "src"))
            return result
        if log:
            log(f"building libncnn for {target.triple.zig} (one-time, cached as {root.name}; several minutes)")
        t0 = time.monotonic()
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        sdist = fetch(NCNN_SDIST)
        with tarfile.open(sdist) as tf:
            tf.extractall(root / "extract", filter="data")
        top = next((root / "extract").iterdir())
        top.rename(root / "src")
        shutil.rmtree(root / "extract")
        patch_source(root / "src")
        for _, _, apply in _arch_patches(target):
            apply(root / "src")
        wrappers = toolchain.write_wrappers(root / "toolchain", target, generic_cpu(target), march_flags(root / "src"))
        _toolchain_file(root / "toolchain.cmake", target, wrappers)
        flags = f"-ffile-prefix-map={root}=/ncnn -ffunction-sections -fdata-sections -g0"
        cfg = ["cmake", "-S", root / "src", "-B", root / "build", "-G", "Ninja",
               f"-DCMAKE_TOOLCHAIN_FILE={root / 'toolchain.cmake'}",
               f"-DCMAKE_INSTALL_PREFIX={root / 'install'}",
               f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}",
               "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON"]
        cfg += [f"-D{k}={v}" for k, v in sorted(opts.items())]
        logs = root / "logs"
        proc.run(cfg, what=f"configuring libncnn for {target.triple.zig}", env=toolchain.env(),
                 log=logs / "configure.log")
        njobs = jobs or os.cpu_count() or 2
        if target.arch == "x86_64":
            dropped = check_x86_configure((root / "build" / "CMakeCache.txt").read_text(errors="replace"), opts)
            if dropped:
                raise BuildError(f"libncnn for {target.triple.zig}: ISA kernels that would silently be missing: "
                                 f"{', '.join(dropped)}", hint=f"see {logs / 'configure.log'} and "
                                 f"{root / 'build' / 'CMakeFiles' / 'CMakeConfigureLog.yaml'}")
        what = f"building libncnn for {target.triple.zig}"
        with StepProgress(what, log) as progress:
            proc.run_streaming(["cmake", "--build", root / "build", "-j", str(njobs)], what=what,
                               on_line=progress.feed, env=toolchain.env(), log=logs / "build.log")
        proc.run(["cmake", "--install", root / "build"], what="installing libncnn", log=logs / "install.log")
        if not lib.is_file():
            raise BuildError(f"libncnn build finished without {lib}")
        check_archive_arch(lib, target)
        if target.arch == "x86_64":
            members = proc.run(toolchain.zig() + ["ar", "t", str(lib)], what="listing libncnn.a",
                               env=toolchain.env()).stdout.split()
            missing = check_x86_archive(members, opts)
            if missing:
                raise BuildError(f"libncnn for {target.triple.zig} was built without the {', '.join(missing)} kernels",
                                 hint=f"see {logs / 'build.log'}")
        _trim_build_dir(root / "build")
        (root / "done.json").write_text(json.dumps({"seconds": round(time.monotonic() - t0, 1),
                                                    "options": opts}, indent=1))
        return result


def march_flags(src: Path) -> set[str]:
    """Every -march=armv... spelling ncnn's CMake files pass (the wrappers translate them for zig)."""
    found = set()
    for f in [src / "CMakeLists.txt", *(src / "cmake").glob("*.cmake"), src / "src" / "CMakeLists.txt"]:
        if f.is_file():
            found |= set(re.findall(r"-march=armv[0-9.]+-a(?:\+[a-z0-9]+)*", f.read_text(errors="replace")))
    return found


def _trim_build_dir(build: Path) -> None:
    """Keep generated headers and compile commands (link-time pruning needs them), drop objects."""
    for p in build.rglob("*.o"):
        p.unlink()
