"""Tanh GELUs as exporters write them out, around a Relu and an Add so the GELU is mid-graph: the
forms tanh_gelu.py matches (tests/unit/test_ncnn_tanh_gelu.py) and pnnx gets wrong
(tests/test_pnnx_tanh_gelu.py). Input "x" [1, 16, 24], output "y"."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

mk = helper.make_node
SQ = 0.7978845608028654


def _model(nodes, consts: dict, opset: int = 15) -> onnx.ModelProto:
    """x [1, 16, 24] -> Relu -> (GELU nodes reading "x0", writing "g") -> Add 1 -> y."""
    nodes = [mk("Relu", ["x"], ["r"]), mk("Sub", ["r", "shift"], ["x0"]), *nodes, mk("Add", ["g", "one_out"], ["y"])]
    consts = {"shift": 1.5, "one_out": 1.0, **consts}
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 24])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 24])],
                              [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in consts.items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def jax2tf_form(cube=0.044715, sq=SQ, half=0.5):
    """magika's: x * c, * x, * x, + x, * sqrt(2/pi), tanh, + 1, * 0.5, * x."""
    return _model([mk("Mul", ["x0", "c"], ["m1"]), mk("Mul", ["x0", "m1"], ["m2"]), mk("Mul", ["x0", "m2"], ["m3"]),
                   mk("Add", ["x0", "m3"], ["a"]), mk("Mul", ["a", "k"], ["b"]), mk("Tanh", ["b"], ["t"]),
                   mk("Add", ["t", "one"], ["u"]), mk("Mul", ["u", "half"], ["h"]), mk("Mul", ["x0", "h"], ["g"])],
                  {"c": cube, "k": sq, "one": 1.0, "half": half})


def torch_form():
    """GPT-2's NewGELU: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * pow(x, 3)))), in the node order
    pnnx fuses (into its erf GELU)."""
    return _model([mk("Pow", ["x0", "three"], ["p"]), mk("Mul", ["p", "c"], ["q"]), mk("Add", ["x0", "q"], ["a"]),
                   mk("Mul", ["a", "k"], ["b"]), mk("Tanh", ["b"], ["t"]), mk("Add", ["t", "one"], ["u"]),
                   mk("Mul", ["x0", "half"], ["h"]), mk("Mul", ["h", "u"], ["g"])],
                  {"three": 3.0, "c": 0.044715, "k": SQ, "one": 1.0, "half": 0.5}, opset=17)


def reordered_torch_form():
    """The same with every constant first and the Add's operands swapped."""
    return _model([mk("Pow", ["x0", "three"], ["p"]), mk("Mul", ["c", "p"], ["q"]), mk("Add", ["q", "x0"], ["a"]),
                   mk("Mul", ["k", "a"], ["b"]), mk("Tanh", ["b"], ["t"]), mk("Add", ["one", "t"], ["u"]),
                   mk("Mul", ["half", "x0"], ["h"]), mk("Mul", ["h", "u"], ["g"])],
                  {"three": 3.0, "c": 0.044715, "k": SQ, "one": 1.0, "half": 0.5}, opset=17)


def divided_form():
    """x^2 by Pow, the half as a division: (x * (1 + tanh(...))) / 2."""
    return _model([mk("Pow", ["x0", "two"], ["p"]), mk("Mul", ["p", "x0"], ["p3"]), mk("Mul", ["p3", "c"], ["q"]),
                   mk("Add", ["x0", "q"], ["a"]), mk("Mul", ["a", "k"], ["b"]), mk("Tanh", ["b"], ["t"]),
                   mk("Add", ["t", "one"], ["u"]), mk("Mul", ["x0", "u"], ["xu"]), mk("Div", ["xu", "two_d"], ["g"])],
                  {"two": 2.0, "c": 0.044715, "k": SQ, "one": 1.0, "two_d": 2.0})
