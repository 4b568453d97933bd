"""Prefix caching (EngineConfig.enable_prefix_caching, vLLM's name): rows whose prompts
start with the same complete blocks share those blocks' K/V.

Exact where a complete prompt block's K/V depend only on the tokens up to its end:
blocks at absolute positions and block-causal attention (LLaDA2.x, SDAR, Fast-dLLM v2;
`Family.prefix_cache_refusal` says why elsewhere). There a block's K/V are a function of
the chain of block tokens from position 0, so the cache is keyed by that chain: a radix
tree of blocks, each node keyed by (its parent node, its L tokens), compared exactly
(no hash collisions to reason about).

Where the K/V live: in the engine's K/V slot storage (engine.slots), beside the batch's
view. The storage holds SLACK x token_budget cells; the batch's view takes the first
rows_cap x cols_cap of them, and a cached block is a chunk of L cells taken from the
storage's end (chunk j: cells [cells - (j+1) L, cells - j L) of every layer's K and V).
So the cache allocates nothing and the K/V peak stays the slots' (SLACK x budget, plus one
layer while rows move). Cached blocks count in the budget: the scheduler admits while
rows x box + cached cells <= token_budget, evicting unreferenced blocks, least recently
used first (leaves first: a block whose chain continues is never evicted before its
children), when it needs the room; the slots shape their view leaving the cache the
budget's unused share (`reserve`), and a new view that reaches a chunk moves it further
up (or evicts it when there is no room).

A row joining the batch takes its leading cached blocks as K/V copied into its own slot
(slots are dense rows: no paged attention to point into) and starts with them as cached
columns, so its prefill (engine.runner.windows) starts after them. A block is referenced
(pinned) from the moment the scheduler admits a row that matched it until that copy; then
the row holds its own copy and the block is free to go. After a row's forward made its
prompt blocks final, the blocks the cache lacks are copied in (when the budget has room).
Preemption needs nothing: a row readmitted is a joining row again."""
from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

if TYPE_CHECKING:  # torch-free at import (the preflight reads `refusal`)
    from .batch import Batch
    from .config import EngineConfig
    from .sequence import Request
    from .slots import KVSlots
    from .stats import EngineStats


# Rounds of leaders prefilled for joining rows that share uncached blocks (`join`): a
# round per depth at which their prompts part ways
MAX_SHARE_ROUNDS = 4


def inexact(family: Any, block_causal: bool, cfg: "EngineConfig", full_canvas: bool) -> Optional[str]:
    """Why this engine cannot cache prompt blocks exactly with these settings, or None."""
    why = family.prefix_cache_refusal(block_causal)
    if why is None and not cfg.mode.caches:
        why = "cache 'none' keeps no K/V to share: use refresh, dual or persistent"
    if why is None and full_canvas:
        why = "the full canvas is not supported with it: use canvas 'block' or 'auto'"
    return why


def refusal(family: Any, block_causal: bool, cfg: "EngineConfig", full_canvas: bool) -> Optional[str]:
    """Why enable_prefix_caching=True cannot be honoured by this engine, or None (also
    when it is auto or off)."""
    why = inexact(family, block_causal, cfg, full_canvas) if cfg.enable_prefix_caching else None
    return None if why is None else f"enable_prefix_caching: {why}"


def enabled(family: Any, block_causal: bool, cfg: "EngineConfig", full_canvas: bool) -> bool:
    """The setting resolved: auto (None) is on wherever the cache is exact."""
    if cfg.enable_prefix_caching is not None:
        return cfg.enable_prefix_caching
    return inexact(family, block_causal, cfg, full_canvas) is None


@dataclass(eq=False)
class Node:
    """One cached block: its chain key, its chunk in the slot storage, when it was last
    used, how many admitted rows reference it, how many cached blocks continue it."""

    key: Tuple[int, Tuple[int, ...]]  # (parent node's id, 0 for the root; the block's tokens)
    id: int
    chunk: int
    used: int
    refs: int = 0
    children: int = 0
    alive: bool = True


class PrefixCache:
    """The cache's tree, its chunks in the slots' storage and its counters (EngineStats)."""

    def __init__(self, slots: "KVSlots", block_length: int, token_budget: int, stats: "EngineStats"):
        self.slots, self.L, self.budget, self.stats = slots, block_length, token_budget, stats
        self.nodes: Dict[Tuple[int, Tuple[int, ...]], Node] = {}
        self.by_chunk: Dict[int, Node] = {}
        self.by_id: Dict[int, Node] = {}
        self._ids = itertools.count(1)
        self._clock = itertools.count()
        self.pins: "weakref.WeakKeyDictionary[Request, List[Node]]" = weakref.WeakKeyDictionary()
        self.inserted: "weakref.WeakKeyDictionary[Request, int]" = weakref.WeakKeyDictionary()
        slots.reserve = self.reserve
        slots.before_view = self.before_view

    # --- the budget ---------------------------------------------------------------------
    @property
    def cells(self) -> int:
        """Cells the cached blocks hold (they count in the token budget)."""
        return len(self.nodes) * self.L

    def reserve(self, area: int) -> int:
        """Cells a new view of the slots leaves the cache: the budget a batch of `area` leaves."""
        return max(0, self.budget - area)

    def _evictable(self, keep: Tuple[Node, ...] = ()) -> Optional[Node]:
        best = None
        for n in self.nodes.values():
            if n.refs == 0 and n.children == 0 and n not in keep and (best is None or n.used < best.used):
                best = n
        return best

    def _evict(self, n: Node) -> None:
        del self.nodes[n.key]
        del self.by_chunk[n.chunk]
        del self.by_id[n.id]
        n.alive = False
        parent = self._parent(n)
        if parent is not None:
            parent.children -= 1
        # its descendants can no longer be matched (their chain starts at it): evict them too
        for c in [c for c in self.nodes.values() if c.key[0] == n.id] if n.children else []:
            self._evict(c)
        self.stats.prefix_evictions += 1
        self.stats.prefix_cached_blocks = len(self.nodes)

    def _parent(self, n: Node) -> Optional[Node]:
        return self.by_id.get(n.key[0])

    def make_room(self, need: int, keep: Optional["Request"] = None) -> bool:
        """Evict unreferenced blocks, least recently used first, until `need` cells of batch
        fit beside the cache in the budget (`keep`: not the blocks that row would use)."""
        spare = tuple(self.match(keep.prompt)) if keep is not None else ()
        while self.cells + need > self.budget:
            n = self._evictable(spare)
            if n is None:
                return False
            self._evict(n)
        return True

    # --- lookups ------------------------------------------------------------------------
    def blocks(self, prompt: List[int]) -> List[Tuple[int, ...]]:
        L = self.L
        return [tuple(prompt[k * L:(k + 1) * L]) for k in range(len(prompt) // L)]

    def match(self, prompt: List[int]) -> List[Node]:
        """The cached chain of `prompt`'s leading complete blocks."""
        out, pid = [], 0
        for blk in self.blocks(prompt):
            n = self.nodes.get((pid, blk))
            if n is None:
                break
            out.append(n)
            pid = n.id
        return out

    def acquire(self, req: "Request") -> None:
        """The scheduler admitted `req`: pin the blocks it will copy."""
        nodes = self.match(req.prompt)
        for n in nodes:
            n.refs += 1
        self.pins[req] = nodes

    def release(self, req: "Request") -> List[Node]:
        nodes = self.pins.pop(req, [])
        for n in nodes:
            n.refs -= 1
        return nodes

    # --- K/V ----------------------------------------------------------------------------
    def _chunk(self, t, j: int):
        """Chunk j of flat storage `t` as [H, L, D]."""
        H, D, L = self.slots.mcfg.n_kv_heads, self.slots.mcfg.head_dim, self.L
        c0 = self.slots.cells - (j + 1) * L
        return t[c0 * H * D:(c0 + L) * H * D].view(H, L, D)

    def _free_chunk(self, floor: int) -> Optional[int]:
        """The lowest free chunk whose cells all lie at or above cell `floor`."""
        top = (self.slots.cells - floor) // self.L  # chunks 0..top-1 qualify
        return next((j for j in range(top) if j not in self.by_chunk), None)

    def _view_end(self) -> int:
        return self.slots.rows_cap * self.slots.cols_cap

    def join(self, b: "Batch", joining: List[int], refreshing: List[int], prefill: Callable[[List[int]], None]) -> None:
        """The batch was laid out: rows `joining` (new to it, in their slots) take their
        cached prompt blocks (`apply`). Joining rows that share prompt blocks nobody has
        cached yet would each compute them: one of them (the leader) is forwarded first
        (`prefill`, a catch-up forward of its row), its blocks cached, and the others
        take them from the cache; again for the blocks they still share. Rows
        `refreshing` (starting a block under refresh / dual, which recompute the row)
        take their cached prompt blocks the same way: their K/V are final, so recomputing
        them would give the same values."""
        self.apply(b, joining, pinned=True)
        self.apply(b, refreshing, count=False)
        cost = len(b.rows) * b.width
        for _ in range(MAX_SHARE_ROUNDS):
            leaders, followers = self._shared(b, joining)
            if not leaders:
                return
            prefill(leaders)
            self.insert(b, cost, rows=leaders)
            before = b.cached[followers].clone()
            self.apply(b, followers, count=False, hits=True)
            if bool((b.cached[followers] == before).all()):  # the cache had no room: they compute their own
                return

    def _shared(self, b: "Batch", rows: List[int]) -> Tuple[List[int], List[int]]:
        """(leaders, followers) among `rows`: rows whose first uncached prompt block another
        of them has too; the first of each such group leads."""
        L, cached = self.L, b.cached.tolist()
        groups: Dict[Any, List[int]] = {}
        for i in rows:
            r = b.rows[i]
            k = cached[i] // L
            if cached[i] % L or k >= len(r.prompt) // L:
                continue
            groups.setdefault((tuple(r.prompt[:k * L]), tuple(r.prompt[k * L:(k + 1) * L])), []).append(i)
        shared = [g for g in groups.values() if len(g) > 1]
        return sorted(g[0] for g in shared), sorted(i for g in shared for i in g[1:])

    def apply(self, b: "Batch", rows: List[int], pinned: bool = False, count: bool = True, hits: bool = False) -> None:
        """Copy the cached blocks of `rows` into their slots and count them as cached
        columns: the blocks pinned at admission (`pinned`: still cached ones), else the
        cached chain of their prompts. `count`: the rows' prompt blocks were looked up
        (hit rate); `hits`: count what they take as hits."""
        slots, L, C = self.slots, self.L, self.slots.cols_cap
        lens = b.lens.tolist()
        st = self.stats
        for i in rows:
            r = b.rows[i]
            nodes = self.release(r) if pinned else self.match(r.prompt)
            live = []
            for n in nodes:
                if not n.alive:
                    break
                live.append(n)
            if count:
                st.prefix_query_blocks += len(r.prompt) // L
                st.prefix_query_tokens += len(r.prompt) + len(r.lead)
            if not live or int(b.cached[i]) >= len(live) * L:
                continue
            got = len(live) - int(b.cached[i]) // L  # blocks it did not hold yet
            c0 = C - lens[i]
            for j, n in enumerate(live):
                n.used = next(self._clock)
                if j < int(b.cached[i]) // L:
                    continue
                for t, k in zip(slots.storage, slots.k + slots.v):
                    k[i, :, c0 + j * L:c0 + (j + 1) * L] = self._chunk(t, n.chunk)
            b.cached[i] = len(live) * L
            self.inserted[r] = max(self.inserted.get(r, 0), len(live))
            if count or hits:
                st.prefix_hit_blocks += got
                st.prefix_hit_tokens += got * L
            st.prefix_copied_bytes += got * L * slots.cell_bytes

    def insert(self, b: "Batch", cost: int, rows: Optional[List[int]] = None) -> None:
        """Copy into the cache the prompt blocks the batch's rows (`rows`: those) made final
        that it lacks, while the budget (`cost`: the batch's cells) leaves room: least
        recently used unreferenced blocks make room for them."""
        if b.cache is None:
            return
        slots, L, C = self.slots, self.L, self.slots.cols_cap
        cached, lens = b.cached.tolist(), b.lens.tolist()
        for i in range(len(b.rows)) if rows is None else rows:
            r = b.rows[i]
            n_blocks = len(r.prompt) // L
            if self.inserted.get(r, 0) >= n_blocks or cached[i] < L:
                continue
            chain, pid = [], 0
            for k, blk in enumerate(self.blocks(r.prompt)):
                if (k + 1) * L > cached[i]:
                    break
                n = self.nodes.get((pid, blk))
                if n is None:
                    n = self._add(pid, blk, cost, tuple(chain))
                    if n is None:
                        break
                    c0 = C - lens[i] + k * L
                    for t, kv in zip(slots.storage, slots.k + slots.v):
                        self._chunk(t, n.chunk).copy_(kv[i, :, c0:c0 + L])
                    self.stats.prefix_copied_bytes += L * slots.cell_bytes
                n.used = next(self._clock)
                chain.append(n)
                pid = n.id
                self.inserted[r] = k + 1

    def _add(self, pid: int, blk: Tuple[int, ...], cost: int, chain: Tuple[Node, ...]) -> Optional[Node]:
        """A node for a new block, its chunk taken (evicting least recently used blocks
        outside `chain` when the budget or the storage has no room), or None."""
        floor = self._view_end()
        while True:
            j = self._free_chunk(floor)
            if j is not None and self.cells + self.L + cost <= self.budget:
                break
            victim = self._evictable(chain)
            if victim is None:
                return None
            self._evict(victim)
        n = Node(key=(pid, blk), id=next(self._ids), chunk=j, used=next(self._clock))
        self.nodes[n.key] = n
        self.by_chunk[j] = n
        self.by_id[n.id] = n
        if chain:
            chain[-1].children += 1
        self.stats.prefix_inserted_blocks += 1
        self.stats.prefix_cached_blocks = len(self.nodes)
        return n

    def before_view(self, old_end: int, new_end: int, grow: bool) -> None:
        """The slots take a new view (cells [0, new_end)): chunks inside it move above both
        views (the old one still holds rows being moved), or are evicted when there is no
        room; a storage allocated anew (a batch wider than the budget) drops them all."""
        if grow:
            for n in list(self.nodes.values()):
                if n.alive:
                    self._evict(n)
            return
        floor = max(old_end, new_end)
        for n in sorted(self.by_chunk.values(), key=lambda n: -n.used):  # most recent keep their place first
            if not n.alive or self.slots.cells - (n.chunk + 1) * self.L >= new_end:
                continue
            j = self._free_chunk(floor)
            if j is None:
                self._evict(n)
                continue
            for t in self.slots.storage:
                self._chunk(t, j).copy_(self._chunk(t, n.chunk))
            del self.by_chunk[n.chunk]
            n.chunk = j
            self.by_chunk[j] = n
            self.stats.prefix_copied_bytes += self.L * self.slots.cell_bytes

    def forget(self, req: "Request") -> None:
        """A row failed before its blocks were copied: unpin them."""
        self.release(req)
