"""Small relax modules for the in-process TVM tests (test_tvm_schedules.py, test_tvm_layout.py)."""
from __future__ import annotations

import tvm
from tvm import relax

HOST = {"kind": "llvm", "mtriple": "x86_64-unknown-linux-gnu", "mcpu": "x86-64", "num-cores": 2}


def host_target(**kw):
    """The host's x86-64 baseline, or another level (mcpu=...)."""
    return tvm.target.Target(dict(HOST, **kw))


def relax_module(inputs: dict, body):
    """A relax module main(inputs...) -> body(bb, vars...); ``inputs``: name -> numpy array."""
    bb = relax.BlockBuilder()
    params = [relax.Var(n, relax.TensorType(a.shape, "float32")) for n, a in inputs.items()]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(body(bb, *params))
        bb.emit_func_output(out)
    return bb.get()
