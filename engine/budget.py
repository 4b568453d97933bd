"""Token-budget auto-sizer: the largest `EngineConfig.token_budget` that fits in free
accelerator memory.

Why: the budget bounds the padded batch area A = |rows| * width of every forward, and
the memory that grows with the batch grows with A (K/V cache, one layer's activations)
or with the number of rows (each row's L block columns of logits, which the decoding
policy turns into a float64 softmax over the whole vocabulary). Picked by hand it either
leaves most of an H200 idle or fails on the first wide batch. The model is simple and
deliberately conservative (every term is an upper bound on what the engine allocates):

    weights + A * (kv + activations) + rows * L * logit_cell + margin  <=  free
    kv          = copies * 2 * n_kv_heads * head_dim * bytes * (SLACK * n_layers + 1/2)
    copies      = 1 with a cache (refresh, dual, persistent), 0 with none. The K/V live in
                  slots that outlive batches (engine/slots.py): per layer one K and one V
                  storage of SLACK x token_budget cells (SLACK = 1.05; x engine.buckets.ROOM
                  with compile_decode, room for its shape buckets' padding), allocated once and
                  viewed by each batch, so a join, leave or width change moves only the
                  rows that must move and never builds a second box. The "+ 1/2" is one
                  layer's K (or V) of transient while rows are copied to a new shape
    activations = one layer's transients: (4 f + 12 d + 6 kv_dim) * bytes + 8 d (float32 norms)
    logit_cell  = embedding_size * bytes (LM head out) + vocab * 24 (float64 copy, softmax, temp)
    rows       <= min(max_batch_size, A / (min_prompt_len + L))
    margin      = max(reserve_bytes, margin_frac * free)

`min_prompt_len` matters: with a big vocabulary (LLaDA: 126464) a row of one block of
32 columns needs ~100 MB of float64 logits workspace, more than its K/V, so a budget for
1-token prompts is much smaller than one for chat-length prompts. Attention is assumed
to run in a fused kernel (no [T, W] score matrix); block-causal models add the boolean
mask row of each query column, built per forward (engine.batch.AttentionMask: A *
max_width bytes at most).

An engine whose EngineConfig.token_budget is not given plans it here at start
(`resolve_token_budget`): on a GPU, `free` is what gpu_memory_utilization of the device
leaves after what is already held there (vLLM's rule: utilization x total - used, the
weights loaded), with no margin but `reserve_bytes`; the budget is capped at what the
engine can ever fill (max_batch_size rows of the model's context). On a device without a
memory query (CPU) it is DEFAULT_TOKEN_BUDGET. The job's preflight refuses a model whose
weights and one row of one block cannot fit in utilization x a GPU's memory (`engine_plan`
with the weights not loaded).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Dict, Optional, Tuple

import torch

from .config import DEFAULT_TOKEN_BUDGET, EngineConfig
from .models import ModelConfig
from .modes import MODES, cache_mode
from .buckets import ROOM as BUCKET_ROOM
from .slots import SLACK

KV_COPIES = {name: m.kv_copies for name, m in MODES.items()}  # K/V buffers alive at the peak (engine.modes)


def dtype_bytes(dtype: torch.dtype) -> int:
    return dtype.itemsize


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Parameters (including norm weights and biases, which are few) in `dtype`."""
    return cfg.num_params() * dtype_bytes(dtype)


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of every layer for one column of batch area (one buffer)."""
    return cfg.kv_bytes_per_token(dtype_bytes(dtype))


def kv_slack(compile_decode: bool = False) -> float:
    """K/V columns the slots hold per column of token budget: SLACK, and with compile_decode
    room for its shape buckets' padding (engine.buckets.ROOM)."""
    return SLACK * (BUCKET_ROOM if compile_decode else 1.0)


def kv_peak_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, cache: str = "refresh",
                            compile_decode: bool = False) -> int:
    """K/V bytes per column of batch area at the engine's peak: KV_COPIES buffers and one
    layer's transient."""
    kv = kv_bytes_per_token(cfg, dtype)
    return cache_mode(cache).kv_copies * (math.ceil(kv_slack(compile_decode) * kv) + kv // (2 * cfg.n_layers))


def activation_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, max_width: Optional[int] = None) -> int:
    """Transients of one layer's forward (inference mode frees the previous layer's):
    norm temporaries in float32, q/k/v and their RoPE temporaries, the MLP's gate, up,
    silu and product, residuals; plus the block-causal mask's row of `max_width` bools."""
    b, d, f = dtype_bytes(dtype), cfg.hidden_size, math.ceil(cfg.active_intermediate_size)  # MoE: active experts
    kv_dim = cfg.n_kv_heads * cfg.head_dim
    per = (4 * f + 12 * d + 6 * kv_dim) * b + 8 * d
    if cfg.block_causal:
        per += max_width if max_width is not None else cfg.max_seq_len
    return per


def logits_bytes_per_row(cfg: ModelConfig, dtype: torch.dtype, block_length: int) -> int:
    """The L block columns' logits: the LM head output in `dtype` over the (padded)
    embedding rows, then float64 copy, float64 softmax and one float64 temporary."""
    return block_length * (cfg.embedding_size * dtype_bytes(dtype) + cfg.vocab_size * 24)


@dataclass(frozen=True)
class MemoryPlan:
    """The terms of the estimate and the budget they allow (all in bytes / tokens)."""

    token_budget: int
    free_bytes: int
    weights_bytes: int
    margin_bytes: int
    kv_per_token: int
    activations_per_token: int
    logits_per_row: int
    min_row_width: int
    max_rows: Optional[int]

    def rows_for(self, area: int) -> int:
        rows = area // self.min_row_width
        return rows if self.max_rows is None else min(rows, self.max_rows)

    def bytes_for(self, area: int) -> int:
        """Estimated peak bytes of a batch of padded area `area` (weights and margin included)."""
        return (self.weights_bytes + self.margin_bytes + area * (self.kv_per_token + self.activations_per_token)
                + self.rows_for(area) * self.logits_per_row)

    def as_dict(self) -> dict:
        return asdict(self)


def plan_token_budget(free_bytes: int, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16,
                      cache: str = "refresh", block_length: int = 32, *, weights_loaded: bool = False,
                      min_prompt_len: int = 1, max_batch_size: Optional[int] = None,
                      max_width: Optional[int] = None, margin_frac: float = 0.10,
                      reserve_bytes: int = 512 << 20, max_area: Optional[int] = None,
                      weights_bytes: Optional[int] = None, compile_decode: bool = False) -> MemoryPlan:
    """The largest token budget A with `bytes_for(A) <= free_bytes`, at most `max_area`
    (the largest box the engine can form: more is memory it never fills).

    `free_bytes` is what the device reports free (torch.cuda.mem_get_info()[0]); pass
    `weights_loaded=True` when the model is already resident (then weights are not
    subtracted again); `weights_bytes`: what the weights take when they are not
    weight_bytes(cfg) (a tensor-parallel rank's shard). Returns budget 0 when not even one
    block fits."""
    if free_bytes < 0 or block_length < 1 or min_prompt_len < 1:
        raise ValueError("free_bytes must be >= 0, block_length and min_prompt_len >= 1")
    weights = 0 if weights_loaded else (weight_bytes(cfg, dtype) if weights_bytes is None else weights_bytes)
    margin = max(int(reserve_bytes), int(margin_frac * free_bytes))
    plan = MemoryPlan(token_budget=0, free_bytes=free_bytes, weights_bytes=weights, margin_bytes=margin,
                      kv_per_token=kv_peak_bytes_per_token(cfg, dtype, cache, compile_decode),
                      activations_per_token=activation_bytes_per_token(cfg, dtype, max_width),
                      logits_per_row=logits_bytes_per_row(cfg, dtype, block_length),
                      min_row_width=min_prompt_len + block_length, max_rows=max_batch_size)
    per_token, per_row, width = plan.kv_per_token + plan.activations_per_token, plan.logits_per_row, plan.min_row_width
    avail = free_bytes - weights - margin
    # rows = A / width while that stays under max_batch_size: A * (per_token + per_row / width) <= avail
    area = max(0, int(avail // (per_token + per_row / width))) if avail > 0 else 0
    if max_batch_size is not None and area // width > max_batch_size:
        area = max(0, int((avail - max_batch_size * per_row) // per_token))  # the row cap binds
    while area > 0 and plan.bytes_for(area) > free_bytes:  # float rounding
        area -= 1
    while area > 0 and plan.bytes_for(area + 1) <= free_bytes:  # rows are floored: the last partial row is free
        area += 1
    if max_area is not None:
        area = min(area, max_area)
    if area <= block_length:
        area = 0
    return replace(plan, token_budget=area)


GiB = 1 << 30


def device_memory(device: Any) -> Optional[Tuple[int, int]]:
    """(free, total) bytes of `device` for this process, or None where there is no memory
    query (CPU). The one place an engine asks its device: free counts what torch's caching
    allocator holds unused too (a warm-up engine's freed K/V), which this process reuses."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return int(free + cached), int(total)


def engine_plan(mcfg: ModelConfig, dtype: torch.dtype, config: EngineConfig, free_bytes: int, total_bytes: int,
                *, weights_loaded: bool = True) -> MemoryPlan:
    """The budget an engine of `config` plans with `free_bytes` of its device's `total_bytes`
    free: what gpu_memory_utilization of the device leaves after what is held already,
    capped at max_batch_size rows of the model's context. The preflight asks the same of a
    whole GPU (free = total, weights not loaded). `mcfg` is the whole model's: under
    config.tensor_parallel_size = N > 1 the plan is one rank's (`ShardBytes`)."""
    usable = max(0, free_bytes - math.ceil((1 - config.gpu_memory_utilization) * total_bytes))
    weights, local = None, mcfg
    if config.tensor_parallel_size > 1:
        shard = ShardBytes.of(mcfg, dtype, config.tensor_parallel_size)
        weights, local = shard.weights, shard.local
    return plan_token_budget(usable, local, dtype, config.cache, config.block_length, weights_loaded=weights_loaded,
                             max_batch_size=config.max_batch_size, margin_frac=0.0,
                             max_area=config.max_batch_size * mcfg.max_seq_len, weights_bytes=weights,
                             compile_decode=config.compile_decode)


# --- tensor parallel: one rank's memory ---------------------------------------------------
@dataclass(frozen=True)
class ShardBytes:
    """What one of N tensor-parallel ranks holds (engine.models.sharding): its weights
    (each split tensor's shard, the replicated parts whole: norms, routers, row-parallel
    biases, K/V heads when there are fewer than N), of which `replicated` are copies every
    rank holds; `local` the rank's layer config (its heads, K/V heads and MLP widths), from
    which K/V and activations are planned; the logits are planned as gathered (the whole
    vocabulary on every rank)."""

    size: int
    weights: int
    replicated: int
    local: ModelConfig

    @classmethod
    def of(cls, cfg: ModelConfig, dtype: torch.dtype, size: int) -> "ShardBytes":
        """Rank 0's (experts split as evenly as they divide: no rank holds more)."""
        from .models.sharding import ShardPlan

        plan = ShardPlan(cfg, 0, size)
        weights = replicated = 0
        for name, shape in cfg.family.param_shapes(cfg).items():
            item = 4 if cfg.family.keeps_float32(name) and dtype.itemsize < 4 else dtype.itemsize
            piece = plan.piece(name, shape)
            if piece is None:
                continue
            weights += piece.length() * math.prod(s for i, s in enumerate(shape) if i != piece.dim) * item
            replicated += plan.replicated_elements(name, shape) * item
        return cls(size, weights, replicated, plan.local_config())


@dataclass(frozen=True)
class ParallelPlan:
    """One row of `blockray plan`: a model on N devices of `device_bytes` each."""

    size: int
    fits: bool
    why: Optional[str]  # why N cannot serve it (a size that does not divide the heads), else None
    weights_bytes: int  # per device
    replicated_bytes: int  # per device: the copies every rank holds
    kv_bytes_per_token: int  # per device, at the cache mode's peak
    logits_bytes_per_row: int  # gathered: every rank holds the whole vocabulary's
    token_budget: int  # the budget one engine would plan (0: not even one row of one block fits)

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def parallel_plan(mcfg: ModelConfig, dtype: torch.dtype, config: EngineConfig, device_bytes: int,
                  size: int) -> ParallelPlan:
    """The per-device plan of `mcfg` (the whole model's config) on `size` devices of
    `device_bytes`, nothing held yet (the preflight's question)."""
    from .models.sharding import ShardingRefused

    cfg = replace(config, tensor_parallel_size=size, token_budget=None)
    try:
        shard = ShardBytes.of(mcfg, dtype, size) if size > 1 else ShardBytes(1, weight_bytes(mcfg, dtype), 0, mcfg)
    except ShardingRefused as e:
        return ParallelPlan(size, False, str(e), 0, 0, 0, 0, 0)
    plan = engine_plan(mcfg, dtype, cfg, device_bytes, device_bytes, weights_loaded=False)
    return ParallelPlan(size, plan.token_budget > 0, None, shard.weights, shard.replicated, plan.kv_per_token,
                        plan.logits_per_row, plan.token_budget)


def smallest_tensor_parallel_size(mcfg: ModelConfig, dtype: torch.dtype, config: EngineConfig, device_bytes: int,
                                  sizes=(1, 2, 4, 8)) -> Optional[int]:
    """The smallest of `sizes` at which one row of one block fits on each device (None: none)."""
    return next((n for n in sizes if parallel_plan(mcfg, dtype, config, device_bytes, n).fits), None)


@dataclass(frozen=True)
class Budget:
    """An engine's resolved token budget and where it came from: "token_budget" (given),
    "planned" (from the device's memory, `plan`), "default" (no memory query: CPU)."""

    token_budget: int
    source: str
    gpu_memory_utilization: Optional[float] = None
    free_bytes: Optional[int] = None
    total_bytes: Optional[int] = None
    plan: Optional[MemoryPlan] = None

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """The engine's start-up log line's words for it."""
        if self.source == "planned":
            return (f"token budget {self.token_budget} planned from {self.free_bytes / GiB:.2f} GiB free of "
                    f"{self.total_bytes / GiB:.2f} GiB (gpu_memory_utilization {self.gpu_memory_utilization:g})")
        return f"token budget {self.token_budget} ({'given' if self.source == 'token_budget' else 'the default'})"


def fixed_budget(config: EngineConfig) -> Budget:
    """The budget of an engine that plans none: the given one, else DEFAULT_TOKEN_BUDGET."""
    return Budget(config.fixed_token_budget(), "default" if config.token_budget is None else "token_budget")


def resolve_token_budget(config: EngineConfig, mcfg: ModelConfig, dtype: torch.dtype, device: Any) -> Budget:
    """The token budget an engine of `config` runs with on `device`, once, at its start: the
    given one; else, on a device with a memory query, the plan from its free memory
    (`engine_plan`, the weights loaded); else DEFAULT_TOKEN_BUDGET. Raises ValueError when
    no row of one block fits, and for a gpu_memory_utilization the device cannot honour."""
    if config.token_budget is not None and config.gpu_memory_utilization == EngineConfig().gpu_memory_utilization:
        return fixed_budget(config)  # given: nothing to ask the device
    memory = device_memory(device)
    if memory is None and config.gpu_memory_utilization != EngineConfig().gpu_memory_utilization:
        raise ValueError(f"gpu_memory_utilization={config.gpu_memory_utilization:g}: this engine runs on {device}, "
                         f"which has no memory query to size the token budget from (it is token_budget, else "
                         f"{DEFAULT_TOKEN_BUDGET}); leave gpu_memory_utilization at its default")
    if memory is None or config.token_budget is not None:
        return fixed_budget(config)
    free, total = memory
    plan = engine_plan(mcfg, dtype, config, free, total)
    if not plan.token_budget:
        raise ValueError(
            f"no token budget fits on {device}: {free / GiB:.2f} GiB free of {total / GiB:.2f} GiB, of which "
            f"gpu_memory_utilization {config.gpu_memory_utilization:g} leaves {plan.free_bytes / GiB:.2f} GiB to this "
            f"engine, less than one row of one block needs ({plan.bytes_for(config.block_length + 1) / GiB:.2f} GiB "
            "with the reserve); raise gpu_memory_utilization, free the GPU, or give token_budget")
    return Budget(plan.token_budget, "planned", config.gpu_memory_utilization, free, total, plan)
