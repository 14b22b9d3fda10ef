"""A .param's layer lines as a graph, for the folds that rewrite it after conversion
(fake_quant_patch.fold_fake_quant, dynamic_quant_fold.fold_dynamic_quant)."""
from __future__ import annotations


def is_float(text: str) -> bool:
    """Whether ncnn's ParamDict reads this value as a float (it does for a '.', 'e' or 'E' in it),
    and it is a finite number."""
    if not any(c in text for c in ".eE"):
        return False
    try:
        v = float(text)
    except ValueError:
        return False
    return v == v and abs(v) != float("inf")


class Line:
    """One layer line of a .param: type, name, bottoms, tops and its key=value fields."""

    def __init__(self, text: str):
        t = text.split()
        self.text = text
        self.type, self.name = t[0], t[1]
        n_in, n_out = int(t[2]), int(t[3])
        self.bottoms = t[4:4 + n_in]
        self.tops = t[4 + n_in:4 + n_in + n_out]
        self.fields = dict(kv.split("=", 1) for kv in t[4 + n_in + n_out:] if "=" in kv)

    def one_to_one(self) -> bool:
        return len(self.bottoms) == 1 and len(self.tops) == 1

    def render(self) -> str:
        """The line from its parts (fields as they were read)."""
        fields = " ".join(f"{k}={v}" for k, v in self.fields.items())
        return (f"{self.type:<24} {self.name:<24} {len(self.bottoms)} {len(self.tops)} "
                f"{' '.join(self.bottoms + self.tops)} {fields}").rstrip()


def split_param(param_text: str) -> tuple[str, list[Line]] | None:
    """(the magic line, the layer lines) of a .param; None for one without layers."""
    lines = param_text.strip().splitlines()
    if len(lines) < 2:
        return None
    return lines[0], [Line(s) for s in lines[2:] if s.strip()]


def join_param(magic: str, layers: list[Line], texts: list[str] | None = None) -> str:
    """A .param from its layers, the header counted again: one blob per top (ncnn sizes its blob
    table by the header, so it must not be short)."""
    texts = texts if texts is not None else [layer.text for layer in layers]
    blobs = {t for layer in layers for t in layer.tops}
    return "\n".join([magic, f"{len(layers)} {len(blobs)}"] + texts) + "\n"


def toposorted(layers: list[Line]) -> list[Line]:
    """`layers` in an order where each layer follows the producers of its bottoms (ncnn's loader
    takes a bottom not yet made for a new blob), keeping the given order wherever it already does."""
    import heapq
    producer = {t: i for i, layer in enumerate(layers) for t in layer.tops}
    waiting = [sum(1 for b in layer.bottoms if b in producer) for layer in layers]
    readers: dict[int, list[int]] = {}
    for i, layer in enumerate(layers):
        for b in layer.bottoms:
            if b in producer:
                readers.setdefault(producer[b], []).append(i)
    ready = [i for i, n in enumerate(waiting) if n == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        i = heapq.heappop(ready)
        out.append(layers[i])
        for j in readers.get(i, []):
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, j)
    if len(out) != len(layers):
        raise ValueError("the .param's layers read each other in a cycle")
    return out


class Graph:
    """Who makes and who reads each blob of a .param's layers; Splits can be looked through."""

    def __init__(self, layers: list[Line]):
        self.layers = layers
        self.producer = {t: i for i, layer in enumerate(layers) for t in layer.tops}
        self.readers: dict[str, list[tuple[int, int]]] = {}
        for i, layer in enumerate(layers):
            for slot, b in enumerate(layer.bottoms):
                self.readers.setdefault(b, []).append((i, slot))

    def value(self, blob: str) -> str:
        """The blob a Split copied `blob` from (through any number of Splits)."""
        while blob in self.producer and self.layers[self.producer[blob]].type == "Split":
            blob = self.layers[self.producer[blob]].bottoms[0]
        return blob

    def uses(self, blob: str) -> list[tuple[int, int]]:
        """(layer, input slot) of every non-Split reader of `blob`, through Splits."""
        out = []
        for i, slot in self.readers.get(blob, []):
            if self.layers[i].type == "Split":
                for t in self.layers[i].tops:
                    out += self.uses(t)
            else:
                out.append((i, slot))
        return out

    def splits(self, blob: str) -> list[int]:
        """The Split layers that copy `blob`, through Splits."""
        out = []
        for i, _ in self.readers.get(blob, []):
            if self.layers[i].type == "Split":
                out.append(i)
                for t in self.layers[i].tops:
                    out += self.splits(t)
        return out
