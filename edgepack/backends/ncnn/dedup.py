"""Store each repeated stretch of an ncnn .bin once, with a map the C runtime reads it back through.

pnnx writes a weight once per layer that uses it: an unrolled recurrence (ddddocr_old_int8: one
InnerProduct per step) holds the same matrix dozens of times, 102 MB of fp16 weights that hold 27 MB
of content. The artifact embeds the stored bytes plus a segment map, and the ncnn engine's weight
reader (runtimes/ncnn/ep_engine_ncnn.c) replays the original byte stream from it, so ncnn loads
exactly the bytes pnnx wrote.

Repeats are found by content-defined chunking: a chunk ends before a word whose hash has its top
CHUNK_BITS bits zero (and which differs from the word before it, so a run of zeros gives one
boundary, not one per word). Boundaries depend only on nearby content, so a weight written again at
another offset is cut into the same chunks, whatever came before it. A chunk seen before (digest,
then bytes compared) becomes a reference to the first copy.

Map format (little-endian): b"EPWMAP1\\0", u64 logical size, u64 row count, then per row u64 length,
u64 offset into the stored bytes; rows in stream order, lengths summing to the logical size."""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VERSION = 1
MAGIC = b"EPWMAP1\0"
CHUNK_BITS = 12        # a boundary every ~4096 words (16 KiB) on average
MIN_CHUNK_WORDS = 1024  # 4 KiB: a shorter chunk costs a map row for little
MIN_SAVING = 64 << 10   # below this an artifact keeps the plain .bin (no map)


@dataclass(frozen=True)
class DedupedWeights:
    weights: Path           # the stored bytes
    segment_map: Path       # rows replaying the original stream from them
    logical_bytes: int
    stored_bytes: int
    rows: int

    def manifest(self) -> dict:
        return {"logical_bytes": self.logical_bytes, "stored_bytes": self.stored_bytes, "rows": self.rows,
                "version": VERSION}


def _mix(words: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finaliser: every input bit moves the top bits."""
    m = np.uint64(0xFFFFFFFF)
    x = words.astype(np.uint64)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x85EBCA6B)) & m
    x ^= x >> np.uint64(13)
    x = (x * np.uint64(0xC2B2AE35)) & m
    x ^= x >> np.uint64(16)
    return x


def chunk_bounds(data: bytes | memoryview) -> list[int]:
    """Byte offsets [0, ..., len(data)] cutting ``data`` into content-defined chunks."""
    n = len(data) // 4
    bounds = [0]
    if n:
        words = np.frombuffer(data, np.uint32, count=n)
        hit = (_mix(words) >> np.uint64(32 - CHUNK_BITS)) == 0
        hit[0] = False
        hit[1:] &= words[1:] != words[:-1]
        last = 0
        for w in np.flatnonzero(hit).tolist():
            if w - last >= MIN_CHUNK_WORDS and n - w >= MIN_CHUNK_WORDS:
                bounds.append(w * 4)
                last = w
    if len(data):
        bounds.append(len(data))
    return bounds


def dedupe_bytes(data: bytes) -> tuple[bytes, list[tuple[int, int]]]:
    """(stored bytes, rows of (length, offset into them)) that replay ``data`` in order."""
    view = memoryview(data)
    stored = bytearray()
    first: dict[bytes, int] = {}
    rows: list[list[int]] = []
    bounds = chunk_bounds(view)
    for a, b in zip(bounds, bounds[1:]):
        piece = view[a:b]
        digest = hashlib.blake2b(piece, digest_size=16).digest()
        off = first.get(digest)
        if off is None or stored[off:off + (b - a)] != piece:
            off = len(stored)
            stored += piece
            first.setdefault(digest, off)
        if rows and rows[-1][0] + rows[-1][1] == off:  # continues the row before: one longer row
            rows[-1][0] += b - a
        else:
            rows.append([b - a, off])
    return bytes(stored), [(n, o) for n, o in rows]


def replay(stored: bytes, rows: list[tuple[int, int]]) -> bytes:
    """The original stream back from ``dedupe_bytes``'s output (what the C reader does)."""
    return b"".join(stored[o:o + n] for n, o in rows)


def encode_map(logical: int, rows: list[tuple[int, int]]) -> bytes:
    return MAGIC + struct.pack("<QQ", logical, len(rows)) + b"".join(struct.pack("<QQ", n, o) for n, o in rows)


def _write_atomically(path: Path, data: bytes) -> None:
    # a temporary name of its own: two targets of one build (threads of one process) can dedupe the
    # same conversion at once, and a name made from the pid alone was moved away under the other
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def deduped(bin_path: Path) -> DedupedWeights | None:
    """The deduplicated form of a converted .bin, cached beside it; None when it saves under
    MIN_SAVING (the artifact then embeds the .bin as it is). The files depend only on the .bin's bytes,
    so two builds racing here write the same files."""
    stem = bin_path.with_name(f"weights-v{VERSION}")
    meta_path = stem.with_suffix(".json")
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
    else:
        data = bin_path.read_bytes()
        stored, rows = dedupe_bytes(data)
        meta = {"logical_bytes": len(data), "stored_bytes": len(stored), "rows": len(rows)}
        if len(data) - len(stored) >= MIN_SAVING:
            _write_atomically(stem.with_suffix(".bin"), stored)
            _write_atomically(stem.with_suffix(".map"), encode_map(len(data), rows))
        _write_atomically(meta_path, json.dumps(meta).encode())
    if meta["logical_bytes"] - meta["stored_bytes"] < MIN_SAVING:
        return None
    return DedupedWeights(stem.with_suffix(".bin"), stem.with_suffix(".map"), **meta)
