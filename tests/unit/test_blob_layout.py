"""The embedded blobs' assembler (edgepack/bundle.py, _blob_asm): every size sits in a section of its
own, ahead of the blobs, so reading the sizes at start-up touches no page of a blob. Where the kernel
keeps files in large folios, a touch maps the whole folio: a size after each blob had mapped the end of
every blob (YOLO11s-seg's golden outputs: 4.8 MB of RSS). Each blob still ends in a NUL (the .param is
parsed as a C string where the engine cannot copy it)."""
from __future__ import annotations

import re

from edgepack.bundle import _blob_asm

BLOBS = [("ep_param", "model.param"), ("ep_bin", "model.bin"), ("ep_golden_out0", "golden/out0.bin")]


def _sections(asm: str) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = []
    for line in asm.splitlines():
        m = re.match(r"\.section (\S+?),", line)
        if m:
            out.append((m.group(1), []))
        elif out:
            out[-1][1].append(line)
    return out


def test_sizes_come_first_in_their_own_section():
    for bits, word in ((64, ".quad"), (32, ".long")):
        sections = _sections(_blob_asm(BLOBS, bits))
        names = [n for n, _ in sections]
        assert names == [".rodata.edgepack_sizes", ".rodata.edgepack", ".note.GNU-stack"], names
        sizes, blobs = sections[0][1], sections[1][1]
        for sym, rel in BLOBS:
            assert f"{sym}_size:" in sizes and f"{word} {sym}_end - {sym}" in sizes
            assert f'.incbin "{rel}"' in blobs
        # no size among the blobs: only the data, its end label and the NUL after it
        assert not [line for line in blobs if line.startswith((".quad", ".long"))], blobs
        assert blobs.count(".byte 0") == len(BLOBS)
        if bits == 32:  # sizes are read as uint64_t: a zero high word after each
            assert sizes.count(".long 0") == len(BLOBS)
