"""The user-facing processor: `build_processor(config, preprocess=…, postprocess=…)(ds) -> ds`.

Modelled on `ray.data.llm.build_llm_processor`: a processor is a fixed chain of
`map_batches` stages derived from one config, applied lazily to a Dataset, so it
composes with whatever the user reads from or writes to. Stages:

    preprocess (user, per row) → [chat template] → tokenize → engines (a pool of
    dispatchers, one engine actor each) → detokenize → postprocess (user, per row)

Every stage adds columns and keeps the rest, so user columns reach the output as they
came in (unless postprocess chooses otherwise). As in ray.data.llm, a row that fails
(`error` set: a prompt too long, a bad per-row sampling value, ...) raises `ErrorRow`,
naming its id and error, when the dataset is consumed (`should_continue_on_error=False`,
the default); with True it skips postprocess (it has no generated text to build on) and
comes out whole, `error` set and `generated_text` null, unless `postprocess_error_rows`.
A row's `model` column names the model it is for (MODEL_COLUMN), which must be the one
served.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

import pyarrow as pa
import ray
import ray.data

from actors.engine_router import DISPATCHER_CPUS, EngineDispatcher
from actors.metrics import new_run_id
from actors.rank import engine_group
from actors.spec import EngineSpec
from common.schema import ENGINE_RETRIES, OUTPUT_SCHEMA, PRE_ERROR, TOKEN_IDS
from common.storage import StorageOptions

from .config import DLLMProcessorConfig
from .errors import JobError, UserFunctionError
from .run_spec import UNREAD, read_chat_template
from .sorting import order_dataset
from .sorting.order import max_width
from .stages import DetokenizeUDF, TokenizeUDF, chat_stage_kwargs

# the least time the dispatchers get to start when engines are waited for (seconds)
DISPATCHER_START_S = 120

RowFn = Callable[[Dict[str, Any]], Dict[str, Any]]

# Columns the processor adds to every row.
OUTPUT_COLUMNS = ("generated_text", *OUTPUT_SCHEMA.names, ENGINE_RETRIES.name)
# The input column naming the model (or LoRA adapter) a row is for: ray.data.llm's and
# vLLM's name; a row naming another than the one served is an error row.
MODEL_COLUMN = "model"


def _users(name: str, fn: RowFn, id_column: Optional[str] = None) -> RowFn:
    """The caller's `fn` (its preprocess or postprocess), whose exceptions say whose they
    are: a UserFunctionError naming it and the row's id, raised from the original, so that
    a failing run reads as the caller's to fix (pipeline/failures.py), not as a bug in
    blockray."""
    @functools.wraps(fn)  # Ray Data names the stage after it
    def call(row: Dict[str, Any]) -> Dict[str, Any]:
        try:
            return fn(row)
        except Exception as e:
            where = f" on the row with {id_column} {row[id_column]!r}" if id_column and id_column in row else ""
            if name == "postprocess" and row.get("error"):
                where += f", an error row ({row['error']}; its generated_text is null)"
            raise UserFunctionError(f"your {name} function raised {type(e).__name__}: {e}{where}") from e

    return call


def _postprocess(fn: RowFn, error_rows: bool, id_column: Optional[str]) -> RowFn:
    """The caller's postprocess over the rows that were generated; an error row passes
    whole (as ray.data.llm's error rows bypass postprocess), unless `error_rows`."""
    users = _users("postprocess", fn, id_column)

    @functools.wraps(fn)
    def apply(row: Dict[str, Any]) -> Dict[str, Any]:
        return row if row.get("error") and not error_rows else users(row)

    return apply


def served_names(config: DLLMProcessorConfig) -> Dict[str, Any]:
    """The names a row's MODEL_COLUMN may give for the model this run serves (its served
    name, config.served_name; its adapter's when there is one: with the adapter merged,
    the base model alone is not served), and
    what it serves in words; the tokenize stage's `models` argument."""
    name = config.adapter or config.model
    names = {name, name.rstrip("/"), config.served_name()}
    if os.path.isdir(name):  # a local folder by any spelling of its path
        names |= {os.path.abspath(name), os.path.realpath(name)}
    serving = (f"{config.model!r}" + (f" with adapter {config.adapter!r}" if config.adapter else "")
               + f" (served as {config.served_name()!r})")
    return dict(column=MODEL_COLUMN, served=sorted(names), serving=serving)


class ErrorRow(ValueError):
    """A row failed and the processor was built with should_continue_on_error=False
    (ray.data.llm's default): the dataset stops at the first such row, naming it."""


def raise_on_error_rows(batch: pa.Table, *, id_column: Optional[str]) -> pa.Table:
    """The batch unchanged, or ErrorRow for its first row whose `error` is set (its id and
    error: ray.data.llm's default, should_continue_on_error=False)."""
    errors = batch.column("error").to_pylist()
    first = next((i for i, e in enumerate(errors) if e), None)
    if first is None:
        return batch
    ids = batch.column(id_column).to_pylist() if id_column and id_column in batch.column_names else None
    name = f"with {id_column} {ids[first]!r}" if ids is not None else f"{first} of its batch (no {id_column!r} column)"
    raise ErrorRow(f"row {name} failed: {errors[first]} (should_continue_on_error=False, ray.data.llm's default; "
                   "True passes error rows through with their error column)")


def _merge_preprocess(fn: RowFn) -> RowFn:
    """Preprocess returns the fields it adds or changes; the rest of the row is kept."""
    def apply(row: Dict[str, Any]) -> Dict[str, Any]:
        return {**row, **fn(row)}

    return apply


@dataclass
class DLLMProcessor:
    config: DLLMProcessorConfig
    preprocess: Optional[RowFn] = None
    postprocess: Optional[RowFn] = None
    storage: Optional[StorageOptions] = None  # where a remote model (s3://…) is read from
    run_id: str = field(default_factory=new_run_id)  # the `run` tag of the engines' metrics
    checkpoint: Any = None  # the model read once (engine.checkpoint.Checkpoint): every stage and engine gets it
    # the template chat turns are rendered with, as read on the driver (None: the tokenizer's); UNREAD: read
    # config.chat_template here, once
    chat_template: Any = UNREAD

    def __post_init__(self) -> None:
        if self.chat_template is UNREAD:
            try:
                self.chat_template = read_chat_template(self.config.chat_template)
            except JobError as e:
                raise ValueError(e.message) from None

    def engine_resources(self) -> Dict[str, Any]:
        """num_gpus / num_cpus / device of each engine actor, resolved against the cluster."""
        return self.config.engine_resources(ray.cluster_resources().get("GPU", 0) if ray.is_initialized() else 0)

    def engine_options(self) -> Dict[str, Any]:
        """Each engine actor's Ray options: its CPUs, GPUs and custom resources (those of
        placement_group_config's bundles, and accelerator_type's resource, the one Ray's
        option of that name asks for), spread over the cluster's nodes. With
        tensor_parallel_size N > 1, the engine's placement group instead ("placement": N
        bundles, one per rank, which the group actor reserves: actors/rank.py), and the
        engine actor, rank 0, asks for bundle 0's resources."""
        res = self.engine_resources()
        if "placement" in res:
            first = dict(res["placement"]["bundles"][0])
            cpus, gpus = first.pop("CPU", 0.0), first.pop("GPU", 0.0)
            return dict(num_cpus=cpus, num_gpus=gpus, placement=res["placement"],
                        **({"resources": first} if first else {}))
        return dict(num_cpus=res["num_cpus"], num_gpus=res["num_gpus"], scheduling_strategy="SPREAD",
                    **({"resources": res["resources"]} if res["resources"] else {}))

    def engine_stats(self) -> Dict[int, Dict[str, Any]]:
        """{rank: engine stats} as last posted (config.collect_engine_stats), else {}."""
        group = getattr(self, "_group", None)
        return ray.get(group.stats.remote()) if group is not None and self.config.collect_engine_stats else {}

    def __call__(self, ds: ray.data.Dataset) -> ray.data.Dataset:
        cfg = self.config
        if self.preprocess is not None:
            ds = ds.map(_merge_preprocess(_users("preprocess", self.preprocess, cfg.id_column)),
                        num_cpus=cfg.cpu_stage_num_cpus)
        # tasks (pipeline/stages.py): the tokenize stage fuses with the read
        cpu_stage = dict(batch_format="pyarrow", batch_size=cfg.batch_size, num_cpus=cfg.cpu_stage_num_cpus,
                         udf_modifying_row_count=False)
        where = dict(run_id=self.run_id, checkpoint=self.checkpoint)
        ds = ds.map_batches(self.tokenize_udf(), **cpu_stage)

        res = self.engine_resources()
        k = cfg.max_concurrent_batches
        spec = EngineSpec(
            model=self.checkpoint, engine=cfg.engine, sampling=cfg.sampling, dtype=cfg.dtype,
            device=res["device"], torch_threads=cfg.torch_threads, run_id=self.run_id, enable_metrics=cfg.enable_metrics,
            prefix_affinity=cfg.prefix_affinity, post_stats=cfg.collect_engine_stats,
            record_batches=cfg.record_batches, token_ids_column=TOKEN_IDS, error_column=PRE_ERROR,
            sampling_column=cfg.sampling_column, seed_column=cfg.seed_column, id_column=cfg.id_column)
        if cfg.wait_for_engines_s > 0 and ds.context.wait_for_min_actors_s <= 0:
            # The dispatchers themselves (a twentieth of a CPU each) must be placed within it
            # too, given at least DISPATCHER_START_S (a worker process starting on a loaded
            # node is no engine failing to load); each then holds its first batches until its
            # engine has loaded, for wait_for_engines_s (actors/engine_router.py). Shared by
            # this dataset's lineage only (not the global DataContext).
            ds.context.wait_for_min_actors_s = max(cfg.wait_for_engines_s, DISPATCHER_START_S)
        # One pool of num_engines dispatchers pulling blocks as they free up, each with an
        # engine actor of its own, started and owned by the run's group actor; a lost engine's
        # batches go to a live engine (actors/engine_router.py). Engines number themselves
        # from the group, which the driver owns, so a restarted engine gets a rank of its own.
        self._group = engine_group()
        engines = dict(
            # the dataset holds the group
            fn_constructor_args=(spec, self.engine_options(), self._group, cfg.wait_for_engines_s),
            # k calls in flight per dispatcher, all feeding its one engine (see actors/engine_actor.py).
            compute=ray.data.ActorPoolStrategy(size=cfg.num_engines, max_tasks_in_flight_per_actor=k,
                                               max_concurrent_calls_per_actor=k),
            batch_size=cfg.batch_size, batch_format="pyarrow", num_cpus=DISPATCHER_CPUS,
            udf_modifying_row_count=True,  # n > 1: a row per sample
            # on the driver's node, else anywhere: a lost worker node then takes no dispatcher with it
            label_selector={"ray.io/node-id": ray.get_runtime_context().get_node_id()},
            fallback_strategy=[{"label_selector": {}}])
        if cfg.sort == "blendserve":  # lazy, streaming: windows ordered by a per-row key (pipeline/sorting)
            ds = order_dataset(ds, cfg, dict(num_cpus=cfg.cpu_stage_num_cpus), res["device"], self.checkpoint)
        ds = ds.map_batches(EngineDispatcher, **engines)
        ds = ds.map_batches(DetokenizeUDF(**where, detokenize=cfg.detokenize,
                                          skip_special_tokens=cfg.skip_special_tokens), **cpu_stage)
        if not cfg.should_continue_on_error:
            ds = ds.map_batches(functools.partial(raise_on_error_rows, id_column=cfg.id_column), **cpu_stage)
        if self.postprocess is not None:
            ds = ds.map(_postprocess(self.postprocess, cfg.postprocess_error_rows, cfg.id_column),
                        num_cpus=cfg.cpu_stage_num_cpus)
        return ds

    def tokenize_udf(self) -> TokenizeUDF:
        """The tokenize stage: the row's model checked, the chat template (auto: when a batch
        has messages and there is a template), then tokenize, a prompt certainly longer than
        an engine takes refused before it is tokenized whole."""
        cfg = self.config
        return TokenizeUDF(
            run_id=self.run_id, checkpoint=self.checkpoint, prompt_column=cfg.prompt_column,
            prompt_token_ids_column=cfg.prompt_token_ids_column, messages_column=cfg.messages_column,
            add_special_tokens=cfg.add_special_tokens, chat=chat_stage_kwargs(cfg, self.chat_template),
            max_prompt_tokens=max_width(cfg, self.checkpoint), models=served_names(cfg))


def build_processor(config: DLLMProcessorConfig, preprocess: Optional[RowFn] = None,
                    postprocess: Optional[RowFn] = None, *, storage: Optional[StorageOptions] = None,
                    run_id: Optional[str] = None, checkpoint: Any = None, chat_template: Any = UNREAD) -> DLLMProcessor:
    """A callable that maps a Dataset of prompts to a Dataset of generations.

    `preprocess(row) -> dict` runs first and its fields are merged into the row (e.g.
    build `prompt` from other columns, or set a per-row `sampling_params` dict).
    `postprocess(row) -> dict` runs last and its result *is* the output row. An error row
    (`error` set, `generated_text` null) raises ErrorRow naming it when the dataset is
    consumed, unless `config.should_continue_on_error`: then it skips postprocess and comes
    out whole, unless `config.postprocess_error_rows`.
    `storage`: object-storage options for a remote `config.model` (default: AWS_* variables).
    `run_id`: the engines' `run` metrics tag (default: a fresh one).
    `checkpoint`: the model's Checkpoint when the caller's preflight opened it (the job
    does); else the model is opened and checked here, once.
    `chat_template`: the template's text when the caller read it (the job's preflight:
    the template rendering, the tokenizer's included; None: none); else config.chat_template
    is read here, once.
    Raises ValueError (one line) when the model cannot be served, before any actor starts.
    """
    from .preflight import check_model, check_tensor_parallel

    storage = (storage or StorageOptions()).resolved()  # once, here: every actor talks to the same endpoint
    if checkpoint is None:
        try:
            checkpoint = check_model(config.model, needs_tokenizer=False, storage=storage, adapter=config.adapter,
                                     attention=config.attention, sampling=config.sampling, engine=config.engine,
                                     revision=config.revision)
            check_tensor_parallel(config, checkpoint)
        except JobError as e:
            raise ValueError(e.message) from None
    return DLLMProcessor(config, preprocess, postprocess, storage, run_id or new_run_id(), checkpoint, chat_template)
