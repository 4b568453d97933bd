"""Tensor-parallel sharding of blockray's transformer: what rank r of N holds of each
parameter (`ShardPlan`, from what the family declares: Family.sharding), the modules that
run a shard (row-parallel linears that all-reduce, the vocab-parallel embedding), and
`shard_model`, which turns a DLLM built on the meta device into rank r's shard.

The rank's model has the local shape of everything it holds: its config (`model.config`)
counts the rank's query heads (H/N) and K/V heads (Hkv/N, or 1 replicated when Hkv < N),
and the MLP widths / N, so the K/V cache, the token budget and the runner size themselves
per rank without knowing about tensor parallelism. What the engine reads of the config
(vocabulary, ids, layers, blocks) is the model's. The logits are all-gathered, so every
rank holds the whole vocabulary's logits, equal to one device's, and takes the same
decisions from them (SPMD).

Randomness under tensor parallelism: the engine never draws a seed of its own when
N > 1 (a row that needs noise and has no seed is refused, engine.engine.Engine.check);
the Ray side fills every row's seed on rank 0 before it broadcasts the requests. Host
measurements (the forward-cost fit, the token budget from free memory) are agreed across
ranks (engine.parallel.TensorParallel.agree / min_int).

MoE experts are expert parallel (docs/engine.md, "Tensor parallel", says why): rank r
runs experts [r E/N, (r+1) E/N) on every token routed to them (the activations are
replicated, so no token exchange is needed) and the partial mixture is all-reduced with
the shared expert's row-parallel partial in one reduction."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .families import Shard


def tensor_parallel_of(model: Any, config: Any) -> Optional[Any]:
    """The model's TensorParallel when it spans more than one rank (None on one device);
    ValueError when EngineConfig.tensor_parallel_size disagrees with the model's shards."""
    tp = getattr(model, "tp", None)
    size = 1 if tp is None else tp.size
    if config.tensor_parallel_size != size:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size}, but the model was loaded "
                         f"{'whole' if tp is None else f'as a shard of {size}'} (engine.load_model(..., tp=...) "
                         f"with a TensorParallel of that size, one per rank)")
    return tp if size > 1 else None


class ShardingRefused(ValueError):
    """The model cannot be split over this many ranks (a size that does not divide)."""


@dataclass(frozen=True)
class Piece:
    """What a rank holds of one tensor: along `dim`, the checkpoint ranges `ranges`
    concatenated, then `pad` zero slices (the last vocabulary shard)."""

    dim: int
    ranges: Tuple[Tuple[int, int], ...]
    pad: int = 0

    def length(self) -> int:
        return sum(b - a for a, b in self.ranges) + self.pad


def head_ranges(H: int, Hkv: int, rank: int, size: int) -> Tuple[Tuple[int, int], Tuple[int, int]]:
    """(query heads, K/V heads) rank `rank` of `size` holds: H/N query heads, and their
    K/V heads (Hkv/N of them, or the one they use when Hkv < N, a copy on each rank)."""
    N = size
    if H % N:
        raise ShardingRefused(f"tensor_parallel_size={N}: {H} attention heads do not divide into {N} ranks")
    if (Hkv >= N and Hkv % N) or (Hkv < N and N % Hkv):
        raise ShardingRefused(f"tensor_parallel_size={N}: {Hkv} K/V heads neither divide into {N} ranks nor "
                              f"replicate evenly over them")
    heads = (rank * H // N, (rank + 1) * H // N)
    if Hkv >= N:
        return heads, (rank * Hkv // N, (rank + 1) * Hkv // N)
    first = heads[0] // (H // Hkv)  # fewer K/V heads than ranks: the one this rank's query heads use
    return heads, (first, first + 1)


class ShardPlan:
    """Rank `rank` of `size`'s share of a model `cfg` (the whole model's ModelConfig)."""

    def __init__(self, cfg: ModelConfig, rank: int, size: int):
        self.cfg, self.rank, self.size = cfg, rank, size
        N = size
        self.heads, self.kv_heads = head_ranges(cfg.n_heads, cfg.n_kv_heads, rank, size)
        self.vocab_rows = math.ceil(cfg.embedding_size / N)
        m = cfg.moe
        self.experts = range(0) if m is None else range(rank * m.num_experts // N, (rank + 1) * m.num_experts // N)
        for what, width in (("intermediate_size", cfg.intermediate_size if m is None else 0),
                            ("the dense layers' intermediate_size", m.dense_size if m and m.dense_size > 0 else 0),
                            ("the shared expert's width", (m.shared_size or 0) if m else 0)):
            if width % N:
                raise ShardingRefused(f"tensor_parallel_size={N}: {what} {width} does not divide into {N} ranks")

    # --- the rank's model -------------------------------------------------------------------
    def local_config(self) -> ModelConfig:
        """The config of this rank's layers: its heads and MLP widths."""
        c, N, m = self.cfg, self.size, self.cfg.moe
        moe = None if m is None else replace(m, dense_size=m.dense_size // N if m.dense_size > 0 else m.dense_size,
                                             shared_size=m.shared_size // N if m.shared_size else m.shared_size)
        return replace(c, n_heads=c.n_heads // N, n_kv_heads=self.kv_heads[1] - self.kv_heads[0],
                       head_dim=c.head_dim, intermediate_size=c.intermediate_size // N, moe=moe)

    def piece(self, name: str, shape: Tuple[int, ...]) -> Optional[Piece]:
        """What this rank holds of internal parameter `name` (the whole model's `shape`);
        None: nothing (an expert another rank owns)."""
        kind = self.cfg.family.shard_of(name)
        whole = Piece(0, ((0, shape[0]),))
        r, N, hd = self.rank, self.size, self.cfg.head_dim
        if kind == Shard.EXPERT:
            expert = int(name.split(".experts.")[1].split(".")[0])
            return whole if expert in self.experts else None
        if kind == Shard.VOCAB:
            a = min(r * self.vocab_rows, shape[0])
            b = min(a + self.vocab_rows, shape[0])
            return Piece(0, ((a, b),), self.vocab_rows - (b - a))
        if kind == Shard.ROW:
            if len(shape) == 1:  # its bias: added once, after the all-reduce
                return whole
            return Piece(1, ((r * shape[1] // N, (r + 1) * shape[1] // N),))
        if kind == Shard.COLUMN:
            return Piece(0, ((r * shape[0] // N, (r + 1) * shape[0] // N),))
        q = (self.heads[0] * hd, self.heads[1] * hd)
        kv = (self.kv_heads[0] * hd, self.kv_heads[1] * hd)
        if kind == Shard.KV:
            return Piece(0, (kv,))
        if kind == Shard.QKV:  # q heads, then k, then v
            qn, kvn = self.cfg.n_heads * hd, self.cfg.n_kv_heads * hd
            return Piece(0, (q, (qn + kv[0], qn + kv[1]), (qn + kvn + kv[0], qn + kvn + kv[1])))
        return whole

    def replicated_elements(self, name: str, shape: Tuple[int, ...]) -> int:
        """Elements of `name` every rank holds a copy of: all of a replicated tensor, and the
        K/V head of a rank when there are fewer K/V heads than ranks (fused or not)."""
        kind, hd = self.cfg.family.shard_of(name), self.cfg.head_dim
        rest = math.prod(shape[1:])
        if self.cfg.n_kv_heads < self.size and kind in (Shard.KV, Shard.QKV):
            return (2 if kind == Shard.QKV else 1) * hd * rest
        return math.prod(shape) if self.replicated(name) else 0

    def replicated(self, name: str) -> bool:
        """Whether every rank holds all of `name` (norms, routers, row-parallel biases, and
        K/V heads when there are fewer than ranks)."""
        kind = self.cfg.family.shard_of(name)
        if kind == Shard.REPLICATE or (kind == Shard.ROW and name.endswith(".bias")):
            return True
        return kind == Shard.KV and self.cfg.n_kv_heads < self.size


# --- the modules of a shard ---------------------------------------------------------------
class RowParallelLinear(nn.Linear):
    """A linear whose input features are split over the ranks: each computes its partial
    product, the partials are summed (all-reduce; `reduce=False` leaves that to the
    caller, who sums several partials at once), and the bias is added once, after."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: Any, reduce: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        self.tp, self.reduce = tp, reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.reduce:
            y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Rows [start, start + num_embeddings) of the embedding: a token outside them looks up
    zeros, and the ranks' lookups are summed (one rank holds each token: exact)."""

    def __init__(self, rows: int, dim: int, start: int, tp: Any):
        super().__init__(rows, dim, _weight=torch.empty(rows, dim))
        self.start, self.tp = start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        e = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0)
        return self.tp.all_reduce(e)


def shard_model(model: nn.Module, plan: ShardPlan, tp: Any) -> nn.Module:
    """Turn `model`, a DLLM built (on the meta device) from `plan.local_config()`, into
    rank `plan.rank`'s shard: row-parallel o and down projections, the vocab-parallel
    embedding and LM head, only the rank's own experts (the others' slots hold no
    parameters), and the group (`model.tp`) whose collectives the forward runs."""
    cfg, d = plan.cfg, plan.cfg.hidden_size
    start = min(plan.rank * plan.vocab_rows, cfg.embedding_size)
    model.embed = VocabParallelEmbedding(plan.vocab_rows, d, start, tp)
    if model.lm_head is not None:
        model.lm_head = nn.Linear(d, plan.vocab_rows, bias=model.lm_head.bias is not None)
    for layer in model.layers:
        layer.tp = tp
        layer.o = RowParallelLinear(layer.o.in_features, d, layer.o.bias is not None, tp)
        if hasattr(layer, "gate"):
            layer.down = RowParallelLinear(layer.down.in_features, d, layer.down.bias is not None, tp)
        elif not layer.routed:
            layer.dense.down = RowParallelLinear(layer.dense.down.in_features, d, False, tp)
        else:
            layer.owned = plan.experts
            for j in range(len(layer.experts)):
                if j not in plan.experts:
                    layer.experts[j] = nn.Identity()  # another rank's expert: no parameters here
            if layer.shared is not None:  # reduced with the experts' partial mixture, in one all-reduce
                layer.shared.down = RowParallelLinear(layer.shared.down.in_features, d, False, tp, reduce=False)
    model.tp = tp
    return model


def resident_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this process holds."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def replicated_elements(plan: ShardPlan) -> Dict[str, int]:
    """Per internal parameter, the elements every rank holds a copy of."""
    shapes = plan.cfg.family.param_shapes(plan.cfg)
    return {n: plan.replicated_elements(n, s) for n, s in shapes.items()}


__all__ = ["head_ranges", "ShardPlan", "Piece", "ShardingRefused", "RowParallelLinear", "VocabParallelEmbedding", "shard_model",
           "tensor_parallel_of", "resident_bytes", "replicated_elements"]
