"""sort="blendserve": the request order, computed lazily, in a streaming stage.

Why this shape: an engine pads little when the rows it batches have similar widths,
shared prompt prefixes are cheapest side by side, and a pool of engines ends together
when the longest work goes first (LPT: the tail is short rows). All three follow from
one per-row sort key, so the ordering is one map stage over windows of
`sort_window_rows` rows: it computes the key and passes the window on sorted, in blocks of
one engine call each, to one pool of engines that pull them as they free up (a slow,
restarted or lost engine's work is taken by the others; a static per-rank plan would
make it wait). Nothing runs before the dataset executes, nothing on the driver grows
with the rows, and generation starts after the first window instead of after the whole
input. Inputs up to one window are ordered globally; longer ones window by window.
(Ray Data's distributed `sort` would order globally, but its tasks take a whole CPU
each, which the engine actors of a small machine do not leave free.)

The key, in order:
  1. cost bucket, descending: the request's estimated engine time on a geometric grid
     of ratio COST_BUCKET_RATIO, so requests of similar cost sit together and the
     costliest go first. The time is the roofline of the engines' model (the run's
     Checkpoint, wherever the model lives), dtype and device under their cache mode and
     canvas (`cost.Roofline`);
  2. prefix group: a hash of the prompt's first `sort_min_prefix` tokens (in
     PREFIX_CHUNK pieces), so prompts sharing a preamble sit next to each other within
     their bucket; 0 for prompts shorter than that. `sort_prefix_locality` (0..1) trades
     cost order for prefix locality: a group's rows within 1 / (1 - locality) buckets
     take its costliest row's bucket (`grouped_buckets`), so they are batched together
     for the engines' prefix cache;
  3. prompt length, descending.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray.data

from engine.config import Attention, SamplingParams  # dataclasses only: no torch

from ..config import DLLMProcessorConfig
from actors.row_values import RowValueError, parse_sampling
from ..stages import TOKEN_IDS
from .cost import CostModel, Roofline
from .model import ModelProfile, device_profile, dtype_bytes
from .prefix import PREFIX_CHUNK, prefix_key

COST_BUCKET_RATIO = 1.25


def row_budget(override: Any, base: SamplingParams, column: str = "sampling_params") -> Optional[int]:
    """A row's generation budget: max_new_tokens of the SamplingParams the engine builds for
    it (actors/row_values.py, the one parser of per-row values, which the engine actor
    uses too); None when the override does not parse (the engine reports it, as an error row)."""
    try:
        return parse_sampling(override, base, column).max_new_tokens
    except RowValueError:
        return None


def _budget(override: Any, base: SamplingParams) -> int:
    """row_budget, the config's when the override is not usable."""
    budget = row_budget(override, base)
    return base.max_new_tokens if budget is None else budget


def full_canvas(cfg: DLLMProcessorConfig, checkpoint: Any) -> bool:
    """The canvas the engines will use: EngineConfig.canvas, "auto" resolved from the
    checkpoint's attention (with --attention applied) as the engine resolves it."""
    return cfg.engine.full_canvas(checkpoint.config.dllm_attention == Attention.BLOCK_CAUSAL)


class SortWindowUDF:
    """Orders a window of rows by the key (see the module docstring)."""

    def __init__(self, cost: Union[CostModel, Roofline], sampling: SamplingParams, sampling_column: str,
                 min_chunks: int, max_width: Optional[int] = None, prefix_locality: float = 0.0):
        self.cost, self.sampling = cost, sampling
        self.sampling_column, self.min_chunks, self.max_width = sampling_column, min_chunks, max_width
        self.prefix_locality = prefix_locality

    def budgets(self, batch: pa.Table, lens: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(max_new_tokens, refused) per row: a row whose override does not parse, or whose
        final width (prompt + whole blocks) exceeds what the engines accept (`max_width`),
        is refused by the engine (an error row) and costs nothing to order."""
        n = batch.num_rows
        over = (batch.column(self.sampling_column).to_pylist() if self.sampling_column in batch.column_names
                else [None] * n)
        budgets = [row_budget(o, self.sampling, self.sampling_column) for o in over]
        refused = np.array([g is None for g in budgets], dtype=bool)
        gens = np.array([1 if g is None else g for g in budgets], dtype=np.float64)
        if self.max_width is not None:
            L = float(self.cost.block_length)
            refused |= lens + np.ceil(gens / L) * L > self.max_width
        gens[refused] = 1.0
        return gens, refused

    def keys(self, batch: pa.Table) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(cost bucket, prefix group, prompt length) per row."""
        n = batch.num_rows
        ids = batch.column(TOKEN_IDS) if TOKEN_IDS in batch.column_names else None
        lens = np.asarray(pc.fill_null(pc.list_value_length(ids), 0).to_pylist() if ids is not None else [0] * n,
                          dtype=np.int64)
        gens, refused = self.budgets(batch, lens)
        seconds = self.cost.times(lens, gens)
        bucket = np.floor(np.log(np.maximum(seconds, 1e-300)) / math.log(COST_BUCKET_RATIO)).astype(np.int64)
        bucket[refused] = np.iinfo(np.int64).max  # first: their error rows come back at once
        prefix = np.zeros(n, dtype=np.int64)
        if self.min_chunks and ids is not None:
            heads = pc.list_slice(ids, 0, self.min_chunks * PREFIX_CHUNK).to_pylist()
            prefix = np.array([k[self.min_chunks - 1] if len(k) >= self.min_chunks else 0
                               for k in (prefix_key(h or ()) for h in heads)], dtype=np.int64)
        if self.prefix_locality > 0:
            bucket = grouped_buckets(bucket, prefix, refused, self.prefix_locality)
        return bucket, prefix, lens

    def __call__(self, batch: pa.Table) -> pa.Table:
        bucket, prefix, lens = self.keys(batch)
        return batch.take(pa.array(np.lexsort((-lens, prefix, -bucket)), pa.int64()))  # the last key is the primary one


def grouped_buckets(bucket: np.ndarray, prefix: np.ndarray, refused: np.ndarray, locality: float) -> np.ndarray:
    """Cost buckets with rows of one prefix group brought together (sort_prefix_locality):
    within each range of 1 / (1 - locality) buckets (every bucket at locality 1), a
    group's rows take the bucket of its costliest row, so they sit side by side there
    (an engine's prefix cache computes their preamble once) at the price of LPT's order
    among them. 0 keeps the order by cost alone; rows without a group are unchanged."""
    out = bucket.copy()
    shared = np.nonzero((prefix != 0) & ~refused)[0]
    if not len(shared):
        return out
    span = 1.0 / (1.0 - locality) if locality < 1 else math.inf
    coarse = np.zeros(len(shared), np.int64) if span == math.inf else np.floor(bucket[shared] / span).astype(np.int64)
    top: Dict[Tuple[int, int], int] = {}
    for i, c in zip(shared.tolist(), coarse.tolist()):
        k = (int(prefix[i]), c)
        top[k] = max(top.get(k, int(bucket[i])), int(bucket[i]))
    for i, c in zip(shared.tolist(), coarse.tolist()):
        out[i] = top[(int(prefix[i]), c)]
    return out


def max_width(cfg: DLLMProcessorConfig, checkpoint: Any) -> int:
    """The widest request the engines accept: token_budget and the model's context
    (engine/sequence.py `validate` refuses wider ones)."""
    budget = cfg.engine.token_budget  # None: each engine plans its own (engine.budget) and refuses wider rows
    return int(checkpoint.config.max_seq_len) if budget is None else min(budget, int(checkpoint.config.max_seq_len))


def cost_shape(cfg: DLLMProcessorConfig, checkpoint: Any) -> Dict[str, Any]:
    """What a block is, as the engine serving the model runs it (its serving mode says:
    engine.serving.Serving.block). A DiffusionGemma block is
    a canvas (`canvas_length`) of at most `max_denoising_steps` decoder steps (the request's
    knob, else generation_config.json's, else transformers' default); the encoder writes
    the prompt once and every committed canvas once, the last one never: cache
    "persistent" on a block canvas, p + K S L + (K - 1) L cells for K = ceil(g / L)
    canvases. An upper bound of what the canvas engine forwards (its `cells`), reached
    when no canvas stops early and no row ends before max_tokens; a preempted row's
    recompute is not charged."""
    return checkpoint.serving.block(checkpoint, cfg.sampling, cfg.engine)


def cost_model(cfg: DLLMProcessorConfig, device: str = "cpu", checkpoint: Any = None) -> Roofline:
    """The ordering's cost: the roofline of the engines' model (its Checkpoint's
    ModelConfig; opened from cfg.model when not given), the dtype they load on `device`,
    its cache mode and canvas."""
    if checkpoint is None:
        checkpoint = _open(cfg)
    model = ModelProfile(checkpoint.config, dtype_bytes(cfg.dtype, device))
    return Roofline(model=model, device=device_profile(device), **cost_shape(cfg, checkpoint))


def _open(cfg: DLLMProcessorConfig) -> Any:
    """The Checkpoint of cfg.model, for callers that have none (a run passes its preflight's)."""
    from engine.checkpoint import Checkpoint

    return Checkpoint.open(cfg.model, attention=cfg.attention, weights=False)


def order_dataset(ds: ray.data.Dataset, cfg: DLLMProcessorConfig, ray_remote_args: Optional[Dict[str, Any]] = None,
                  device: str = "cpu", checkpoint: Any = None) -> ray.data.Dataset:
    """`ds` (tokenized) in blendserve order, window by window; lazy like every stage.
    `device`: where the engines run ("cuda" or "cpu"), for the roofline; `checkpoint`: the
    run's model (engine.checkpoint; opened from cfg.model when not given)."""
    if checkpoint is None:
        checkpoint = _open(cfg)
    cost = cost_model(cfg, device, checkpoint)
    min_chunks = -(-cfg.sort_min_prefix // PREFIX_CHUNK) if cfg.sort_min_prefix > 0 else 0
    remote = ray_remote_args or {}
    # A task stage (the UDF is stateless): no actor of its own to start before the first
    # window, which on a small machine delays the engines by seconds.
    ordered = ds.map_batches(SortWindowUDF(cost, cfg.sampling, cfg.sampling_column, min_chunks,
                                           max_width(cfg, checkpoint), cfg.sort_prefix_locality),
                             batch_format="pyarrow", batch_size=cfg.sort_window_rows, udf_modifying_row_count=False,
                             **remote)
    # Ray Data joins a stage's yields into one block; engines pull whole blocks, so cut the
    # window into blocks of one engine call again (streaming, order kept).
    return with_remote_args(ordered.repartition(target_num_rows_per_block=cfg.batch_size), remote)


def with_remote_args(ds: ray.data.Dataset, remote: Dict[str, Any]) -> ray.data.Dataset:
    """`repartition` (like `ray.data.range`'s reads) takes no resource arguments and its
    tasks ask for a whole CPU, which the engine actors of a small machine do not leave
    free (the run would hang): give `ds`'s last stage the CPU stages' fraction (Ray 2.60's
    logical operator holds them in a dict)."""
    args = getattr(getattr(getattr(ds, "_logical_plan", None), "dag", None), "ray_remote_args", None)
    if isinstance(args, dict):
        args.update(remote)
    return ds


__all__ = ["order_dataset", "cost_model", "full_canvas", "with_remote_args", "SortWindowUDF", "COST_BUCKET_RATIO"]
