"""The TVM runtime per target: the C++ runtime sources the apache-tvm wheel ships plus the
apache-tvm-ffi sdist, compiled with zig and archived, cached by a content hash.

No CMake: the runtime is a fixed list of translation units, compiled here in parallel (at most
``EDGEPACK_JOBS`` at once, default 2). Headers the wheel lacks are edgepack's own, in
``runtimes/tvm/include`` and ``runtimes/tvm/src/support``. The runtime code is not hot (the
model's kernels are in lib0.o, compiled for the exact CPU), so one build per (triple, PIE) is
shared by every target of an architecture.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ... import proc
from ...cache import cache_root, key_of, lock_file, locked, touch_used
from ...elf import check_archive_arch
from ...errors import BuildError, ToolMissingError
from ...progress import StepProgress
from ...resources import runtimes_dir
from ...sources import PinnedSource, fetch
from ...targets import Target
from ...toolchains import Toolchain, generic_cpu

RECIPE_VERSION = 2

TVM_VERSION = "0.27.0.post1"
TVM_FFI_VERSION = "0.1.14.post1"
TVM_FFI_SDIST = PinnedSource("apache-tvm-ffi", "apache_tvm_ffi-0.1.14.post1.tar.gz",
                             "8ebd92dc97cdcb22ab494aa252c868ddd6a9b6c89be69188562e0f236652429f", 3232883)

# TVM runtime sources (relative to the wheel's src/runtime) a relax VM on the CPU needs. Left out:
# LLM-only files (KV caches, attention, tensor caches), RPC, disco, contrib libraries, GPU parts.
TVM_SOURCES = (
    "builtin_fp16.cc", "cpu_device_api.cc", "device_api.cc", "file_utils.cc", "logging.cc",
    "memory/memory_manager.cc", "module.cc", "tensor.cc", "thread_pool.cc", "threading_backend.cc",
    "workspace_pool.cc", "vm/builtin.cc", "vm/bytecode.cc", "vm/executable.cc", "vm/vm.cc",
    # TopK/ArgSort/Sort lower to these packed functions on CPUs (tvm.contrib.sort.*).
    "extra/contrib/sort/sort.cc",
)
# tvm-ffi sources (relative to the sdist's src/ffi): the core plus the module/system-lib loader.
FFI_SOURCES = (
    "backtrace.cc", "object.cc", "error.cc", "function.cc", "tensor.cc", "dtype.cc", "container.cc",
    "init_once.cc", "custom_allocator.cc",
    "extra/module.cc", "extra/library_module.cc", "extra/library_module_system_lib.cc",
    "extra/env_context.cc", "extra/env_c_api.cc", "extra/json_parser.cc", "extra/json_writer.cc",
)
DEFINES = (
    "-DNDEBUG", "-DTVM_FFI_CMAKE_LITTLE_ENDIAN=1", "-DTVM_FFI_USE_LIBBACKTRACE=0",
    "-DTVM_FFI_BACKTRACE_ON_SEGFAULT=0", "-DTVM_LOG_DEBUG=0", "-DTVM_THREADPOOL_USE_OPENMP=0",
    "-DTVM_FFI_DLL_EXPORT=", "-DTVM_RUNTIME_DLL=",
)
CXXFLAGS = ("-std=c++17", "-O2", "-g0", "-ffunction-sections", "-fdata-sections", "-fvisibility=hidden",
            "-w")


@dataclass(frozen=True)
class TvmRuntime:
    root: Path
    archives: tuple[Path, ...]      # libtvm_runtime.a, libtvm_ffi.a (link with --whole-archive)
    include_dirs: tuple[Path, ...]  # for the engine source
    key: str

    def manifest(self) -> dict:
        return {"apache-tvm": TVM_VERSION, "apache-tvm-ffi": TVM_FFI_VERSION, "sdist_sha256": TVM_FFI_SDIST.sha256,
                "cache_key": self.key}


def tvm_package_dir() -> Path:
    try:
        import tvm  # noqa: F401  (heavy, but needed anyway for the compile stage)
    except ImportError as exc:
        raise ToolMissingError("the TVM backend needs apache-tvm",
                               hint=f"pip install apache-tvm=={TVM_VERSION} apache-tvm-ffi=={TVM_FFI_VERSION}") from exc
    return Path(tvm.__file__).parent


def wheel_runtime_dir() -> Path:
    src = tvm_package_dir() / "src" / "runtime"
    if not (src / "vm" / "vm.cc").is_file():
        raise ToolMissingError(f"the installed apache-tvm has no runtime sources under {src}",
                               hint=f"pip install --force-reinstall apache-tvm=={TVM_VERSION}")
    return src


def _own_headers() -> Path:
    return runtimes_dir() / "tvm"


def _tree_digest(paths: list[Path], base: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(str(p.relative_to(base)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _pic(target: Target) -> bool:
    return target.link in ("static-pie", "dynamic")


def runtime_key(target: Target, toolchain: Toolchain, tvm_root: Path | None = None) -> str:
    """``tvm_root``: the apache-tvm package folder when already known (`edgepack cache` keys entries
    without importing tvm)."""
    tvm_root = tvm_root or tvm_package_dir()
    wheel_files = [p for p in (tvm_root / "src" / "runtime").rglob("*")
                   if p.is_file() and ("extra" not in p.parts or "sort" in p.parts)]
    wheel_files += [p for p in (tvm_root / "include").rglob("*.h")]
    own = [p for p in _own_headers().rglob("*.h")]
    return key_of({"tvm_sources": _tree_digest(wheel_files, tvm_root), "own_headers": _tree_digest(own, _own_headers()),
                   "ffi_sdist": TVM_FFI_SDIST.sha256, "zig": toolchain.version, "triple": target.triple.zig,
                   "cpu": generic_cpu(target), "pic": _pic(target), "tvm": TVM_SOURCES, "ffi": FFI_SOURCES,
                   "defines": DEFINES, "cxxflags": CXXFLAGS, "recipe": RECIPE_VERSION})


def _jobs() -> int:
    try:
        return max(1, int(os.environ.get("EDGEPACK_JOBS", "2")))
    except ValueError:
        return 2


def build_runtime(target: Target, toolchain: Toolchain, *, log=None) -> TvmRuntime:
    key = runtime_key(target, toolchain)
    root = cache_root() / "tvm-runtime" / f"{target.triple.zig}-{key}"
    archives = (root / "lib" / "libtvm_runtime.a", root / "lib" / "libtvm_ffi.a")
    includes = (root / "include", root / "ffi" / "include", root / "ffi" / "3rdparty" / "dlpack" / "include")
    result = TvmRuntime(root, archives, includes, key)
    with locked(lock_file("tvm-runtime", key)):
        if (root / "done.json").is_file() and all(a.is_file() for a in archives):
            touch_used(root)
            return result
        if log:
            log(f"building the TVM runtime for {target.triple.zig} (one-time, cached as {root.name}; a few minutes)")
        t0 = time.monotonic()
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        _stage_sources(root)
        flags = list(CXXFLAGS) + list(DEFINES) + [f"-ffile-prefix-map={root}=/tvm"]
        if _pic(target):
            flags.append("-fPIC")
        flags += [f"-I{d}" for d in (root / "include", root / "ffi" / "include",
                                     root / "ffi" / "3rdparty" / "dlpack" / "include", root)]
        units = [("tvm", root / "src" / "runtime" / s) for s in TVM_SOURCES]
        units += [("ffi", root / "ffi" / "src" / "ffi" / s) for s in FFI_SOURCES]
        objs: dict[str, list[Path]] = {"tvm": [], "ffi": []}

        def one(unit):
            lib, src = unit
            rel = src.relative_to(root).with_suffix(".o")
            obj = root / "obj" / str(rel).replace("/", "__")
            obj.parent.mkdir(parents=True, exist_ok=True)
            cmd = toolchain.zig() + ["c++"] + toolchain.target_flags(target, cpu=generic_cpu(target)) + flags + \
                ["-c", str(src), "-o", str(obj)]
            proc.run(cmd, what=f"compiling TVM runtime {rel.name} for {target.triple.zig}", env=toolchain.env(),
                     cwd=root)
            return lib, obj

        what = f"building the TVM runtime for {target.triple.zig}"
        with ThreadPoolExecutor(max_workers=_jobs()) as pool, \
                StepProgress(what, log or (lambda m: None)) as progress:
            for done, (lib, obj) in enumerate(pool.map(one, units), 1):
                objs[lib].append(obj)
                progress.update(done, len(units))
        (root / "lib").mkdir()
        for lib, archive in zip(("tvm", "ffi"), archives):
            proc.run(toolchain.zig() + ["ar", "rcs", str(archive)] + [str(o) for o in sorted(objs[lib])],
                     what=f"archiving {archive.name}", env=toolchain.env(), cwd=root)
            check_archive_arch(archive, target)
        shutil.rmtree(root / "obj")
        (root / "done.json").write_text(json.dumps({"seconds": round(time.monotonic() - t0, 1), "key": key,
                                                    "tvm_sources": list(TVM_SOURCES),
                                                    "ffi_sources": list(FFI_SOURCES)}, indent=1))
        return result


def _stage_sources(root: Path) -> None:
    """root/src/runtime + root/include from the wheel, root/src/support + headers of our own,
    root/ffi from the pinned sdist."""
    tvm_root = tvm_package_dir()
    wheel_runtime_dir()
    shutil.copytree(tvm_root / "src" / "runtime", root / "src" / "runtime",
                    ignore=shutil.ignore_patterns("extra", "rpc", "cuda", "hexagon", "__pycache__"))
    shutil.copytree(tvm_root / "include", root / "include")
    own = _own_headers()
    shutil.copytree(own / "include", root / "include", dirs_exist_ok=True)
    shutil.copytree(own / "src" / "support", root / "src" / "support")
    shutil.copytree(tvm_root / "src" / "runtime" / "extra" / "contrib" / "sort",
                    root / "src" / "runtime" / "extra" / "contrib" / "sort")
    # contrib/sort includes the fp16 header by its path in the TVM source tree.
    (root / "3rdparty" / "compiler-rt").mkdir(parents=True)
    shutil.copyfile(own / "include" / "builtin_fp16.h", root / "3rdparty" / "compiler-rt" / "builtin_fp16.h")
    sdist = fetch(TVM_FFI_SDIST)
    with tarfile.open(sdist) as tf:
        members = [m for m in tf.getmembers()
                   if m.name.split("/", 2)[1:2] and m.name.split("/", 2)[1] in ("include", "src", "3rdparty")]
        tf.extractall(root / "extract", members=members, filter="data")
    top = next((root / "extract").iterdir())
    top.rename(root / "ffi")
    shutil.rmtree(root / "extract")
    if not (root / "ffi" / "3rdparty" / "dlpack" / "include" / "dlpack" / "dlpack.h").is_file():
        raise BuildError(f"{TVM_FFI_SDIST.filename} has no 3rdparty/dlpack headers")
