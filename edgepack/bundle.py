"""Stage 5: the C runtime + a backend's engine + the model and golden data -> one executable."""
from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .backends import EngineBuild
from .elf import ElfInfo, check_executable
from .errors import ModelError
from .model import TensorSpec
from .resources import runtimes_dir
from .targets import Target
from .toolchains import Toolchain

COMMON_SOURCES = ("ep_util.c", "ep_npy.c", "ep_cli.c", "ep_main.c", "ep_json.c", "ep_http.c", "ep_csv.c",
                  "ep_predict.c", "ep_serve.c", "ep_batch.c", "ep_page.c", "ep_engine_seq.c", "ep_emulation.c", "ep_detect.c")
# ep_image.c includes stb_image.h from Debian's libstb-dev (a well-kept decoder, not vendored); only
# artifacts with baked image preprocessing link it, the others a stub (ep_image_none.c, ~35 KB less).
STB_INCLUDE_DIR = Path("/usr/include/stb")


# engine sources with parallel loops: compiled with -fopenmp, they fork on the runtime libncnn carries
# (simpleomp; zig ships no OpenMP library), as ncnn's own layers do
OPENMP_SOURCES = frozenset({"ep_ncnn_layers.cc"})


def image_sources(manifest: dict) -> tuple[str, ...]:
    return ("ep_image.c",) if manifest.get("prepost", {}).get("preprocess") else ("ep_image_none.c",)


_DTYPE_ENUM = {"float32": "EP_F32", "float64": "EP_F64", "int32": "EP_I32", "int64": "EP_I64",
               "uint8": "EP_U8", "int8": "EP_I8", "bool": "EP_BOOL", "float16": "EP_F16"}


@dataclass(frozen=True)
class BundleSegment:
    """One engine's part of a partitioned artifact (runtimes/common/ep_engine_table.h)."""
    backend: str                        # names the engine table ep_engine_ops_<backend>
    inputs: tuple[TensorSpec, ...]      # tensors it reads (model inputs or earlier segments' outputs)
    outputs: tuple[TensorSpec, ...]     # tensors it writes
    options: dict
    model_blobs: tuple[Path, ...] = ()


@dataclass(frozen=True)
class BundleRequest:
    name: str
    target: Target
    engine: EngineBuild
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    golden_inputs: dict            # name -> np.ndarray
    golden_outputs: dict
    manifest: dict
    workdir: Path
    out_path: Path
    toolchain: Toolchain
    # empty: one segment, the whole model on req.engine; else the segments in run order
    segments: tuple[BundleSegment, ...] = ()


@dataclass(frozen=True)
class Bundled:
    path: Path
    size: int
    elf: ElfInfo


def c_string(s: str) -> str:
    out = ['"']
    for ch in s.encode():
        c = chr(ch)
        if c in '"\\':
            out.append("\\" + c)
        elif 32 <= ch < 127 and c != "?":  # '?' avoids trigraphs
            out.append(c)
        else:
            out.append(f"\\{ch:03o}")
    out.append('"')
    return "".join(out)


def _blob_asm(symbols: list[tuple[str, str]], bits: int) -> str:
    word = ".quad" if bits == 64 else ".long"
    lines = ['.section .rodata.edgepack,"a"']
    for sym, rel in symbols:
        lines += [".balign 16", f".global {sym}", f"{sym}:", f'.incbin "{rel}"', f"{sym}_end:",
                  ".byte 0",  # NUL after each blob: ncnn parses the .param as a C string
                  ".balign 8", f".global {sym}_size", f"{sym}_size:", f"{word} {sym}_end - {sym}"]
        if bits != 64:
            lines.append(".long 0")  # sizes are read as uint64_t: little-endian high word
    lines.append('.section .note.GNU-stack,"",%progbits')
    return "\n".join(lines) + "\n"


EP_MAX_DIMS, EP_MAX_IO = 8, 65536  # runtimes/common/ep_runtime.h


def _io_array(name: str, specs: tuple[TensorSpec, ...]) -> str:
    rows = []
    if len(specs) > EP_MAX_IO:
        raise ModelError(f"the model has {len(specs)} {name}; artifacts take at most {EP_MAX_IO}")
    for s in specs:
        if len(s.shape) > EP_MAX_DIMS:  # the runtime's ep_io_spec holds EP_MAX_DIMS dims
            raise ModelError(f"{name[:-1]} {s.name[:80]!r} has {len(s.shape)} dimensions; "
                             f"artifacts take at most {EP_MAX_DIMS}")
        dims = ", ".join(str(int(d)) for d in s.shape) or "0"
        rows.append(f"    {{{c_string(s.name)}, {_DTYPE_ENUM[s.dtype]}, {len(s.shape)}, {{{dims}}}}},")
    return f"static const ep_io_spec {name}[] = {{\n" + "\n".join(rows) + "\n};\n"


def generate_sources(req: BundleRequest) -> tuple[Path, Path]:
    """Write blobs (.npy, manifest, model files) plus blobs.S and spec.c into the workdir."""
    wd = req.workdir
    (wd / "blobs").mkdir(parents=True, exist_ok=True)
    symbols: list[tuple[str, str]] = []

    def add(sym: str, src: Path | bytes, filename: str) -> str:
        dest = wd / "blobs" / filename
        if isinstance(src, bytes):
            dest.write_bytes(src)
        else:
            shutil.copyfile(src, dest)
        symbols.append((sym, f"blobs/{filename}"))
        return sym

    manifest_bytes = json.dumps(req.manifest, indent=1, sort_keys=True).encode()
    add("ep_blob_manifest", manifest_bytes, "manifest.json")
    gin = [add(f"ep_blob_gin{i}", _npy_bytes(req.golden_inputs[s.name]), f"golden_in{i}.npy")
           for i, s in enumerate(req.inputs)]
    gout = [add(f"ep_blob_gout{i}", _npy_bytes(req.golden_outputs[s.name]), f"golden_out{i}.npy")
            for i, s in enumerate(req.outputs)]
    mblobs = [add(f"ep_blob_model{i}", p, f"model{i}{p.suffix}") for i, p in enumerate(req.engine.model_blobs)]
    seg_blobs = [[add(f"ep_blob_s{k}_model{i}", p, f"s{k}_model{i}{p.suffix}") for i, p in enumerate(seg.model_blobs)]
                 for k, seg in enumerate(req.segments or req.engine.segments)]
    consts = [(s, add(f"ep_blob_const{i}", np.ascontiguousarray(req.golden_outputs[s.name]).tobytes(), f"const{i}.bin"))
              for i, s in enumerate(constant_outputs(req))]

    asm = wd / "blobs.S"
    asm.write_text(_blob_asm(symbols, 64 if req.target.triple.arch != "arm" else 32))

    decl = "".join(f"extern const unsigned char {s}[];\nextern const uint64_t {s}_size;\n" for s, _ in symbols)
    blob = lambda s: f"{{{s}, &{s}_size}}"  # noqa: E731
    opts = sorted(req.engine.options.items())
    opt_rows = "\n".join(f"    {{{c_string(k)}, {c_string(str(v))}}}," for k, v in opts) or "    {0, 0},"
    spec_c = f"""/* generated by edgepack: the embedded model's description */
#include "ep_engine_table.h"

{decl}
{_io_array("inputs", req.inputs)}
{_io_array("outputs", req.outputs)}
static const ep_option options[] = {{
{opt_rows}
}};
static const ep_blob golden_in[] = {{ {", ".join(blob(s) for s in gin) or "{0, 0}"} }};
static const ep_blob golden_out[] = {{ {", ".join(blob(s) for s in gout) or "{0, 0}"} }};
static const ep_blob model_blobs[] = {{ {", ".join(blob(s) for s in mblobs) or "{0, 0}"} }};

const ep_model_spec ep_spec = {{
    .model_name = {c_string(req.name)},
    .target = {c_string(req.target.name)},
    .backend = {c_string(req.engine.backend)},
    .n_inputs = {len(req.inputs)}, .inputs = inputs,
    .n_outputs = {len(req.outputs)}, .outputs = outputs,
    .atol = {req.engine.tolerance.atol!r}, .rtol = {req.engine.tolerance.rtol!r},
    .min_cosine = {req.engine.tolerance.min_cosine!r},
    .n_options = {len(opts)}, .options = options,
    .manifest_json = {blob("ep_blob_manifest")},
    .golden_inputs = golden_in, .golden_outputs = golden_out,
    .n_model_blobs = {len(mblobs)}, .model_blobs = model_blobs,
}};
""" + _segment_table(req, seg_blobs, blob, consts)
    spec = wd / "spec.c"
    spec.write_text(spec_c)
    return asm, spec


def constant_outputs(req: BundleRequest) -> list[TensorSpec]:
    """The model outputs no segment of a partitioned build writes and no input is: constants (onnx-asr's
    features_lens once the input shapes are fixed), whose value is the golden run's."""
    given = req.segments or req.engine.segments
    written = {s.name for s in req.inputs} | {o.name for seg in given for o in seg.outputs}
    return [s for s in req.outputs if given and s.name not in written]


def _segment_table(req: BundleRequest, seg_blobs: list[list[str]], blob, consts: list) -> str:
    """C for ep_segments: slots 0..n-1 are the model's inputs, then its constant outputs (filled at
    open from their blobs), then each segment's outputs."""
    given = req.segments or req.engine.segments
    segments = given or (BundleSegment(req.engine.backend, req.inputs, req.outputs, {}),)
    slots: dict[str, int] = {}
    slot_specs: list[TensorSpec] = []
    for s in req.inputs + tuple(c for c, _ in consts) + tuple(o for seg in segments for o in seg.outputs):
        if s.name in slots:
            raise ValueError(f"tensor {s.name} is written twice in the segment table")
        slots[s.name] = len(slot_specs)
        slot_specs.append(s)
    out = [_io_array("slot_specs", tuple(slot_specs))]
    rows = []
    for k, seg in enumerate(segments):
        ins = ", ".join(str(slots[s.name]) for s in seg.inputs) or "0"
        outs = ", ".join(str(slots[s.name]) for s in seg.outputs)
        out.append(f"static const int s{k}_in[] = {{{ins}}};\nstatic const int s{k}_out[] = {{{outs}}};\n")
        if not given:  # one segment: the model's own spec
            rows.append(f"    {{&ep_engine_ops_{seg.backend}, &ep_spec, s{k}_in, s{k}_out}},")
            continue
        opts = sorted(seg.options.items())
        opt_rows = "\n".join(f"    {{{c_string(a)}, {c_string(str(v))}}}," for a, v in opts) or "    {0, 0},"
        mb = seg_blobs[k]
        nogold = ", ".join(["{0, 0}"] * max(len(seg.inputs), len(seg.outputs), 1))
        out.append(f"""{_io_array(f"s{k}_inputs", seg.inputs)}{_io_array(f"s{k}_outputs", seg.outputs)}
static const ep_option s{k}_options[] = {{
{opt_rows}
}};
static const ep_blob s{k}_blobs[] = {{ {", ".join(blob(b) for b in mb) or "{0, 0}"} }};
static const ep_blob s{k}_nogold[] = {{ {nogold} }}; /* golden data belongs to the whole model */
static const ep_model_spec s{k}_spec = {{
    .model_name = {c_string(f"{req.name}:{k}")}, .target = {c_string(req.target.name)},
    .backend = {c_string(seg.backend)},
    .n_inputs = {len(seg.inputs)}, .inputs = s{k}_inputs, .n_outputs = {len(seg.outputs)}, .outputs = s{k}_outputs,
    .atol = {req.engine.tolerance.atol!r}, .rtol = {req.engine.tolerance.rtol!r},
    .min_cosine = {req.engine.tolerance.min_cosine!r},
    .n_options = {len(opts)}, .options = s{k}_options,
    .golden_inputs = s{k}_nogold, .golden_outputs = s{k}_nogold,
    .n_model_blobs = {len(mb)}, .model_blobs = s{k}_blobs,
}};
""")
        rows.append(f"    {{&ep_engine_ops_{seg.backend}, &s{k}_spec, s{k}_in, s{k}_out}},")
    model_out = ", ".join(str(slots[s.name]) for s in req.outputs)
    const_slots = ", ".join(str(slots[c.name]) for c, _ in consts) or "0"
    const_data = ", ".join(blob(sym) for _, sym in consts) or "{0, 0}"
    out.append(f"""static const ep_segment segments[] = {{
{chr(10).join(rows)}
}};
static const int model_out_slots[] = {{{model_out}}};
static const int const_slots[] = {{{const_slots}}};
static const ep_blob const_data[] = {{ {const_data} }};
const ep_segment_table ep_segments = {{
    .n_slots = {len(slot_specs)}, .slots = slot_specs,
    .n_segments = {len(segments)}, .segments = segments,
    .output_slots = model_out_slots,
    .n_consts = {len(consts)}, .const_slots = const_slots, .const_data = const_data,
}};
""")
    return "\n".join(out)


def _npy_bytes(arr: np.ndarray) -> bytes:
    import io
    buf = io.BytesIO()
    # not ascontiguousarray: it turns a 0-d array (Gemm's scalar bias) into shape (1,)
    np.save(buf, np.array(arr, order="C"), allow_pickle=False)
    return buf.getvalue()


def bundle(req: BundleRequest) -> Bundled:
    tc, target, wd = req.toolchain, req.target, req.workdir
    wd.mkdir(parents=True, exist_ok=True)
    asm, spec = generate_sources(req)
    common = runtimes_dir() / "common"
    if "ep_image.c" in image_sources(req.manifest) and not (STB_INCLUDE_DIR / "stb_image.h").is_file():
        from .errors import ToolMissingError
        raise ToolMissingError(f"{STB_INCLUDE_DIR / 'stb_image.h'} is missing (the artifact's image decoder)",
                               hint="apt-get install libstb-dev")
    includes = [f"-I{common}", f"-I{STB_INCLUDE_DIR}"] + [f"-I{d}" for d in req.engine.include_dirs]
    prefix_maps = [f"-ffile-prefix-map={wd}=.", f"-ffile-prefix-map={runtimes_dir()}=runtimes"]
    objs = []
    sources = ([common / s for s in COMMON_SOURCES + image_sources(req.manifest)] + list(req.engine.sources)
               + [spec, asm])
    for i, src in enumerate(sources):
        obj = wd / "obj" / f"{i:02d}-{src.stem}.o"
        obj.parent.mkdir(exist_ok=True)
        cxx = src.suffix in (".cc", ".cpp")
        std = ["-std=c++17"] if cxx else (["-std=c11"] if src.suffix == ".c" else [])
        omp = ["-fopenmp"] if src.name in OPENMP_SOURCES else []
        tc.compile(src, obj, target, cxx=cxx, extra=includes + prefix_maps + std + omp + ["-Wall"], cwd=wd)
        objs.append(obj)
    tmp = wd / "artifact.tmp"
    tc.link(objs, tmp, target, extra=list(req.engine.link_flags) + [str(p) for p in req.engine.link_inputs]
            + ["-lm"], cwd=wd)
    tc.strip(tmp)
    info = check_executable(tmp, target)
    req.out_path.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(tmp, req.out_path)
    req.out_path.chmod(0o755)
    return Bundled(req.out_path, req.out_path.stat().st_size, info)
