"""The compiled step's shapes (EngineConfig.compile_decode): rows, query columns and key
width padded up to a small fixed ladder of sizes.

Why: a CUDA graph replays one set of input shapes, and a batch's rows and width change at
almost every layout. As vLLM pads a decode batch to one of its cudagraph capture sizes,
the step pads each size up to the next rung of a ladder, so a whole run captures one CUDA
graph per bucket it reaches (inductor compiles a graph or two for them all: engine.runner).
The padding is invisible (engine.runner.plan): padded rows attend to no key and store
nothing, padded query columns store nothing, padded keys are masked out, so tokens do not
change.

Rows: 1-4, then 4 rungs an octave (5, 6, 7, 8, 10, 12, 14, 16, 20, ...; capped at
max_batch_size; under a fifth of the rows are padding). Keys: in blocks of L on the same
ladder (1-4 blocks, 5, 6, 7, 8, 10, ... blocks). Query columns: the block step's L (+1
for shifted logits) as it is; a wider step's (the masked suffix under refresh or
persistent on the full canvas) on the keys' ladder, never wider than the keys; without a
cache the query is the whole row, as wide as the keys."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List


def ladder(n: int, per_octave: int) -> int:
    """The smallest m * 2^k >= n with per_octave <= m < 2 * per_octave (n itself up to
    per_octave, a power of two)."""
    if n <= per_octave:
        return max(n, 1)
    step = 1
    while per_octave * step * 2 < n:
        step *= 2
    return -(-n // step) * step


def rungs(limit: int, per_octave: int) -> List[int]:
    """Every ladder size up to the one that holds `limit`."""
    out, n = [], 1
    while True:
        out.append(ladder(n, per_octave))
        if out[-1] >= limit:
            return out
        n = out[-1] + 1


ROWS_PER_OCTAVE = 4
BLOCKS_PER_OCTAVE = 4
# K/V room compile_decode keeps for its buckets' padding, as a multiple of the slots' usual
# (engine.slots.SLACK x token_budget; engine.budget plans it): a batch that fills the token
# budget pads into it. A step whose bucket does not fit runs eager (EngineStats.uncompiled_steps).
ROOM = 1.25


@dataclass(frozen=True)
class Box:
    """One bucket: the padded rows, query columns and key width of a compiled step."""

    rows: int
    queries: int
    keys: int


@dataclass(frozen=True)
class ShapeBuckets:
    """The ladder of one engine: its block length L, logit shift and row cap."""

    block_length: int
    shift: int
    max_rows: int

    def rows(self, n: int) -> int:
        return min(ladder(n, ROWS_PER_OCTAVE), max(self.max_rows, n))

    def keys(self, width: int) -> int:
        L = self.block_length
        return L * ladder(-(-width // L), BLOCKS_PER_OCTAVE)

    def queries(self, T: int, keys: int, cached: bool) -> int:
        if not cached:  # the whole row: queries are the keys
            return keys
        L, s = self.block_length, self.shift
        return min(keys, s + L * ladder(-(-max(T - s, 1) // L), BLOCKS_PER_OCTAVE))

    def box(self, rows: int, T: int, width: int, cached: bool) -> Box:
        """The bucket of a forward over `rows` rows of `T` query columns and a `width`-wide box."""
        keys = self.keys(width)
        return Box(self.rows(rows), self.queries(T, keys, cached), keys)

    def count(self, max_rows: int, max_width: int, cached: bool) -> int:
        """How many buckets forwards of up to `max_rows` rows and `max_width` columns can reach."""
        keys = sorted({self.keys(k * self.block_length) for k in
                       rungs(-(-max_width // self.block_length), BLOCKS_PER_OCTAVE)})
        rows = sorted({self.rows(n) for n in rungs(max_rows, ROWS_PER_OCTAVE)})
        pairs = {(self.queries(T, k, cached), k) for k in keys for T in range(1, k + 1)}
        return len(rows) * len(pairs)
