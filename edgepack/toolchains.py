"""Hermetic toolchains described by ``toolchains/*.toml`` (today: zig from PyPI).

Every compile and link for a target goes through ``Toolchain``; CMake projects get generated
cc/c++/ar/ranlib wrapper scripts with the target baked in (setting it through the environment
at configure time silently produced host binaries, see shared notes).
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import shlex
import os
import re
import shutil
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from . import proc
from .cache import cache_root
from .errors import BuildError, ToolMissingError
from .resources import toolchains_dir
from .targets import Target

# Fixed so builds are reproducible: nothing time-dependent reaches the binaries.
SOURCE_DATE_EPOCH = "1700000000"
WRAPPER_VERSION = 2  # bump when the wrapper's rewriting changes (part of cache keys)

# zig rejects -march=armv8.2-a+fp16 (CMake feature checks then silently drop fp16 kernels),
# so wrappers rewrite it into zig's -mcpu=generic+v8_2a+fullfp16 spelling.
_ARM_FEATURE_NAMES = {"fp16": "fullfp16", "simd": "neon", "crypto": "crypto", "dotprod": "dotprod",
                      "fp16fml": "fp16fml", "bf16": "bf16", "i8mm": "i8mm", "sve": "sve", "sve2": "sve2",
                      "f32mm": "f32mm", "f64mm": "f64mm"}


def rewrite_march(arg: str) -> str:
    # x86: zig names the psABI levels x86_64_v3 etc.; it rejects -march=x86-64-v3 (but knows
    # -march=haswell, -mavx512f, ... as clang does)
    x86 = re.fullmatch(r"-march=x86-64(?:-(v[234]))?", arg)
    if x86:
        return "-mcpu=x86_64" + (f"_{x86.group(1)}" if x86.group(1) else "")
    m = re.fullmatch(r"-march=armv(\d)\.(\d)-a((?:\+[a-z0-9]+)*)", arg)
    if not m:
        m8 = re.fullmatch(r"-march=armv8-a((?:\+[a-z0-9]+)*)", arg)
        if not m8:
            return arg
        major, minor, feats = "8", "0", m8.group(1)
    else:
        major, minor, feats = m.group(1), m.group(2), m.group(3)
    parts = ["generic"]
    if minor != "0":
        parts.append(f"v{major}_{minor}a")
    for f in filter(None, feats.split("+")):
        parts.append(_ARM_FEATURE_NAMES.get(f, f))
    return "-mcpu=" + "+".join(parts)


@dataclass(frozen=True)
class Toolchain:
    name: str
    package: str
    version: str
    python_module: str
    strip_candidates: tuple[str, ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]

    @classmethod
    def load(cls, name: str = "zig") -> "Toolchain":
        path = toolchains_dir() / f"{name}.toml"
        if not path.is_file():
            raise ToolMissingError(f"no toolchain file for {name!r} ({path})")
        d = tomllib.loads(path.read_text())
        return cls(d["name"], d["package"], d["version"], d["python_module"], tuple(d["strip"]),
                   tuple(d.get("cflags", [])), tuple(d.get("ldflags", [])))

    # ---- discovery -------------------------------------------------------------------------
    def installed_version(self) -> str | None:
        try:
            return importlib.metadata.version(self.package)
        except importlib.metadata.PackageNotFoundError:
            return None

    def check(self) -> None:
        have = self.installed_version()
        if have is None:
            raise ToolMissingError(f"toolchain {self.name}: Python package {self.package} is not installed",
                                   hint=f"pip install {self.package}=={self.version}")
        if have != self.version:
            raise ToolMissingError(f"toolchain {self.name}: {self.package} {have} installed, edgepack pins "
                                   f"{self.version}", hint=f"pip install {self.package}=={self.version}")

    def strip_tool(self) -> str:
        for cand in self.strip_candidates:
            found = shutil.which(cand)
            if found:
                return found
        raise ToolMissingError("no llvm-strip found", hint="apt-get install llvm")

    def zig(self) -> list[str]:
        """The zig executable inside the Python package (no Python start-up per compile). A frozen
        edgepack carries the package in its tools archive, unpacked once into the cache."""
        frozen = frozen_tool_dir(self.python_module)
        if frozen is not None:
            return [str(frozen / "zig")]
        spec = importlib.util.find_spec(self.python_module)
        if spec is None or not spec.submodule_search_locations:
            raise ToolMissingError(f"toolchain {self.name}: Python package {self.package} is not installed",
                                   hint=f"pip install {self.package}=={self.version}")
        exe = Path(list(spec.submodule_search_locations)[0]) / "zig"
        if not exe.is_file():
            raise ToolMissingError(f"toolchain {self.name}: {exe} is missing",
                                   hint=f"pip install --force-reinstall {self.package}=={self.version}")
        return [str(exe)]

    def env(self) -> dict[str, str]:
        root = cache_root()
        return {"ZIG_GLOBAL_CACHE_DIR": str(root / "zig-global"),
                "ZIG_LOCAL_CACHE_DIR": str(root / "zig-local"),
                "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH}

    # ---- flags -------------------------------------------------------------------------------
    def target_flags(self, target: Target, cpu: str | None = None) -> list[str]:
        return ["-target", target.triple.zig, f"-mcpu={cpu or target.cpu}"]

    def compile_flags(self, target: Target, cpu: str | None = None) -> list[str]:
        flags = self.target_flags(target, cpu) + list(self.cflags)
        if target.link in ("static-pie", "dynamic"):
            flags.append("-fPIE")
        return flags

    def link_flags(self, target: Target) -> list[str]:
        # Link for the triple's baseline CPU: zig builds libc/libc++ once per (triple, cpu, pie)
        # combination, and the hot code is already compiled for target.cpu.
        flags = self.target_flags(target, cpu=generic_cpu(target)) + list(self.ldflags)
        flags.append(f"-Wl,-z,max-page-size={target.page_size}")
        if target.link == "static":
            flags.append("-static")
        elif target.link == "static-pie":
            flags += ["-static", "-fPIE", "-pie"]
        return flags

    # ---- actions -----------------------------------------------------------------------------
    def compile(self, src: Path, out: Path, target: Target, *, cxx: bool = False, extra: list[str] = (),
                cwd: Path | None = None) -> Path:
        driver = "c++" if cxx else "cc"
        cmd = self.zig() + [driver] + self.compile_flags(target) + list(extra) + ["-c", str(src), "-o", str(out)]
        proc.run(cmd, what=f"compiling {src.name} for {target.name}", env=self.env(), cwd=cwd)
        return out

    def link(self, inputs: list[Path], out: Path, target: Target, *, extra: list[str] = (),
             cwd: Path | None = None) -> Path:
        cmd = self.zig() + ["c++"] + self.link_flags(target) + [str(i) for i in inputs] + list(extra) + ["-o", str(out)]
        proc.run(cmd, what=f"linking {out.name} for {target.name}", env=self.env(), cwd=cwd)
        return out

    def strip(self, path: Path) -> None:
        proc.run([self.strip_tool(), "--strip-all", str(path)], what=f"stripping {path.name}")

    def write_wrappers(self, folder: Path, target: Target, cpu: str, march_flags=()) -> dict[str, Path]:
        """POSIX sh cc/c++/ar/ranlib scripts for CMake, with the zig target baked in.

        ``march_flags``: the -march=armv8.x-a+... spellings the project's build files use; each is
        rewritten to zig's -mcpu form (see rewrite_march); any other -march=armv* fails loudly.
        """
        folder.mkdir(parents=True, exist_ok=True)
        zig = self.zig()[0]
        exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(self.env().items()))
        flags = set(march_flags)
        if target.arch == "x86_64":
            flags |= {"-march=x86-64", "-march=x86-64-v2", "-march=x86-64-v3", "-march=x86-64-v4"}
        cases = "".join(f"    {shlex.quote(f)}) a={shlex.quote(rewrite_march(f))} ;;\n"
                        for f in sorted(flags) if rewrite_march(f) != f)
        out = {}
        for tool in ("cc", "c++", "ar", "ranlib"):
            takes_target = tool in ("cc", "c++")
            head = [zig, tool] + (["-target", target.triple.zig, f"-mcpu={cpu}"] if takes_target else [])
            body = ""
            if takes_target:
                body = ("n=$#\ni=0\nwhile [ \"$i\" -lt \"$n\" ]; do\n  a=$1; shift\n  case \"$a\" in\n" + cases +
                        "    -march=armv*) echo \"edgepack zig wrapper: no zig spelling for $a\" >&2; exit 1 ;;\n"
                        "  esac\n  set -- \"$@\" \"$a\"\n  i=$((i+1))\ndone\n")
            script = folder / tool
            text = (f"#!/bin/sh\n# generated by edgepack: zig {tool} for {target.triple.zig}\n{exports}{body}"
                    f"exec {' '.join(shlex.quote(h) for h in head)} \"$@\"\n")
            if not script.is_file() or script.read_text() != text:
                # write-then-rename: another edgepack may be running this wrapper right now
                tmp = folder / f".{tool}.{os.getpid()}.tmp"
                tmp.write_text(text)
                tmp.chmod(0o755)
                os.replace(tmp, script)
            out[tool] = script
        return out


def generic_cpu(target: Target) -> str:
    return {"x86_64": "x86_64", "aarch64": "generic", "arm": "generic"}[target.arch]


# ---- frozen (PyInstaller one-file) edgepack ---------------------------------------------------
# packaging/edgepack.spec bundles zig and pnnx (~500 MB unpacked) as one pre-compressed archive,
# edgepack_tools/tools.tar.gz, with edgepack_tools/tools.json ({"sha256", "packages": {...}}).
# A one-file binary re-extracts everything it bundles at every start, so the archive is unpacked
# once per cache into <cache>/tools/<sha256[:16]>/ instead of 500 MB per run.

def frozen_tool_dir(package: str) -> Path | None:
    """In a frozen edgepack: the unpacked folder of ``package`` (e.g. ziglang, pnnx); else None."""
    base = getattr(sys, "_MEIPASS", None)
    if not getattr(sys, "frozen", False) or base is None:
        return None
    bundle = Path(base) / "edgepack_tools"
    info_path = bundle / "tools.json"
    if not info_path.is_file():
        raise ToolMissingError(f"this frozen edgepack has no tools archive ({info_path})",
                               hint="rebuild it with scripts/freeze.sh")
    import json
    info = json.loads(info_path.read_text())
    if package not in info["packages"]:
        raise ToolMissingError(f"this frozen edgepack does not carry {package}")
    dest = cache_root() / "tools" / info["sha256"][:16]
    if not (dest / ".complete").is_file():
        from .cache import lock_file, locked
        with locked(lock_file("tools", info["sha256"][:16])):
            if not (dest / ".complete").is_file():
                _unpack_tools(bundle / "tools.tar.gz", info["sha256"], dest)
    return dest / package


def _unpack_tools(archive: Path, sha256: str, dest: Path) -> None:
    import tarfile
    from .cache import sha256_file
    if sha256_file(archive) != sha256:
        raise BuildError(f"{archive}: the bundled tools archive is damaged (sha256 mismatch)")
    part = dest.with_name(dest.name + ".part")
    if part.exists():
        shutil.rmtree(part)
    if dest.exists():
        shutil.rmtree(dest)
    part.mkdir(parents=True)
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(part, filter="data")
    (part / ".complete").write_text(sha256 + "\n")
    part.rename(dest)
