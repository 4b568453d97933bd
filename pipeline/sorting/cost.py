"""What a request costs an engine, before it runs, for every cache mode and canvas.

One account of the work (`work`): per block cycle, the query cells the engine forwards,
the (query, key) pairs its attention scores and the K/V columns it writes or reads,
exactly as the engine's cache mode and canvas run them. Two views of it:
`CostModel` (seconds = a per cycle + b per cell: the ordering's default, a = 0, b = 1
counts cells) and `Roofline` (FLOPs and K/V bytes of the model on a device: seconds =
max(compute, memory)). Weight traffic is left out of both: a batch shares it, so it does
not tell requests apart.

Honesty about estimates: how many blocks a request really needs (EOS can come early)
is unknown before generation, so every estimate charges the budget ceil(g / L) blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import numpy as np

from engine.modes import MODES, cache_mode

from .model import DeviceProfile, ModelProfile

CACHE_MODES = tuple(MODES)


@dataclass(frozen=True)
class Work:
    """A request's work over its life: query cells, attention pairs, K/V columns moved."""

    cells: np.ndarray
    pairs: np.ndarray
    kv_columns: np.ndarray


def blocks(max_new_tokens: np.ndarray, block_length: int) -> np.ndarray:
    """Blocks charged per request: the budget ceil(g / L), at least 1."""
    return np.maximum(np.ceil(np.asarray(max_new_tokens, dtype=np.float64) / block_length), 1.0)


def work(prompt_len: np.ndarray, num_blocks: np.ndarray, block_length: int, steps_per_block: int,
         cache: str = "refresh", full_canvas: bool = False) -> Work:
    """Sum over each request's block cycles b = 0..K-1 of what the engine forwards.

    Block canvas: the row is w = p + (b+1) L wide. `none` runs the row at every step;
    `refresh` (and `dual`, which has no suffix to cache here) runs it at the block's
    first step and the L block columns against the cached row at the other S-1;
    `persistent` computes the prompt once, S steps of the L block columns, and commits
    each finished block but the last (L columns). Full canvas: the row is w = p + K L
    from the start; `none` runs w per step; `refresh` (and `persistent`) w at a block's
    first step, then the block and the masked suffix behind it, (K-b) L columns;
    `dual` w and then the block alone. Every step's queries attend the whole row, and
    touch its w cached columns plus the ones they write.
    """
    mode = cache_mode(cache)  # the engine's own rules (engine.modes)
    if block_length < 1 or steps_per_block < 1:
        raise ValueError("block_length and steps_per_block must be >= 1")
    p = np.asarray(prompt_len, dtype=np.float64)
    K = np.asarray(num_blocks, dtype=np.float64) + np.zeros_like(p)
    L, S = float(block_length), float(steps_per_block)
    shape = (p, K, L, S, mode, full_canvas)
    cells, pairs, kv = np.zeros_like(p), np.zeros_like(p), np.zeros_like(p)
    if mode.keeps_prefix and not full_canvas:
        cells += p
        pairs += p * p
        kv += p
    # Closed form, never a loop over a request's blocks (a budget of 10^9 tokens is 3 x 10^7
    # of them): the first and last cycles as they run, the ones between summed from the
    # polynomial (degree <= 2 in b) they follow there, by Newton's forward differences.
    n = np.maximum(K - 2, 0.0)
    f1, f2, f3 = (np.stack(_cycle(*shape, np.full_like(p, b), middle=True)) for b in (1.0, 2.0, 3.0))
    middle = n * f1 + n * (n - 1) / 2 * (f2 - f1) + n * (n - 1) * (n - 2) / 6 * (f3 - 2 * f2 + f1)
    first = np.stack(_cycle(*shape, np.zeros_like(p))) * (K >= 1)
    last = np.stack(_cycle(*shape, np.maximum(K - 1, 0.0))) * (K >= 2)
    total = first + middle + last
    return Work(cells=cells + total[0], pairs=pairs + total[1], kv_columns=kv + total[2])


def _cycle(p, K, L, S, mode, full_canvas, b, middle=False):
    """(cells, pairs, K/V columns) of block cycle b (arrays). `middle`: the form of the
    cycles strictly between the first and the last one, a polynomial in b (a commit
    follows every such block, and its queries are fewer than the row's columns)."""
    w = p + K * L if full_canvas else p + (b + 1) * L
    q_rest = mode.later_step_columns(L, (K - b - 1) * L if full_canvas else 0.0, w)
    q_first, commit = w, 0.0  # a block's first step computes the row whole
    if mode.keeps_prefix and not full_canvas:  # only the block, and the finished block is committed
        q_first, commit = L, L if middle else L * (b + 1 < K)
    cols = (lambda q, width: np.where(q == 0, 0.0, np.where(np.asarray(q) == width, width, width + q))) if middle \
        else _columns
    q = q_first + (S - 1) * q_rest + commit
    return np.broadcast_arrays(q, w * q, cols(q_first, w) + (S - 1) * cols(q_rest, w) + cols(commit, w))


def _columns(queries, width):
    """K/V columns one forward of `queries` columns on a row of `width` moves: the row's
    own when it runs whole, else the cached row read plus the queries' written; none
    when nothing runs."""
    q = np.asarray(queries, dtype=np.float64)
    return np.where(q <= 0, 0.0, np.where(q < width, width + q, width))


@dataclass(frozen=True)
class CostModel:
    """Seconds per request from cycle constants: `a / concurrency` per block cycle (a
    cycle's fixed overhead, shared by the requests in it) plus `b` per forwarded cell.
    With a = 0, b = 1 it counts cells: the ordering's model-free default."""

    a: float
    b: float
    block_length: int
    concurrency: float = 1.0
    steps_per_block: int = 1
    cache: str = "refresh"
    full_canvas: bool = False

    def cells(self, prompt_len: np.ndarray, num_blocks: np.ndarray) -> np.ndarray:
        """Query cells forwarded over a request's life (vectorised)."""
        return work(prompt_len, num_blocks, self.block_length, self.steps_per_block, self.cache,
                    self.full_canvas).cells

    def times(self, prompt_len: np.ndarray, max_new_tokens: np.ndarray) -> np.ndarray:
        """Estimated engine seconds per request (vectorised)."""
        K = blocks(max_new_tokens, self.block_length)
        return K * self.a / max(self.concurrency, 1e-12) + self.b * self.cells(prompt_len, K)


@dataclass(frozen=True)
class Roofline:
    """Per-request FLOPs and K/V bytes of the model on a device, for the engine's cache
    mode and canvas. `density` = compute time / memory time (> 1: compute-bound)."""

    model: ModelProfile
    device: DeviceProfile
    block_length: int
    steps_per_block: int
    cache: str = "refresh"
    full_canvas: bool = False

    def estimate(self, prompt_len: np.ndarray, max_new_tokens: np.ndarray) -> Dict[str, np.ndarray]:
        """Vectorised: blocks, cells, flops, kv_bytes, compute_s, memory_s, density, time_s."""
        K = blocks(max_new_tokens, self.block_length)
        w = work(prompt_len, K, self.block_length, self.steps_per_block, self.cache, self.full_canvas)
        m = self.model
        flops = (m.linear_flops_per_token() * w.cells + m.attention_flops_per_pair() * w.pairs
                 + m.head_flops_per_token() * K * self.steps_per_block * self.block_length)
        kv_bytes = m.kv_bytes_per_token() * w.kv_columns
        compute_s, memory_s = flops / self.device.peak_flops, kv_bytes / self.device.mem_bandwidth
        return {"blocks": K, "cells": w.cells, "flops": flops, "kv_bytes": kv_bytes, "compute_s": compute_s,
                "memory_s": memory_s, "density": compute_s / memory_s, "time_s": np.maximum(compute_s, memory_s)}

    def times(self, prompt_len: np.ndarray, max_new_tokens: np.ndarray) -> np.ndarray:
        """Roofline seconds per request: max(compute, memory)."""
        return self.estimate(prompt_len, max_new_tokens)["time_s"]
