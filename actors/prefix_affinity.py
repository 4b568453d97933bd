"""Prefix affinity (issue 40): with several engines, a batch goes to the engine that
served its prefix last, where the prefix cache (engine.prefix_cache) still holds that
prefix's K/V; otherwise, or when that engine is busier than the least loaded one by more
than `slack` batches, to the least loaded engine. Ray-free and torch-free: the run's
group actor (actors/rank.py) keeps one for every dispatcher (actors/engine_router.py),
and bench/prefix_bench.py replays batches through the same logic.

A batch's key is its first row's leading complete blocks (at most `KEY_BLOCKS` of them):
the sorter (pipeline/sorting) puts rows that share a prefix into the same batches, so
the first row's prefix is the batch's."""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Dict, Hashable, Optional, Sequence

KEY_BLOCKS = 4  # leading blocks that name a prefix (a few-shot preamble differs from another within them)
KEY_BLOCK_LENGTH = 32  # the engines' default block_length; any fixed length names prefixes alike
MAX_KEYS = 4096  # prefixes remembered, least recently routed forgotten first


def prefix_key(prompts: Sequence[Sequence[int]], block_length: int = KEY_BLOCK_LENGTH,
               blocks: int = KEY_BLOCKS) -> Optional[int]:
    """The batch's prefix key: a hash of its first prompt's leading complete blocks; None
    when it has no complete block (nothing worth routing for)."""
    for p in prompts:
        if p is None:
            continue
        n = min(blocks, len(p) // block_length) * block_length
        return hash(tuple(int(t) for t in p[:n])) if n else None
    return None


class PrefixAffinity:
    """Prefix key -> the engine that served it last (an LRU of `max_keys`)."""

    def __init__(self, slack: int = 1, max_keys: int = MAX_KEYS):
        self.slack, self.max_keys = slack, max_keys
        self.last: "OrderedDict[int, Hashable]" = OrderedDict()
        self.routed = {"affinity": 0, "least_loaded": 0}

    def choose(self, key: Optional[int], loads: Dict[Hashable, int], default: Hashable) -> Hashable:
        """The engine for a batch of prefix `key`, among `loads` (engine -> batches in flight,
        the live engines): the one that served `key` last unless it is more than `slack`
        batches busier than the least loaded, else the least loaded (`default` among equals)."""
        least = min(loads.values())
        target = self.last.get(key) if key is not None else None
        if target in loads and loads[target] <= least + self.slack:
            self.routed["affinity"] += 1
            return target
        self.routed["least_loaded"] += 1
        if default in loads and loads[default] == least:
            return default
        return min(loads, key=lambda e: loads[e])

    def record(self, key: Optional[int], engine: Any) -> None:
        """`engine` serves a batch of prefix `key`: route the next batch of that prefix there."""
        if key is None:
            return
        self.last[key] = engine
        self.last.move_to_end(key)
        while len(self.last) > self.max_keys:
            self.last.popitem(last=False)
