"""ONNX -> ncnn .param/.bin with pnnx's standalone executable, checked twice:
the layer types must exist in ncnn, and the converted model (run with the ncnn Python wheel)
must agree with onnxruntime, because pnnx silently mis-converts some graphs."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ... import proc
from ...cache import cache_root, key_of, lock_file, locked, sha256_bytes, touch_used
from ...errors import BuildError, ToolMissingError, UnsupportedOpError, VerificationError
from ...model import LoadedModel
from ...quantized import rounds_quotients, sums_integers
from .recurrent_forms import flat_gru_initial_states
from ...reference import Tolerance, compare, random_inputs, run_onnxruntime
from .fuse import VERSION as FUSE_VERSION
from .fuse import batch_shared_products, gemv_as_gemm
from .int8_gemm_patch import mark_integer_gemms
from .memory import integer_convolutions
from .erf_gelu import erf_gelus_as_gelu
from .strided_conv import strided_convs_as_rows, wide_convs_as_rows
from .dilated_conv import dilated_convs_as_phases
from .tanh_gelu import tanh_gelus_as_gelu
from .token_ids import INTEGER_IDS, as_pnnx_embeddings, embed_only, id_inputs
from . import (dilated_conv, erf_gelu, fuse, memory, recurrent_forms, reduce_max, rewrite, seq_first, strided_conv,
               tanh_gelu, token_ids, unit_batch)
from .rewrite import VERSION as REWRITE_VERSION
from .reduce_max import reduce_maxes_for_ncnn
from .rewrite import rewrite_for_ncnn, split_sum_of_squares

PNNX_VERSION = "20261020"
PNNX_MAX_IR_VERSION = 13  # the onnxruntime (1.30) inside that pnnx reads IR versions up to 13


def pnnx_executable() -> Path:
    from ...toolchains import frozen_tool_dir
    frozen = frozen_tool_dir("pnnx")  # a frozen edgepack's own copy, unpacked once into the cache
    if frozen is not None:
        return frozen / "pnnx"
    spec = importlib.util.find_spec("pnnx")
    if spec is None or not spec.submodule_search_locations:
        raise ToolMissingError("pnnx is not installed",
                               hint=f"pip install --no-deps pnnx=={PNNX_VERSION} (its executable needs no torch)")
    exe = Path(list(spec.submodule_search_locations)[0]) / "pnnx"
    if not exe.is_file():
        raise ToolMissingError(f"pnnx executable missing at {exe}", hint=f"pip install --no-deps pnnx=={PNNX_VERSION}")
    return exe


@dataclass(frozen=True)
class NcnnModel:
    param: Path
    bin: Path
    input_blobs: tuple[str, ...]
    output_blobs: tuple[str, ...]
    input_batch: tuple[str, ...]    # the axis pnnx drops ("0", or another unit axis) or "none", per input
    output_batch: tuple[str, ...]
    layer_types: tuple[str, ...]
    check_error: float              # python-ncnn vs onnxruntime, max abs
    key: str
    rewrites: tuple[str, ...] = ()  # ONNX rewrites (rewrite.py) applied before pnnx, "name x count"
    input_ids: tuple[int, ...] = ()  # per input: rows of the embedding table its integer ids index, 0 for float


def parse_param_layers(text: str) -> list[tuple[str, str]]:
    """(type, name) for each layer line of a .param file."""
    lines = text.strip().splitlines()
    if not lines or lines[0].strip() != "7767517":
        raise BuildError("pnnx wrote a .param without the ncnn magic number")
    out = []
    for line in lines[2:]:
        parts = line.split()
        if len(parts) >= 2:
            out.append((parts[0], parts[1]))
    return out


def _guess_onnx_op(layer_type: str, model: LoadedModel) -> str:
    """Map a pnnx leftover such as torch.topk / Tensor.masked_fill to the ONNX op it came from."""
    tail = layer_type.split(".")[-1].lower().replace("_", "")
    for op, nodes in model.ops().items():
        if op.lower() == tail or tail.startswith(op.lower()) or op.lower().startswith(tail):
            return f"ONNX op {op} (node {nodes[0]})"
    return f"no single ONNX op; pnnx layer {layer_type}"


def _io_from_pyscript(py: str, n_in: int, n_out: int, in_shapes: tuple = ()):
    ins = re.findall(r'ex\.input\("([^"]+)",\s*ncnn\.Mat\(\w+\.numpy\(\)(?:,\s*batch_index=(\d+))?\)', py)
    outs = re.findall(r'_,\s*(\w+)\s*=\s*ex\.extract\("([^"]+)"\)', py)
    out_batch = {}
    for var, _ in outs:
        m = re.search(rf"{var}\.numpy\((?:batch_index=(\d+))?\)", py)
        out_batch[var] = m.group(1) if m and m.group(1) else None
    if len(ins) != n_in or len(outs) != n_out:
        raise BuildError(f"pnnx produced {len(ins)} inputs/{len(outs)} outputs, the model has {n_in}/{n_out}",
                         hint="the graph may have unused inputs or constant outputs; simplify it first")
    in_blobs = tuple(n for n, _ in ins)
    # pnnx drops the batch axis of an input (batch_index): the first, or another unit axis (a time-major
    # [T, 1, C] input or [dirs, 1, H] state has batch at 1); dropping a unit axis moves no value
    in_batch = tuple(b if b == "0" or (b and k < len(in_shapes) and int(b) < len(in_shapes[k])
                                       and in_shapes[k][int(b)] == 1) else "none"
                     for k, (_, b) in enumerate(ins))
    out_blobs = tuple(b for _, b in outs)
    ob = tuple("0" if out_batch[v] == "0" else "none" for v, _ in outs)
    return in_blobs, in_batch, out_blobs, ob


def graph_code_digest() -> str:
    """A digest of the source of the modules that rewrite the graph before pnnx, of this one (which
    lists the speed rewrites and runs them) and of memory.py (which marks the .param pnnx writes): part
    of the conversion cache folder's name next to their version numbers, so edited code never reuses a
    conversion made by the old code (an experiment under an unbumped version number once did). A frozen
    edgepack ships no .py files: there the version numbers alone key it."""
    h = hashlib.sha256()
    for module in (rewrite, seq_first, fuse, strided_conv, dilated_conv, erf_gelu, tanh_gelu, reduce_max,
                   recurrent_forms, memory, token_ids, unit_batch, sys.modules[__name__]):
        src = Path(module.__file__)
        h.update(src.read_bytes() if src.suffix == ".py" and src.is_file() else module.__name__.encode())
    return h.hexdigest()[:16]


def convert(model: LoadedModel, precision: str, log=print) -> NcnnModel:
    import ncnn  # the Python wheel: the converted model's independent check
    blob = model.proto.SerializeToString()
    # (a graph with lowered quantisation says so in its metadata, dynamic or static: the model's bytes
    # already key it; static graphs' key also says which conversion rule they had)
    parts = {"model": sha256_bytes(blob), "pnnx": PNNX_VERSION, "precision": precision, "v": 3,
             "rewrites": REWRITE_VERSION, "fuse": FUSE_VERSION}
    if rounds_quotients(model.proto) and not sums_integers(model.proto):
        parts["static_int8"] = 2   # 2: Winograd kept for static (QDQ) graphs
    if sums_integers(model.proto):
        parts["integer_sums"] = 1  # 1: convolutions marked memory.INTEGER_SUMS (F(2,3) on x86)
    key = key_of(parts)
    # The folder also follows the rewrite code; the key the manifest records does not, so a frozen
    # edgepack (no .py files to digest) builds the same bytes as a pip-installed one.
    entry = key_of({"key": key, "graph_code": graph_code_digest()})
    root = cache_root() / "ncnn-models" / entry
    with locked(lock_file("ncnn-model", entry)):
        meta_path = root / "convert.json"
        if meta_path.is_file():
            touch_used(root)
            meta = json.loads(meta_path.read_text())
            return NcnnModel(root / "model.ncnn.param", root / "model.ncnn.bin", **{
                k: tuple(v) if isinstance(v, list) else v for k, v in meta.items()})
        if root.exists():
            shutil.rmtree(root)
        root.mkdir(parents=True)
        ids = id_inputs(model.proto, model.inputs, model.path.name)  # integer inputs: embedding ids only
        for s in model.inputs:
            if s.dtype != "float32" and s.name not in ids:
                raise UnsupportedOpError(f"{model.path.name}: input {s.name} is {s.dtype}; ncnn artifacts take float32",
                                         hint="use --backend tvm for integer inputs")
            if not s.shape:  # pnnx's inputshape= has no spelling for a 0-d tensor (it drops it, then fails)
                raise UnsupportedOpError(f"{model.path.name}: input {s.name} is a scalar (0-d); ncnn artifacts "
                                         "take tensors of at least one dimension", hint="use --backend tvm")
        fp16 = "1" if precision == "fp16" else "0"
        log(f"converting with pnnx (fp16 weights={fp16})")
        ready, ready_note = reduce_maxes_for_ncnn(as_pnnx_embeddings(model.proto, ids))  # exact, and needed
        batched, batch_note = _batched(ready, log)
        try:
            meta = _convert_in(root, model, batched, ready_note + batch_note, fp16, precision, key, log)
        except (UnsupportedOpError, VerificationError, BuildError) as exc:
            if not batch_note:
                raise
            # the batched graph is only a speed-up: never let it cost a model NCNN converted before
            # (the ReduceMax rewrites stay: the op check passed on the graph they give)
            log(f"conversion of the batched graph failed ({exc.message}); converting the graph as it is")
            meta = _convert_in(root, model, ready, ready_note, fp16, precision, key, log)
        for junk in root.glob("model.pnnx*"):
            junk.unlink()
        meta_path.write_text(json.dumps(meta, indent=1))
        return NcnnModel(root / "model.ncnn.param", root / "model.ncnn.bin", **{k: tuple(v) if isinstance(v, list) else v for k, v in meta.items()})


def _convert_in(root: Path, model: LoadedModel, proto, rewrites: tuple[str, ...], fp16: str, precision: str,
                key: str, log) -> dict:
    """_converted_or_rewritten, and when ncnn cannot compute pnnx's result or it disagrees with
    onnxruntime, one last try on the graph with a leading unit axis on every tensor (unit_batch.py:
    a sequence-first transformer, whose axis 0 pnnx takes for the batch)."""
    try:
        return _converted_or_rewritten(root, model, proto, rewrites, fp16, precision, key, log)
    except (VerificationError, BuildError) as exc:
        lifted = unit_batch.lift_unit_batch(proto)
        if lifted is None:
            raise
        log(f"{exc.message[:200]}; retrying with a leading unit axis on every tensor (a sequence-first graph)")
        layers = _run_pnnx(model, lifted, root, fp16)
        left = _leftovers(layers)
        if left:   # (not recorded for the split: the probe works on the graph as given)
            log(f"after lifting, pnnx left {', '.join(sorted({t for t, _ in left}))}")
            raise exc from None
        try:
            return _checked(root, model, layers, rewrites + ("unit_batch x1",), precision, key)
        except (UnsupportedOpError, VerificationError, BuildError) as retry_exc:
            log(f"after lifting: {retry_exc.message[:200]}")
            raise exc from None


def _converted_or_rewritten(root: Path, model: LoadedModel, proto, rewrites: tuple[str, ...], fp16: str,
                            precision: str, key: str, log) -> dict:
    """pnnx on ``proto`` into ``root``, checked; the convert.json meta. One retry on the graph
    rewrite_for_ncnn makes, when pnnx left layers ncnn cannot load (batch-axis reshapes/slices, strided
    slices, an LSTM not in torch's export form) or, failing that, when the converted model disagrees
    with onnxruntime (pnnx took a sequence axis for the batch: seq_first.py). The check always
    compares against onnxruntime on the original model."""
    layers = _run_pnnx(model, proto, root, fp16)
    if _leftovers(layers) or not _loads(root / "model.ncnn.param"):
        again = _rewritten(proto, log)
        if again:
            rewritten, applied = again
            left = sorted({t for t, _ in _leftovers(layers)}) or ["a layer ncnn cannot load"]
            log(f"pnnx left {', '.join(left)}; retrying after ONNX rewrites: {', '.join(applied)}")
            return _checked(root, model, _run_pnnx(model, rewritten, root, fp16), rewrites + applied, precision, key)
    try:
        return _checked(root, model, layers, rewrites, precision, key)
    except VerificationError as exc:
        again = _rewritten(proto, log)
        if not again:
            raise
        rewritten, applied = again
        log(f"{exc.message}; retrying after ONNX rewrites: {', '.join(applied)}")
        try:
            return _checked(root, model, _run_pnnx(model, rewritten, root, fp16), rewrites + applied, precision, key)
        except (UnsupportedOpError, VerificationError) as retry_exc:
            log(f"after the rewrites: {retry_exc.message}")
            if isinstance(retry_exc, VerificationError):  # the rewrites got further: theirs is the error to show
                raise VerificationError(f"{retry_exc.message} (after ONNX rewrites: {', '.join(applied)})",
                                        hint=retry_exc.hint) from None
            raise exc from None


def _rewritten(proto, log) -> tuple[object, tuple[str, ...]] | None:
    """rewrite_for_ncnn on ``proto``: (the rewritten graph, "name xN" per rewrite), None if none applied."""
    try:
        rewritten, applied = rewrite_for_ncnn(proto)
    except Exception as exc:  # a rewrite bug must cost only the retry, not the build
        log(f"ONNX rewrites failed ({type(exc).__name__}: {exc}); keeping pnnx's first result")
        return None
    return (rewritten, tuple(f"{k} x{v}" for k, v in sorted(applied.items()))) if applied else None


def _checked(root: Path, model: LoadedModel, layers, rewrites: tuple[str, ...], precision: str, key: str) -> dict:
    """pnnx's result in ``root`` loaded by the ncnn wheel and compared with onnxruntime; the meta."""
    left = _leftovers(layers)
    if left:
        from ...partition_probe import record
        record(model, left)  # the split backend cuts their nodes out to TVM (partition_probe.py)
    for ltype, lname in left:
        raise UnsupportedOpError(
            f"{model.path.name}: ncnn has no layer for {ltype} (layer {lname}; {_guess_onnx_op(ltype, model)})",
            hint="use --backend tvm, or rewrite that part of the model")
    param, binf = root / "model.ncnn.param", root / "model.ncnn.bin"
    in_blobs, in_batch, out_blobs, out_batch = _io_from_pyscript(
        (root / "model_ncnn.py").read_text(), len(model.inputs), len(model.outputs),
        tuple(tuple(s.shape) for s in model.inputs))
    ids = id_inputs(model.proto, model.inputs, model.path.name)
    text = param.read_text()
    for s, blob in zip(model.inputs, in_blobs):
        if s.name in ids and not embed_only(text, blob):
            raise UnsupportedOpError(f"{model.path.name}: input {s.name} ({s.dtype} ids) reaches an ncnn layer "
                                     "other than Embed after pnnx", hint="use --backend tvm")
    err = _check_with_python_ncnn(model, param, binf, in_blobs, in_batch, out_blobs, out_batch, precision)
    return {"input_blobs": in_blobs, "output_blobs": out_blobs, "input_batch": in_batch,
            "output_batch": out_batch, "layer_types": sorted({t for t, _ in layers}), "check_error": err,
            "key": key, "rewrites": rewrites, "input_ids": [ids.get(s.name, 0) for s in model.inputs]}


def _batched(proto, log) -> tuple[object, tuple[str, ...]]:
    """The speed rewrites on ``proto``, in order: fuse.batch_shared_products, fuse.gemv_as_gemm,
    rewrite.split_sum_of_squares, strided_conv.strided_convs_as_rows, strided_conv.wide_convs_as_rows,
    dilated_conv.dilated_convs_as_phases, erf_gelu.erf_gelus_as_gelu, tanh_gelu.tanh_gelus_as_gelu:
    (the graph pnnx gets, the rewrites it names)."""
    notes = []
    for fn, what in ((batch_shared_products, "batching shared-weight products"),
                     (gemv_as_gemm, "one-row products as Gemm"),
                     (split_sum_of_squares, "sums of squared channel ranges as slices"),
                     (strided_convs_as_rows, "strided few-channel Conv1D as a 2-D Convolution of one row"),
                     (wide_convs_as_rows, "many-channel Conv1D as a 2-D Convolution of one row"),
                     (dilated_convs_as_phases, "height-dilated 3x3 Convs over their row phases"),
                     (erf_gelus_as_gelu, "erf GELUs in the form pnnx fuses"),
                     (tanh_gelus_as_gelu, "tanh GELUs as ONNX's Gelu")):
        try:
            rewritten, count = fn(proto)
        except Exception as exc:  # a rewrite bug must cost only the speed-up, not the build
            log(f"{what} failed ({type(exc).__name__}: {exc}); converting without it")
            continue
        if count:
            if fn is batch_shared_products:
                log(f"batched shared-weight Gemm/MatMul: {count} products fewer (one weight copy each)")
            notes.append(f"{fn.__name__} x{count}")
            proto = rewritten
    return proto, tuple(notes)


def _readable_by_pnnx(proto):
    """proto, or a copy stamped with the newest IR version pnnx's own onnxruntime reads. onnx >= 1.23
    stamps IR 14 on every model it writes; pnnx's onnxruntime refuses it and pnnx then crashes, though
    nothing in an IR 14 graph of opset <= 27 needs more than IR 13. A graph that does use newer
    features still fails in pnnx, with pnnx's own message in its log."""
    if proto.ir_version <= PNNX_MAX_IR_VERSION:
        return proto
    readable = onnx.ModelProto()
    readable.CopyFrom(proto)
    readable.ir_version = PNNX_MAX_IR_VERSION
    return readable


def _run_pnnx(model: LoadedModel, proto, root: Path, fp16: str) -> list[tuple[str, str]]:
    """pnnx on proto (written to root/model.onnx); the (type, name) layers of its .param."""
    (root / "model.onnx").write_bytes(_readable_by_pnnx(proto).SerializeToString())
    dtypes = {"float32": "f32", "float16": "f16", "int32": "i32", "int64": "i64", "uint8": "u8", "int8": "i8"}
    type_suffix = ",".join(f"[{','.join(str(d) for d in s.shape)}]{dtypes.get(s.dtype, 'f32')}"
                           for s in model.inputs)
    param, binf = root / "model.ncnn.param", root / "model.ncnn.bin"
    for old in (param, binf):
        old.unlink(missing_ok=True)
    proc.run([pnnx_executable(), "model.onnx", f"inputshape={type_suffix}", f"fp16={fp16}"],
             what=f"pnnx converting {model.path.name}", cwd=root, timeout=900, log=root / "pnnx.log")
    if not param.is_file() or not binf.is_file():
        raise BuildError(f"pnnx wrote no ncnn model for {model.path.name} (log: {root / 'pnnx.log'})")
    text = written = param.read_text()
    if rounds_quotients(model.proto):
        # Gemms of constant B marked for integer sums (int8_gemm_patch.py); convolutions that sum
        # integers exactly, as ConvInteger and QLinearConv do: no Winograd there
        text = mark_integer_gemms(integer_convolutions(text) if sums_integers(model.proto) else text)[0]
    text = flat_gru_initial_states(text)[0]
    if text != written:
        param.write_text(text)
    return parse_param_layers(text)


def _loads(param: Path) -> bool:
    """Whether ncnn accepts the .param (pnnx can write a known layer type without its parameters)."""
    import ncnn
    return ncnn.Net().load_param(str(param)) == 0


def _leftovers(layers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    import ncnn
    return [(t, n) for t, n in layers if ncnn.layer_to_index(t) < 0]


def run_python_ncnn(model: LoadedModel, converted: NcnnModel, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The converted model's outputs on ``inputs`` with the ncnn Python wheel (fp32, 1 thread),
    reshaped to onnxruntime's shapes (the model's declared output shapes)."""
    return _run_python_ncnn(model, converted.param, converted.bin, converted.input_blobs, converted.input_batch,
                            converted.output_blobs, converted.output_batch, inputs)


def _run_python_ncnn(model, param, binf, in_blobs, in_batch, out_blobs, out_batch, inputs,
                     ref: dict | None = None) -> dict[str, np.ndarray]:
    import ncnn
    net = ncnn.Net()
    net.opt.num_threads = 1
    net.opt.use_fp16_packed = net.opt.use_fp16_storage = net.opt.use_fp16_arithmetic = False
    if net.load_param(str(param)) != 0 or net.load_model(str(binf)) != 0:
        raise BuildError("the ncnn Python wheel could not load pnnx's output")
    got, fed = {}, []
    with net.create_extractor() as ex:
        for spec, blob, b in zip(model.inputs, in_blobs, in_batch):
            # integer ids: Embed reads int32 words (the engine writes them the same way)
            dtype = np.int32 if spec.dtype in INTEGER_IDS else np.float32
            arr = np.ascontiguousarray(inputs[spec.name], dtype=dtype).view(np.float32)
            # the arrays and Mats stay referenced until the extractor is done with them
            fed.append(np.ascontiguousarray(arr if b == "none" else np.take(arr, 0, axis=int(b))))
            fed.append(ncnn.Mat(fed[-1]).clone())
            ex.input(blob, fed[-1])
        for spec, blob, b in zip(model.outputs, out_blobs, out_batch):
            ret, mat = ex.extract(blob)
            if ret != 0:
                raise BuildError(f"ncnn failed to compute output {spec.name} (blob {blob})")
            arr = np.array(mat)
            want = tuple(int(d) for d in (ref[spec.name].shape if ref is not None else spec.shape))
            if arr.size != int(np.prod(want)):
                raise VerificationError(
                    f"{model.path.name}: pnnx mis-converted output {spec.name}: ncnn gives shape {arr.shape}, "
                    f"onnxruntime {want}", hint="use --backend tvm for this model")
            got[spec.name] = arr.reshape(want)
    return got


def _isolated_python_ncnn(model, args: tuple, timeout: float = 600) -> dict[str, np.ndarray]:
    """_run_python_ncnn in a forked child: ncnn segfaults on some of pnnx's output (a Slice into
    three outputs written without its slice sizes, from ONNX Split), and that must become this
    build's clean error, not the end of edgepack."""
    import ncnn  # noqa: F401  imported before the fork, so the child imports nothing
    kind, got = proc.run_forked(_run_python_ncnn, (model, *args), timeout)
    if kind == "died":
        raise BuildError(f"{model.path.name}: ncnn crashed running pnnx's conversion ({got})",
                         hint="pnnx wrote a model ncnn cannot run; try --backend tvm")
    if kind == "raised":
        cls, message, hint = got
        if cls is None:  # reported as a build error
            raise BuildError(f"the ncnn Python wheel failed: {message}")
        raise cls(message, hint=hint)
    return got


# the wheel's check of a graph that rounds quotients (lowered dynamic int8): 10% of scale, cosine 0.99
_ROUNDED_QUOTIENTS = Tolerance(atol=1e-3, rtol=0.1, min_cosine=0.99)


def _check_with_python_ncnn(model, param, binf, in_blobs, in_batch, out_blobs, out_batch, precision) -> float:
    inputs = random_inputs(model.inputs, seed=1234)
    ref = run_onnxruntime(model, inputs)
    got = _isolated_python_ncnn(model, (param, binf, in_blobs, in_batch, out_blobs, out_batch, inputs, ref))
    tol = Tolerance(atol=1e-3, rtol=1e-2) if precision == "fp16" else Tolerance(atol=1e-4, rtol=1e-3)
    if rounds_quotients(model.proto):
        # The ncnn wheel divides by reciprocals (-ffast-math); the artifact's libncnn does not
        # (exact_div_patch.py). Where quotients are rounded, a tie then flips and moves the output
        # by a few % of its scale, so here only a gross mis-conversion fails; the artifact's own
        # verification holds it to the one policy (reference.POLICY).
        tol = _ROUNDED_QUOTIENTS
    results = compare(got, ref, tol)
    bad = [r for r in results if not r.ok]
    if bad:
        r = bad[0]
        raise VerificationError(
            f"{model.path.name}: pnnx/ncnn output {r.name} disagrees with onnxruntime: max abs error "
            f"{r.max_abs_err:.3g} > {r.bound:.3g}", hint="pnnx mis-converted this graph; try --backend tvm")
    return max((r.max_abs_err for r in results), default=0.0)
