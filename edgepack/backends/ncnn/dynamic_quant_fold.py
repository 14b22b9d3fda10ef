"""Dynamic quantisation in one layer: the lowered DynamicQuantizeLinear chain folded into EpDynQuant.

edgepack/quantized.py lowers onnxruntime's DynamicQuantizeLinear (and the "less its zero point" that
follows it before an integer product) to ONNX ops NCNN has; pnnx writes them as ~30 ncnn layers:
a flattening Reshape, two global max pools (of x and -x) with their Reshapes, ReLUs, the scalar ops
that make the scale and zero point, then x / scale, round, + zp, clip, - zp over the tensor, with
Splits between. A dynamically quantised model runs one such chain per convolution input and, in a
quantised LSTM, per step: in ddddocr_old_int8 they were 2,000 of its 2,300 layers, and each costs
ncnn a dispatch, a few allocations and (for the tensor-sized ones) a pass over memory.

``fold_dynamic_quant`` finds each chain in the .param by its structure (the layers, their fields and
which reads which; Splits are looked through) and writes one ``EpDynQuant`` line in its place:
bottom x, tops (centred, scale, zero point). The layer is the engine's own
(runtimes/ncnn/ep_ncnn_layers.cc, registered on every net), so every architecture takes the folded
.param; it computes the chain's float operations in the chain's order. Readers of the scale or zero
point outside the chain read the new tops (through a new Split where there are several). A chain
whose intermediate blob is read from outside, or is an output the runtime extracts, is left alone.
"""
from __future__ import annotations

import struct

from .param_graph import Graph, Line, is_float, join_param, split_param, toposorted

LAYER_TYPE = "EpDynQuant"


def _f32(text: str) -> float | None:
    """The float32 ncnn reads for a field, None where it reads no float."""
    if not is_float(text):
        return None
    return struct.unpack("<f", struct.pack("<f", float(text)))[0]


class _NoMatch(Exception):
    pass


def _is(layer: Line, kind: str, fields: dict[str, float | str] | None = None, n_in: int = 1) -> bool:
    """Whether `layer` is a `kind` with n_in bottoms, one top and exactly these fields (floats
    compared as the float32 ncnn reads)."""
    if layer.type != kind or len(layer.bottoms) != n_in or len(layer.tops) != 1:
        return False
    fields = fields or {}
    if set(layer.fields) != set(fields):
        return False
    for k, want in fields.items():
        got = layer.fields[k]
        if isinstance(want, float):
            if _f32(got) != want:
                return False
        elif got != want:
            return False
    return True


class _Chain:
    """One matched chain: its layers, x's blob, and the blobs outside readers take from it."""

    def __init__(self, g: Graph, pool: int):
        self.g, self.members = g, set()
        L = g.layers
        gmp = {"0": "0", "4": "1"}
        if not _is(L[pool], "Pooling", gmp):
            raise _NoMatch
        flat = g.value(L[pool].bottoms[0])
        r0 = g.producer.get(flat)
        # one channel (w = all of x): the pools then take the max over the whole tensor
        if r0 is None or not _is(L[r0], "Reshape", {"0": L[r0].fields.get("0", ""), "1": "1", "2": "1"}):
            raise _NoMatch
        self.x = self.unshaped(L[r0].bottoms[0])
        neg = self.only([u for u in g.uses(flat) if u[0] != pool], "UnaryOp", {"0": "1"})
        pool2 = self.only(g.uses(L[neg].tops[0]), "Pooling", gmp)
        self.members.update((r0, pool, neg, pool2))
        hi = self.relu_after(L[pool].tops[0])
        nlo = self.relu_after(L[pool2].tops[0])
        nlo_uses = g.uses(nlo)
        add = self.only(g.uses(hi), "BinaryOp", {"0": "0"}, n_in=2)
        if {g.value(b) for b in L[add].bottoms} != {hi, nlo} or len(nlo_uses) != 2:
            raise _NoMatch
        span = L[add].tops[0]
        uses = g.uses(span)
        big = [i for i, _ in uses if _is(L[i], "BinaryOp", {"0": "2", "1": "1", "2": 2.0 ** 100})]
        raw = [i for i, _ in uses if _is(L[i], "BinaryOp", {"0": "3", "1": "1", "2": 255.0})]
        if len(uses) != 2 or len(big) != 1 or len(raw) != 1:
            raise _NoMatch
        rsub = self.only(g.uses(L[big[0]].tops[0]), "BinaryOp", {"0": "7", "1": "1", "2": 1.0})
        empty = self.relu_after(L[rsub].tops[0], through_reshapes=False)
        add2 = self.only(g.uses(empty), "BinaryOp", {"0": "0"}, n_in=2)
        if {g.value(b) for b in L[add2].bottoms} != {L[raw[0]].tops[0], empty} or \
                len(g.uses(L[raw[0]].tops[0])) != 1:
            raise _NoMatch
        self.members.update((add, big[0], rsub, raw[0], add2))
        self.scale = L[add2].tops[0]
        # zp = round(clip(nlo / scale, 0, 255))
        div6 = [i for i, s in nlo_uses if i != add]
        if not div6 or not _is(L[div6[0]], "BinaryOp", {"0": "3"}, n_in=2) or \
                g.value(L[div6[0]].bottoms[0]) != nlo or g.value(L[div6[0]].bottoms[1]) != self.scale:
            raise _NoMatch
        clip = self.only(g.uses(L[div6[0]].tops[0]), "Clip", {"0": 0.0, "1": 255.0})
        rnd = self.only(g.uses(L[clip].tops[0]), "UnaryOp", {"0": "18"})
        self.members.update((div6[0], clip, rnd))
        self.zp = L[rnd].tops[0]
        # centred = clip(round(x / scale) + zp, 0, 255) - zp
        div8 = self.binary_with(self.scale, "3")
        if self.unshaped(L[div8].bottoms[0]) != self.x:   # x, or a Reshape of it (the same elements)
            raise _NoMatch
        self.x_blob = L[div8].bottoms[0]
        rnd2 = self.only(g.uses(L[div8].tops[0]), "UnaryOp", {"0": "18"})
        add3 = self.binary_with(self.zp, "0")
        if g.value(L[add3].bottoms[0]) != L[rnd2].tops[0] or len(g.uses(L[rnd2].tops[0])) != 1:
            raise _NoMatch
        clip2 = self.only(g.uses(L[add3].tops[0]), "Clip", {"0": 0.0, "1": 255.0})
        sub = self.binary_with(self.zp, "1")
        uses_y = g.uses(L[clip2].tops[0])
        if uses_y != [(sub, 0)]:
            raise _NoMatch
        self.members.update((div8, rnd2, add3, clip2, sub))
        self.centred = L[sub].tops[0]
        self.r0 = r0
        self.outside = {v: [u for u in g.uses(v) if u[0] not in self.members] for v in (self.scale, self.zp)}
        internal = {flat, hi, nlo, span, empty, self.scale, self.zp, L[raw[0]].tops[0]}
        self.members.update(i for v in internal for i in g.splits(v))

    def only(self, uses, kind, fields, n_in=1) -> int:
        """The one reader in `uses`, which must be a `kind` with these fields."""
        if len(uses) != 1 or not _is(self.g.layers[uses[0][0]], kind, fields, n_in):
            raise _NoMatch
        return uses[0][0]

    def relu_after(self, blob: str, through_reshapes: bool = True) -> str:
        """The top of the plain ReLU that reads `blob` (after 1-in 1-out Reshapes of it)."""
        L = self.g.layers
        while True:
            uses = self.g.uses(blob)
            if len(uses) != 1:
                raise _NoMatch
            i = uses[0][0]
            if through_reshapes and L[i].type == "Reshape" and L[i].one_to_one():
                self.members.add(i)
                blob = L[i].tops[0]
                continue
            if not _is(L[i], "ReLU", {}):
                raise _NoMatch
            self.members.add(i)
            return L[i].tops[0]

    def unshaped(self, blob: str) -> str:
        """The value `blob` was reshaped from (through 1-in 1-out Reshapes and Splits)."""
        L = self.g.layers
        blob = self.g.value(blob)
        while blob in self.g.producer and L[self.g.producer[blob]].type == "Reshape" and \
                L[self.g.producer[blob]].one_to_one():
            blob = self.g.value(L[self.g.producer[blob]].bottoms[0])
        return blob

    def binary_with(self, scalar: str, op: str) -> int:
        """The 2-input BinaryOp `op` whose second input is `scalar` through one Reshape of it."""
        L, found = self.g.layers, []
        for i, _ in self.g.uses(scalar):
            if L[i].type == "Reshape" and L[i].one_to_one():
                for j, slot in self.g.uses(L[i].tops[0]):
                    if slot == 1 and _is(L[j], "BinaryOp", {"0": op}, n_in=2):
                        found.append((i, j))
        if len(found) != 1 or len(self.g.uses(L[found[0][0]].tops[0])) != 1:
            raise _NoMatch
        self.members.add(found[0][0])
        return found[0][1]

    def read_inside(self) -> bool:
        """Whether a layer outside the chain reads one of its intermediate blobs (anything but the
        centred tensor, the scale and the zero point, and their copies)."""
        return any(i not in self.members and self.g.value(b) not in (self.centred, self.scale, self.zp)
                   for b in self.blobs() for i, _ in self.g.readers.get(b, []))

    def blobs(self) -> set[str]:
        """Every top the chain's layers make."""
        return {t for i in self.members for t in self.g.layers[i].tops}


def fold_dynamic_quant(param_text: str, outputs: tuple[str, ...] = ()) -> tuple[str, int]:
    """The .param with every lowered DynamicQuantizeLinear chain written as one EpDynQuant layer,
    and how many were folded. ``outputs``: blobs the runtime extracts (never folded away)."""
    parsed = split_param(param_text)
    if parsed is None:
        return param_text, 0
    magic, layers = parsed
    g = Graph(layers)
    chains: list[_Chain] = []
    taken: set[int] = set()
    for i, layer in enumerate(layers):
        if layer.type != "Pooling" or i in taken:
            continue
        try:
            chain = _Chain(g, i)
        except _NoMatch:
            continue
        if chain.members & taken or chain.blobs() & (set(outputs) - {chain.centred}) or chain.read_inside():
            continue
        chains.append(chain)
        taken |= chain.members
    if not chains:
        return param_text, 0
    out: list[Line] = []
    at = {min(c.members): c for c in chains}
    for i, layer in enumerate(layers):
        if i in at:
            out += _replacement(at[i], len(out))
        if i in taken:
            continue
        out.append(layer)
    # a Split of x loses the top the chain's flattening Reshape read
    unread = {layers[c.r0].bottoms[0] for c in chains} - {c.x_blob for c in chains}
    for layer in out:
        if layer.type == "Split" and any(t in unread for t in layer.tops) and len(layer.tops) > 1:
            layer.tops = [t for t in layer.tops if t not in unread] or layer.tops[:1]
            layer.text = layer.render()
    return join_param(magic, toposorted(out)), len(chains)


def _replacement(c: _Chain, k: int) -> list[Line]:
    """The EpDynQuant line for chain `c`, and Splits for scale and zp where several outside layers
    read them (their bottoms renamed to the new blobs)."""
    L = c.g.layers
    name = L[min(c.members)].name
    tops = [c.centred, f"ep_dq_{name}_scale", f"ep_dq_{name}_zp"]
    lines = [Line(f"{LAYER_TYPE} ep_dq_{name} 1 3 {c.x_blob} {' '.join(tops)}")]
    for top, value in ((tops[1], c.scale), (tops[2], c.zp)):
        readers = c.outside[value]
        names = [top] if len(readers) == 1 else [f"{top}_{n}" for n in range(len(readers))]
        if len(readers) > 1:
            lines.append(Line(f"Split ep_dq_{name}_{value}_split 1 {len(names)} {top} {' '.join(names)}"))
        for (i, slot), blob in zip(readers, names):
            L[i].bottoms[slot] = blob
            L[i].text = L[i].render()
    return lines
