"""Apache TVM backend (relax): the whole graph compiled to native code for the target's CPU,
optionally tuned (MetaSchedule), linked with a static TVM runtime into the artifact.

Modules: ``ops`` (op coverage table), ``target_map`` (edgepack target -> TVM target),
``compile`` (from_onnx -> fused pipeline -> relax.build), ``runtime_lib`` (the runtime
archives per triple), ``tuning`` (databases and ``edgepack tune``).
"""
from __future__ import annotations

import importlib.util

from .. import CompileRequest, EngineBuild, register
from ...model import LoadedModel
from ...reference import TOLERANCES
from ...resources import runtimes_dir
from . import ops
from .runtime_lib import TVM_FFI_VERSION, TVM_VERSION


class TvmBackend:
    name = "tvm"

    def unsupported_ops(self, model: LoadedModel) -> dict[str, list[str]]:
        return ops.unsupported(model.ops(), model.proto)

    def missing_tools(self) -> list[str]:
        missing = []
        for module, pkg in (("tvm", f"apache-tvm=={TVM_VERSION}"), ("tvm_ffi", f"apache-tvm-ffi=={TVM_FFI_VERSION}")):
            if importlib.util.find_spec(module) is None:
                missing.append(f"{pkg} (pip install {pkg})")
        if not missing:
            import importlib.metadata as md
            have = md.version("apache-tvm-ffi")
            if have != TVM_FFI_VERSION:
                missing.append(f"apache-tvm-ffi {have} installed, need {TVM_FFI_VERSION} "
                               f"(pip install apache-tvm-ffi=={TVM_FFI_VERSION})")
        return missing

    def compile(self, req: CompileRequest) -> EngineBuild:
        from .compile import compile_model
        from .runtime_lib import build_runtime
        from .target_map import isa_variants, target_dict, tvm_target, tvm_target_of
        from .tuning import database_sha256, find_database
        from ...toolchains import Toolchain  # noqa: F401  (type only)

        db, why = find_database(req.target, req.tuning_db)
        req.log(f"tvm: {why}")
        from .compile import TVM_LOCK
        with TVM_LOCK:
            tgt = tvm_target(req.target)
            variants = [(lv, prefix, tvm_target_of(req.target, d)) for lv, prefix, d in isa_variants(req.target)]
        compiled = compile_model(req.model, tgt, req.workdir / "tvm", tuning_db=db, log=req.log, variants=variants)
        rt = build_runtime(req.target, req.toolchain, log=req.log)
        notes = [f"tvm: {why}"]
        proxy = False
        if db is not None:
            import json as _json
            try:
                proxy = bool(_json.loads((db / "meta.json").read_text()).get("proxy", False))
            except (OSError, ValueError):
                proxy = False
            k, n = compiled.tuned_kernels
            notes.append(f"tvm: the database scheduled {k} of {n} kernels"
                         + (" (proxy-tuned: measured on the build machine, not the device)" if proxy else ""))
        base_cpu = target_dict(req.target)["mcpu"]
        options = {"tvm.entry": "main"}
        from .index_bounds import guard
        id_options, id_manifest, id_note = guard(req.model)  # the engine refuses ids outside their tables
        options.update(id_options)
        notes += [id_note] if id_note else []
        if compiled.skipped_levels:
            notes.append(f"tvm: kernels for {base_cpu} only where TVM could not build ISA copies "
                         f"({'; '.join(compiled.skipped_levels)})")
        if compiled.variants:
            # best first; the engine takes the first level the CPU has, else the base kernels
            options["tvm.isa"] = ";".join(f"{v.level}={v.prefix}" for v in compiled.variants)
            options["tvm.isa_base"] = base_cpu
            extra = sum(v.code_bytes for v in compiled.variants)
            notes.append(f"tvm: kernels for {base_cpu} + {', '.join(v.level for v in compiled.variants)} "
                         f"(picked at start-up by CPUID; +{extra / 1e6:.2f} MB over the {base_cpu} kernels' "
                         f"{compiled.base_code_bytes / 1e6:.2f} MB)")
        if req.precision == "fp16":
            notes.append("tvm: computes in fp32 (fp16 storage is an NCNN feature); tolerance is fp32's")
        return EngineBuild(
            backend=self.name,
            sources=(runtimes_dir() / "tvm" / "ep_engine_tvm.cc",),
            include_dirs=rt.include_dirs,
            link_inputs=(compiled.lib0, compiled.devc, *(v.lib0 for v in compiled.variants)),
            link_flags=("-Wl,--whole-archive", *(str(a) for a in rt.archives), "-Wl,--no-whole-archive"),
            model_blobs=(),
            options=options,
            tolerance=TOLERANCES["fp32"],
            manifest={"apache-tvm": TVM_VERSION, "apache-tvm-ffi": TVM_FFI_VERSION, "target": target_dict(req.target),
                      "pipeline": "cpu_generic fused" + (" + MetaSchedule database" if db else " (untuned)")
                      + (" + default schedules" if compiled.default_schedules else ""),
                      "default_schedules": dict(compiled.default_schedules),
                      "conv_layout": compiled.conv_layout,
                      "tuned": db is not None, "tuning_db": db.name if db else None, "compute_precision": "fp32",
                      "tuning_db_sha256": database_sha256(db) if db else None,
                      "tuned_kernels": list(compiled.tuned_kernels) if db else None,
                      "proxy_tuned": proxy if db else None,
                      "compile_seconds": compiled.seconds, "runtime": rt.manifest(),
                      **id_manifest,
                      "isa_levels_skipped": list(compiled.skipped_levels),
                      "isa_levels": [{"level": base_cpu, "prefix": "", "kernel_bytes": compiled.base_code_bytes}]
                      + [{"level": v.level, "prefix": v.prefix, "kernel_bytes": v.code_bytes, "kernels": v.kernels,
                          "missing_kernels": list(v.missing)} for v in compiled.variants]},
            notes=tuple(notes),
            weight_bytes=compiled.weight_bytes,
        )


register(TvmBackend())
