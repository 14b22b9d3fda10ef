"""The NCNN backend: pnnx -> .param/.bin, libncnn from source per architecture, pruned at link."""
from __future__ import annotations

import dataclasses
import shutil

from .. import CompileRequest, EngineBuild, register
from ...model import LoadedModel
from ...quantized import sums_integers
from .recurrent_forms import torch_form_gru
from ...reference import POLICY
from ...resources import runtimes_dir
from .constants_last import constants_last
from .convert import PNNX_VERSION, convert, pnnx_executable
from .dedup import deduped
from .dynamic_quant_fold import fold_dynamic_quant
from .fake_quant_patch import fold_fake_quant
from .int8_gemv_patch import mark_integer_gemvs
from .library import build_library
from .ops import CONVERSION_DECIDES, SUPPORTED
from .prune import pruned_layer_object
from .reduce_max import reduce_maxes_for_ncnn

# The precision ladder, best first: fp16 weights and fp16 arithmetic (where the CPU has it), fp16
# weights/storage with fp32 arithmetic, all fp32.
RUNGS = ("fp16-arith", "fp16-storage", "fp32")


class NcnnBackend:
    name = "ncnn"
    thread_safe = True  # every shared step (conversion, libncnn, pruning) is guarded by cache file locks
    runs_items = True   # no batch axis in ncnn: a batch of N runs the batch-1 graph once per item (batch_items.py)

    def unsupported_ops(self, model: LoadedModel) -> dict[str, list[str]]:
        # after the exact rewrites conversion applies (a ReduceMax over trailing axes is a GlobalMaxPool)
        ready = dataclasses.replace(model, proto=reduce_maxes_for_ncnn(model.proto)[0])
        out = {op: nodes for op, nodes in ready.ops().items() if op not in SUPPORTED and op not in CONVERSION_DECIDES}
        # ncnn's GRU is torch's (recurrent_forms.py); a GRU of another form is not one it can run
        other_grus = [n.name for n in ready.proto.graph.node if n.op_type == "GRU" and not torch_form_gru(n)]
        if other_grus:
            out["GRU"] = other_grus
        return out

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

    def precision_ladder(self, target, requested: str) -> list[str]:
        """fp16 arithmetic -> fp16 storage with fp32 arithmetic -> fp32, best first. fp16
        arithmetic is only offered where a verification CPU can run it (qemu's Arm "max"; TCG has
        no AVX512-FP16), so an x86_64 artifact never turns it on unverified."""
        if requested in RUNGS:   # pinned (verify-build rebuilds the rung that was kept)
            return [requested]
        if requested == "fp32":
            return ["fp32"]
        return list(RUNGS) if target.arch == "aarch64" else ["fp16-storage", "fp32"]

    def compile(self, req: CompileRequest) -> EngineBuild:
        rung = req.precision if req.precision in RUNGS else self.precision_ladder(req.target, req.precision)[0]
        weights = "fp32" if rung == "fp32" else "fp16"
        converted = convert(req.model, weights, log=req.log)
        param, folds, gemvs = converted.param, 0, 0
        # the chains stock ncnn (the conversion check) runs as ~30 layers: one engine layer on every arch
        text, dq_folds = fold_dynamic_quant(converted.param.read_text(), converted.output_blobs)
        if dq_folds:
            req.log(f"dynamic quantisation: {dq_folds} chains run as one EpDynQuant layer each")
        # a constant read first is made before the rest of the graph and held through the run (constants_last.py)
        text, swaps = constants_last(text)
        if req.target.arch == "x86_64":
            # the chains stock ncnn (the conversion check) runs as four layers, one Clip in edgepack's x86 library
            text, folds = fold_fake_quant(text, converted.output_blobs)
            if folds:
                req.log(f"fake quantisation: {folds} divide-round-clip chains run as one pass each")
            # products of the centred integers by integer weights: int8 quads in edgepack's x86 library
            text, gemvs = mark_integer_gemvs(text)
        if folds or dq_folds or swaps:
            req.workdir.mkdir(parents=True, exist_ok=True)
            # one per conversion and arch (rungs share workdir)
            param = req.workdir / f"model-{converted.key}.{req.target.arch}.param"
            param.write_text(text)
        # a weight pnnx wrote once per layer using it is embedded once (model_blobs[2] maps it back)
        dedup = deduped(converted.bin)
        blobs = (param, dedup.weights, dedup.segment_map) if dedup else (param, converted.bin)
        if dedup:
            req.log(f"weights stored once each: {dedup.logical_bytes / 1e6:.1f} MB -> {dedup.stored_bytes / 1e6:.1f} MB")
        lib = build_library(req.target, req.toolchain, log=req.log)
        layer_obj, kept = pruned_layer_object(lib, set(converted.layer_types), log=req.log)
        fp16_math = rung == "fp16-arith"
        options = {"ncnn.fp32": "1" if rung == "fp32" else "0", "ncnn.fp16_arithmetic": "1" if fp16_math else "0"}
        for i, (blob, b) in enumerate(zip(converted.input_blobs, converted.input_batch)):
            options[f"ncnn.in.{i}"] = blob
            options[f"ncnn.in_batch.{i}"] = b
            if i < len(converted.input_ids) and converted.input_ids[i]:  # integer ids: rows of their table
                options[f"ncnn.in_ids.{i}"] = str(converted.input_ids[i])
        for i, (blob, b) in enumerate(zip(converted.output_blobs, converted.output_batch)):
            options[f"ncnn.out.{i}"] = blob
            options[f"ncnn.out_batch.{i}"] = b
        if req.items > 1:
            options["ncnn.items"] = str(req.items)
            req.log(f"batch of {req.items}: the batch-1 graph runs once per item")
        return EngineBuild(
            backend=self.name,
            sources=(runtimes_dir() / "ncnn" / "ep_engine_ncnn.c", runtimes_dir() / "ncnn" / "ep_blob_file.c",
                     runtimes_dir() / "ncnn" / "ep_ncnn_pool.cc", runtimes_dir() / "ncnn" / "ep_ncnn_layers.cc"),
            include_dirs=(lib.include,),
            link_inputs=(layer_obj, lib.lib),
            model_blobs=blobs,
            options=options,
            tolerance=POLICY,
            manifest={"pnnx": PNNX_VERSION, "conversion_cache_key": converted.key, "layers": list(converted.layer_types),
                      "linked_layers": kept, "library": lib.manifest(), "fp16_arithmetic": fp16_math,
                      "precision": rung, "weights": weights,
                      "conversion_check_max_abs_err": converted.check_error,
                      # lowered dynamic int8: Winograd off on every convolution (exact integer sums)
                      "exact_integer_convolutions": sums_integers(req.model.proto),
                      "onnx_rewrites": list(converted.rewrites),
                      "fake_quant_folds": folds,
                      "dynamic_quant_folds": dq_folds,
                      "constants_read_last": swaps,
                      "integer_gemvs_marked": gemvs,
                      "weights_dedup": dedup.manifest() if dedup else None,
                      "batch_items": req.items},
            weight_bytes=sum(p.stat().st_size for p in blobs[1:]),  # embedded: stored bytes (+ map)
        )


register(NcnnBackend())
