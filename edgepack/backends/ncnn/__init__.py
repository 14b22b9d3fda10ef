"""The NCNN backend: pnnx -> .param/.bin, libncnn from source per architecture, pruned at link."""
from __future__ import annotations

import shutil

from .. import CompileRequest, EngineBuild, register
from ...model import LoadedModel
from ...reference import TOLERANCES
from ...resources import runtimes_dir
from .convert import PNNX_VERSION, convert, pnnx_executable
from .library import build_library
from .ops import CONVERSION_DECIDES, SUPPORTED
from .prune import pruned_layer_object


class NcnnBackend:
    name = "ncnn"
    thread_safe = True  # every shared step (conversion, libncnn, pruning) is guarded by cache file locks

    def unsupported_ops(self, model: LoadedModel) -> dict[str, list[str]]:
        return {op: nodes for op, nodes in model.ops().items() if op not in SUPPORTED and op not in CONVERSION_DECIDES}

    def missing_tools(self) -> list[str]:
        missing = []
        try:
            pnnx_executable()
        except Exception as exc:  # ToolMissingError
            missing.append(str(exc))
        for tool in ("cmake", "ninja"):
            if shutil.which(tool) is None:
                missing.append(f"{tool} (apt-get install {tool if tool == 'cmake' else 'ninja-build'})")
        return missing

    def compile(self, req: CompileRequest) -> EngineBuild:
        converted = convert(req.model, req.precision, log=req.log)
        lib = build_library(req.target, req.toolchain, log=req.log)
        layer_obj, kept = pruned_layer_object(lib, set(converted.layer_types), log=req.log)
        # ncnn turns fp16 arithmetic on by itself on any Arm CPU that has it, so a generic arm64
        # artifact may meet it on the device (an arm64 build copied to an Orin): budget for it.
        fp16_math = req.precision == "fp16" and (req.target.fp16_arithmetic or req.target.arch == "aarch64")
        tol = TOLERANCES["fp16-arith" if fp16_math else req.precision]
        options = {"ncnn.fp32": "1" if req.precision == "fp32" else "0"}
        for i, (blob, b) in enumerate(zip(converted.input_blobs, converted.input_batch)):
            options[f"ncnn.in.{i}"] = blob
            options[f"ncnn.in_batch.{i}"] = b
        for i, (blob, b) in enumerate(zip(converted.output_blobs, converted.output_batch)):
            options[f"ncnn.out.{i}"] = blob
            options[f"ncnn.out_batch.{i}"] = b
        return EngineBuild(
            backend=self.name,
            sources=(runtimes_dir() / "ncnn" / "ep_engine_ncnn.c",),
            include_dirs=(lib.include,),
            link_inputs=(layer_obj, lib.lib),
            model_blobs=(converted.param, converted.bin),
            options=options,
            tolerance=tol,
            manifest={"pnnx": PNNX_VERSION, "conversion_cache_key": converted.key, "layers": list(converted.layer_types),
                      "linked_layers": kept, "library": lib.manifest(), "fp16_arithmetic": fp16_math,
                      "conversion_check_max_abs_err": converted.check_error,
                      "onnx_rewrites": list(converted.rewrites)},
            weight_bytes=converted.bin.stat().st_size,
        )


register(NcnnBackend())
