"""ONNX -> relax (from_onnx) -> the fused CPU pipeline (+ a tuning database when there is one)
-> relax.build(system_lib=True) -> lib0.o (kernels) + devc.o (VM bytecode and weights)."""
from __future__ import annotations

import struct
import tarfile
import threading
import time
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
class CompiledModel:
    lib0: Path           # kernels, compiled for the target's CPU
    devc: Path           # VM bytecode + constants (weights)
    weight_bytes: int    # bytes of devc.o's data sections
    seconds: dict        # stage -> seconds
    tuned: bool


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
        return from_onnx(model.proto, shape_dict=shapes, dtype_dict=dtypes, keep_params_in_input=False)
    except Exception as exc:  # the frontend raises anything from KeyError to TVMError
        raise BuildError(f"TVM could not import the model: {_first_line(exc)}",
                         hint="fix the input shapes (--input-shape) or try --backend ncnn") from exc


def fuse(mod, tvm_target):
    """Legalise to TIR and fuse (the part MetaSchedule tunes); no scheduling yet."""
    import tvm
    from tvm import relax
    from tvm.relax.backend.cpu_generic import pipeline as cpu
    with tvm_target:
        seq = tvm.transform.Sequential([relax.transform.DecomposeOpsForInference()]
                                       + list(cpu.library_dispatch_passes(tvm_target))
                                       + list(cpu.legalize_passes(tvm_target)))
        return seq(mod)


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


def apply_database(mod, tvm_target, db_dir: Path):
    import tvm
    from tvm import relax
    from tvm.s_tir import meta_schedule as ms
    database = ms.database.JSONDatabase(work_dir=str(db_dir), module_equality="structural")
    with tvm_target, database, tvm.transform.PassContext(opt_level=3):
        return relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)


def compile_model(model: LoadedModel, tvm_target, workdir: Path, *, tuning_db: Path | None = None,
                  log=print) -> CompiledModel:
    with TVM_LOCK:
        return _compile_model(model, tvm_target, workdir, tuning_db=tuning_db)


def _compile_model(model: LoadedModel, tvm_target, workdir: Path, *, tuning_db: Path | None = None) -> CompiledModel:
    tvm = import_tvm()
    from tvm import relax
    workdir.mkdir(parents=True, exist_ok=True)
    times = {}
    t0 = time.monotonic()
    mod = import_onnx(model)
    times["import"] = time.monotonic() - t0
    t0 = time.monotonic()
    try:
        mod = fuse(mod, tvm_target)
        if tuning_db is not None:
            mod = apply_database(mod, tvm_target, tuning_db)
        with tvm.transform.PassContext(opt_level=3):
            ex = relax.build(mod, target=tvm_target, relax_pipeline=lower_pipeline(tvm_target), system_lib=True)
    except BuildError:
        raise
    except Exception as exc:
        raise BuildError(f"TVM could not compile the model: {_first_line(exc)}",
                         hint="try --backend ncnn") from exc
    times["build"] = time.monotonic() - t0
    t0 = time.monotonic()
    tar_path = workdir / "model.tar"
    try:
        ex.export_library(str(tar_path))
    except Exception as exc:
        raise BuildError(f"TVM could not export the compiled model: {_first_line(exc)}") from exc
    out = {}
    with tarfile.open(tar_path) as tf:
        for name in ("lib0.o", "devc.o"):
            try:
                member = tf.getmember(name)
            except KeyError as exc:
                raise BuildError(f"TVM's export holds no {name} ({', '.join(tf.getnames())})") from exc
            (workdir / name).write_bytes(tf.extractfile(member).read())
            out[name] = workdir / name
    times["export"] = time.monotonic() - t0
    return CompiledModel(out["lib0.o"], out["devc.o"], data_section_bytes(out["devc.o"]),
                         {k: round(v, 2) for k, v in times.items()}, tuning_db is not None)


def data_section_bytes(obj: Path) -> int:
    """Bytes of allocated data sections in a 64-bit little-endian ELF object (devc.o: the weights)."""
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
        if sh_flags & 0x2 and sh_type != 8:  # SHF_ALLOC, not NOBITS
            total += sh_size
    return total
