"""Link-time pruning: recompile ncnn's layer.cpp against a registry that only names the layers
a model uses (plus the helper layers those create internally). The linker then leaves every
other layer's objects out of the static executable, without rebuilding libncnn per model."""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from ... import proc
from ...cache import key_of, locked
from ...errors import BuildError
from .library import NcnnLibrary

_ENTRY = re.compile(r'\{\s*"(\w+)"\s*,\s*(\w+)\s*\}')
# Always kept: cheap layers ncnn's Net itself or many layers create.
ALWAYS = frozenset({"Input", "Split", "Packing", "Cast", "Flatten", "Reshape", "Padding", "Crop"})


def registry_names(header: str) -> list[str]:
    names = []
    for m in _ENTRY.finditer(header):
        if m.group(1) not in names:
            names.append(m.group(1))
    return names


def helper_graph(src: Path, names: list[str]) -> tuple[dict[str, set[str]], set[str]]:
    """layer -> layers its sources create via LayerType::X; plus types referenced by shared files
    that belong to no single layer (kept whenever anything is kept)."""
    lowered = sorted(((n.lower(), n) for n in names), key=lambda x: -len(x[0]))
    deps: dict[str, set[str]] = {n: set() for n in names}
    shared: set[str] = set()
    for path in (src / "src" / "layer").rglob("*"):
        if path.suffix not in (".cpp", ".h"):
            continue
        refs = set(re.findall(r"LayerType::(\w+)", path.read_text(errors="replace")))
        refs &= set(names)
        if not refs:
            continue
        stem = path.stem.lower()
        owner = next((orig for low, orig in lowered if stem == low or stem.startswith(low + "_")), None)
        if owner is None:
            shared |= refs
        else:
            deps[owner] |= refs
    return deps, shared


def keep_set(layer_types: set[str], deps: dict[str, set[str]], shared: set[str]) -> set[str]:
    keep = set(layer_types) | ALWAYS | shared
    todo = list(keep)
    while todo:
        for d in deps.get(todo.pop(), ()):
            if d not in keep:
                keep.add(d)
                todo.append(d)
    return keep


def pruned_registry(header: str, keep: set[str]) -> str:
    return _ENTRY.sub(lambda m: m.group(0) if m.group(1) in keep else f'{{"{m.group(1)}", 0}}', header)


def pruned_layer_object(lib: NcnnLibrary, layer_types: set[str], log=None) -> tuple[Path, list[str]]:
    """layer.o whose registry holds only what ``layer_types`` needs; cached per (library, set)."""
    gen = lib.build / "src" / "layer_registry.h"
    if not gen.is_file():
        raise BuildError(f"libncnn cache entry {lib.root} lacks its generated layer_registry.h; clear the cache")
    header = gen.read_text()
    names = registry_names(header)
    deps, shared = helper_graph(lib.source, names)
    keep = keep_set(layer_types, deps, shared) & set(names)
    key = key_of(sorted(keep))
    out_dir = lib.root / "pruned" / key
    obj = out_dir / "layer.o"
    with locked(lib.root / "pruned" / f"{key}.lock"):
        if obj.is_file():
            return obj, sorted(keep)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "layer_registry.h").write_text(pruned_registry(header, keep))
        commands = json.loads((lib.build / "compile_commands.json").read_text())
        entry = next((c for c in commands if c["file"].endswith("/src/layer.cpp")), None)
        if entry is None:
            raise BuildError("compile_commands.json has no entry for layer.cpp")
        argv = entry["arguments"] if "arguments" in entry else shlex.split(entry["command"])
        fixed, skip = [], False
        for a in argv:
            if skip:
                skip = False
                continue
            if a == "-o":
                skip = True
                continue
            if a in ("-MF", "-MT", "-MQ"):
                skip = True
                continue
            if a.startswith("-MF") or a == "-MD":
                continue
            fixed.append(a)
        fixed = [fixed[0], "-iquote", str(out_dir)] + fixed[1:] + ["-o", str(obj)]
        proc.run(fixed, what="compiling ncnn's pruned layer registry", cwd=Path(entry["directory"]))
        if log:
            log(f"pruned ncnn to {len(keep)} of {len(names)} layers")
        return obj, sorted(keep)
