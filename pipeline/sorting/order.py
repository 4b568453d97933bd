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
     costliest go first. The time is the roofline of the engines' model, dtype and
     device under their cache mode and canvas (`cost.Roofline`), or, where the model's
     config.json cannot be read here (a remote model), the forwarded cells
     (`cost.CostModel`);
  2. prefix group: a hash of the prompt's first `sort_min_prefix` tokens (in
     PREFIX_CHUNK pieces), so prompts sharing a preamble sit next to each other within
     their bucket; 0 for prompts shorter than that;
  3. prompt length, descending.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple, Union

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray.data

from engine.config import SamplingParams  # dataclasses only: no torch
from engine.models.families.diffusion_gemma import cost_shape as diffusion_gemma_cost_shape  # torch-free

from ..config import DLLMProcessorConfig
from actors.row_values import RowValueError, parse_sampling
from ..stages import TOKEN_IDS
from .cost import CostModel, Roofline
from .model import ModelProfile, device_profile, read_model_config
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


def full_canvas(cfg: DLLMProcessorConfig) -> bool:
    """The canvas the engines will use (EngineConfig.canvas, "auto" resolved from the
    model's config.json as the engine does); full when the config cannot be read here."""
    try:
        declared = cfg.attention == "block_causal" or (  # --attention overrides the checkpoint
            cfg.attention == "auto" and read_model_config(cfg.model).block_causal)
        block_causal = cfg.engine.canvas == "auto" and declared
    except (OSError, ValueError, KeyError):
        return True
    return cfg.engine.full_canvas(block_causal)


class SortWindowUDF:
    """Orders a window of rows by the key (see the module docstring)."""

    def __init__(self, cost: Union[CostModel, Roofline], sampling: SamplingParams, sampling_column: str,
                 min_chunks: int, max_width: Optional[int] = None):
        self.cost, self.sampling = cost, sampling
        self.sampling_column, self.min_chunks, self.max_width = sampling_column, min_chunks, max_width

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
        return bucket, prefix, lens

    def __call__(self, batch: pa.Table) -> pa.Table:
        bucket, prefix, lens = self.keys(batch)
        return batch.take(pa.array(np.lexsort((-lens, prefix, -bucket)), pa.int64()))  # the last key is the primary one


def max_width(cfg: DLLMProcessorConfig) -> int:
    """The widest request the engines accept: token_budget, and the model's context where
    its config.json is readable here (engine/sequence.py `validate` refuses wider ones)."""
    try:
        return min(cfg.engine.token_budget, int(read_model_config(cfg.model).max_seq_len))
    except (OSError, ValueError, KeyError):
        return cfg.engine.token_budget


def cost_model(cfg: DLLMProcessorConfig, device: str = "cpu") -> Union[Roofline, CostModel]:
    """The ordering's cost: the roofline of the engines' model (their ModelConfig, the
    dtype they load on `device`), cache mode and canvas; forwarded cells where the
    model's config.json is not readable here (a remote model)."""
    # DiffusionGemma: a block is a canvas (engine.models.families.diffusion_gemma.cost_shape)
    shape = diffusion_gemma_cost_shape(str(cfg.model), cfg.sampling.max_denoising_steps) or dict(
        block_length=cfg.engine.block_length, steps_per_block=cfg.engine.steps_per_block,
        cache=cfg.engine.cache, full_canvas=full_canvas(cfg))
    try:
        model = ModelProfile.from_config(cfg.model, dtype=cfg.dtype, device=device)
    except (OSError, ValueError, KeyError):
        return CostModel(a=0.0, b=1.0, **shape)
    return Roofline(model=model, device=device_profile(device), **shape)


def order_dataset(ds: ray.data.Dataset, cfg: DLLMProcessorConfig,
                  ray_remote_args: Optional[Dict[str, Any]] = None, device: str = "cpu") -> ray.data.Dataset:
    """`ds` (tokenized) in blendserve order, window by window; lazy like every stage.
    `device`: where the engines run ("cuda" or "cpu"), for the roofline."""
    cost = cost_model(cfg, device)
    min_chunks = -(-cfg.sort_min_prefix // PREFIX_CHUNK) if cfg.sort_min_prefix > 0 else 0
    remote = ray_remote_args or {}
    # A task stage (the UDF is stateless): no actor of its own to start before the first
    # window, which on a small machine delays the engines by seconds.
    ordered = ds.map_batches(SortWindowUDF(cost, cfg.sampling, cfg.sampling_column, min_chunks, max_width(cfg)),
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
