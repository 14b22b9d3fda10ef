"""ONNX's STFT op as a convolution: neither backend takes STFT (ncnn has no layer; TVM 0.27's relax
importer has no converter), and audio front ends written with OnnxScript use it (onnx-asr's Whisper
and NeMo log-mel preprocessors: a Hann window of 400 samples, hop 160).

For a real signal, frame f's bin k is X[f, k] = sum over n of x[f * step + n] w[n] e^(-2 pi i k n / N):
a 1-D convolution over the signal with stride `step` and 2 x bins kernels of length N, w[n] cos(2 pi k n / N)
for the real parts and -w[n] sin(2 pi k n / N) for the imaginary ones. So
    signal [B, L] or [B, L, 1] -> [B, 1, L] -> Conv(stride step) [B, 2 x bins, F] -> Reshape [B, 2, bins, F]
    -> Transpose [B, F, bins, 2]
is STFT's output, frames F = (L - N) / step + 1 as the op defines them. The sums are the DFT's, added in a
different order than onnxruntime's FFT (the build verifies against it, as for any kernel), and the NCNN
backend then runs the convolution as a 2-D one of one row (backends/ncnn/strided_conv.py).

Lowered only where the frame step, the window and the frame length are constants (as every exporter
writes them), the signal is real float32 and its rank is known; any other STFT stays, and the backends
refuse it by name as before.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .model import LoadedModel, _with
from .onnx_index import constants, node_attrs, tensor_infos


def lower_stft(model: LoadedModel) -> LoadedModel:
    """The model with each qualifying STFT computed as a Conv; unchanged without one."""
    proto, lowered, kept = replace_nodes(model, "STFT", _stft_as_conv)
    if proto is None:
        return model
    note = f"STFT as a strided convolution: {lowered} node(s)"
    if kept:
        note += f"; {kept} left (a computed window, step or length, a complex or non-float32 signal)"
    return _with(model, proto, note)


def replace_nodes(model: LoadedModel, op_type: str, lower_one) -> tuple[onnx.ModelProto | None, int, int]:
    """A copy of ``model``'s graph in which each ``op_type`` node that ``lower_one(node, k, graph, consts,
    infos)`` answers with a list of nodes (adding what initializers they need to ``graph``) is replaced by
    them, in place: (the copy, or None when no node was replaced; how many were; how many were left)."""
    if op_type not in model.ops():
        return None, 0, 0
    proto = onnx.ModelProto()
    proto.CopyFrom(model.proto)
    graph = proto.graph
    consts, infos = constants(proto), tensor_infos(proto)
    nodes, lowered, kept = [], 0, 0
    for k, node in enumerate(graph.node):
        new = lower_one(node, k, graph, consts, infos) if node.op_type == op_type else None
        if new is None:
            nodes.append(node)
            kept += node.op_type == op_type
            continue
        nodes += new
        lowered += 1
    if not lowered:
        return None, 0, kept
    del graph.node[:]
    graph.node.extend(nodes)
    # shapes recorded for the old graph (onnxsim writes them) may disagree with the new nodes' inference
    del graph.value_info[:]
    return proto, lowered, kept


def dft_kernels(window: np.ndarray, n: int, onesided: bool) -> np.ndarray:
    """[2 x bins, 1, n] float32: the windowed cosines (real parts), then the negated windowed sines."""
    bins = n // 2 + 1 if onesided else n
    t = np.arange(n, dtype=np.float64)
    angle = 2 * np.pi * np.outer(np.arange(bins), t) / n
    real = np.cos(angle) * window
    imag = -np.sin(angle) * window
    return np.concatenate([real, imag])[:, None, :].astype(np.float32)


def _form(node, consts, infos) -> tuple[np.ndarray, int, int, int, bool] | None:
    """(window, n, step, signal rank, onesided) of an STFT this lowering takes, else None."""
    if node.domain not in ("", "ai.onnx") or len(node.input) < 2:
        return None
    attrs = node_attrs(node)
    onesided = bool(attrs.get("onesided", 1))
    given = list(node.input[1:4]) + [""] * (4 - len(node.input))  # step, window, length ("": not given)
    if any(name and name not in consts for name in given) or not given[0] or not (given[1] or given[2]):
        return None  # a computed argument, or no frame length at all
    step, window, length = (consts[name] if name else None for name in given)
    if step.size != 1:
        return None
    n = int(length.reshape(-1)[0]) if length is not None else int(window.size)
    if window is None:
        window = np.ones(n)
    if window.ndim != 1 or window.size != n or n < 1 or int(step.reshape(-1)[0]) < 1:
        return None
    info = infos.get(node.input[0])
    if info is None or info.dims is None or info.elem_type != TensorProto.FLOAT:
        return None
    rank = len(info.dims)
    if rank not in (2, 3) or (rank == 3 and info.dims[2] != 1):
        return None  # [B, L, 2] is a complex signal
    return window.astype(np.float64), n, int(step.reshape(-1)[0]), rank, onesided


def _stft_as_conv(node, k: int, graph, consts, infos) -> list | None:
    form = _form(node, consts, infos)
    if form is None:
        return None
    window, n, step, rank, onesided = form
    base = f"{node.name or f'stft{k}'}__ep_stft"
    kernels = dft_kernels(window, n, onesided)
    bins = kernels.shape[0] // 2
    graph.initializer.extend([
        numpy_helper.from_array(kernels, f"{base}_kernels"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), f"{base}_axis1"),
        numpy_helper.from_array(np.array([0, 2, bins, -1], dtype=np.int64), f"{base}_shape")])
    x = node.input[0]
    if rank == 2:
        nodes = [helper.make_node("Unsqueeze", [x, f"{base}_axis1"], [f"{base}_signal"])]
    else:
        nodes = [helper.make_node("Transpose", [x], [f"{base}_signal"], perm=[0, 2, 1])]
    return nodes + [helper.make_node("Conv", [f"{base}_signal", f"{base}_kernels"], [f"{base}_bins"],
                                     kernel_shape=[n], strides=[step]),
                    helper.make_node("Reshape", [f"{base}_bins", f"{base}_shape"], [f"{base}_parts"]),
                    helper.make_node("Transpose", [f"{base}_parts"], [node.output[0]], perm=[0, 3, 2, 1])]


def lower_dft(model: LoadedModel) -> LoadedModel:
    """The model with each qualifying DFT of a real signal as a MatMul by the cosine and sine matrix
    (onnx-asr's WeSpeaker front end takes a 512-point DFT of 400-sample frames); unchanged without one.
    Lowered where the frames' axis is the one before the [.., 1] real/imaginary axis, the length is
    a constant at least the frames' own, and the transform is forward; any other DFT stays."""
    proto, lowered, _kept = replace_nodes(model, "DFT", _dft_as_matmul)
    return model if proto is None else _with(model, proto, f"DFT as a MatMul: {lowered} node(s)")


def _dft_as_matmul(node, k: int, graph, consts, infos) -> list | None:
    form = _dft_form(node, consts, infos)
    if form is None:
        return None
    dims, n, onesided = form
    width, bins = dims[-2], (n // 2 + 1 if onesided else n)
    base = f"{node.name or f'dft{k}'}__ep_dft"
    basis = dft_kernels(np.ones(n), n, onesided)[:, 0, :width].T        # [width, 2 x bins]
    graph.initializer.extend([
        numpy_helper.from_array(np.ascontiguousarray(basis), f"{base}_basis"),
        numpy_helper.from_array(np.array([-1], np.int64), f"{base}_last"),
        numpy_helper.from_array(np.array([*dims[:-2], 2, bins], np.int64), f"{base}_shape")])
    perm = [*range(len(dims) - 2), len(dims) - 1, len(dims) - 2]
    return [helper.make_node("Squeeze", [node.input[0], f"{base}_last"], [f"{base}_frames"]),
            helper.make_node("MatMul", [f"{base}_frames", f"{base}_basis"], [f"{base}_bins"]),
            helper.make_node("Reshape", [f"{base}_bins", f"{base}_shape"], [f"{base}_parts"]),
            helper.make_node("Transpose", [f"{base}_parts"], [node.output[0]], perm=perm)]


def _dft_form(node, consts, infos) -> tuple[tuple[int, ...], int, bool] | None:
    """(the signal's dims, the transform's length, onesided) of a DFT lower_dft takes, else None."""
    attrs = node_attrs(node)
    info = infos.get(node.input[0])
    if node.domain not in ("", "ai.onnx") or attrs.get("inverse", 0) or info is None or info.dims is None:
        return None
    dims = tuple(int(d) for d in info.dims)
    if info.elem_type != TensorProto.FLOAT or len(dims) < 3 or dims[-1] != 1:
        return None  # [.., 2] is a complex signal
    given = list(node.input[1:3]) + [""] * (3 - len(node.input[1:3]))   # dft_length, axis (opset 20)
    if any(name and name not in consts for name in given):
        return None
    axis = int(consts[given[1]].reshape(-1)[0]) if given[1] else int(attrs.get("axis", 1))
    if axis % len(dims) != len(dims) - 2:
        return None
    n = int(consts[given[0]].reshape(-1)[0]) if given[0] else dims[-2]
    if n < dims[-2] or n < 1:
        return None  # a transform shorter than the frames cuts them: left to the op
    return dims, n, bool(attrs.get("onesided", 0))
