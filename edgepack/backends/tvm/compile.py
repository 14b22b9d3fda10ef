"""ONNX -> relax (from_onnx) -> the fused CPU pipeline (+ a tuning database when there is one)
-> relax.build(system_lib=True) -> lib0.o (kernels) + devc.o (VM bytecode and weights).

ISA variants (x86_64): the same fused module is built again per extra ISA level with a
system-lib symbol prefix; only that build's kernels (lib0.o) are kept. tvm-ffi's SystemLib(prefix)
resolves a kernel as prefix+name first and plain name second, and the VM bytecode + weights
(devc.o, registered without prefix) are found by the same fallback, so one copy of the weights
serves every level."""
from __future__ import annotations

import os
import struct
import tarfile
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ...errors import BuildError, ToolMissingError
from ...model import LoadedModel
from .runtime_lib import TVM_FFI_VERSION, TVM_VERSION


# TVM's Python-side compiler keeps global state (TE tag scopes, block builders, the target
# context stack): two compiles in one process at once fail with "nested op_tag is not allowed".
# The pipeline builds targets in threads, so TVM work is serialised here (bundling, linking and
# verification still run in parallel).
TVM_LOCK = threading.RLock()


@dataclass(frozen=True)
class IsaVariant:
    level: str           # e.g. x86-64-v3
    prefix: str          # system-lib symbol prefix the engine asks for
    lib0: Path           # the kernels compiled for that level
    kernels: int         # kernels it holds
    missing: tuple[str, ...]  # base kernels it lacks (the engine falls back to the base ones)
    code_bytes: int      # bytes of its allocated sections (its size cost)


@dataclass(frozen=True)
class CompiledModel:
    lib0: Path           # kernels, compiled for the target's CPU
    devc: Path           # VM bytecode + constants (weights)
    weight_bytes: int    # bytes of devc.o's data sections
    seconds: dict        # stage -> seconds
    tuned: bool
    variants: tuple[IsaVariant, ...] = ()
    base_code_bytes: int = 0
    tuned_kernels: tuple[int, int] = (0, 0)  # (kernels the database scheduled, kernels)
    skipped_levels: tuple[str, ...] = ()     # ISA levels that could not be built, with why
    default_schedules: tuple[tuple[str, int], ...] = ()  # (rule, kernels) of the base build; () = off
    conv_layout: str = "?"  # what the convolutions compute in (layout.py): NHWC, or NCHW and why


def import_tvm():
    try:
        import tvm  # noqa: F401
        from tvm import relax  # noqa: F401
    except ImportError as exc:
        raise ToolMissingError("the TVM backend needs apache-tvm",
                               hint=f"pip install apache-tvm=={TVM_VERSION} apache-tvm-ffi=={TVM_FFI_VERSION}") from exc
    import tvm_ffi
    have = getattr(tvm_ffi, "__version__", "?")
    if have != TVM_FFI_VERSION:
        raise ToolMissingError(f"apache-tvm-ffi {have} is installed, edgepack needs {TVM_FFI_VERSION} "
                               "(newer versions segfault while serialising TVM functions)",
                               hint=f"pip install apache-tvm-ffi=={TVM_FFI_VERSION}")
    return tvm


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    # TVM errors end with the useful line ("...Error: message"); tracebacks come first.
    msg = lines[-1] if lines else type(exc).__name__
    return msg[:300]


def import_onnx(model: LoadedModel):
    """The model as a relax IRModule (weights bound as constants)."""
    import_tvm()
    from tvm.relax.frontend.onnx import from_onnx
    shapes = {s.name: [int(d) for d in s.shape] for s in model.inputs}
    dtypes = {s.name: s.dtype for s in model.inputs}
    try:
        # the relax importer has no LSTM/GRU: they go in unrolled into primitive ops (ops.DECOMPOSED)
        from ...onnx_lstm import decompose
        from .index_bounds import bounded  # computed indices stay inside their tensors (hostile input)
        with _layout_friendly_import():
            proto = _one_hot_as_compare(bounded(decompose(model.proto))[0])
            return from_onnx(proto, shape_dict=shapes, dtype_dict=dtypes, keep_params_in_input=False)
    except Exception as exc:  # the frontend raises anything from KeyError to TVMError
        raise BuildError(f"TVM could not import the model: {_first_line(exc)}",
                         hint="fix the input shapes (--input-shape) or try --backend ncnn") from exc


def _one_hot_as_compare(proto):
    """OneHot with a constant depth as Where(Equal(indices, Range(depth)), on, off). The importer's
    OneHot takes its values with tolist(): Python floats, so the result comes out float64 (Concat with
    float32 then fails), and a one-element depth ([50], as Paddle writes it) is passed on as a list,
    which relax.op.one_hot refuses."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    from ...onnx_index import constants, tensor_infos
    consts = constants(proto)
    hot = [n for n in proto.graph.node if n.op_type == "OneHot" and n.domain in ("", "ai.onnx")
           and n.input[1] in consts and n.input[2] in consts and consts[n.input[1]].size == 1]
    if not hot:
        return proto
    infos = tensor_infos(proto)
    fixed = onnx.ModelProto()
    fixed.CopyFrom(proto)
    replaced = {}
    for k, n in enumerate(hot):
        info = infos.get(n.input[0])
        if info is None or info.dims is None:
            continue
        rank = len(info.dims)
        axis = next((a.i for a in n.attribute if a.name == "axis"), -1)
        axis = axis + rank + 1 if axis < 0 else axis
        depth = int(np.asarray(consts[n.input[1]]).reshape(-1)[0])
        off, on = np.asarray(consts[n.input[2]]).reshape(-1)[:2]
        p = f"{n.output[0]}__onehot{k}"
        row = np.arange(depth, dtype=np.int64).reshape([depth if d == axis else 1 for d in range(rank + 1)])
        fixed.graph.initializer.extend([
            numpy_helper.from_array(row, f"{p}_row"), numpy_helper.from_array(np.asarray([axis], np.int64), f"{p}_axis"),
            numpy_helper.from_array(np.asarray(depth, np.int64), f"{p}_depth"),
            numpy_helper.from_array(np.asarray(0, np.int64), f"{p}_zero"),
            numpy_helper.from_array(np.asarray(on), f"{p}_on"), numpy_helper.from_array(np.asarray(off), f"{p}_off")])
        replaced[n.name or n.output[0]] = [
            helper.make_node("Cast", [n.input[0]], [f"{p}_i"], to=onnx.TensorProto.INT64),
            helper.make_node("Less", [f"{p}_i", f"{p}_zero"], [f"{p}_neg"]),
            helper.make_node("Add", [f"{p}_i", f"{p}_depth"], [f"{p}_wrapped"]),
            helper.make_node("Where", [f"{p}_neg", f"{p}_wrapped", f"{p}_i"], [f"{p}_idx"]),
            helper.make_node("Unsqueeze", [f"{p}_idx", f"{p}_axis"], [f"{p}_col"]),
            helper.make_node("Equal", [f"{p}_col", f"{p}_row"], [f"{p}_hit"]),
            helper.make_node("Where", [f"{p}_hit", f"{p}_on", f"{p}_off"], [n.output[0]]),
        ]
    nodes = []
    for n in fixed.graph.node:
        nodes += replaced.get(n.name or n.output[0], [n]) if n.op_type == "OneHot" else [n]
    del fixed.graph.node[:]
    fixed.graph.node.extend(nodes)
    return fixed


LAYOUT_ATTR = "edgepack_conv_layout"


@contextmanager
def _layout_friendly_import():
    """Two importer forms ConvertLayout (layout.py) cannot see through, replaced while importing:
    - ONNX Max/Min/Sum/Mean over tensors as maximum(a, b) (pairwise, as the importer already does
      where a shape is unknown) rather than broadcast_to + stack + a reduction over the stacked axis:
      the stacked copy cost a pass over the data, the reduction kept the op out of its neighbours'
      kernel, and the 5-D stack has no layout rule. Constants still fold as before.
    - ONNX Clip as relax maximum/minimum rather than TE calls (emit_te of topi.maximum/minimum, the
      same functions legalisation uses for the relax ops, so the same bits): a TE call is opaque to
      ConvertLayout, which put two transposes around every Clip of an NHWC model (PP-OCR's
      HardSwish, written as Clip: its classifier ran 1.5x slower in NHWC than in NCHW)."""
    import tvm
    from tvm import relax
    from tvm.relax.frontend.onnx import onnx_frontend as fe
    base, clip = fe.MultiInputBase, fe.Clip
    stacked = base.__dict__["_impl_v1"]
    clip_v1, clip_v13 = clip.__dict__["_impl_v1"], clip.__dict__["_impl_v13"]

    def pairwise(cls, bb, inputs, attr, params):
        if cls.binary_op is not None and not all(isinstance(i, tvm.ir.GenericConst) for i in inputs):
            return cls._impl_dynamic(bb, inputs)
        return stacked.__func__(cls, bb, inputs, attr, params)

    def floating(x) -> bool:
        dtype = getattr(getattr(x, "ty", None), "dtype", "")
        return str(dtype).startswith(("float", "bfloat"))

    def clip_attrs(cls, bb, inputs, attr, params):
        x = inputs[0]
        if not floating(x):
            return clip_v1.__func__(cls, bb, inputs, attr, params)
        dtype = x.ty.dtype
        x = bb.normalize(relax.op.maximum(x, relax.const(float(attr.get("min", -float("inf"))), dtype)))
        return bb.normalize(relax.op.minimum(x, relax.const(float(attr.get("max", float("inf"))), dtype)))

    def clip_inputs(cls, bb, inputs, attr, params):
        x = inputs[0]
        if not floating(x):
            return clip_v13.__func__(cls, bb, inputs, attr, params)
        if inputs[1] is not None:
            x = bb.normalize(relax.op.maximum(x, cls._sanitize_nan_clip_bound(bb, inputs[1], for_min=True)))
        if inputs[2] is not None:
            x = bb.normalize(relax.op.minimum(x, cls._sanitize_nan_clip_bound(bb, inputs[2], for_min=False)))
        return x
    base._impl_v1 = classmethod(pairwise)
    clip._impl_v1, clip._impl_v13 = classmethod(clip_attrs), classmethod(clip_inputs)
    try:
        yield
    finally:
        base._impl_v1 = stacked
        clip._impl_v1, clip._impl_v13 = clip_v1, clip_v13


def fuse(mod, tvm_target):
    """Legalise to TIR and fuse (the part MetaSchedule tunes); no scheduling yet. Convolutions are
    moved to NHWC first (layout.py); the module's attribute LAYOUT_ATTR says what they compute in."""
    import tvm
    from tvm import relax
    from tvm.relax.backend.cpu_generic import pipeline as cpu
    from .layout import channels_last
    with tvm_target:
        mod = relax.transform.DecomposeOpsForInference()(mod)
        mod = _fast_tanh(mod)
        mod, layout = channels_last(mod)
        seq = tvm.transform.Sequential(list(cpu.library_dispatch_passes(tvm_target))
                                       + list(cpu.legalize_passes(tvm_target)))
        return seq(mod).with_attr(LAYOUT_ATTR, layout)


def _fast_tanh(mod):
    """tanh as topi's rational approximation (within 4e-7 of tanh in float32, vectorised). Legalised,
    relax's tanh becomes two libm expf calls per element, one at a time: SLANet-plus's attention spent
    0.44 of its ~1 ms step in the tanh over [256, 256]."""
    from tvm import relax, topi
    from tvm.relax.expr_functor import PyExprMutator, mutator

    @mutator
    class _Tanh(PyExprMutator):
        def visit_call_(self, call):
            call = super().visit_call_(call)
            if getattr(call.op, "name", None) == "relax.tanh":
                return self.builder_.call_te(topi.fast_tanh, call.args[0])
            return call

    if not any(_calls_op(f, "relax.tanh") for _, f in mod.functions_items() if isinstance(f, relax.Function)):
        return mod
    m = _Tanh(mod)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            m.builder_.update_func(gv, m.visit_expr(func))
    return m.builder_.get()


def _calls_op(func, name: str) -> bool:
    from tvm import relax
    found = []
    relax.analysis.post_order_visit(func, lambda e: found.append(1) if isinstance(e, relax.Call)
                                    and getattr(e.op, "name", None) == name else None)
    return bool(found)


def conv_layout(mod) -> str:
    attrs = mod.attrs
    return str(attrs[LAYOUT_ATTR]) if attrs is not None and LAYOUT_ATTR in attrs else "?"


def lower_pipeline(tvm_target):
    import tvm
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    @tvm.transform.module_pass(opt_level=0)
    def _lower(mod, _ctx):
        with tvm_target:
            seq = tvm.transform.Sequential(list(cpu.dataflow_lower_passes(tvm_target))
                                           + list(cpu.finalize_passes(tvm_target)))
            return seq(mod)
    return _lower


def scheduled_count(mod) -> tuple[int, int]:
    """(PrimFuncs marked scheduled, PrimFuncs) in a module."""
    import tvm
    funcs = [f for _gv, f in mod.functions.items() if isinstance(f, tvm.tirx.PrimFunc)]
    done = sum(1 for f in funcs if f.attrs is not None and "tirx.is_scheduled" in f.attrs
               and bool(f.attrs["tirx.is_scheduled"]))
    return done, len(funcs)


def apply_database(mod, tvm_target, db_dir: Path):
    import tvm
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms
    database = ms.database.JSONDatabase(work_dir=str(db_dir), module_equality="structural")
    with tvm_target, database, tvm.transform.PassContext(opt_level=3):
        return relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)


def compile_model(model: LoadedModel, tvm_target, workdir: Path, *, tuning_db: Path | None = None,
                  log=print, variants=()) -> CompiledModel:
    """``variants``: (level, prefix, TVM target) for extra ISA copies of the kernels."""
    with TVM_LOCK:
        return _compile_model(model, tvm_target, workdir, tuning_db=tuning_db, variants=variants, log=log)


def default_schedules_enabled() -> bool:
    """EDGEPACK_TVM_SCHEDULES=off builds the naive loop nests (the "before" column of
    bench/bench_tvm_untuned.py); anything else, or unset, schedules them."""
    return os.environ.get("EDGEPACK_TVM_SCHEDULES", "on").strip().lower() not in ("off", "0", "no")


def _build(mod, tvm_target, tuning_db, prefix: str | None = None, coverage: list | None = None,
           rules: Counter | None = None):
    import tvm
    from tvm import relax
    from .schedules import apply_default_schedules
    try:
        if tuning_db is not None:
            mod = apply_database(mod, tvm_target, tuning_db)
            if coverage is not None:
                coverage.extend(scheduled_count(mod))
        if default_schedules_enabled():
            # after the database: its records win, the default rules take only what it left
            mod, used = apply_default_schedules(mod, tvm_target)
            if rules is not None:
                rules.update(used)
        if prefix:
            mod = mod.with_attr("system_lib_prefix", prefix)
        with tvm.transform.PassContext(opt_level=3):
            return relax.build(mod, target=tvm_target, relax_pipeline=lower_pipeline(tvm_target), system_lib=True)
    except BuildError:
        raise
    except Exception as exc:
        what = f" for {tvm_target.attrs.get('mcpu', '?')}" if prefix else ""
        raise BuildError(f"TVM could not compile the model{what}: {_first_line(exc)}",
                         hint="try --backend ncnn") from exc


def _export(ex, workdir: Path, tag: str, wanted: dict[str, str]) -> dict[str, Path]:
    """Export ``ex`` and keep the tar members ``wanted`` (member -> file name in workdir)."""
    tar_path = workdir / f"model{tag}.tar"
    try:
        ex.export_library(str(tar_path))
    except Exception as exc:
        raise BuildError(f"TVM could not export the compiled model: {_first_line(exc)}") from exc
    out = {}
    with tarfile.open(tar_path) as tf:
        for name, dest in wanted.items():
            try:
                member = tf.getmember(name)
            except KeyError as exc:
                raise BuildError(f"TVM's export holds no {name} ({', '.join(tf.getnames())})") from exc
            (workdir / dest).write_bytes(tf.extractfile(member).read())
            out[name] = workdir / dest
    tar_path.unlink()
    return out


def _compile_model(model: LoadedModel, tvm_target, workdir: Path, *, tuning_db: Path | None = None,
                   variants=(), log=print) -> CompiledModel:
    import_tvm()
    workdir.mkdir(parents=True, exist_ok=True)
    times = {}
    t0 = time.monotonic()
    mod = import_onnx(model)
    times["import"] = time.monotonic() - t0
    t0 = time.monotonic()
    try:
        mod = fuse(mod, tvm_target)
    except Exception as exc:
        raise BuildError(f"TVM could not compile the model: {_first_line(exc)}", hint="try --backend ncnn") from exc
    layout = conv_layout(mod)
    if log and layout != "no conv2d":
        log(f"tvm: convolutions in {layout}")
    coverage: list = []
    rules: Counter = Counter()
    ex = _build(mod, tvm_target, tuning_db, coverage=coverage, rules=rules)
    times["build"] = time.monotonic() - t0
    if rules and log:
        log("tvm: default schedules: " + ", ".join(f"{n} {k}" for k, n in rules.most_common()))
    t0 = time.monotonic()
    out = _export(ex, workdir, "", {"lib0.o": "lib0.o", "devc.o": "devc.o"})
    times["export"] = time.monotonic() - t0
    base = kernel_names(out["lib0.o"], "")
    built = []
    skipped = []
    for level, prefix, vt in variants:
        t0 = time.monotonic()
        # the base module, fused once: every level then holds kernels of the same names
        try:
            vex = _build(mod, vt, tuning_db, prefix)
        except BuildError as exc:
            # TVM 0.27 cannot build some ops under a system-lib prefix (TopK's sort call fails in
            # AttachGlobalSymbol): such a model keeps the baseline kernels only, still correct
            skipped.append(f"{level}: {exc}"[:300])
            if log:
                log(f"tvm: no {level} copy of the kernels ({str(exc)[:200]}); the baseline ones serve every CPU")
            continue
        obj = _export(vex, workdir, f"-{level}", {"lib0.o": f"lib0-{level}.o"})["lib0.o"]
        names = kernel_names(obj, prefix)
        missing = tuple(sorted(base - names))
        built.append(IsaVariant(level, prefix, obj, len(names), missing, data_section_bytes(obj, code=True)))
        times[f"build {level}"] = time.monotonic() - t0
        if missing and log:
            log(f"tvm: {len(missing)} of {len(base)} kernels have no {level} copy (the baseline ones run there)")
    return CompiledModel(out["lib0.o"], out["devc.o"], data_section_bytes(out["devc.o"]),
                         {k: round(v, 2) for k, v in times.items()}, tuning_db is not None, tuple(built),
                         data_section_bytes(out["lib0.o"], code=True), tuple(coverage) or (0, 0), tuple(skipped),
                         tuple(rules.most_common()), layout)


def _elf_symbols(obj: Path) -> list[str]:
    """Names of the defined symbols of a 64-bit little-endian ELF object."""
    data = obj.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise BuildError(f"{obj} is not a 64-bit ELF object")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = []
    for i in range(shnum):
        off = shoff + i * shentsize
        sh_type, = struct.unpack_from("<I", data, off + 4)
        sh_offset, sh_size, sh_link = struct.unpack_from("<QQI", data, off + 24)
        sections.append((sh_type, sh_offset, sh_size, sh_link))
    names = []
    for sh_type, off, size, link in sections:
        if sh_type != 2:  # SHT_SYMTAB
            continue
        str_off = sections[link][1]
        for k in range(off, off + size, 24):
            st_name, _info, _other, st_shndx = struct.unpack_from("<IBBH", data, k)
            if st_shndx == 0 or st_name == 0:
                continue
            end = data.index(b"\0", str_off + st_name)
            names.append(data[str_off + st_name:end].decode())
    return names


def kernel_names(obj: Path, prefix: str) -> set[str]:
    """The kernels a lib0.o registers (their names without the system-lib prefix)."""
    head = "__tvm_ffi_" + prefix
    return {n[len(head):] for n in _elf_symbols(obj) if n.startswith(head) and not n.startswith("__tvm_ffi__")}


def data_section_bytes(obj: Path, code: bool = False) -> int:
    """Bytes of allocated data sections in a 64-bit little-endian ELF object (devc.o: the weights);
    ``code``: of every allocated section, code included (a lib0.o's size)."""
    data = obj.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return obj.stat().st_size
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    total = 0
    for i in range(shnum):
        off = shoff + i * shentsize
        sh_type, sh_flags = struct.unpack_from("<IQ", data, off + 4)
        sh_size, = struct.unpack_from("<Q", data, off + 32)
        if sh_flags & 0x2 and sh_type != 8 and (code or not sh_flags & 0x4):  # ALLOC, not NOBITS, EXECINSTR?
            total += sh_size
    return total
