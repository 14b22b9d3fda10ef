"""The default TVM CPU schedules (edgepack/backends/tvm/schedules.py): each common kernel shape gets
the rule meant for it, and the scheduled, compiled kernels compute what numpy computes.

In-process TVM (relax.build for the host's x86-64 baseline, run in the VM); no artifact, no
subprocess. Shapes are deliberately awkward (odd widths, channel counts no tile divides) so the
predicated tails of the tiling are exercised, not only the perfect splits."""
from __future__ import annotations

import numpy as np
import pytest

import tvm  # noqa: E402  (installed in CI: a missing one fails, never skips)
from tvm import relax  # noqa: E402

from tvm_modules import host_target as _target, relax_module as _module  # noqa: E402
from edgepack.backends.tvm.compile import fuse, lower_pipeline  # noqa: E402
from edgepack.backends.tvm.schedules import apply_default_schedules, schedule_func, vector_bits  # noqa: E402

RNG = np.random.default_rng(0)


def _rand(*shape):
    return RNG.standard_normal(shape).astype("float32")


def _run(mod, inputs: dict, target):
    """Fuse, schedule, build for ``target`` and run: (output, rule -> kernels)."""
    fused = fuse(mod, target)
    scheduled, used = apply_default_schedules(fused, target)
    with tvm.transform.PassContext(opt_level=3):
        ex = relax.build(scheduled, target=target, relax_pipeline=lower_pipeline(target))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in inputs.values()])
    return out.numpy(), used


def _conv_ref(x, w, b, stride, pad, groups):
    n, c, h, wd = x.shape
    f, cg, kh, kw = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oh, ow = (h + 2 * pad - kh) // stride + 1, (wd + 2 * pad - kw) // stride + 1
    out = np.zeros((n, f, oh, ow), np.float64)
    fg = f // groups
    for o in range(f):
        g = o // fg
        for i in range(cg):
            for dy in range(kh):
                for dx in range(kw):
                    out[:, o] += w[o, i, dy, dx] * xp[:, g * cg + i, dy:dy + stride * oh:stride, dx:dx + stride * ow:stride]
    return out + b.reshape(1, f, 1, 1)


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_matmul_bias_is_register_tiled_and_correct():
    x, w, b = _rand(37, 50), _rand(50, 29), _rand(29)
    mod = _module({"x": x}, lambda bb, v: relax.op.add(relax.op.matmul(v, relax.const(w)), relax.const(b)))
    got, used = _run(mod, {"x": x}, _target())
    assert used == {"tile": 1}
    _close(got, x @ w + b)


def test_gemv_and_squeeze_excite_conv():
    """One row times a matrix, and a 1x1 convolution on a 1x1 map (squeeze-excite blocks): the tiling
    rule takes them (dlight's GEMV rule made LLVM spend ~1 min per such kernel for x86-64-v4)."""
    x, w, b = _rand(1, 200), _rand(200, 35), _rand(35)
    got, used = _run(_module({"x": x}, lambda bb, v: relax.op.add(relax.op.matmul(v, relax.const(w)),
                                                                   relax.const(b))), {"x": x}, _target())
    assert used == {"tile": 1}
    _close(got, x @ w + b)
    x, w = _rand(1, 48, 1, 1), _rand(12, 48, 1, 1)
    got, used = _run(_module({"x": x}, lambda bb, v: relax.op.nn.conv2d(v, relax.const(w))), {"x": x},
                     _target())
    assert used["tile"] == 1 and set(used) <= {"tile", "injective"}, used  # NHWC: transposes at the edges
    _close(got, _conv_ref(x, w, np.zeros(12, "float32"), 1, 0, 1))


@pytest.mark.parametrize("layout", ["nhwc", "nchw"])
@pytest.mark.parametrize("stride,pad,groups,chans", [(1, 1, 1, 12), (2, 1, 1, 7), (1, 1, 12, 12), (2, 0, 12, 12)],
                         ids=["conv3x3", "conv3x3-s2", "depthwise", "depthwise-s2-nopad"])
def test_conv2d_with_epilogue(stride, pad, groups, chans, layout, monkeypatch):
    monkeypatch.setenv("EDGEPACK_TVM_LAYOUT", layout)  # layout.py: NHWC by default
    x = _rand(1, 12, 19, 23)
    w, b = _rand(chans, 12 // groups, 3, 3), _rand(chans)

    def body(bb, v):
        y = relax.op.nn.conv2d(v, relax.const(w), strides=stride, padding=pad, groups=groups)
        return relax.op.nn.relu(relax.op.add(y, relax.const(b.reshape(1, chans, 1, 1))))
    got, used = _run(_module({"x": x}, body), {"x": x}, _target())
    assert used.get("tile") == 1, used
    assert set(used) <= ({"tile", "injective"} if layout == "nhwc" else {"tile"}), used
    _close(got, np.maximum(_conv_ref(x, w, b, stride, pad, groups), 0))


def test_softmax_and_elementwise():
    x = _rand(6, 77)

    def body(bb, v):
        s = relax.op.nn.softmax(v, axis=-1)
        return relax.op.multiply(s, relax.op.sigmoid(v))
    got, used = _run(_module({"x": x}, body), {"x": x}, _target())
    assert "naive" not in used, used
    e = np.exp(x - x.max(-1, keepdims=True))
    _close(got, e / e.sum(-1, keepdims=True) * (1 / (1 + np.exp(-x))))


def test_pure_elementwise_chain_is_vectorised():
    x = _rand(3, 40, 21)
    got, used = _run(_module({"x": x}, lambda bb, v: relax.op.nn.relu(relax.op.multiply(v, v))), {"x": x}, _target())
    assert used == {"injective": 1}
    _close(got, np.maximum(x * x, 0))


def test_kernels_a_database_scheduled_are_left_alone():
    x = _rand(8, 16)
    fused = fuse(_module({"x": x}, lambda bb, v: relax.op.matmul(v, relax.const(_rand(16, 24)))), _target())
    gv = next(g for g, f in fused.functions.items() if isinstance(f, tvm.tirx.PrimFunc))
    fused[gv] = fused[gv].with_attr("tirx.is_scheduled", True)
    before = fused[gv]
    out, used = apply_default_schedules(fused, _target())
    assert not used
    assert out[gv].same_as(before)


def test_vector_width_follows_the_isa_level():
    assert vector_bits(_target()) == 128
    assert vector_bits(_target(mcpu="x86-64-v3")) == 256
    assert vector_bits(_target(mcpu="x86-64-v4")) == 512
    arm = tvm.target.Target({"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mcpu": "cortex-a78ae",
                             "mattr": ["+neon"]})
    assert vector_bits(arm) == 128


def test_each_isa_level_gets_its_own_schedule_from_one_fused_module():
    """compile.py schedules one fused module once per ISA level: scheduling must leave that module
    as it was (it once marked every kernel scheduled in place, so the x86-64-v3/v4 copies kept the
    baseline's 128-bit schedules)."""
    x = _rand(8, 64)
    fused = fuse(_module({"x": x}, lambda bb, v: relax.op.matmul(v, relax.const(_rand(64, 64)))), _target())
    gv = next(g for g, f in fused.functions.items() if isinstance(f, tvm.tirx.PrimFunc))
    base, _ = apply_default_schedules(fused, _target())
    assert "tirx.is_scheduled" not in (fused[gv].attrs or {})
    v3, used = apply_default_schedules(fused, _target(mcpu="x86-64-v3"))
    assert used == {"tile": 1}
    assert "T.vectorized(T.int64(4))" in base[gv].script() and "T.vectorized(T.int64(8))" in v3[gv].script()


def test_schedule_is_deterministic():
    x = _rand(1, 8, 10, 14)
    fused = fuse(_module({"x": x}, lambda bb, v: relax.op.nn.conv2d(v, relax.const(_rand(8, 8, 3, 3)), padding=1)),
                 _target())
    f = next(f for gv, f in fused.functions.items() if isinstance(f, tvm.tirx.PrimFunc) and "conv2d" in gv.name_hint)
    a, b = schedule_func(f, _target()), schedule_func(f, _target())
    assert a[0] == b[0] == "tile"
    tvm.ir.assert_structural_equal(a[1], b[1])


def test_prime_width_conv_is_unrolled_not_predicated(monkeypatch):
    """An output width no vector divides (13 here, 17 in a real text model) is tiled whole and
    unrolled; the kernel still computes the convolution. (NCHW: in NHWC the vector is the channels.)"""
    monkeypatch.setenv("EDGEPACK_TVM_LAYOUT", "nchw")
    x, w = _rand(2, 8, 1, 17), _rand(6, 8, 1, 5)
    fused = fuse(_module({"x": x}, lambda bb, v: relax.op.nn.conv2d(v, relax.const(w))), _target())
    f = next(f for f in fused.functions.values() if isinstance(f, tvm.tirx.PrimFunc) and "conv" in f.script())
    rule, sched = schedule_func(f, _target())
    assert rule == "tile" and "T.unroll(T.int64(13))" in sched.script()
    got, _used = _run(_module({"x": x}, lambda bb, v: relax.op.nn.conv2d(v, relax.const(w))), {"x": x}, _target())
    _close(got, _conv_ref(x, w, np.zeros(6, "float32"), 1, 0, 1))


@pytest.mark.parametrize("rows", [17, 5])
def test_a_prime_number_of_rows_is_still_tiled(rows):
    """x[rows, 128] @ W[128, 128] + b where no row tile (8, 7, 6, 4, 3, 2) divides the rows (an unrolled
    decoder's 17th step). 17 rows: the 8-row tile anyway, its last tile's missing rows skipped by a
    predicate; 5 rows: each row summed into 8 vectors side by side. Either way 8 independent FMA
    chains share each load, where one row of one vector chained every FMA on the last (x[17,128] @ W:
    50 us that way, 23 us as 8 vectors, 19-20 us as the predicated tile). The answer is the same."""
    x, w, b = _rand(rows, 128), _rand(128, 128), _rand(128)
    mod = _module({"x": x}, lambda bb, v: relax.op.add(relax.op.matmul(v, relax.const(w)), relax.const(b)))
    target = _target(mcpu="x86-64-v3")
    f = next(f for f in fuse(mod, target).functions.values() if isinstance(f, tvm.tirx.PrimFunc) and "matmul" in f.script())
    rule, sched = schedule_func(f, target)
    text = sched.script()
    reduction = text[text.index("for k in range(T.int64(128))"):]
    assert rule == "tile" and "T.unroll(T.int64(8))" in reduction and "T.vectorized(T.int64(8))" in reduction, reduction
    if rows == 17:   # 3 row tiles x 16 column vectors, the third tile guarded
        assert "T.parallel(T.int64(48))" in text and "< T.int64(17))" in reduction, text[-3000:]
    else:            # 5 rows x 2 tiles of 64 columns (too little work for threads)
        assert "T.where" not in text, text[-3000:]
    got, _ = _run(mod, {"x": x}, target)
    _close(got, x @ w + b)


def test_gemv_over_a_row_major_matrix_reads_whole_rows():
    """h[1, K] @ W[K, N] with N contiguous (an unrolled LSTM's recurrent step): the output tile is many
    vectors wide, so each row of W is one contiguous read, not a 32-byte stride down the matrix; the
    width divides N exactly, the epilogue (bias) is vectorised per tile, the answer exact. A [N, K]
    (transposed) matrix keeps the one-vector tile."""
    x, w, b = _rand(1, 1, 96), _rand(96, 384), _rand(384)
    mod = _module({"x": x}, lambda bb, v: relax.op.add(relax.op.matmul(v, relax.const(w)), relax.const(b)))
    target = _target(mcpu="x86-64-v3")
    fused = fuse(mod, target)
    scheduled, used = apply_default_schedules(fused, target)
    assert used == {"tile": 1}
    text = "\n".join(f.script() for f in scheduled.functions.values() if isinstance(f, tvm.tirx.PrimFunc))
    # 192 wide (the largest multiple of 8 up to 256 dividing 384): 24 unrolled vectors of 8 per row of W
    assert "T.unroll(T.int64(24))" in text and "T.vectorized(T.int64(8))" in text, text[-3000:]
    got, _ = _run(mod, {"x": x}, target)
    _close(got, x @ w + b)
    wt = _rand(384, 96)  # stored [N, K]: rows are not output-contiguous
    mod_t = _module({"x": x}, lambda bb, v: relax.op.matmul(v, relax.op.permute_dims(relax.const(wt))))
    got, used = _run(mod_t, {"x": x}, target)
    assert used == {"tile": 1}
    _close(got, x @ wt.T)


def test_a_mean_subtracted_from_its_own_signal_is_summed_once():
    # onnx-asr's kaldi front end: x - mean(x) over 160000 samples. dlight's CPU reduction rule
    # put the sum inside the subtraction's parallel loop (summed 160000 times, 21 s a run): the
    # rule is refused where it recomputes a block, and the next one takes the kernel
    from edgepack.backends.tvm.schedules import _runs
    x = _rand(1, 160000)

    def body(bb, v):
        return relax.op.subtract(v, relax.op.mean(v, axis=[1], keepdims=True))
    target = _target()
    fused = fuse(_module({"x": x}, body), target)
    scheduled, used = apply_default_schedules(fused, target)
    assert "dlight.Reduction" not in used, used
    for _gv, func in scheduled.functions.items():
        if isinstance(func, tvm.tirx.PrimFunc):
            assert max(_runs(func).values()) <= 2 * x.size, _runs(func)
    got, _ = _run(_module({"x": x}, body), {"x": x}, target)
    _close(got, x - x.mean(1, keepdims=True))
