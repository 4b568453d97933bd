"""sort="blendserve": plan with pipeline/sorter.shard, then feed each rank's shard, in
order, to that rank's engine actor.

Why offline: the sorter needs every prompt's token count up front. So the tokenized
dataset is materialized once, its small features (prompt tokens, budget and a hash
chain of the leading tokens per row, `prefix_key`) are brought to the driver, `shard`
computes the plan, and the rows are gathered per rank in plan order (one remote gather
task per rank, blocks of `batch_size` rows). Each rank's dataset then runs through its
own actor pool of size 1 whose engine carries that rank; the R branches are unioned. Every input row goes to exactly one rank, once.

Costs of this path: generation starts only after tokenization of the whole input has
finished (no streaming from read to engine), and the tokenized rows are held in the
object store until their rank consumes them.

Calibration (optional): `calibrate_cost_model` runs an Engine in-process on a sample of
prompts, records (cells forwarded, seconds) per block cycle and fits
`sorter.fit_cycle_time`, so `shard` balances on measured time instead of the roofline.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
import json
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray
import ray.data

from .config import DLLMProcessorConfig
from .sorter import CPU, H200, CostModel, ModelProfile, RequestFeatures, ShardPlan, fit_cycle_time, shard
from .stages import TOKEN_IDS

SHARD_RANK = "shard_rank"  # output columns in sort="blendserve" mode
SHARD_ORDER = "shard_order"


def _budget(override: Any, default: int) -> int:
    """A row's generation budget: its override's max_new_tokens when usable, else the
    default (a bad override is the engine's to report, as an error row)."""
    try:
        return max(1, int(override["max_new_tokens"])) if override["max_new_tokens"] else default
    except (TypeError, KeyError, ValueError):
        return default


def model_profile(model: str) -> ModelProfile:
    with open(os.path.join(model, "config.json")) as f:
        return ModelProfile.from_config(json.load(f))


# Shared prompt prefixes are compared in pieces of PREFIX_CHUNK tokens, over at most the
# first PREFIX_TOKENS tokens: the driver holds one hash per piece, not the token ids.
PREFIX_CHUNK = 16
PREFIX_TOKENS = 512


def prefix_key(ids: Sequence[int], chunk: int = PREFIX_CHUNK) -> Tuple[int, ...]:
    """Chained hashes of the whole `chunk`-token pieces of `ids`: two prompts share their
    first k elements iff they share their first k * chunk tokens (barring a 64-bit hash
    collision). The sorter's prefix trie runs on these as it would on token ids.
    Deterministic across processes (int tuples are not salted by PYTHONHASHSEED)."""
    out, h = [], 0
    for s in range(0, len(ids) - chunk + 1, chunk):
        h = hash((h, tuple(ids[s:s + chunk])))
        out.append(h)
    return tuple(out)


def plan_shards(prompt_lens: Sequence[int], max_new: Sequence[int], cfg: DLLMProcessorConfig,
                device: str, cost_model: Optional[CostModel] = None,
                prefixes: Optional[Sequence[Optional[Tuple[int, ...]]]] = None) -> ShardPlan:
    """`prefixes`: per row, its `prefix_key` (None: never grouped)."""
    prefixes = prefixes if prefixes is not None else [None] * len(prompt_lens)
    feats = [RequestFeatures(prompt_len=int(p), max_new_tokens=int(g), prefix=k)
             for p, g, k in zip(prompt_lens, max_new, prefixes)]
    return shard(feats, num_ranks=cfg.num_engines, model=model_profile(cfg.model),
                 device=H200 if device == "cuda" else CPU, block_length=cfg.engine.block_length,
                 steps_per_block=cfg.engine.steps_per_block, batch_size=cfg.batch_size,
                 cost_model=cost_model, min_prefix=_min_chunks(cfg.sort_min_prefix))


def _min_chunks(min_prefix_tokens: int) -> int:
    """The sorter's min_prefix in prefix_key pieces (0: no grouping)."""
    return -(-min_prefix_tokens // PREFIX_CHUNK) if min_prefix_tokens > 0 else 0


@ray.remote(num_cpus=0.25)
def _gather(runs: List[Tuple[int, List[int]]], rows_per_block: int, rank: int, *blocks: pa.Table):
    """The rows [(block position in `blocks`, [rows in block])...] of the given blocks,
    in that order (plan order: consecutive runs of one block), tagged with `rank` and
    their position, cut into blocks of `rows_per_block` rows (one engine call each)."""
    table = pa.concat_tables([blocks[bi].take(pa.array(rows, pa.int64())) for bi, rows in runs],
                             promote_options="default")
    n = table.num_rows
    table = table.drop_columns([c for c in (SHARD_RANK, SHARD_ORDER) if c in table.column_names])
    table = table.append_column(SHARD_RANK, pa.array([rank] * n, pa.int64()))
    table = table.append_column(SHARD_ORDER, pa.array(range(n), pa.int64()))
    parts = [table.slice(s, rows_per_block) for s in range(0, n, rows_per_block)]
    return parts[0] if len(parts) == 1 else tuple(parts)


def _runs(order: List[Tuple[int, int]]) -> List[Tuple[int, List[int]]]:
    """Consecutive runs of rows from the same block: [(block, [rows...]), ...]."""
    out: List[Tuple[int, List[int]]] = []
    for b, r in order:
        if out and out[-1][0] == b:
            out[-1][1].append(r)
        else:
            out.append((b, [r]))
    return out


@dataclass
class ShardedInput:
    """The materialized, planned input: one ordered dataset per rank (None: no rows)."""

    rank_datasets: List[Optional[ray.data.Dataset]]
    plan: ShardPlan
    calibration: Optional[Dict[str, Any]] = None
    timings: Dict[str, float] = field(default_factory=dict)


FEATURE_TASKS = 16  # at most this many feature tasks (and no more than the cluster's CPUs)


def shard_dataset(ds: ray.data.Dataset, cfg: DLLMProcessorConfig, device: str,
                  cost_model: Optional[CostModel] = None) -> ShardedInput:
    """Materialize the tokenized `ds`, plan, and cut it into per-rank ordered datasets.
    With `cfg.calibrate` (and no `cost_model`), fit one on a sample of the input first."""
    t0 = time.perf_counter()
    mat = ds.materialize()
    timings = {"materialize_s": time.perf_counter() - t0}
    calibration = None
    if cfg.calibrate and cost_model is None:
        t1 = time.perf_counter()
        cost_model, calibration = calibrate_cost_model(cfg, sample_prompts(mat, cfg.calibration_samples))
        timings["calibrate_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    refs = mat.to_arrow_refs()
    # A few tasks over many blocks each: every task may need a fresh worker process,
    # which on a busy node costs far more than reading token counts.
    tasks = min(len(refs), FEATURE_TASKS, max(1, int(ray.cluster_resources().get("CPU", 1))))
    chunks = np.array_split(np.arange(len(refs)), tasks) if refs else []
    metas = ray.get([_features_remote.remote(cfg.sampling.max_new_tokens, cfg.sampling_column,
                                             _min_chunks(cfg.sort_min_prefix), *[refs[i] for i in c])
                     for c in chunks])
    lens, gens, prefixes, rows_per_block = ([x for m in metas for x in m[k]] for k in range(4))
    loc = [(bi, j) for bi, n in enumerate(rows_per_block) for j in range(n)]
    plan = plan_shards(lens, gens, cfg, device, cost_model=cost_model, prefixes=prefixes)
    rank_datasets: List[Optional[ray.data.Dataset]] = []
    for r, idx in enumerate(plan.ranks):
        if not idx:
            rank_datasets.append(None)
            continue
        order = [loc[i] for i in idx]
        used = sorted({b for b, _ in order})
        remap = {b: n for n, b in enumerate(used)}
        runs = [(remap[b], rows) for b, rows in _runs(order)]
        # Blocks of one batch each, in plan order, so the engine gets the shard in order.
        k = -(-len(order) // cfg.batch_size)
        parts = _gather.options(num_returns=k).remote(runs, cfg.batch_size, r, *[refs[b] for b in used])
        rank_datasets.append(ray.data.from_arrow_refs([parts] if k == 1 else list(parts)))
    timings["plan_and_gather_s"] = time.perf_counter() - t2
    return ShardedInput(rank_datasets, plan, calibration, timings)


@ray.remote(num_cpus=0.25)
def _features_remote(default_max_new: int, sampling_column: str, min_chunks: int, *blocks: pa.Table):
    """(prompt tokens, budget, prefix_key or None) per row, and rows per block, of
    `blocks` in order. Token counts come from the list lengths; only the first
    PREFIX_TOKENS ids of a row become Python objects, and only when grouping is on."""
    lens: List[int] = []
    gens: List[int] = []
    keys: List[Optional[Tuple[int, ...]]] = []
    for b in blocks:
        names, n = b.column_names, b.num_rows
        ids = b.column(TOKEN_IDS) if TOKEN_IDS in names else None
        lens += pc.fill_null(pc.list_value_length(ids), 0).to_pylist() if ids is not None else [0] * n
        over = b.column(sampling_column).to_pylist() if sampling_column in names else [None] * n
        gens += [_budget(o, default_max_new) if isinstance(o, dict) else default_max_new for o in over]
        if min_chunks and ids is not None:
            heads = pc.list_slice(ids, 0, PREFIX_TOKENS).to_pylist()
            keys += [k if len(k) >= min_chunks else None for k in (prefix_key(h or ()) for h in heads)]
        else:
            keys += [None] * n
    return lens, gens, keys, [b.num_rows for b in blocks]


# --------------------------------------------------------------------------- calibration


def calibrate_cost_model(cfg: DLLMProcessorConfig, prompts: Sequence[Sequence[int]], *,
                         max_new_tokens: Optional[int] = None, concurrency: Optional[float] = None
                         ) -> Tuple[CostModel, Dict[str, Any]]:
    """Fit the cycle-time constants from the engine's own timings on `prompts`.

    Runs an Engine in-process (CPU, `cfg.torch_threads` threads) on the sample, in
    waves of growing batch size so the fit sees several batch widths, and records
    (cells forwarded, seconds) of every block cycle. Returns the CostModel and a report.
    """
    import torch

    from engine import Engine, load_model

    if len(prompts) < 2:
        raise ValueError("calibration needs at least 2 prompts")
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, cfg.torch_threads))
    try:
        model, _ = load_model(cfg.model, dtype=torch.float32, device=torch.device("cpu"), tokenizer=False)
        params = cfg.sampling if max_new_tokens is None else dataclasses.replace(cfg.sampling,
                                                                                max_new_tokens=max_new_tokens)
        samples: List[Tuple[float, float]] = []
        # warm-up on a throwaway engine
        warm = Engine(model, cfg.engine)
        warm.generate([list(prompts[0])], params)
        sizes = sorted({1, max(1, len(prompts) // 4), max(1, len(prompts) // 2), len(prompts)})
        start = 0
        for size in sizes:
            wave = [list(p) for p in prompts[start:start + size]] or [list(p) for p in prompts[:size]]
            start = (start + size) % len(prompts)
            eng = Engine(model, cfg.engine)
            for p in wave:
                eng.add_request(p, params)
            while eng.has_unfinished():
                t0, cells = time.perf_counter(), eng.stats.computed_cells
                eng.step()
                dt = time.perf_counter() - t0
                if eng.stats.computed_cells > cells:
                    samples.append((float(eng.stats.computed_cells - cells), dt))
    finally:
        torch.set_num_threads(threads)
    fit = fit_cycle_time(samples)
    # rows sharing a cycle in the pipeline: what the engine admits of the batches in flight
    conc = concurrency if concurrency is not None else float(
        min(cfg.engine.max_batch_size, cfg.batch_size * cfg.max_concurrent_batches))
    # A tiny model's cycles are overhead-bound and noisy: the fitted slope can come out
    # <= 0 (or the intercept < 0). Neither is physical; clamp so costs stay positive and
    # still grow with width (report the raw fit).
    a = max(fit.a, 0.0)
    b = fit.b if fit.b > 0 else max(float(np.mean([t for _, t in samples])) / max(
        float(np.mean([c for c, _ in samples])), 1.0) * 1e-3, 1e-12)
    cm = CostModel(a=a, b=b, block_length=cfg.engine.block_length, concurrency=conc,
                   steps_per_block=cfg.engine.steps_per_block, cache=cfg.engine.cache,
                   full_canvas=warm.full_canvas)
    return cm, {"a": fit.a, "b": fit.b, "rmse": fit.rmse, "n": fit.n, "concurrency": conc,
                "clamped": (a != fit.a) or (b != fit.b), "used_a": a, "used_b": b}


def sample_prompts(ds: ray.data.Dataset, n: int) -> List[List[int]]:
    rows = ds.select_columns([TOKEN_IDS]).take(n)
    return [list(r[TOKEN_IDS]) for r in rows if r.get(TOKEN_IDS)]


__all__ = ["shard_dataset", "plan_shards", "prefix_key", "calibrate_cost_model", "ShardedInput", "SHARD_RANK",
           "SHARD_ORDER", "sample_prompts"]
