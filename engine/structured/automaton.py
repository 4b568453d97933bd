"""A constraint compiled for one tokenizer and one row's stop ids: outlines-core's
token-level index (regex -> DFA over the vocabulary's tokens) as dense tensors the
per-step dynamic program reads.

States are the index's, renumbered 0..n-1, plus END = n: the language has ended and only
stop ids follow (from every final state, any of the row's stop ids goes to END, and END
stays there on a stop id). Tokens with the same transitions everywhere share a class,
so the table is [Q, C] with C far below the vocabulary (byte-level BPE vocabularies
collapse to a few hundred classes under a JSON schema). `free[k]`: the states from which
some k more tokens reach an accepting state (a final one or END), so the canvas past
what a step decodes is never asked for more than it holds."""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .params import Constraint
from .vocabulary import token_bytes

DEAD = -1
CACHE_SIZE = 64  # compiled constraints kept per engine (LRU)


@dataclass
class Automaton:
    constraint: Constraint
    init: int
    table: torch.Tensor  # [Q, C] next state per (state, token class), DEAD where the token is refused
    cls: torch.Tensor  # [V] class of each token id (a class with no transition: never allowed)
    accept: torch.Tensor  # [Q] bool: the answer may end here
    any_next: torch.Tensor  # [Q, Q] bool: some token goes from q to q'
    compile_s: float = 0.0
    _free: List[torch.Tensor] = field(default_factory=list)

    @property
    def n_states(self) -> int:
        return self.table.shape[0]

    def free(self, k: int) -> torch.Tensor:
        """[Q] bool: states from which exactly k more tokens (stop ids after the end
        included) reach an accepting state."""
        if not self._free:
            self._free.append(self.accept.clone())
        anyf = self.any_next.float()
        while len(self._free) <= k:
            self._free.append((anyf @ self._free[-1].float()) > 0)
        return self._free[k]

    def advance(self, states: Sequence[int], tokens: Sequence[int]) -> List[int]:
        """The states after `tokens` from `states` (a committed stretch)."""
        cur = set(states)
        table, cls = self.table, self.cls
        for t in tokens:
            c = int(cls[t]) if 0 <= t < len(cls) else -1
            cur = {int(table[q, c]) for q in cur} - {DEAD} if c >= 0 else set()
            if not cur:
                break
        return sorted(cur)


def compile_automaton(constraint: Constraint, vocabulary: Any, vocab_size: int, stop_ids: Sequence[int]) -> Automaton:
    """`constraint` over `vocabulary` (outlines_core.Vocabulary, whose eos id is
    `vocab_size`: outside the model's ids, its transitions dropped) for a row ending on
    `stop_ids`."""
    import time

    from outlines_core import Index

    t0 = time.process_time()
    index = Index(constraint.regex(), vocabulary)
    trans = index.get_transitions()
    finals = set(index.get_final_states())
    states = sorted(set(trans) | finals | {index.get_initial_state()})
    num = {s: i for i, s in enumerate(states)}
    end = len(states)
    Q = end + 1
    src, tok, dst = [], [], []
    for s, row in trans.items():
        for t, n in row.items():
            if t < vocab_size:
                src.append(num[s]), tok.append(t), dst.append(num[n])
    stops = sorted({int(t) for t in stop_ids if 0 <= int(t) < vocab_size})
    for f in sorted(num[s] for s in finals) + [end]:
        for t in stops:
            src.append(f), tok.append(t), dst.append(end)
    src_a, tok_a, dst_a = (np.asarray(x, dtype=np.int64) for x in (src, tok, dst))
    # token classes: tokens whose (state -> next) pairs are all equal; two 64-bit hashes per token
    rng = np.random.default_rng(0)
    h = np.zeros((2, vocab_size), dtype=np.uint64)
    for j in range(2):
        a, b = rng.integers(1, 2**62, size=Q, dtype=np.uint64), rng.integers(1, 2**62, size=Q + 1, dtype=np.uint64)
        with np.errstate(over="ignore"):
            np.add.at(h[j], tok_a, a[src_a] * b[dst_a] + a[src_a])
    _, cls = np.unique(h.T, axis=0, return_inverse=True)
    cls = cls.reshape(-1)
    none = cls[np.nonzero((h[0] == 0) & (h[1] == 0))[0][:1]]  # the class of tokens with no transition
    C = int(cls.max()) + 1
    table = np.full((Q, C), DEAD, dtype=np.int64)
    table[src_a, cls[tok_a]] = dst_a
    if len(none):
        table[:, none[0]] = DEAD
    any_next = np.zeros((Q, Q), dtype=bool)
    any_next[src_a, dst_a] = True
    accept = np.zeros(Q, dtype=bool)
    accept[[num[s] for s in finals] + [end]] = True
    return Automaton(constraint=constraint, init=num[index.get_initial_state()], table=torch.from_numpy(table),
                     cls=torch.from_numpy(cls.astype(np.int64)), accept=torch.from_numpy(accept),
                     any_next=torch.from_numpy(any_next), compile_s=time.process_time() - t0)


class Compiler:
    """Compiles constraints for one engine's tokenizer, each (constraint, stop ids) once,
    keeping the last CACHE_SIZE (LRU)."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache_size: int = CACHE_SIZE):
        self.tokenizer, self.vocab_size, self.cache_size = tokenizer, vocab_size, cache_size
        self._vocabulary = None
        self._cache: "OrderedDict[Tuple[Constraint, Tuple[int, ...]], Automaton]" = OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0

    def vocabulary(self) -> Any:
        if self._vocabulary is None:
            from outlines_core import Vocabulary

            tb = {b: [i for i in ids if i < self.vocab_size] for b, ids in token_bytes(self.tokenizer).items()}
            self._vocabulary = Vocabulary(self.vocab_size, {b: ids for b, ids in tb.items() if ids})
        return self._vocabulary

    def get(self, constraint: Constraint, stop_ids: Sequence[int]) -> Automaton:
        key = (constraint, tuple(sorted(set(int(t) for t in stop_ids))))
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        a = compile_automaton(constraint, self.vocabulary(), self.vocab_size, key[1])
        with self._lock:
            self.compiles += 1
            self._cache[key] = a
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return a
