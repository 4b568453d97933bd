"""DLLMEngineActor: the actor that owns one engine, built from one EngineSpec.

The run's group actor (actors/rank.py) starts one per dispatcher (actors/engine_router.py),
which calls `ready` (its rank, once loaded), `load` (batches in flight) and `run_batch`;
each call also starts the watchdog that has the group stop it once its dispatcher is gone.
Its rank is the group's next one (a restarted engine gets a new one), asked in the
constructor and awaited at the first call, which then starts its metrics (tagged by it):
the actor is async, and a blocking `ray.get` would stall its event loop.
It is a Ray Data callable class too: `ds.map_batches(DLLMEngineActor, fn_constructor_args=
(EngineSpec(model),), compute=ActorPoolStrategy(size=n, max_concurrent_calls_per_actor=k,
max_tasks_in_flight_per_actor=k), batch_format="pyarrow")`.

Calls are async: up to k run at once on the actor's event loop, each adding its rows to
the one engine that runs in a background thread (EngineLoop), so rows of the next batch
are admitted while the previous batch finishes. Each call returns its batch once, every
input row present once per sample (`n`, default 1; `sample_index` 0..n-1), in input
order, with the engine's output columns appended; a failed row carries a message in
`error` instead of failing the batch.

Seeds: a row's `sampling_params.seed`, else its `seed_column`, else one derived from the
job seed and the row's id (`row_seed`), so two rows with the same prompt are two
samples; the n samples of a row get seeds derived from the row's (`sample_seeds`).

It knows nothing of files or object storage: it reads a token-id column and writes
result columns. torch and the engine load when an actor is built, not at import.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import logging
import time
from typing import Any, Dict, List, Optional, Sequence, Union

import pyarrow as pa
import ray

from common.model_source import model_name
from common.schema import OUTPUT_SCHEMA, STOP_TEXT, as_table
from actors.row_values import RowValueError, parse_sampling, parse_seed

from .engine_build import load_engine, resolve_device, warm_up
from .engine_loop import EngineLoop, error_output
from .metrics import EngineMetrics
from .spec import EngineSpec
from .tensor_parallel import RankGroup

logger = logging.getLogger(__name__)

WATCH_S = 2.0  # how often an engine asks whether its dispatcher is still there


def derive_seed(*parts: Any) -> int:
    """A stable 62-bit seed from `parts` (not Python's salted hash): the same job seed and
    row id give the same seed on every worker and every run."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**62 - 1)


def row_seed(explicit: Optional[int], column: Any, job_seed: Optional[int], row_id: Any) -> Optional[int]:
    """A row's seed, first of: its own `sampling_params.seed`, its seed column, one derived
    from the job seed and its id (so duplicated prompts are distinct samples), the job
    seed (no id), None (the engine draws one)."""
    if explicit is not None:
        return int(explicit)
    if column is not None:
        return int(column)
    if job_seed is not None and row_id is not None:
        return derive_seed(int(job_seed), str(row_id))
    return job_seed


def sample_seeds(seed: Optional[int], n: int) -> List[Optional[int]]:
    """Seeds of a row's n samples: sample 0 keeps the row's seed (n=1 is unchanged),
    sample k > 0 gets one derived from it; None stays None (the engine draws per sample)."""
    if seed is None:
        return [None] * n
    return [seed] + [derive_seed(seed, k) for k in range(1, n)]


class DLLMEngineActor:
    """One engine on this actor's device; see the module docstring. `group`, `key`,
    `dispatcher`: the run's group actor, which numbers the engines and started this one
    for dispatcher `key` (a handle that does not keep it alive); None outside a run."""

    def __init__(self, spec: EngineSpec, group: Any = None, key: str = "", dispatcher: Any = None):
        import torch

        if spec.torch_threads:
            torch.set_num_threads(spec.torch_threads)
        self.spec, self.device = spec, resolve_device(spec.device)
        self.engine_config, self.sampling = spec.engine, spec.sampling
        self._group, self._key, self._dispatcher = group, key, dispatcher
        self._watchdog: Optional[asyncio.Future] = None
        self._tokenizer = None  # loaded for the first row with stop strings
        # spec.rank, else the group's next (asked now, in start order, and awaited at the first
        # call: see _numbered), else 0 (a plain Ray Data callable class)
        self.rank: Optional[int] = spec.rank if spec.rank is not None else (None if group is not None else 0)
        self._rank_ref = group.next.remote() if self.rank is None else None
        self.metrics: Optional[EngineMetrics] = None
        self.checkpoint = ckpt = spec.checkpoint()  # read once by the job's preflight
        self.model_name = model_name(ckpt.model)
        # s3://… or a hub id: downloaded once per node (under a lock), then loaded from disk
        self.model_dir = ckpt.weights_dir()  # also where stop strings' tokenizer is
        # tensor_parallel_size > 1: rank 0 of a placement group; it starts the other ranks,
        # which load their shards and step in lock step with it (actors/tensor_parallel.py)
        self.ranks = RankGroup(spec) if spec.tensor_parallel_size > 1 else None
        self.model, self.budget, self.engine_config, factory = load_engine(
            spec, ckpt, self.device, self.model_dir, lambda: self._tokenizer, tp=self.ranks and self.ranks.tp)
        if spec.warmup and ckpt.serving.warms_up:
            self._warmup()
        self._batch_seq = itertools.count()
        self._in_flight = 0
        self.loop = EngineLoop(factory, on_step=self._on_step) if self.ranks is None else \
            self.ranks.lockstep(factory, on_step=self._on_step)
        if self.rank is not None:
            self._numbered_as(self.rank)

    # --- setup ----------------------------------------------------------------------
    def _warmup(self) -> None:
        warm_up(self.model, self.engine_config)

    def _numbered_as(self, rank: int) -> None:
        """Take `rank` and start the metrics, which are tagged by it."""
        self.rank = rank
        if self.spec.enable_metrics and ray.is_initialized():
            self.metrics = EngineMetrics(rank, model=self.model_name, run=self.spec.run_id)
        logger.info("engine rank %d ready on %s (%s), %s", rank, self.device, self.checkpoint.model,
                    self.budget.describe())

    async def _numbered(self) -> int:
        """Its rank: the group's answer to the constructor's request, awaited by the first
        call (the calls that arrive meanwhile await the same answer)."""
        if self.rank is None:
            rank = int(await self._rank_ref)
            if self.rank is None:  # not taken by a call that awaited alongside
                self._numbered_as(rank)
        return self.rank

    def _on_step(self, engine: Any, outs: List[Any]) -> None:
        if self.metrics is not None:
            self.metrics.record_step(engine.stats, [o.latency_s for o in outs])
            # set again at every step, as the engine's own gauges are: set only when a batch
            # comes and goes, a long batch's value was missing from exports under load
            self.metrics.set_batches_in_flight(self._in_flight)

    # --- entry points: Ray Data, the dispatcher ----------------------------------------
    async def __call__(self, batch: Union[pa.Table, Dict[str, Any]]):
        yield await self.run_batch(batch)

    async def ready(self) -> int:
        """Its rank; answered once the model has loaded (a constructor runs before any call)."""
        self._watch()
        return await self._numbered()

    async def load(self) -> int:
        """Calls of run_batch running now (a dispatcher whose engine is lost picks the least busy)."""
        self._watch()
        return self._in_flight

    async def run_batch(self, batch: Union[pa.Table, Dict[str, Any]]) -> pa.Table:
        """The batch with the engine's output columns appended: one output row per
        (input row, sample), in input order (a row with `n` > 1 gives n rows)."""
        self._watch()
        await self._numbered()  # the rank of its output rows and metrics
        table = as_table(batch)
        seq = next(self._batch_seq)
        self._set_in_flight(+1)
        try:
            submitted = time.time()  # + each row's engine latency = when it finished
            rows, futures = self._submit_rows(table, seq)
            outs = await asyncio.gather(*futures)
        finally:
            self._set_in_flight(-1)
        out = self._attach(table, rows, outs, submitted)
        if self.spec.post_stats and self._group is not None:
            try:  # awaited: the pool may be torn down as soon as the last batch returns
                await self._group.put_stats.remote(self.rank, self.engine_stats())
            except Exception:  # noqa: BLE001 - stats are best effort
                logger.warning("engine stats not posted", exc_info=True)
        return out

    def _watch(self) -> None:
        if self._dispatcher is not None and self._group is not None and self._watchdog is None:
            self._watchdog = asyncio.ensure_future(self._stop_when_unneeded())

    async def _stop_when_unneeded(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            try:
                await self._dispatcher.__ray_ready__.remote()  # any actor has it
                continue
            except ray.exceptions.ActorDiedError:
                pass  # released by Ray Data (or failed for good)
            except Exception:  # noqa: BLE001 - restarting, unreachable: ask again later
                continue
            try:
                await self._group.release.remote(self._key)  # stops this actor when nothing is in flight
            except Exception:  # noqa: BLE001 - the group is gone: so is this engine, its owner's child
                return

    def _column(self, table: pa.Table, name: Optional[str]) -> List[Any]:
        return table.column(name).to_pylist() if name and name in table.column_names else [None] * table.num_rows

    def _submit_rows(self, table: pa.Table, seq: int) -> "tuple[List[_Sample], List[asyncio.Future]]":
        """One request per (row, sample); a row that cannot run gives one error row."""
        sp = self.spec
        cols = [self._column(table, c) for c in (sp.token_ids_column, sp.error_column, sp.sampling_column,
                                                 sp.seed_column, sp.id_column)]
        rows: List[_Sample] = []
        futures = []
        for i, (prompt, err, override, seed, row_id) in enumerate(zip(*cols)):
            try:
                params, err = self._params(prompt, err, override, seed, row_id)
            except Exception as e:  # noqa: BLE001 - whatever one row raises is that row's error
                params, err = None, f"row could not be prepared: {type(e).__name__}: {e}"
            if params is None:
                rows.append(_Sample(i, 0, False))
                futures.append(self._done(error_output((seq, i, 0), prompt or [], err)))
                continue
            for k, sample_seed in enumerate(sample_seeds(params.seed, params.n)):
                rows.append(_Sample(i, k, bool(params.stop)))
                futures.append(asyncio.wrap_future(
                    self.loop.submit(prompt, dataclasses.replace(params, seed=sample_seed, n=1), (seq, i, k))))
        return rows, futures

    def _params(self, prompt: Any, err: Any, override: Any, seed: Any, row_id: Any) -> "tuple[Any, str]":
        """(the row's SamplingParams with its seed resolved, "") or (None, why it cannot run)."""
        if err:
            return None, str(err)
        if prompt is None:
            return None, f"missing {self.spec.token_ids_column!r}"
        try:
            params = parse_sampling(override, self.sampling, self.spec.sampling_column)
            seed = parse_seed(seed, self.spec.seed_column)
            own = params.seed if override and override.get("seed") is not None else None
            params = dataclasses.replace(params, seed=row_seed(own, seed, self.sampling.seed, row_id))
        except RowValueError as e:  # a bad per-row value fails that row only, naming the field
            return None, str(e)
        uses_tokenizer = self.checkpoint.serving.uses_tokenizer  # the canvas engine reads neither field
        if params.stop and uses_tokenizer and not self._ensure_tokenizer():
            return None, "stop strings need the model's tokenizer, and the model has none; use stop_token_ids"
        if params.structured_outputs is not None and uses_tokenizer and not self._ensure_tokenizer():
            return None, "structured_outputs need the model's tokenizer, and the model has none"
        return params, ""

    def _ensure_tokenizer(self) -> bool:
        """Give the engine the model's tokenizer (stop strings are decided on the text, structured
        outputs compiled over its vocabulary); loaded once, at the first row that needs it."""
        if self._tokenizer is None:
            from common.tokenizer import load_tokenizer

            try:
                self._tokenizer = load_tokenizer(self.model_dir, self.checkpoint.hf, self.checkpoint.tokenizer.config)
            except Exception:  # noqa: BLE001 - no tokenizer: such rows fail, the rest run
                logger.warning("no tokenizer for stop strings in %s", self.model_dir, exc_info=True)
            if self._tokenizer is None:
                return False
            self.loop.engine.tokenizer = self._tokenizer
        return True

    @staticmethod
    def _done(out: Any) -> "asyncio.Future[Any]":
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(out)
        return fut

    def _set_in_flight(self, delta: int) -> None:
        self._in_flight += delta
        if self.metrics is not None:
            self.metrics.set_batches_in_flight(self._in_flight)

    def _attach(self, table: pa.Table, rows: Sequence["_Sample"], outs: Sequence[Any], submitted: float) -> pa.Table:
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
            "sample_index": [r.sample for r in rows],
            "finished_at": [submitted + float(o.latency_s) for o in outs],
            "generated_logprobs": [o.logprobs for o in outs],
            "top_logprobs": [None if o.top_logprobs is None else
                             [[{"token_id": t, "logprob": v} for t, v in top] for top in o.top_logprobs] for o in outs],
        }
        keep = [c for c in table.column_names if c not in cols and c != STOP_TEXT]
        table = table.select(keep)
        if len(rows) != table.num_rows or any(r.row != i for i, r in enumerate(rows)):
            table = table.take(pa.array([r.row for r in rows], pa.int64()))  # n > 1: a row per sample
        for f in OUTPUT_SCHEMA:
            table = table.append_column(f, pa.array(cols[f.name], f.type))
        texts = [o.text if r.stop and o.finish_reason != "error" else None for r, o in zip(rows, outs)]
        return table.append_column(STOP_TEXT, pa.array(texts, pa.string()))

    # --- introspection (tests, debugging) ----------------------------------------------
    def batch_log(self) -> Optional[List[List[Any]]]:
        """Request ids (batch number, row) of every block cycle, when record_batches."""
        log = self.loop.engine.batch_log
        return None if log is None else [list(r.request_ids) for r in log]

    def engine_stats(self) -> Dict[str, Any]:
        """The engine's EngineStats, and how its token budget was resolved (`budget`: where
        it came from, the memory plan: engine.budget.Budget)."""
        return {**dataclasses.asdict(self.loop.engine.stats), "budget": self.budget.as_dict()}

    def __del__(self) -> None:
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.shutdown(timeout=1.0)


@dataclasses.dataclass(frozen=True)
class _Sample:
    """Which input row an output row belongs to, its sample index, and whether it had
    stop strings (its text then comes from the engine)."""

    row: int
    sample: int
    stop: bool
