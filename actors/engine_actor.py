"""DLLMEngineActor: the Ray Data callable class that owns one engine.

Use it with `ds.map_batches(DLLMEngineActor, compute=ActorPoolStrategy(size=n,
max_concurrent_calls_per_actor=k, max_tasks_in_flight_per_actor=k), batch_format="pyarrow",
...)`. `__call__` is an async generator: Ray Data then runs up to k calls at once on the
actor's event loop, each adding its rows to the one engine that runs in a background
thread (EngineLoop), so rows of the next batch are admitted while the previous batch
finishes. Each call yields its batch once, every input row present exactly once, in
input order, with the engine's output columns appended; a failed row carries a message
in `error` instead of failing the batch.

It knows nothing of files or object storage: it reads a token-id column and writes
result columns.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import uuid
from typing import Any, Dict, List, Optional, Sequence, Union

import pyarrow as pa
import torch

from engine import Engine, EngineConfig, RequestOutput, SamplingParams, load_model

from .engine_loop import EngineLoop, error_output
from .metrics import EngineMetrics

logger = logging.getLogger(__name__)

# Output columns and their Arrow types (fixed, so every batch has the same schema).
OUTPUT_SCHEMA = pa.schema([
    ("generated_token_ids", pa.list_(pa.int64())),
    ("num_prompt_tokens", pa.int64()),
    ("num_generated_tokens", pa.int64()),
    ("num_blocks", pa.int64()),
    ("num_steps", pa.int64()),
    ("finish_reason", pa.string()),
    ("error", pa.string()),
    ("engine_rank", pa.int64()),
    ("latency_s", pa.float64()),
])


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: Union[str, torch.dtype], device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def _as_table(batch: Union[pa.Table, Dict[str, Any]]) -> pa.Table:
    if isinstance(batch, pa.Table):
        return batch
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas
        return pa.Table.from_pandas(batch, preserve_index=False)
    return pa.table({k: list(v) for k, v in batch.items()})


def _row_params(base: SamplingParams, override: Any) -> SamplingParams:
    """`base` with the non-null fields of a per-row dict applied (unknown keys raise)."""
    if not override:
        return base
    fields = {k: v for k, v in dict(override).items() if v is not None}
    if "stop_token_ids" in fields:
        fields["stop_token_ids"] = [int(t) for t in fields["stop_token_ids"]]
    return dataclasses.replace(base, **fields)


class DLLMEngineActor:
    """One engine on this actor's device; see the module docstring."""

    def __init__(self, model: str, engine: Optional[EngineConfig] = None, sampling: Optional[SamplingParams] = None,
                 *, dtype: str = "auto", device: str = "auto", torch_threads: Optional[int] = 1,
                 rank: Optional[int] = None, rank_group: Optional[str] = None, enable_metrics: bool = True,
                 record_batches: bool = False, warmup: bool = True,
                 token_ids_column: str = "prompt_token_ids", sampling_column: str = "sampling_params",
                 error_column: str = "error", model_storage: Any = None, run_id: str = ""):
        from pipeline.model_source import model_name, resolve_model  # lazy: pipeline imports this module

        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.device = resolve_device(device)
        self.engine_config = engine or EngineConfig()
        self.sampling = sampling or SamplingParams()
        self.token_ids_column = token_ids_column
        self.sampling_column = sampling_column
        self.error_column = error_column
        self._rank_counter = None  # keeps the group's rank counter alive while this engine lives
        self.rank = self._resolve_rank(rank, rank_group)
        # s3://… or a hub id: downloaded once per node (under a lock), then loaded from disk.
        self.model_name, self.run_id = model_name(model), run_id
        self.model, _ = load_model(resolve_model(model, model_storage), dtype=resolve_dtype(dtype, self.device),
                                   device=self.device, tokenizer=False)
        if warmup:
            self._warmup()
        self.metrics = self._make_metrics(enable_metrics)
        self._batch_seq = itertools.count()
        self._in_flight = 0
        self.loop = EngineLoop(
            lambda: Engine(self.model, self.engine_config, tokenizer=None, record_batches=record_batches),
            on_step=self._on_step)
        logger.info("engine rank %d ready on %s (%s)", self.rank, self.device, model)

    # --- setup ----------------------------------------------------------------------
    def _resolve_rank(self, rank: Optional[int], group: Optional[str]) -> int:
        if rank is not None:
            return int(rank)
        import ray

        if group and ray.is_initialized():
            from .rank import assign_rank

            rank, self._rank_counter = assign_rank(group)
            return rank
        return 0

    def _make_metrics(self, enable: bool) -> Optional[EngineMetrics]:
        import ray

        if not enable or not ray.is_initialized():
            return None
        return EngineMetrics(self.rank, model=self.model_name, run=self.run_id)

    def _warmup(self) -> None:
        """One throwaway request on a throwaway engine: the first forwards of a process
        are slow (lazy kernel setup), which would otherwise land in the first batch's
        latencies and metrics."""
        try:
            cfg = self.model.config
            token = next(t for t in range(cfg.vocab_size) if t not in (cfg.mask_token_id, *cfg.stop_token_ids))
            Engine(self.model, self.engine_config).generate(
                [[token]], SamplingParams(max_new_tokens=self.engine_config.block_length))
        except Exception:  # noqa: BLE001 - warm-up is best effort
            logger.warning("engine warm-up failed", exc_info=True)

    def _on_step(self, engine: Engine, outs: List[RequestOutput]) -> None:
        if self.metrics is not None:
            self.metrics.record_step(engine.stats, [o.latency_s for o in outs])

    # --- Ray Data entry point -----------------------------------------------------
    async def __call__(self, batch: Union[pa.Table, Dict[str, Any]]):
        yield await self.run_batch(batch)

    async def run_batch(self, batch: Union[pa.Table, Dict[str, Any]]) -> pa.Table:
        """The batch with the engine's output columns appended (one output per row)."""
        table = _as_table(batch)
        seq = next(self._batch_seq)
        self._set_in_flight(+1)
        try:
            outs = await asyncio.gather(*self._submit_rows(table, seq))
        finally:
            self._set_in_flight(-1)
        return self._attach(table, outs)

    def _submit_rows(self, table: pa.Table, seq: int) -> List["asyncio.Future[RequestOutput]"]:
        n, names = table.num_rows, table.column_names
        prompts = table.column(self.token_ids_column).to_pylist() if self.token_ids_column in names else [None] * n
        errors = table.column(self.error_column).to_pylist() if self.error_column in names else [None] * n
        overrides = table.column(self.sampling_column).to_pylist() if self.sampling_column in names else [None] * n
        futures = []
        for i, (prompt, err, override) in enumerate(zip(prompts, errors, overrides)):
            rid = (seq, i)
            if err:
                futures.append(self._done(error_output(rid, prompt or [], str(err))))
                continue
            if prompt is None:
                futures.append(self._done(error_output(rid, [], f"missing {self.token_ids_column!r}")))
                continue
            try:
                params = _row_params(self.sampling, override)
            except Exception as e:  # noqa: BLE001 - a bad per-row override fails that row only
                futures.append(self._done(error_output(rid, prompt, f"bad {self.sampling_column}: {e}")))
                continue
            futures.append(asyncio.wrap_future(self.loop.submit(prompt, params, rid)))
        return futures

    @staticmethod
    def _done(out: RequestOutput) -> "asyncio.Future[RequestOutput]":
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(out)
        return fut

    def _set_in_flight(self, delta: int) -> None:
        self._in_flight += delta
        if self.metrics is not None:
            self.metrics.set_batches_in_flight(self._in_flight)

    def _attach(self, table: pa.Table, outs: Sequence[RequestOutput]) -> pa.Table:
        cols = {
            "generated_token_ids": [list(o.token_ids) for o in outs],
            "num_prompt_tokens": [len(o.prompt_token_ids) for o in outs],
            "num_generated_tokens": [len(o.token_ids) for o in outs],
            "num_blocks": [o.num_blocks for o in outs],
            "num_steps": [o.num_steps for o in outs],
            "finish_reason": [o.finish_reason for o in outs],
            "error": [o.error if o.finish_reason == "error" else None for o in outs],
            "engine_rank": [self.rank] * len(outs),
            "latency_s": [float(o.latency_s) for o in outs],
        }
        keep = [c for c in table.column_names if c not in cols]
        table = table.select(keep)
        for f in OUTPUT_SCHEMA:
            table = table.append_column(f, pa.array(cols[f.name], f.type))
        return table

    # --- introspection (tests, debugging) -------------------------------------------
    def batch_log(self) -> Optional[List[List[Any]]]:
        """Request ids (batch number, row) of every block cycle, when record_batches."""
        log = self.loop.engine.batch_log
        return None if log is None else [list(r.request_ids) for r in log]

    def engine_stats(self) -> Dict[str, Any]:
        return dataclasses.asdict(self.loop.engine.stats)

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.shutdown(timeout=1.0)


def new_rank_group() -> str:
    """A fresh group id: the engines of one processor run number themselves 0..n-1."""
    return uuid.uuid4().hex[:12]
