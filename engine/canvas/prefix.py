"""Prefix caching for DiffusionGemma's commit (encoder) pass: the K/V of complete prompt
blocks, keyed by the chain of their tokens (a block's key is its parent's key plus its
own tokens, so a key names the whole prefix up to the block's end: no hash collision can
hand a row another prompt's K/V), reference-counted by the active rows whose prompts hold
them, evicted least recently used, leaves before their parents.

Why it is exact: the encoder is causal, so the K/V at positions < p depend only on the
tokens < p; a row whose leading blocks are cached copies their K/V into its slot and
encodes the rest of its prompt after them, attending them as transformers' own prefill
attends them (the float64 tests check the tokens against transformers' `generate`)."""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch


@dataclass(eq=False)
class Block:
    key: Any
    parent: Optional["Block"]
    kv: List[Tuple[torch.Tensor, torch.Tensor]]  # per layer (H, block, D) keys and values
    refs: int = 0  # active rows whose prompts hold it
    children: int = 0  # cached blocks that extend it


@dataclass
class PrefixStats:
    """The engine stats' prefix_* counters (engine.stats.EngineStats, the masked engine's names)."""

    query_blocks: int = 0  # complete prompt blocks of the rows that joined
    hit_blocks: int = 0
    query_tokens: int = 0  # prompt tokens of the rows that joined
    hit_tokens: int = 0
    inserted_blocks: int = 0
    evictions: int = 0
    copied_bytes: int = 0  # K/V copied between the cache and the rows' slots


class PrefixCache:
    """Complete prompt blocks of `block` tokens; `tokens` of them count in the token budget."""

    def __init__(self, block: int):
        self.block = block
        self.blocks: "OrderedDict[Any, Block]" = OrderedDict()  # least recently used first
        self.stats = PrefixStats()

    @property
    def tokens(self) -> int:
        return len(self.blocks) * self.block

    def keys(self, prompt: Sequence[int]) -> List[Any]:
        """The chain keys of the prompt's complete blocks."""
        out, key, b = [], None, self.block
        for i in range(len(prompt) // b):
            key = (key, tuple(prompt[i * b:(i + 1) * b]))
            out.append(key)
        return out

    def match(self, keys: Sequence[Any]) -> List[Block]:
        """The longest cached chain of `keys` (held by the caller: `hold`)."""
        got: List[Block] = []
        for k in keys:
            blk = self.blocks.get(k)
            if blk is None:
                break
            got.append(blk)
        return got

    def count_lookup(self, prompt_len: int, hits: int) -> None:
        self.stats.query_tokens += prompt_len
        self.stats.query_blocks += prompt_len // self.block
        self.stats.hit_blocks += hits
        self.stats.hit_tokens += hits * self.block

    def hold(self, chain: Sequence[Block]) -> None:
        """A row takes `chain`; its blocks become the most recently used, parents after
        their children (so LRU evicts leaves first)."""
        for blk in chain:
            blk.refs += 1
        for blk in reversed(chain):
            self.blocks.move_to_end(blk.key)

    def release(self, chain: Sequence[Block]) -> None:
        for blk in chain:
            blk.refs -= 1

    def insert(self, key: Any, parent: Optional[Block], kv: List[Tuple[torch.Tensor, torch.Tensor]]) -> Block:
        blk = Block(key, parent, kv)
        self.blocks[key] = blk
        if parent is not None:
            parent.children += 1
        self.stats.inserted_blocks += 1
        return blk

    def evict(self, held: bool = False) -> bool:
        """Drops the least recently used leaf no row holds (any leaf with `held`): True if one went."""
        for blk in self.blocks.values():
            if blk.children == 0 and (held or blk.refs == 0):
                del self.blocks[blk.key]
                if blk.parent is not None:
                    blk.parent.children -= 1
                self.stats.evictions += 1
                return True
        return False

    def figures(self) -> Dict[str, int]:
        """The engine stats' names (the masked engine's prefix cache uses the same)."""
        s = self.stats
        return dict(prefix_query_blocks=s.query_blocks, prefix_hit_blocks=s.hit_blocks,
                    prefix_query_tokens=s.query_tokens, prefix_hit_tokens=s.hit_tokens,
                    prefix_cached_blocks=len(self.blocks), prefix_inserted_blocks=s.inserted_blocks,
                    prefix_evictions=s.evictions, prefix_copied_bytes=s.copied_bytes)


__all__ = ["Block", "PrefixCache", "PrefixStats"]
