"""A constraint compiled for one tokenizer and one row's stop ids: outlines-core's
token-level index (regex -> DFA over the vocabulary's tokens) as sparse tensors the
per-step dynamic program reads.

States are the index's, renumbered 0..n-1, plus END = n: the language has ended and only
stop ids follow (from every final state, any of the row's stop ids goes to END, and END
stays there on a stop id). Tokens with the same transitions everywhere share a class
(byte-level BPE vocabularies collapse to a few hundred classes under a JSON schema), and
the transitions are kept as they are, (state, class) -> state sorted by state * C + class:
memory in proportion to the transitions, never states x states or states x classes.
`free[k]`: the states from which some k more tokens reach an accepting state (a final one
or END), so the canvas past what a step decodes is never asked for more than it holds.

Compiling is bounded (EngineConfig's structured_* fields): the constraint's text and its
regex are capped in characters, the regex's DFA is counted up to the state cap before
outlines-core sees it (`regular.count_states`), and outlines-core builds its index in a
child process with a time limit and a memory cap (`worker`). A constraint over a cap is
its row's error naming the cap."""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, List, Sequence, Tuple, Union

import numpy as np
import torch

from .params import Constraint
from .regular import OverCap, count_states
from .vocabulary import token_bytes
from .worker import CompileFailed, IndexOverCap, new_key, worker

CACHE_SIZE = 64  # compiled constraints (and refusals) kept per engine (LRU)


class ConstraintRefused(ValueError):
    """Why a row's constraint is not compiled: over a cap, or not a language the DFA expresses."""


@dataclass
class Automaton:
    constraint: Constraint
    init: int
    n_states: int
    n_classes: int
    keys: torch.Tensor  # [E] state * n_classes + class of every transition, sorted
    dst: torch.Tensor  # [E] its next state
    cls: torch.Tensor  # [V] class of each token id (a class with no transition: never allowed)
    accept: torch.Tensor  # [Q] bool: the answer may end here
    pair_src: torch.Tensor  # [P] the distinct (q, q') some token goes between
    pair_dst: torch.Tensor
    compile_s: float = 0.0
    _free: List[torch.Tensor] = field(default_factory=list)

    def free(self, k: int) -> torch.Tensor:
        """[Q] bool: states from which exactly k more tokens (stop ids after the end
        included) reach an accepting state."""
        if not self._free:
            self._free.append(self.accept.clone())
        while len(self._free) <= k:
            nxt = torch.zeros(self.n_states).index_add_(0, self.pair_src, self._free[-1][self.pair_dst].float())
            self._free.append(nxt > 0)
        return self._free[k]

    def advance(self, states: Sequence[int], tokens: Sequence[int]) -> List[int]:
        """The states after `tokens` from `states` (a committed stretch)."""
        cur = set(states)
        keys, dst, cls = self.keys.numpy(), self.dst.numpy(), self.cls
        for t in tokens:
            c = int(cls[t]) if 0 <= t < len(cls) else -1
            if c < 0:
                return []
            want = np.array(sorted(cur), dtype=np.int64) * self.n_classes + c
            at = np.searchsorted(keys, want).clip(max=max(len(keys) - 1, 0))
            hit = keys[at] == want if len(keys) else np.zeros(len(want), dtype=bool)
            cur = set(dst[at[hit]].tolist())
            if not cur:
                break
        return sorted(cur)


def checked_regex(constraint: Constraint, config: Any) -> str:
    """The constraint's regex once it is within the text and state caps; a
    ConstraintRefused naming the cap (and how to raise it) otherwise. Costs at most the
    cap's work, whatever the constraint."""
    cap = config.structured_max_chars
    how = "raise it with --structured-max-chars or EngineConfig(structured_max_chars=...)"
    if len(constraint.spec) > cap:
        raise ConstraintRefused(f"its {constraint.kind} is {len(constraint.spec):,} characters, over the cap "
                                f"(structured_max_chars={cap:,}; {how})")
    try:
        regex = constraint.regex()
    except (ValueError, TypeError) as e:  # outlines-core's refusal of a schema
        raise ConstraintRefused(f"cannot be compiled: {str(e)[:300]}") from None
    if len(regex) > cap:
        raise ConstraintRefused(f"its regex is {len(regex):,} characters, over the cap "
                                f"(structured_max_chars={cap:,}; {how})")
    try:
        count_states(regex, config.structured_max_states)
    except OverCap as e:
        raise ConstraintRefused(over_states(str(e), config)) from None
    except ValueError as e:  # a construct no DFA expresses (a schema's pattern among them)
        raise ConstraintRefused(str(e)) from None
    return regex


def over_states(detail: str, config: Any) -> str:
    cap = config.structured_max_states
    return (f"too large to compile: {detail} (the cap: structured_max_states={cap:,}; raise it with "
            f"--structured-max-states or EngineConfig(structured_max_states=...))")


def automaton_from(constraint: Constraint, index: Tuple[int, List[int], List[int], List[int], List[int]],
                   vocab_size: int, stop_ids: Sequence[int]) -> Automaton:
    """The Automaton of outlines-core's index (initial state, finals, transitions as flat
    lists src, token, dst over the vocabulary whose eos id is `vocab_size`: outside the
    model's ids, its transitions dropped) for a row ending on `stop_ids`."""
    initial, finals, src0, tok0, dst0 = index
    states = np.unique(np.asarray(list(src0) + list(finals) + [initial], dtype=np.int64))
    end = len(states)
    Q = end + 1
    src_a = np.searchsorted(states, np.asarray(src0, dtype=np.int64))
    dst_a = np.searchsorted(states, np.asarray(dst0, dtype=np.int64))
    tok_a = np.asarray(tok0, dtype=np.int64)
    keep = tok_a < vocab_size
    src_a, tok_a, dst_a = src_a[keep], tok_a[keep], dst_a[keep]
    stops = np.asarray(sorted({int(t) for t in stop_ids if 0 <= int(t) < vocab_size}), dtype=np.int64)
    acc = np.append(np.searchsorted(states, np.asarray(finals, dtype=np.int64)), end)
    src_a = np.concatenate([src_a, np.repeat(acc, len(stops))])
    tok_a = np.concatenate([tok_a, np.tile(stops, len(acc))])
    dst_a = np.concatenate([dst_a, np.full(len(acc) * len(stops), end)])
    # token classes: tokens whose (state -> next) pairs are all equal; two 64-bit hashes per token
    rng = np.random.default_rng(0)
    h = np.zeros((2, vocab_size), dtype=np.uint64)
    for j in range(2):
        a, b = rng.integers(1, 2**62, size=Q, dtype=np.uint64), rng.integers(1, 2**62, size=Q + 1, dtype=np.uint64)
        with np.errstate(over="ignore"):
            np.add.at(h[j], tok_a, a[src_a] * b[dst_a] + a[src_a])
    _, cls = np.unique(h.T, axis=0, return_inverse=True)
    cls = cls.reshape(-1)
    C = int(cls.max()) + 1
    keys, first = np.unique(src_a * C + cls[tok_a], return_index=True)  # one next state per (state, class)
    pairs = np.unique(src_a * Q + dst_a)
    accept = np.zeros(Q, dtype=bool)
    accept[acc] = True
    t = torch.from_numpy
    return Automaton(constraint=constraint, init=int(np.searchsorted(states, initial)), n_states=Q, n_classes=C,
                     keys=t(keys), dst=t(dst_a[first]), cls=t(cls.astype(np.int64)), accept=t(accept),
                     pair_src=t(pairs // Q), pair_dst=t(pairs % Q))


class Compiler:
    """Compiles constraints for one engine's tokenizer within the engine's caps
    (`config`: EngineConfig), each (constraint, stop ids) once, keeping the last
    CACHE_SIZE results, refusals included (LRU)."""

    def __init__(self, tokenizer: Any, vocab_size: int, config: Any, cache_size: int = CACHE_SIZE):
        self.tokenizer, self.vocab_size, self.config, self.cache_size = tokenizer, vocab_size, config, cache_size
        self._vocabulary = None
        self._key = new_key()  # the vocabulary's name in the compiler process
        self._cache: "OrderedDict[Tuple[Constraint, Tuple[int, ...]], Union[Automaton, ConstraintRefused]]" = \
            OrderedDict()
        self._lock = threading.Lock()
        self.compiles = 0

    def vocabulary(self) -> Tuple[int, dict]:
        """outlines-core's Vocabulary arguments: (eos id, {token bytes: ids})."""
        if self._vocabulary is None:
            tb = {b: [i for i in ids if i < self.vocab_size] for b, ids in token_bytes(self.tokenizer).items()}
            self._vocabulary = (self.vocab_size, {b: ids for b, ids in tb.items() if ids})
        return self._vocabulary

    def compile(self, constraint: Constraint, stop_ids: Sequence[int]) -> Automaton:
        """The constraint's Automaton; a ConstraintRefused saying why not."""
        t0 = time.perf_counter()
        regex = checked_regex(constraint, self.config)
        try:
            index = worker().build(self._key, self.vocabulary(), regex, self.config.structured_max_states,
                                   self.config.structured_compile_timeout_s)
        except IndexOverCap as e:
            raise ConstraintRefused(over_states(str(e), self.config)) from None
        except TimeoutError as e:
            raise ConstraintRefused(f"{e}, the limit (structured_compile_timeout_s; raise it with "
                                    f"--structured-compile-timeout-s or EngineConfig(structured_compile_timeout_s=...)"
                                    f")") from None
        except CompileFailed as e:
            raise ConstraintRefused(f"cannot be compiled: {str(e)[:300]}") from None
        a = automaton_from(constraint, index, self.vocab_size, stop_ids)
        a.compile_s = time.perf_counter() - t0  # wall: outlines-core's index is built in the child
        return a

    def get(self, constraint: Constraint, stop_ids: Sequence[int]) -> Automaton:
        key = (constraint, tuple(sorted(set(int(t) for t in stop_ids))))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            try:
                hit = self.compile(constraint, key[1])
            except ConstraintRefused as e:
                hit = e
            with self._lock:
                self.compiles += 1
                self._cache[key] = hit
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        if isinstance(hit, ConstraintRefused):
            raise hit
        return hit
