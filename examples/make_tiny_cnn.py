"""Write examples/tiny_cnn.onnx: a small seeded CNN classifier (no torch needed).

image [N,3,64,64] float32 -> Conv3x3(16)+BN+ReLU -> DWConv3x3/2+ReLU6 -> Conv1x1(32)+HardSwish
-> residual Add -> GlobalAveragePool -> Flatten -> Gemm(10) -> logits [N,10]

The batch dim is symbolic ("N"), as in most exported models; edgepack fixes it to 1.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def build(seed: int = 20261130) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)

    def w(name, *shape, scale=None):
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        s = scale if scale is not None else (2.0 / fan_in) ** 0.5
        return numpy_helper.from_array((rng.standard_normal(shape) * s).astype(np.float32), name)

    inits = [
        w("c1.w", 16, 3, 3, 3), w("c1.b", 16, scale=0.1),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, 16).astype(np.float32), "bn.scale"),
        numpy_helper.from_array((rng.standard_normal(16) * 0.1).astype(np.float32), "bn.bias"),
        numpy_helper.from_array((rng.standard_normal(16) * 0.1).astype(np.float32), "bn.mean"),
        numpy_helper.from_array(rng.uniform(0.5, 1.5, 16).astype(np.float32), "bn.var"),
        w("dw.w", 16, 1, 3, 3), w("dw.b", 16, scale=0.1),
        w("pw.w", 32, 16, 1, 1), w("pw.b", 32, scale=0.1),
        w("sc.w", 32, 16, 1, 1), w("sc.b", 32, scale=0.1),
        w("fc.w", 10, 32), w("fc.b", 10, scale=0.1),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        numpy_helper.from_array(np.array(6.0, np.float32), "six"),
    ]
    nodes = [
        helper.make_node("Conv", ["image", "c1.w", "c1.b"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("BatchNormalization", ["c1", "bn.scale", "bn.bias", "bn.mean", "bn.var"], ["bn"], name="bn1"),
        helper.make_node("Relu", ["bn"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "dw.w", "dw.b"], ["dw"], pads=[1, 1, 1, 1], strides=[2, 2], group=16,
                         name="dwconv"),
        helper.make_node("Clip", ["dw", "zero", "six"], ["r2"], name="relu6"),
        helper.make_node("Conv", ["r2", "pw.w", "pw.b"], ["pw"], name="pwconv"),
        helper.make_node("HardSwish", ["pw"], ["hs"], name="hswish"),
        helper.make_node("Conv", ["r2", "sc.w", "sc.b"], ["sc"], name="shortcut"),
        helper.make_node("Add", ["hs", "sc"], ["res"], name="residual"),
        helper.make_node("GlobalAveragePool", ["res"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
        helper.make_node("Gemm", ["flat", "fc.w", "fc.b"], ["logits"], transB=1, name="fc"),
    ]
    graph = helper.make_graph(
        nodes, "tiny_cnn",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, 64, 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])],
        inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="edgepack-example")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).with_name("tiny_cnn.onnx")
    onnx.save(build(), str(out))
    print(out)
