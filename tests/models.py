"""Test models exported with torch 2.13 (CPU, dynamo=False, opset 17) and small ONNX graphs
made with onnx.helper. Weights are seeded so every run builds the same bytes."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _torch():
    import torch
    torch.manual_seed(0)
    return torch


def mobilenet_v2_like(path: Path, width: float = 0.5, size: int = 96) -> Path:
    """A MobileNetV2-class CNN: inverted residuals with depthwise convs, ReLU6, BN, 1000 classes."""
    torch = _torch()
    nn = torch.nn

    def conv_bn(i, o, k, s, groups=1, act=True):
        layers = [nn.Conv2d(i, o, k, s, k // 2, groups=groups, bias=False), nn.BatchNorm2d(o)]
        if act:
            layers.append(nn.ReLU6())
        return nn.Sequential(*layers)

    class Inverted(nn.Module):
        def __init__(self, i, o, s, t):
            super().__init__()
            h = i * t
            self.res = s == 1 and i == o
            self.body = nn.Sequential(conv_bn(i, h, 1, 1), conv_bn(h, h, 3, s, groups=h), conv_bn(h, o, 1, 1, act=False))

        def forward(self, x):
            y = self.body(x)
            return x + y if self.res else y

    cfg = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]
    c = lambda v: max(8, int(v * width + 4) // 8 * 8)  # noqa: E731
    layers, inp = [conv_bn(3, c(32), 3, 2)], c(32)
    for t, ch, n, s in cfg:
        for k in range(n):
            layers.append(Inverted(inp, c(ch), s if k == 0 else 1, t))
            inp = c(ch)
    layers.append(conv_bn(inp, 1280, 1, 1))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(*layers)
            self.fc = nn.Linear(1280, 1000)

        def forward(self, x):
            x = self.features(x).mean((2, 3))
            return self.fc(x)

    net = Net().eval()
    with torch.no_grad():  # non-trivial BN statistics so outputs are not near-constant
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
    torch.onnx.export(net, (torch.randn(1, 3, size, size),), str(path), opset_version=17, dynamo=False,
                      input_names=["image"], output_names=["logits"], dynamic_axes={"image": {0: "batch"}})
    return path


def transformer_block(path: Path, d: int = 64, heads: int = 4, seq: int = 16) -> Path:
    """A post-norm transformer encoder block: multi-head self-attention written out (q/k/v
    projections, scaled dot-product, softmax), residuals, LayerNorm, GELU MLP."""
    torch = _torch()
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
            self.proj = nn.Linear(d, d)
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            b, s, _ = x.shape  # heads split as 4-D tensors: ncnn has no 5-D blobs
            q, k, v = (f(x).reshape(b, s, heads, d // heads).transpose(1, 2) for f in (self.q, self.k, self.v))
            att = torch.softmax(q @ k.transpose(-2, -1) * (d // heads) ** -0.5, dim=-1)
            y = (att @ v).transpose(1, 2).reshape(b, s, d)
            x = self.ln1(x + self.proj(y))
            return self.ln2(x + self.mlp(x))

    torch.onnx.export(Block().eval(), (torch.randn(1, seq, d),), str(path), opset_version=17, dynamo=False,
                      input_names=["tokens"], output_names=["hidden"])
    return path


def saved_graph(graph, path: Path, opset: int = 17) -> Path:
    """``graph`` as a checked model (IR 8, which every onnxruntime in use reads) at ``path``."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def quantised_graph(graph, tmp: Path, stem: str, opset: int = 13, **options) -> Path:
    """``graph`` saved as tmp/STEM-float.onnx (saved_graph), then through onnxruntime's quantize_dynamic with
    ``options`` (weight_type, nodes_to_exclude, ...) to tmp/STEM.onnx."""
    import logging

    from onnxruntime.quantization import quantize_dynamic
    src, dst = saved_graph(graph, tmp / f"{stem}-float.onnx", opset), tmp / f"{stem}.onnx"
    logging.getLogger().setLevel(logging.ERROR)
    quantize_dynamic(src, dst, **options)
    return dst


def single_op_model(path: Path, op: str, inputs: dict, outputs: dict, inits=(), opset: int = 17, **attrs) -> Path:
    """A one-node model: inputs/outputs map name -> shape (float32)."""
    node = helper.make_node(op, list(inputs) + [i.name for i in inits], list(outputs), name=f"{op.lower()}_node",
                            **attrs)
    graph = helper.make_graph(
        [node], f"single_{op}",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs.items()], list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def topk_model(path: Path) -> Path:
    """Conv -> flatten -> TopK(k=3): NCNN cannot build TopK."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    k = numpy_helper.from_array(np.array([3], np.int64), "k")
    shape = numpy_helper.from_array(np.array([1, -1], np.int64), "shape")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Reshape", ["c", "shape"], ["flat"], name="flatten"),
        helper.make_node("TopK", ["flat", "k"], ["values", "indices"], axis=1, name="top3"),
    ]
    graph = helper.make_graph(
        nodes, "topk", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("values", TensorProto.FLOAT, [1, 3]),
         helper.make_tensor_value_info("indices", TensorProto.INT64, [1, 3])], [w, k, shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path
