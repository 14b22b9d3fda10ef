"""Default CPU schedules for the kernels a tuning database leaves unscheduled.

Without a schedule, relax's cpu_generic lowering compiles each legalised PrimFunc as its naive loop
nest (reduction innermost, scalar, single-threaded): 20-70x onnxruntime. This module gives every
such kernel a fixed, deterministic schedule chosen from the loop nest alone (no measuring, no
device), in this order, first that applies:

1. ``_tile_reduction``: one reduction block (matmul, conv2d incl. depthwise/grouped, pooling),
   GEMV, register-tiled like a BLAS micro-kernel: the last spatial axis split by the target's
   vector width and vectorised (or, when no split fits, tiled whole and unrolled), a spatial axis
   the vector operand does not depend on split by a few rows and unrolled (each loaded vector then feeds several FMAs), the reduction loops outside that
   tile, the elementwise epilogue computed per tile, the outer tiles fused and ``parallel``;
2. dlight's CPU reduction rule: softmax/norm-like chains of reductions;
3. ``_injective``: no reduction: intermediate blocks inlined, the inner axis vectorised, the
   outer axes fused and ``parallel``;
4. ``_outer_parallel``: anything else keeps its loop order but runs its outer spatial loops in
   parallel and its innermost spatial loop vectorised where that loop is innermost.

Every schedule primitive is checked by TVM for validity; a rule that raises leaves the kernel to
the next rule, and a kernel no rule takes stays naive (slow, still correct). The build then
verifies the artifact against onnxruntime as usual.
"""
from __future__ import annotations

from collections import Counter

# a parallel loop with less work than this (multiply-adds or elements; ~10-20 us on one core)
# costs more in thread wake-ups than it saves, and far more on a loaded machine, where a
# descheduled worker stalls every parallel region (measured: a small OCR classifier with 1<<14
# here ran 1.6 ms on 1 thread and 165 ms on 2 threads next to other jobs)
_PARALLEL_MIN_WORK = 1 << 17
# register-tile rows tried for the reuse axis, best first (rows x one vector of accumulators stays
# within the 16 vector registers of AVX2/NEON with room for the loaded operands). 7: NHWC
# convolutions reuse a weight vector over the pixels of an image row, and CNN maps are 7, 14, 28
# pixels wide (2 rows, or 1, without it: PP-LCNet's 1x1 convolutions ran 1.5x slower). Rows must
# divide the axis: a tile straddling two image rows made the epilogue's region a bounding box that
# overlapped the next tile's (wrong answers with parallel tiles)
_ROW_TILES = (8, 7, 6, 4, 3, 2)
# a matrix-vector product whose matrix is stored [K, N] (N contiguous; onnx_lstm's pre-transposed
# recurrent weights): the output tile is up to this many elements wide, so every row of the matrix is
# read as one contiguous run. With one vector per tile the K loop strode down the matrix 32 bytes at
# a time, each access in another page: ddddocr_crnn's [512, 2048] recurrent GEMV took 4.3 ms per step.
_GEMV_TILE = 256


def apply_default_schedules(mod, target) -> tuple[object, Counter]:
    """``mod`` with every PrimFunc not yet marked ``tirx.is_scheduled`` scheduled for ``target``;
    also a Counter rule name -> kernels it scheduled ("naive" for those none could)."""
    import tvm
    used: Counter = Counter()
    updates = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, tvm.tirx.PrimFunc):
            continue
        if func.attrs is not None and "tirx.is_scheduled" in func.attrs and bool(func.attrs["tirx.is_scheduled"]):
            continue
        name, new = schedule_func(func, target)
        used[name] += 1
        if new is not None:
            updates[gv] = new.with_attr("tirx.is_scheduled", True)
    if updates:
        # a copy: mod[gv] = ... updates the module in place, and compile.py schedules the same fused
        # module once per ISA level; in place, the first level's schedules (baseline, 128-bit vectors)
        # marked every kernel scheduled and the x86-64-v3/v4 copies kept them
        mod = mod.clone()
    for gv, func in updates.items():
        mod[gv] = func
    return mod, used


def schedule_func(func, target):
    """(rule name, scheduled PrimFunc) for one kernel, or ("naive", None)."""
    name, sch = default_schedule(func, target)
    return name, (sch.mod["main"] if sch is not None else None)


def default_schedule(func, target):
    """(rule name, the s_tir.Schedule, whose trace replays it) for one kernel, or ("naive", None).
    tuning.py commits the trace as a record competing with MetaSchedule's (a tuned record that
    measured slower than this schedule then never replaces it)."""
    from tvm import s_tir
    from tvm.s_tir import dlight as dl
    # dlight's GEMV rule is left out: its schedules took LLVM 55 s per kernel for x86-64-v4 (the 1x1
    # convolutions of squeeze-excite blocks), minutes per model; ``_tile_reduction`` takes GEMVs too
    rules = (("tile", _tile_reduction), ("dlight.Reduction", dl.cpu.Reduction()),
             ("injective", _injective), ("outer-parallel", _outer_parallel))
    with target:
        for name, rule in rules:
            try:
                if isinstance(rule, dl.ScheduleRule):
                    sch = rule.apply(func, target, False)
                    sch = sch[0] if isinstance(sch, list) else sch
                else:
                    sch = s_tir.Schedule(func)
                    sch = sch if rule(sch, vector_lanes(target, func)) else None
            except Exception:  # a primitive refused (TVM checks every step), or dlight asserted
                sch = None
            if sch is not None and not _recomputes(func, sch.mod["main"]):
                return name, sch
    return "naive", None


def vector_bits(target) -> int:
    """The target's vector register width. (tvm's llvm_get_vector_width answers 512 for every x86
    CPU name, the x86-64 baseline included, so it is read from the target here.)"""
    attrs = target.attrs
    mcpu = str(attrs.get("mcpu", "")) if "mcpu" in attrs else ""
    mattr = [str(a) for a in attrs["mattr"]] if "mattr" in attrs else []
    if "x86_64" not in str(attrs.get("mtriple", "x86_64")) and "x86" not in mcpu:
        return 128  # aarch64 NEON (SVE is not targeted)
    if mcpu == "x86-64-v4" or "+avx512f" in mattr:
        return 512
    if mcpu == "x86-64-v3" or "+avx2" in mattr or "+avx" in mattr:
        return 256
    return 128


def vector_lanes(target, func) -> int:
    import tvm
    bits = 32
    for param in func.params[-1:]:  # the output's element type (params carry their buffer type)
        dtype = getattr(getattr(param, "ty", None), "dtype", None)
        if dtype is not None:
            bits = max(8, tvm.DataType(str(dtype)).bits)
    return max(2, vector_bits(target) // bits)


# --- block analysis ---------------------------------------------------------------------------

def _runs(func) -> dict[str, int]:
    """How often each top-level block of ``func`` runs (the product of its loops' extents); {}
    where an extent is not a constant."""
    from tvm import s_tir
    sch = s_tir.Schedule(func)
    out = {}
    for block in _blocks(sch):
        n = 1
        for loop in sch.get_loops(block):
            ext = _extent(sch, loop)
            if ext is None:
                return {}
            n *= ext
        out[sch.get(block).name_hint] = n
    return out


def _recomputes(before, after) -> bool:
    """Whether a schedule runs some block more than twice as often as the kernel did: dlight's CPU
    reduction rule computes a reduction inside its broadcast consumer's loop (onnx-asr's kaldi front
    end subtracts the waveform's mean from its 160000 samples: the mean was summed 160000 times, in
    parallel into one accumulator, 21 s a run)."""
    was, now = _runs(before), _runs(after)
    return any(name in was and n > 2 * was[name] for name, n in now.items())


def _blocks(sch):
    from tvm.s_tir.dlight.analysis import get_root_block
    return list(sch.get_child_blocks(get_root_block(sch)))


def _kinds(sch, block) -> str:
    """One letter per block iterator: S spatial, R reduction, O other."""
    return "".join({0: "S", 2: "R"}.get(int(iv.iter_type), "O") for iv in sch.get(block).iter_vars)


def _plain_loops(sch, block):
    """The block's loops when each binds exactly one iterator, in iterator order; else None."""
    loops = sch.get_loops(block)
    stmt = sch.get(block)
    if len(loops) != len(stmt.iter_vars):
        return None
    binds = _bindings(sch, block)
    loop_vars = [sch.get(lp).loop_var for lp in loops]
    if binds is None or len(binds) != len(loop_vars) or any(not b.same_as(v) for b, v in zip(binds, loop_vars)):
        return None
    return loops


def _bindings(sch, block):
    realize = _realize_of(sch, block)
    return list(realize.iter_values) if realize is not None else None


def _realize_of(sch, block):
    """The SBlockRealize of ``block`` (its iterator bindings), found under its innermost loop."""
    import tvm
    import tvm_ffi
    loops = sch.get_loops(block)
    target = sch.get(block)
    found = []

    def visit(node):
        if node.block.same_as(target):
            found.append(node)
    parent = sch.get(loops[-1]).body if loops else sch.get(block)
    tvm_ffi.structural_walk(parent, (tvm.s_tir.SBlockRealize, visit), order="post")
    return found[0] if found else None


def _extent(sch, loop) -> int | None:
    ext = sch.get(loop).extent
    return int(ext.value) if hasattr(ext, "value") else None


def _divisor(n: int, limit: int) -> int:
    for f in range(min(n, limit), 0, -1):
        if n % f == 0:
            return f
    return 1


def _pow2_divisor(n: int, limit: int) -> int:
    p = 1
    while p * 2 <= limit and n % (p * 2) == 0:
        p *= 2
    return p


def _vars_in(expr) -> set:
    from tvm.s_tir.dlight.analysis import collect_vars_used_in_prim_expr
    return collect_vars_used_in_prim_expr(expr)


def _inline_all(sch, blocks, keep) -> list:
    """compute_inline every block it can (besides ``keep``), repeatedly; the blocks left."""
    changed = True
    while changed:
        changed = False
        for b in list(blocks):
            if any(sch.get(b).same_as(sch.get(k)) for k in keep):
                continue
            try:
                sch.compute_inline(b)
            except Exception:  # an output, a reduction, or a producer with several consumers
                continue
            blocks.remove(b)
            changed = True
    return blocks


# --- rules ------------------------------------------------------------------------------------

def _tile_reduction(sch, lanes: int) -> bool:
    blocks = _blocks(sch)
    reds = [b for b in blocks if "R" in _kinds(sch, b)]
    if len(reds) != 1 or "O" in _kinds(sch, reds[0]):
        return False
    main = reds[0]
    kinds = _kinds(sch, main)
    n_s = kinds.index("R")
    if n_s == 0 or "S" in kinds[n_s:]:
        return False
    loops = _plain_loops(sch, main)
    if loops is None:
        return False
    ext = [_extent(sch, lp) for lp in loops]
    if any(e is None for e in ext):
        return False
    stmt = sch.get(main)
    # the operand read with the innermost spatial axis is the vectorised one; a spatial axis it does
    # not depend on is where a loaded vector gets reused (conv: output channels; matmul: rows)
    vec = max((k for k in range(n_s) if ext[k] > 1), default=None)
    if vec is None:
        return False
    ivars = [iv.var for iv in stmt.iter_vars]
    reuse = None
    # every operand read along the vector axis counts, not only the first: an NHWC depthwise conv
    # reads its input *and* its weight along the channels, and only the weight leaves the pixel axes
    # free. Looking at the input alone found no reuse axis, so the conv took the GEMV tile (all 200
    # channels as 25 AVX2 vectors, spilled): PP-OCR's classifier ran 2x slower in NHWC than in NCHW
    for region in stmt.reads:
        used = set()
        for rng in region.region:
            used |= _vars_in(rng.min)
        if ivars[vec] in used:
            free = [k for k in range(n_s) if k != vec and ext[k] > 1 and ivars[k] not in used]
            best = max(free, key=lambda k: (ext[k], k), default=None)
            if best is not None and (reuse is None or ext[best] > ext[reuse]):
                reuse = best
    # the consumer chain: intermediate epilogue blocks inlined into the last one
    idx = [i for i, b in enumerate(blocks) if sch.get(b).same_as(stmt)][0]
    prologue, epilogue = blocks[:idx], blocks[idx + 1:]
    epilogue = _inline_all(sch, epilogue, keep=epilogue[-1:])
    # prologues that are copies/reshapes are inlined into the kernel; padding (if_then_else) stays
    for b in prologue:
        if "if_then_else" not in str(sch.get(b).body):
            try:
                sch.compute_inline(b)
            except Exception:
                pass
    main = sch.get_sblock(stmt.name_hint)
    loops = sch.get_loops(main)
    if not epilogue:
        # writing straight into the function's output: accumulate in a per-tile buffer instead
        epilogue = [sch.cache_write(main, 0, "global")]
    # the vector tile: the whole axis when it fits one vector, else a divisor of at least half a
    # vector. An axis with no such divisor (17, 19: conv1d outputs) is tiled whole and unrolled
    # (LLVM's SLP vectoriser packs it): measured 17x faster than a predicated 8-lane vector, which
    # TVM scalarises, and than a 17-lane vector, which LLVM legalises badly (so is a 14-lane one:
    # 9x slower than 7 lanes)
    unrolled = False
    if ext[vec] <= lanes:
        width = ext[vec]
    elif _pow2_divisor(ext[vec], lanes) >= lanes // 2:
        # a power of two first: an NHWC depthwise conv over 88 or 200 channels took 11- and 10-lane
        # vectors (the largest divisors), which LLVM splits into 8 + 3 and 8 + 2: PP-OCR's
        # classifier ran 1.3x slower in NHWC than in NCHW until they became 8 lanes
        width = _pow2_divisor(ext[vec], lanes)
    elif _divisor(ext[vec], lanes) >= lanes // 2:
        width = _divisor(ext[vec], lanes)
    elif ext[vec] <= 4 * lanes:
        width, unrolled = ext[vec], True
    else:
        width = lanes  # a predicated tail: rare (a long prime axis)
    rows = 1
    row_major = _contiguous_in(stmt, ivars[vec])
    if reuse is not None:
        vregs = -(-width // lanes)
        rows = next((r for r in _ROW_TILES if ext[reuse] % r == 0 and r * vregs <= 8), 1)
        if rows == 1 and ext[reuse] > 8 and vregs == 1 and not unrolled:
            # no row tile divides the reuse axis (a prime number of rows: an unrolled decoder's 17th
            # step): the 8-row tile anyway, its last tile's missing rows skipped by TVM's predicate.
            # One row of one vector chained each FMA on the previous one's latency: x[17,128] @ W
            # took 50 us that way, 23 us as one row of 8 vectors, 19-20 us as this tile
            rows = 8
        elif rows == 1 and width == lanes and not unrolled:
            # a short axis (5 rows): several vectors side by side, independent chains sharing each
            # broadcast
            width = max((w for w in (8 * lanes, 4 * lanes, 2 * lanes) if ext[vec] % w == 0), default=lanes)
    elif not unrolled and width == lanes and row_major:
        # GEMV over a row-major [K, N] matrix: a wide tile, read row by row (see _GEMV_TILE)
        width = max((w for w in range(lanes, min(ext[vec], _GEMV_TILE) + 1, lanes) if ext[vec] % w == 0),
                    default=lanes)
    outer, inner = [], []
    reuse_at = None
    for k in range(n_s):
        if k == vec and width < ext[vec] and width > lanes and width % lanes == 0:
            o, i = sch.split(loops[k], [None, width])
            iu, il = sch.split(i, [None, lanes])
            outer.append(o)
            inner += [iu, il]
        elif k == vec and width < ext[vec]:
            o, i = sch.split(loops[k], [None, width])
            outer.append(o)
            inner.append(i)
        elif k == vec:
            inner.append(loops[k])
        elif k == reuse and rows > 1:
            o, i = sch.split(loops[k], [None, rows])
            reuse_at = len(outer)
            outer.append(o)
            inner.insert(0, i)
        else:
            reuse_at = len(outer) if k == reuse else reuse_at
            outer.append(loops[k])
    if row_major and reuse is not None:
        # a row-major [K, N] matrix times a few rows: the row tiles innermost of the outer loops, so
        # consecutive tiles walk the same strip of the matrix (in cache) instead of the whole matrix
        # once per row tile (ddddocr_crnn's [1024, 8210] classifier: 33.6 MB streamed 5 times)
        outer.append(outer.pop(reuse_at))
    red_loops = loops[n_s:]
    sch.reorder(*outer, *red_loops, *inner)
    fused = sch.fuse(*outer) if len(outer) > 1 else outer[0]
    work = 1
    for e in ext:
        work *= e
    if work >= _PARALLEL_MIN_WORK and _extent(sch, fused) and _extent(sch, fused) > 1:
        sch.parallel(fused)
    for e in epilogue[-1:]:
        sch.reverse_compute_at(e, fused)
        el = sch.get_loops(e)
        if len(el) > 1:
            _vectorize_tail(sch, el[1:], lanes)
    # vectorise before splitting off the init: the update alone is no longer a complete block
    if len(inner) > 1:
        sch.unroll(inner[0])
    if unrolled:
        sch.unroll(inner[-1])
    else:
        sch.vectorize(inner[-1])
    init = sch.decompose_reduction(main, red_loops[0])
    il = sch.get_loops(init)
    if len(il) > 1 and _extent(sch, il[-1]) in (width, lanes):
        sch.vectorize(il[-1])  # (zeroing: any width vectorises well)
    for b in prologue:
        try:
            sch.get(b)
        except Exception:  # inlined
            continue
        _parallel_vectorize(sch, b, lanes)
    return True


def _vectorize_tail(sch, loops, lanes: int) -> None:
    """Vectorise the innermost loop of a per-tile epilogue: whole when it is short, else by vectors
    (a wide GEMV tile's epilogue)."""
    e = _extent(sch, loops[-1])
    if e is not None and 1 < e <= 4 * lanes:
        sch.vectorize(loops[-1])
    elif e is not None and e % lanes == 0:
        sch.vectorize(sch.split(loops[-1], [None, lanes])[1])


def _contiguous_in(stmt, var) -> bool:
    """Whether some operand the block reads (not its own accumulator) is indexed by ``var`` in its
    last (contiguous) dimension and by nothing else there: a row of a row-major matrix."""
    written = [w.source for w in stmt.writes]
    for region in stmt.reads:
        if not region.region or any(region.source.same_as(b) for b in written):
            continue
        last = _vars_in(region.region[-1].min)
        if len(last) == 1 and var in last and all(var not in _vars_in(r.min) for r in region.region[:-1]):
            return True
    return False


def _parallel_vectorize(sch, block, lanes: int) -> None:
    """A spatial block: outer loops fused and parallel, the innermost split and vectorised."""
    loops = sch.get_loops(block)
    ext = [_extent(sch, lp) for lp in loops]
    if not loops or any(e is None for e in ext) or "R" in _kinds(sch, block):
        return
    total = 1
    for e in ext:
        total *= e
    last = ext[-1]
    if last >= lanes and last % lanes == 0:
        _o, vi = sch.split(loops[-1], [None, lanes])
        outer = loops[:-1] + [_o] if len(loops) > 1 else [_o]
    elif 1 < last <= 2 * lanes:
        vi, outer = loops[-1], loops[:-1]
    else:
        vi, outer = None, loops[:-1] if len(loops) > 1 else []
    if vi is not None:
        sch.vectorize(vi)
    if outer and total >= _PARALLEL_MIN_WORK:
        # the outer loops only: fusing the split outer part too would divide by a non-constant
        fused = sch.fuse(*outer[:-1]) if len(outer) > 2 else outer[0]
        if _extent(sch, fused) and _extent(sch, fused) > 1:
            sch.parallel(fused)


def _injective(sch, lanes: int) -> bool:
    blocks = _blocks(sch)
    if any("R" in _kinds(sch, b) or "O" in _kinds(sch, b) for b in blocks):
        return False
    blocks = _inline_all(sch, blocks, keep=[])
    for b in blocks:
        _parallel_vectorize(sch, b, lanes)
    return True


def _outer_parallel(sch, lanes: int) -> bool:
    done = False
    for b in _blocks(sch):
        kinds = _kinds(sch, b)
        loops = sch.get_loops(b)
        if "O" in kinds or len(loops) != len(kinds):
            continue
        if "R" not in kinds:
            _parallel_vectorize(sch, b, lanes)
            done = True
            continue
        lead = len(kinds) - len(kinds.lstrip("S"))
        if lead and _plain_loops(sch, b) is not None:
            fused = sch.fuse(*loops[:lead]) if lead > 1 else loops[0]
            ext = _extent(sch, fused)
            if ext and ext > 1:
                sch.parallel(fused)
                done = True
    return done
