"""The cache modes as objects: one table of what each mode computes, stores and keeps,
read by the runner (which columns a step computes and stores), the batch layout (what
a block start forgets), the token budget (how many K/V copies it plans) and the
sorter's cost model (the cells a request will cost). No torch, no Ray: the data side
imports it.

Per step, a row computes the columns whose K/V are not final and stores those it
computed; what differs between modes is what "final" means:

| mode       | K/V kept | a block start         | a later step computes (block / full canvas) |
|------------|----------|-----------------------|---------------------------------------------|
| none       | no       | -                     | the whole row / the whole row               |
| refresh    | yes      | recomputes the row    | the block / the block and the masked suffix |
| dual       | yes      | recomputes the row    | the block / the block (suffix cached)       |
| persistent | yes      | keeps the cached prefix | the block / the block and the masked suffix |

Under the block canvas there is no suffix, so dual is refresh there."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict


@dataclass(frozen=True)
class CacheMode:
    name: str
    caches: bool  # K/V live in slots between steps (the budget plans one copy)
    keeps_prefix: bool  # a block start keeps the cached prefix (persistent; exact for block-causal models)
    caches_suffix: bool  # after a block's first step, a step forwards the block's columns only (dual)

    @property
    def kv_copies(self) -> int:
        """K/V buffers the token budget plans (engine.budget)."""
        return int(self.caches)

    def recomputes_at_block_start(self) -> bool:
        """Whether a block start forgets the row's cache (the row is computed whole again)."""
        return self.caches and not self.keeps_prefix

    def later_step_columns(self, block: float, suffix: float, row: float):
        """Query columns of a step after the block's first one: `block` (L, plus Dream's
        column before it), `suffix` (the full canvas's masked later blocks: 0 under the
        block canvas), `row` (the row's width). Works on numbers and arrays alike."""
        if not self.caches:
            return row
        return block if self.caches_suffix else block + suffix


MODES: Dict[str, CacheMode] = {m.name: m for m in (
    CacheMode("none", caches=False, keeps_prefix=False, caches_suffix=False),
    CacheMode("refresh", caches=True, keeps_prefix=False, caches_suffix=False),
    CacheMode("dual", caches=True, keeps_prefix=False, caches_suffix=True),
    CacheMode("persistent", caches=True, keeps_prefix=True, caches_suffix=False),
)}


def cache_mode(name) -> CacheMode:
    """The mode named `name` (a CacheMode passes through); a ValueError naming the choices otherwise."""
    if isinstance(name, CacheMode):
        return name
    if name not in MODES:
        raise ValueError(f"cache must be one of {', '.join(map(repr, MODES))}, got {name!r}")
    return MODES[name]
