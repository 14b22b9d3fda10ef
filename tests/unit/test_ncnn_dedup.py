"""edgepack/backends/ncnn/dedup.py: repeated weights stored once, the stream replayed exactly.
(The C reader that replays it is exercised by tests/test_ncnn_shared_weights.py's artifacts.)"""
from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from edgepack.backends.ncnn import dedup


def _stream(rng, weight, repeats, gap_words):
    """pnnx-like: a flag word, then the weight, repeated at varying 4-byte offsets between other data."""
    parts = []
    for i in range(repeats):
        parts.append(rng.standard_normal(gap_words + 3 * i).astype(np.float32).tobytes())
        parts.append(b"\0\0\0\0" + weight)
    return b"".join(parts)


def test_a_weight_written_five_times_is_stored_about_once():
    rng = np.random.default_rng(1)
    weight = rng.standard_normal(256 * 1024).astype(np.float32).tobytes()  # 1 MiB
    data = _stream(rng, weight, 5, 3000)
    stored, rows = dedup.dedupe_bytes(data)
    assert dedup.replay(stored, rows) == data
    # one copy plus the unique gaps and, per repeat, at most the two chunks cut across its edges
    assert len(stored) < len(weight) + 5 * (3000 * 4 + 2 * 80 * 1024)
    assert len(rows) < 40


def test_one_changed_element_is_not_merged_away():
    rng = np.random.default_rng(2)
    w = rng.standard_normal(256 * 1024).astype(np.float32)
    other = w.copy()
    other[100_000] += 0.5
    data = b"".join([b"\0" * 4, w.tobytes(), b"\0" * 4, other.tobytes(), b"\0" * 4, w.tobytes()])
    stored, rows = dedup.dedupe_bytes(data)
    assert dedup.replay(stored, rows) == data
    assert len(stored) < len(w.tobytes()) + 200 * 1024  # the changed element's chunk, not the whole copy


def test_unique_data_and_runs_of_zeros():
    rng = np.random.default_rng(3)
    unique = rng.integers(0, 2 ** 32, 200_000, dtype=np.uint32).tobytes() + b"\x01\x02\x03"  # a ragged tail
    stored, rows = dedup.dedupe_bytes(unique)
    assert stored == unique and rows == [(len(unique), 0)]
    zeros = bytes(3 << 20)
    stored, rows = dedup.dedupe_bytes(zeros)
    assert dedup.replay(stored, rows) == zeros
    # a run of equal words cuts no chunk: stored whole, which is still correct
    assert all(b - a >= 4 * dedup.MIN_CHUNK_WORDS for a, b in zip(dedup.chunk_bounds(unique),
                                                                    dedup.chunk_bounds(unique)[1:-1]))
    assert dedup.dedupe_bytes(b"") == (b"", [])


def test_chunk_cuts_follow_content_not_offset():
    rng = np.random.default_rng(4)
    body = rng.standard_normal(200_000).astype(np.float32).tobytes()
    a = dedup.chunk_bounds(body)
    b = dedup.chunk_bounds(b"\x07" * 44 + body)
    assert len(a) > 5
    assert set(x + 44 for x in a[1:-1]) == set(b[1:-1])


def test_map_encoding_and_cache(tmp_path):
    rng = np.random.default_rng(5)
    weight = rng.standard_normal(64 * 1024).astype(np.float32).tobytes()
    data = b"".join([b"\0" * 4 + weight] * 4)
    binf = tmp_path / "model.ncnn.bin"
    binf.write_bytes(data)
    d = dedup.deduped(binf)
    assert d is not None and d.logical_bytes == len(data) and d.stored_bytes < len(data) // 3
    raw = d.segment_map.read_bytes()
    assert raw[:8] == dedup.MAGIC
    logical, n = struct.unpack("<QQ", raw[8:24])
    rows = [struct.unpack("<QQ", raw[24 + 16 * i:40 + 16 * i]) for i in range(n)]
    assert logical == len(data) and len(raw) == 24 + 16 * n == 24 + 16 * d.rows
    assert dedup.replay(d.weights.read_bytes(), rows) == data
    assert dedup.deduped(binf) == d  # cached beside the .bin
    small = tmp_path / "small" / "model.ncnn.bin"
    small.parent.mkdir()
    small.write_bytes(rng.standard_normal(1000).astype(np.float32).tobytes() * 2)
    assert dedup.deduped(small) is None  # saves under MIN_SAVING: the plain .bin


def test_targets_deduping_one_conversion_at_once_agree(tmp_path):
    # `build --target x86_64,arm64` builds targets in threads, and two of them can share a conversion:
    # a temporary file named from the pid alone was moved away under the other thread (the build failed)
    rng = np.random.default_rng(6)
    for name, data in (("saves", b"".join([b"\0" * 4 + rng.standard_normal(64 * 1024).astype(np.float32).tobytes()] * 3)),
                       ("small", rng.standard_normal(5000).astype(np.float32).tobytes())):
        binf = tmp_path / name / "model.ncnn.bin"
        binf.parent.mkdir()
        binf.write_bytes(data)
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda _: dedup.deduped(binf), range(8)))
        assert all(g == got[0] for g in got)
        assert (got[0] is None) == (name == "small")
        assert not list(binf.parent.glob(".*.tmp"))
