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
                  "ep_predict.c", "ep_serve.c", "ep_batch.c", "ep_page.c", "ep_engine_seq.c", "ep_engine_loop.c",
                  "ep_emulation.c", "ep_detect.c")
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
    body: "LoopBody | None" = None      # backend "loop": the body it steps (edgepack/loops.py)


@dataclass(frozen=True)
class LoopBody:
    """A loop segment's body: a segment table of its own (ep_loop_body in ep_engine_table.h)."""
    inputs: tuple[TensorSpec, ...]      # step, condition, carried values
    outputs: tuple[TensorSpec, ...]     # next condition, changed values
    segments: tuple[BundleSegment, ...]


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
    """The blobs and their sizes. The sizes sit together in a section of their own, ahead of the
    blobs: a size read at start-up touches no blob's page. Where the kernel keeps files in large folios,
    one touch maps the whole folio, so a size after each blob had mapped the end of every blob (the
    golden outputs' 4.8 MB in YOLO11s-seg's RSS); the runtime reads the blobs with pread instead."""
    word = ".quad" if bits == 64 else ".long"
    lines = ['.section .rodata.edgepack_sizes,"a"', ".balign 8"]
    for sym, _ in symbols:
        lines += [f".global {sym}_size", f"{sym}_size:", f"{word} {sym}_end - {sym}"]
        if bits != 64:
            lines.append(".long 0")  # sizes are read as uint64_t: little-endian high word
    lines.append('.section .rodata.edgepack,"a"')
    for sym, rel in symbols:
        lines += [".balign 16", f".global {sym}", f"{sym}:", f'.incbin "{rel}"', f"{sym}_end:",
                  ".byte 0"]  # NUL after each blob: ncnn parses the .param as a C string
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

    def blobs_of(segments, pre: str) -> list:
        """Per segment: its blob symbols, and for a loop segment its body's, nested the same way."""
        return [([add(f"ep_blob_{pre}s{k}_model{i}", p, f"{pre}s{k}_model{i}{p.suffix}")
                  for i, p in enumerate(seg.model_blobs)],
                 blobs_of(seg.body.segments, f"{pre}s{k}b_") if seg.body else None)
                for k, seg in enumerate(segments)]
    seg_blobs = blobs_of(req.segments or req.engine.segments, "")
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


def _segment_table(req: BundleRequest, seg_blobs: list, blob, consts: list) -> str:
    """C for ep_segments: slots 0..n-1 are the model's inputs, then its constant outputs (filled at
    open from their blobs), then each segment's outputs. A loop segment's body gets a table of its own
    (named after the segment), written before the segment that steps it."""
    given = req.segments or req.engine.segments
    segments = given or (BundleSegment(req.engine.backend, req.inputs, req.outputs, {}),)
    out: list[str] = []
    table = _table(req, "", req.inputs, req.outputs, segments, seg_blobs if given else None, blob, consts, out)
    out.append(f"const ep_segment_table ep_segments = {table};\n")
    return "\n".join(out)


def _table(req: BundleRequest, pre: str, inputs, outputs, segments, seg_blobs, blob, consts: list,
           out: list[str]) -> str:
    """Appends the C a segment table needs to ``out``; returns the table's initializer. ``seg_blobs``
    None: one segment, the whole model on ep_spec."""
    slots: dict[str, int] = {}
    slot_specs: list[TensorSpec] = []
    for s in inputs + tuple(c for c, _ in consts) + tuple(o for seg in segments for o in seg.outputs):
        if s.name in slots:
            raise ValueError(f"tensor {s.name} is written twice in the segment table")
        slots[s.name] = len(slot_specs)
        slot_specs.append(s)
    out.append(_io_array(f"{pre}slot_specs", tuple(slot_specs)))
    rows = []
    for k, seg in enumerate(segments):
        name = f"{pre}s{k}"
        ins = ", ".join(str(slots[s.name]) for s in seg.inputs) or "0"
        outs = ", ".join(str(slots[s.name]) for s in seg.outputs)
        out.append(f"static const int {name}_in[] = {{{ins}}};\nstatic const int {name}_out[] = {{{outs}}};\n")
        if seg_blobs is None:  # one segment: the model's own spec
            rows.append(f"    {{&ep_engine_ops_{seg.backend}, &ep_spec, {name}_in, {name}_out}},")
            continue
        mb, body_blobs = seg_blobs[k]
        loop_body = "0"
        if seg.body is not None:
            b = seg.body
            body_table = _table(req, f"{name}b_", b.inputs, b.outputs, b.segments, body_blobs, blob, [], out)
            out.append(f"static const ep_segment_table {name}b_table = {body_table};\n"
                       + _spec_c(req, f"{name}b_spec", f"{name}b_body", b.inputs, b.outputs, {}, [], "loop body")
                       + f"static const ep_loop_body {name}_loop = {{&{name}b_spec, &{name}b_table}};\n")
            loop_body = f"&{name}_loop"
        out.append(_spec_c(req, f"{name}_spec", name, seg.inputs, seg.outputs, seg.options, [blob(x) for x in mb],
                           seg.backend, loop_body))
        rows.append(f"    {{&ep_engine_ops_{seg.backend}, &{name}_spec, {name}_in, {name}_out}},")
    model_out = ", ".join(str(slots[s.name]) for s in outputs)
    const_slots = ", ".join(str(slots[c.name]) for c, _ in consts) or "0"
    const_data = ", ".join(blob(sym) for _, sym in consts) or "{0, 0}"
    trims = [(j, s.trim[0], slots[s.trim[1]]) for j, s in enumerate(outputs) if s.trim]
    col = lambda i: ", ".join(str(t[i]) for t in trims) or "0"  # noqa: E731
    out.append(f"""static const ep_segment {pre}segments[] = {{
{chr(10).join(rows)}
}};
static const int {pre}model_out_slots[] = {{{model_out}}};
static const int {pre}const_slots[] = {{{const_slots}}};
static const ep_blob {pre}const_data[] = {{ {const_data} }};
static const int {pre}trim_outputs[] = {{{col(0)}}};
static const int {pre}trim_axes[] = {{{col(1)}}};
static const int {pre}trim_slots[] = {{{col(2)}}};
""")
    return f"""{{
    .n_slots = {len(slot_specs)}, .slots = {pre}slot_specs,
    .n_segments = {len(segments)}, .segments = {pre}segments,
    .output_slots = {pre}model_out_slots,
    .n_consts = {len(consts)}, .const_slots = {pre}const_slots, .const_data = {pre}const_data,
    .n_trims = {len(trims)}, .trim_outputs = {pre}trim_outputs, .trim_axes = {pre}trim_axes,
    .trim_slots = {pre}trim_slots,
}}"""


def _spec_c(req: BundleRequest, sym: str, name: str, inputs, outputs, options: dict, blobs: list[str],
            backend: str, loop_body: str = "0") -> str:
    """An ep_model_spec for one segment (or a loop's body): golden data belongs to the whole model."""
    opts = sorted(options.items())
    opt_rows = "\n".join(f"    {{{c_string(a)}, {c_string(str(v))}}}," for a, v in opts) or "    {0, 0},"
    nogold = ", ".join(["{0, 0}"] * max(len(inputs), len(outputs), 1))
    return f"""{_io_array(f"{name}_inputs", inputs)}{_io_array(f"{name}_outputs", outputs)}
static const ep_option {name}_options[] = {{
{opt_rows}
}};
static const ep_blob {name}_blobs[] = {{ {", ".join(blobs) or "{0, 0}"} }};
static const ep_blob {name}_nogold[] = {{ {nogold} }};
static const ep_model_spec {sym} = {{
    .model_name = {c_string(f"{req.name}:{name}")}, .target = {c_string(req.target.name)},
    .backend = {c_string(backend)},
    .n_inputs = {len(inputs)}, .inputs = {name}_inputs, .n_outputs = {len(outputs)}, .outputs = {name}_outputs,
    .atol = {req.engine.tolerance.atol!r}, .rtol = {req.engine.tolerance.rtol!r},
    .min_cosine = {req.engine.tolerance.min_cosine!r},
    .n_options = {len(opts)}, .options = {name}_options,
    .golden_inputs = {name}_nogold, .golden_outputs = {name}_nogold,
    .n_model_blobs = {len(blobs)}, .model_blobs = {name}_blobs,
    .loop_body = {loop_body},
}};
"""


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
