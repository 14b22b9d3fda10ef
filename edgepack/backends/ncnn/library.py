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
from ...cache import cache_root, key_of, locked
from ...elf import check_archive_arch
from ...errors import BuildError
from ...sources import NCNN_SDIST, fetch
from ...targets import Target
from ...toolchains import WRAPPER_VERSION, Toolchain, generic_cpu

RECIPE_VERSION = 1

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
# Which run-time dispatched ISA variants to build, per architecture (each variant compiles every
# layer again; these are the ones edge CPUs have).
ARCH_OPTIONS = {
    "x86_64": {"NCNN_AVX512": "OFF", "NCNN_AVXVNNI": "OFF", "NCNN_AVXVNNIINT8": "OFF",
               "NCNN_AVXVNNIINT16": "OFF", "NCNN_AVXNECONVERT": "OFF", "NCNN_FMA4": "OFF", "NCNN_XOP": "OFF"},
    "aarch64": {"NCNN_ARM86SVE": "OFF", "NCNN_ARM84I8MM": "OFF", "NCNN_ARM84BF16": "OFF"},
    "arm": {},
}
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
    opts.update({k: str(v) for k, v in target.backend_options.get("ncnn", {}).get("cmake", {}).items()})
    return opts


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
    key = key_of({"sdist": NCNN_SDIST.sha256, "zig": toolchain.version, "triple": target.triple.zig,
                  "cpu": generic_cpu(target), "options": opts, "wrapper": WRAPPER_VERSION,
                  "recipe": RECIPE_VERSION})
    return key, opts


def build_library(target: Target, toolchain: Toolchain, *, jobs: int | None = None, log=None) -> NcnnLibrary:
    key, opts = library_key(target, toolchain)
    root = cache_root() / "ncnn" / f"{target.triple.zig}-{key}"
    lib = root / "install" / "lib" / "libncnn.a"
    result = NcnnLibrary(root, lib, root / "install" / "include", root / "build", root / "src", key,
                         tuple(sorted(opts.items())))
    with locked(cache_root() / "locks" / f"ncnn-{key}.lock"):
        if (root / "done.json").is_file() and lib.is_file():
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
        proc.run(["cmake", "--build", root / "build", "-j", str(njobs)],
                 what=f"building libncnn for {target.triple.zig}", env=toolchain.env(), log=logs / "build.log")
        proc.run(["cmake", "--install", root / "build"], what="installing libncnn", log=logs / "install.log")
        if not lib.is_file():
            raise BuildError(f"libncnn build finished without {lib}")
        check_archive_arch(lib, target)
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
