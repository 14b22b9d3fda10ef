"""The target matrix: TOML files in ``targets/`` (and folders the user names), validated on load."""
from __future__ import annotations

import difflib
import os
import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from .errors import TargetError
from .triple import ARCHES, Triple, parse_triple

from .resources import targets_dir
_LINK_KINDS = {"static", "static-pie", "dynamic"}
_KNOWN_KEYS = {"name", "description", "aliases", "triple", "cpu", "features", "link", "page_size",
               "qemu_cpu", "verify_cpus", "backends", "toolchain", "ncnn", "tvm", "fp16_arithmetic"}
# "native": the build machine's own CPU, no emulation; anything else is a qemu-user CPU model.
NATIVE = "native"
_QEMU_CPU_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    triple: Triple
    cpu: str                     # zig -mcpu name (underscores), e.g. cortex_a78ae
    features: tuple[str, ...]    # informative CPU features (fp16, dotprod, ...)
    link: str                    # static | static-pie | dynamic
    page_size: int               # max-page-size the ELF LOAD segments are aligned to
    verify_cpus: tuple[str, ...]  # every CPU kind the artifact is verified on ("native" or a qemu -cpu model)
    backends: tuple[str, ...]    # preference order for --backend auto
    toolchain: str
    fp16_arithmetic: bool        # the CPU does fp16 math (ncnn then uses it by default)
    aliases: tuple[str, ...] = ()
    backend_options: dict = field(default_factory=dict, compare=False, hash=False)
    source: str = ""

    @property
    def arch(self) -> str:
        return self.triple.arch

    @property
    def needs_qemu(self) -> bool:
        return ARCHES[self.triple.arch]["qemu"] is not None

    @property
    def qemu_cpu(self) -> str | None:
        """The first emulated CPU of an arch this machine cannot run natively (older manifests and
        the SDK read this key to run an Arm artifact under qemu)."""
        return next((c for c in self.verify_cpus if c != NATIVE), None) if self.needs_qemu else None

    def summary(self) -> dict:
        return {"name": self.name, "description": self.description, "triple": str(self.triple),
                "cpu": self.cpu, "features": list(self.features), "link": self.link,
                "page_size": self.page_size, "qemu_cpu": self.qemu_cpu,
                "verify_cpus": list(self.verify_cpus), "backends": list(self.backends),
                "toolchain": self.toolchain, "aliases": list(self.aliases), "source": self.source}


def _require(data: dict, key: str, typ, path: Path):
    if key not in data:
        raise TargetError(f"{path}: missing key {key!r}")
    value = data[key]
    if not isinstance(value, typ):
        raise TargetError(f"{path}: key {key!r} must be {typ.__name__}, got {type(value).__name__}")
    return value


def parse_target(data: dict, path: Path) -> Target:
    unknown = set(data) - _KNOWN_KEYS
    if unknown:
        close = {k: difflib.get_close_matches(k, _KNOWN_KEYS, n=1) for k in unknown}
        detail = ", ".join(f"{k!r}" + (f" (did you mean {c[0]!r}?)" if c else "") for k, c in close.items())
        raise TargetError(f"{path}: unknown key(s) {detail}")
    name = _require(data, "name", str, path)
    if not name or not all(ch.isalnum() or ch in "-_" for ch in name):
        raise TargetError(f"{path}: target name {name!r} may hold only letters, digits, '-' and '_'")
    triple = parse_triple(_require(data, "triple", str, path))
    cpu = data.get("cpu", "generic")
    if not isinstance(cpu, str) or "-" in cpu:
        raise TargetError(f"{path}: cpu {cpu!r} must be a zig CPU name with underscores (e.g. cortex_a78ae)")
    link = data.get("link", "static")
    if link not in _LINK_KINDS:
        raise TargetError(f"{path}: link must be one of {sorted(_LINK_KINDS)}, got {link!r}")
    if link == "dynamic" and not triple.is_glibc:
        raise TargetError(f"{path}: dynamic linking needs a gnu triple with a glibc baseline")
    if triple.is_glibc and link != "dynamic":
        raise TargetError(f"{path}: a gnu triple links glibc dynamically; set link = \"dynamic\" or use musl")
    if triple.is_glibc and not triple.glibc:
        raise TargetError(f"{path}: a gnu triple must state its glibc baseline, e.g. aarch64-linux-gnu.2.31")
    page_size = data.get("page_size", 4096)
    if not isinstance(page_size, int) or page_size < 4096 or page_size & (page_size - 1):
        raise TargetError(f"{path}: page_size must be a power of two >= 4096, got {page_size!r}")
    backends = tuple(data.get("backends", ["ncnn"]))
    if not backends or not all(isinstance(b, str) for b in backends):
        raise TargetError(f"{path}: backends must be a non-empty list of backend names")
    aliases = tuple(data.get("aliases", []))
    features = tuple(data.get("features", []))
    verify_cpus = _verify_cpus(data, triple.arch, path)
    toolchain = _toolchain(data, path)
    return Target(
        name=name, description=str(data.get("description", "")), triple=triple, cpu=cpu,
        features=features, link=link, page_size=page_size, verify_cpus=verify_cpus, backends=backends,
        toolchain=toolchain, fp16_arithmetic=bool(data.get("fp16_arithmetic", False)),
        aliases=aliases, backend_options={k: data[k] for k in ("ncnn", "tvm") if k in data},
        source=str(path),
    )


def _toolchain(data: dict, path: Path) -> str:
    """The toolchain a target builds with: a toolchains/<name>.toml that must exist (the build
    loads it per target)."""
    from .resources import toolchains_dir
    name = data.get("toolchain", "zig")
    known = sorted(p.stem for p in toolchains_dir().glob("*.toml"))
    if not isinstance(name, str) or name not in known:
        raise TargetError(f"{path}: unknown toolchain {name!r}; known: {', '.join(known)}",
                          hint="toolchains are files in toolchains/<name>.toml")
    return name


def _verify_cpus(data: dict, arch: str, path: Path) -> tuple[str, ...]:
    """``verify_cpus`` (a list), or the older single ``qemu_cpu``: every CPU feature set the
    artifact may meet on a device, since ncnn picks kernels (fp16 arithmetic, AVX-512) at run time."""
    emulated = ARCHES[arch]["qemu"] is not None
    if "verify_cpus" in data and "qemu_cpu" in data:
        raise TargetError(f"{path}: give verify_cpus only (qemu_cpu is its older one-CPU form)")
    if "qemu_cpu" in data:
        cpus = [data["qemu_cpu"]]
        if not isinstance(cpus[0], str):
            raise TargetError(f"{path}: key 'qemu_cpu' must be str, got {type(cpus[0]).__name__}")
    elif "verify_cpus" in data:
        cpus = data["verify_cpus"]
        if not isinstance(cpus, list) or not cpus or not all(isinstance(c, str) for c in cpus):
            raise TargetError(f"{path}: verify_cpus must be a non-empty list of CPU names, "
                              f"e.g. [\"cortex-a53\", \"max\"]")
    elif emulated:
        raise TargetError(f"{path}: verify_cpus is required for {arch} targets (verification runs under qemu), "
                          f"e.g. verify_cpus = [\"cortex-a53\", \"max\"]")
    else:
        cpus = [NATIVE]
    if len(set(cpus)) != len(cpus):
        raise TargetError(f"{path}: verify_cpus lists a CPU twice: {cpus}")
    for c in cpus:
        if c == NATIVE and emulated:
            raise TargetError(f"{path}: verify_cpus: \"native\" is only for targets this machine runs natively "
                              f"(x86_64); name a qemu CPU model for {arch}, e.g. \"cortex-a53\"")
        if c != NATIVE and not _QEMU_CPU_RE.match(c):
            raise TargetError(f"{path}: verify_cpus: {c!r} is not a qemu CPU model name "
                              f"(see `qemu-{arch} -cpu help`)")
    return tuple(cpus)


def load_target_file(path: Path) -> Target:
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise TargetError(f"{path}: not valid TOML: {exc}") from exc
    except OSError as exc:
        raise TargetError(f"{path}: cannot read: {exc.strerror}") from exc
    return parse_target(data, path)


def target_dirs(extra: list[Path] | None = None) -> list[Path]:
    dirs = [targets_dir()]
    env = os.environ.get("EDGEPACK_TARGETS_PATH")
    if env:
        dirs += [Path(p) for p in env.split(os.pathsep) if p]
    dirs += list(extra or [])
    return dirs


class TargetMatrix:
    """All known targets by name, with aliases; later folders override earlier ones."""

    def __init__(self, targets: list[Target]):
        self.targets: dict[str, Target] = {}
        self.aliases: dict[str, str] = {}
        for t in targets:
            self.targets[t.name] = t
        for t in self.targets.values():
            for a in t.aliases:
                if a in self.targets and a != t.name:
                    raise TargetError(f"{t.source}: alias {a!r} clashes with target {a!r}")
                self.aliases[a] = t.name

    @classmethod
    def load(cls, extra_dirs: list[Path] | None = None) -> "TargetMatrix":
        found = []
        for d in target_dirs(extra_dirs):
            if not d.is_dir():
                raise TargetError(f"target folder {d} does not exist")
            found += [load_target_file(p) for p in sorted(d.glob("*.toml"))]
        return cls(found)

    def names(self) -> list[str]:
        return sorted(self.targets)

    def get(self, name: str) -> Target:
        name = name.strip()
        if name in self.targets:
            return self.targets[name]
        if name in self.aliases:
            return self.targets[self.aliases[name]]
        candidates = self.names() + sorted(self.aliases)
        close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise TargetError(f"unknown target {name!r}",
                          hint=f"{hint}known targets: {', '.join(self.names())} (see `edgepack targets`)")

    def resolve(self, specs: list[str], all_targets: bool = False) -> list[Target]:
        """Targets named by repeated/comma-separated ``--target`` values, or every target."""
        if all_targets:
            return [self.targets[n] for n in self.names()]
        out: list[Target] = []
        for spec in specs:
            for name in spec.split(","):
                if not name.strip():
                    continue
                t = self.get(name)
                if t not in out:
                    out.append(t)
        if not out:
            raise TargetError("no target given", hint="pass --target NAME (see `edgepack targets`) or --all")
        return out


def verify_only_on(targets: list[Target], cpus: tuple[str, ...]) -> list[Target]:
    """The targets with ``verify_cpus`` narrowed to ``cpus`` (``--verify-on``): each named CPU must be one a
    target names, and every target keeps at least one, so the option can narrow verification but never
    invent a CPU the target does not promise. Empty ``cpus``: the targets as they are."""
    if not cpus:
        return list(targets)
    unknown = [c for c in cpus if not any(c in t.verify_cpus for t in targets)]
    if unknown:
        offered = sorted({c for t in targets for c in t.verify_cpus})
        raise TargetError(f"--verify-on {','.join(unknown)}: no target built here verifies on it",
                          hint=f"name CPUs from the targets' verify_cpus: {', '.join(offered)}")
    out = []
    for t in targets:
        kept = tuple(c for c in t.verify_cpus if c in cpus)
        if not kept:
            raise TargetError(f"--verify-on {','.join(cpus)} leaves target {t.name} no CPU to verify on",
                              hint=f"add one of its verify_cpus: {', '.join(t.verify_cpus)}")
        out.append(replace(t, verify_cpus=kept))
    return out
