"""The buffers one ranged read of inner chunks fills (``reader_v2._chunk_parts``): every
asked-for byte lands in its piece's destination, every chunk's payload and checksum are
where the checks look, whatever the pieces' alignment."""

from __future__ import annotations

import random

import pytest

from zerostate.store.reader_v2 import _chunk_parts, _Piece
from zerostate.store.rows import CHECKSUM_NBYTES


def _file(first: int, last: int, size: int) -> tuple[bytes, bytes]:
    """Stored chunks ``first..last`` (payload then 4 checksum bytes each) and the logical
    bytes of the row from chunk ``first`` on."""
    rng = random.Random(first * 7919 + last)
    logical = bytes(rng.randrange(256) for _ in range((last - first + 1) * size))
    stored = b"".join(
        logical[k * size : (k + 1) * size] + (1000 + first + k).to_bytes(4, "little")
        for k in range(last - first + 1)
    )
    return stored, logical


def _pieces(rng: random.Random, first: int, last: int, size: int) -> list[tuple[int, int]]:
    """Sorted, disjoint byte ranges within chunks ``first..last``, the first in chunk
    ``first``, with gaps of less than a chunk (as ``_runs`` makes them)."""
    lo_bound, hi_bound = first * size, (last + 1) * size
    out, pos = [], lo_bound + rng.randrange(size)
    while pos < hi_bound:
        end = min(hi_bound, pos + rng.choice([1, 3, size - 1, size, size + 5, 4 * size]))
        if rng.random() < 0.2:
            end = min(hi_bound, (pos // size + rng.randrange(1, 4)) * size)  # chunk aligned
        out.append((pos, end))
        pos = end + rng.choice([0, 0, 1, size // 2, size - 1])
    return out


@pytest.mark.parametrize("seed", range(40))
def test_every_byte_lands_where_it_belongs(seed):
    rng = random.Random(seed)
    size = rng.choice([8, 16, 64])
    first = rng.randrange(5)
    spans = _pieces(rng, first, first + rng.randrange(12), size)
    last = (spans[-1][1] - 1) // size  # as _read_run takes it
    stored, logical = _file(first, last, size)
    dests = [memoryview(bytearray(hi - lo)) for lo, hi in spans]
    run = [
        _Piece(lo, hi, d, f"t{i}") for i, ((lo, hi), d) in enumerate(zip(spans, dests, strict=True))
    ]
    parts, payloads, crcs = _chunk_parts(run, first, last, size)
    assert sum(p.nbytes for p in parts) == len(stored)
    pos = 0
    for p in parts:  # what one preadv does
        p[:] = stored[pos : pos + p.nbytes]
        pos += p.nbytes
    base = first * size
    for (lo, hi), d in zip(spans, dests, strict=True):
        assert bytes(d) == logical[lo - base : hi - base]
    assert len(payloads) == last - first + 1
    for k, payload in enumerate(payloads):
        segments = [payload] if isinstance(payload, memoryview) else list(payload)
        assert b"".join(bytes(s) for s in segments) == logical[k * size : (k + 1) * size]
        crc = crcs[k * CHECKSUM_NBYTES : (k + 1) * CHECKSUM_NBYTES]
        assert int.from_bytes(crc, "little") == 1000 + first + k
