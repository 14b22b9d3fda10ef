"""`edgepack prefetch`: build the per-architecture libraries for targets before any model
arrives (CI runners warm their cache with it; one build serves every target of an arch)."""
from __future__ import annotations

from dataclasses import dataclass

from .backends.ncnn.library import build_library, library_key
from .targets import Target
from .toolchains import Toolchain


@dataclass(frozen=True)
class Prefetched:
    library: str
    key: str
    targets: tuple[str, ...]


def prefetch(targets: list[Target], log=print) -> list[Prefetched]:
    toolchains = {name: Toolchain.load(name) for name in sorted({t.toolchain for t in targets})}
    for tc in toolchains.values():
        tc.check()
    by_key: dict[str, list[Target]] = {}
    for t in targets:
        key, _ = library_key(t, toolchains[t.toolchain])
        by_key.setdefault(key, []).append(t)
    done = []
    for key, group in by_key.items():
        lib = build_library(group[0], toolchains[group[0].toolchain], log=log)
        done.append(Prefetched(str(lib.lib), key, tuple(t.name for t in group)))
        log(f"libncnn for {', '.join(t.name for t in group)}: {lib.lib}")
    return done
