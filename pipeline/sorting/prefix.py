"""Prompt-prefix groups: rows whose prompts share a preamble are cheapest side by side."""
from __future__ import annotations

from typing import Sequence, Tuple

# Shared prompt prefixes are compared in pieces of PREFIX_CHUNK tokens.
PREFIX_CHUNK = 16


def prefix_key(ids: Sequence[int], chunk: int = PREFIX_CHUNK) -> Tuple[int, ...]:
    """Chained hashes of the whole `chunk`-token pieces of `ids`: two prompts share their
    first k elements iff they share their first k * chunk tokens (barring a 64-bit hash
    collision). Deterministic across processes (int tuples are not salted by PYTHONHASHSEED)."""
    out, h = [], 0
    for s in range(0, len(ids) - chunk + 1, chunk):
        h = hash((h, tuple(ids[s:s + chunk])))
        out.append(h)
    return tuple(out)
