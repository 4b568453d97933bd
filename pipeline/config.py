"""DLLMProcessorConfig: everything `build_processor` needs, in one dataclass.

Modelled on `ray.data.llm`'s processor configs: one object names the model, how many
engines run it, how rows are batched and how each request is decoded; the stages are
derived from it. Engine and decoding settings are the engine's own dataclasses so
there is one source of truth for their fields and validation.
"""
from __future__ import annotations

import difflib
import json
import os
import posixpath
from dataclasses import dataclass, field, fields, replace
from typing import Any, Dict, List, Optional

from common.model_source import check_revision
from engine.config import (Attention, Bounds, EngineConfig, SamplingParams, above, at_least, enum_value,
                           out_of_bounds, within)

from .sorting.model import DTYPE_BYTES  # torch-free: the dtypes an engine loads, by name

SORT_MODES = ("none", "blendserve")

# chat_template_kwargs are the template's own variables (enable_thinking, ...): these are the
# named parameters of transformers' apply_chat_template (5.24), which blockray sets itself or
# does not serve, and `messages`, the variable the conversation is rendered as. Passing one
# would fail every chat row with a TypeError that names no option, after the engines start.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})

# The job's own numeric options, which are no config field (run_offline's keywords and the
# CLI's Ray flags): their bounds, declared here as the config fields declare theirs
# (metadata "bounds"), checked by the CLI as it parses and by run_offline / preflight.
JOB_BOUNDS: Dict[str, Bounds] = {
    "limit": at_least(0, integer=True, note=" (0: no rows, every check still made)"),
    "rows_per_file": at_least(0, integer=True, note=" (0: one file per batch)"),
    "max_error_fraction": within(0, 1),
    "num_cpus": at_least(1, integer=True),
    "dashboard_port": within(1, 65535, integer=True),
}


@dataclass
class DLLMProcessorConfig:
    """How a processor runs a dLLM over a Dataset.

    Input rows need `prompt_column` (text), or `messages_column` (chat turns, rendered
    with the chat template: by default whenever the column and a template exist, as
    ray.data.llm does), or `prompt_token_ids_column` (pre-tokenized). A `sampling_column`
    holding a dict per row overrides fields of `sampling` for that row (vLLM's names
    accepted: `max_tokens`, `top_p`, `top_k`, `stop`, `n`, `seed`, ...).
    """

    model: str = field(metadata={"help": (
        "local Hugging Face style directory (config.json, *.safetensors, tokenizer files), s3://… URL or hub "
        "id")})
    served_model_name: Optional[str] = field(default=None, metadata={"help": (
        "the name requests give for this run's model (vLLM's --served-model-name): a row's `model` (an OpenAI "
        "batch line's body.model) naming another is that row's error, and OpenAI batch results name it; the "
        "model's path or id is accepted too (none: the model's folder name, or its hub id)")})
    adapter: Optional[str] = field(default=None, metadata={"help": (
        "PEFT LoRA adapter merged into the model's weights at load time (a local folder with adapter_config.json "
        "+ adapter_model.safetensors, an s3://… URL or a hub id, fetched and cached as --model is), e.g. "
        "SJTU-Deng-Lab/D2F_LLaDA_Instruct_8B_Lora")})
    attention: Attention = field(default=Attention.AUTO, metadata={"help": (
        "the model's attention: auto = what the checkpoint declares (dllm_attention in config.json), else "
        "bidirectional; block_causal for D2F adapters (prompt bidirectional, block j sees the prompt and blocks <= j)")})
    num_engines: int = field(default=1, metadata={"bounds": at_least(1, integer=True),
        "help": "engine actors; one GPU each when the cluster has GPUs"})
    # vLLM's and ray.data.llm's name. > 1: each engine is a placement group of this many
    # bundles (one device each; PACK), one rank actor per bundle (actors/tensor_parallel.py).
    tensor_parallel_size: int = field(default=1, metadata={"bounds": at_least(1, integer=True), "help": (
        "devices one engine spans (vLLM's name): a placement group of that many bundles per engine (one GPU "
        "each on GPUs, CPU bundles on CPU), one rank actor per bundle, each holding its shard of the weights")})
    batch_size: int = field(default=16, metadata={"bounds": at_least(1, integer=True),
        "help": "rows per map_batches call into an engine actor"})
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Batches one engine actor works on at once; > 1 keeps its queue fed across batch
    # boundaries (the engine admits rows of the next batch while the last one finishes).
    max_concurrent_batches: int = field(default=4, metadata={"bounds": at_least(1, integer=True),
        "help": "batches in flight per engine"})
    # Columns.
    prompt_column: str = field(default="prompt", metadata={"help": "the input's text prompts"})
    messages_column: str = field(default="messages", metadata={"help": "the input's chat turns ({role, content})"})
    prompt_token_ids_column: str = field(default="prompt_token_ids", metadata={"help": (
        "the input's pre-tokenized prompts (used instead of text)")})
    sampling_column: str = field(default="sampling_params", metadata={"help": (
        "the input's per-row sampling overrides (a dict; vLLM's names accepted)")})
    seed_column: Optional[str] = field(default=None, metadata={"help": (
        "column holding a per-row seed; without it a row's sampling_params seed, else one derived from --seed "
        "and the row's id, so rows with the same prompt are distinct samples")})
    id_column: Optional[str] = field(default="id", metadata={"help": (
        "column naming each row; per-row seeds derive from it (the job sets it to its --id-column)")})
    # Stages.
    apply_chat_template: Optional[bool] = field(default=None, metadata={"help": (
        "render the messages column with the chat template; default (None): when the input has that column "
        "and the tokenizer (or --chat-template) has a template; True/False force it on/off")})
    chat_template: Optional[str] = field(default=None, metadata={"help": (
        "path to a Jinja chat template file (or the template text) used instead of the tokenizer's")})
    keep_prompt: bool = field(default=True, metadata={"help": (
        "keep the rendered chat prompt in the output's prompt column (what the model saw); off saves space "
        "in large runs")})
    add_special_tokens: bool = field(default=False, metadata={"help": (
        "let the tokenizer add special tokens to text prompts (off: the chat template carries BOS)")})
    detokenize: bool = field(default=True, metadata={"help": "decode generated_text from the generated token ids"})
    skip_special_tokens: bool = field(default=True, metadata={"help": "leave special tokens out of generated_text"})
    # As ray.data.llm: an error row (`error` set, `generated_text` null) skips the user's
    # postprocess and comes out whole; True passes it to postprocess too.
    postprocess_error_rows: bool = field(default=False, metadata={"cli": False, "help": (
        "build_processor: call postprocess on error rows too (default: they skip it and come out whole)")})
    # Resources. None: 1 GPU per engine when the cluster has GPUs, else CPU.
    num_gpus_per_engine: Optional[float] = field(default=None, metadata={"bounds": at_least(0), "help": (
        "GPUs per engine actor (none: 1 when the cluster has GPUs, else 0)")})
    # None: 1 CPU with a GPU; 0.5 on CPU so that read/tokenize/write tasks still get a
    # core on small machines (an actor holding every CPU starves the pipeline).
    num_cpus_per_engine: Optional[float] = field(default=None, metadata={"bounds": at_least(0), "help": (
        "CPUs per engine actor (none: 1 with a GPU, 0.5 without)")})
    # Custom resources each engine actor needs, e.g. {"engine_slot": 1} on a cluster whose
    # engine nodes declare `--resources '{"engine_slot": N}'`: places engines on those nodes
    # (a restarted engine waits for a node with a free slot).
    resources_per_engine: Optional[Dict[str, float]] = None
    torch_threads: int = field(default=1, metadata={"bounds": at_least(1, integer=True),
        "help": "torch threads per CPU engine actor"})
    dtype: str = field(default="auto", metadata={"help": (
        f"weights' dtype: auto (bfloat16 on GPU, float32 on CPU) or {', '.join(DTYPE_BYTES)}")})
    cpu_stage_num_cpus: float = field(default=0.25, metadata={"bounds": above(0), "help": (
        "CPUs per chat-template / tokenize / detokenize task")})
    # Each engine gets rows only once it has loaded its model, and each dispatcher holds its
    # first batches for its own engine, failing the job (naming this option) if that engine
    # has not loaded within this many seconds (actors/engine_router.py). 0: they go to any
    # engine up meanwhile, so the first engine ready takes the early batches and a small run
    # may never reach the others.
    wait_for_engines_s: int = field(default=600, metadata={"bounds": at_least(0, integer=True), "help": (
        "seconds to wait for every engine to load before rows flow (0: start with the first)")})
    # Request ordering. "blendserve": rows ordered by a per-row key (estimated cost,
    # costliest first; shared prompt prefix; prompt length) in windows of
    # `sort_window_rows`, feeding one pool of engines that pull blocks as they free up
    # (pipeline/sorting/order.py); lazy like every stage. "none": arrival order.
    sort: str = field(default="blendserve", metadata={"choices": SORT_MODES, "help": (
        "blendserve: costliest first over one engine pool; none: arrival order")})
    sort_window_rows: int = field(default=4096, metadata={"bounds": at_least(1, integer=True), "help": (
        "blendserve: rows ordered together (a shorter input is ordered whole)")})
    # sort="blendserve" only: prompts sharing at least this many leading tokens (compared
    # in pieces of 16) sit next to each other among requests of similar cost, so a shared
    # few-shot preamble is batched together. 0: no prefix grouping.
    sort_min_prefix: int = field(default=32, metadata={"bounds": at_least(0, integer=True), "help": (
        "blendserve: prompts sharing this many leading tokens sit together (0: off)")})
    # sort="blendserve" only: how far rows of one prefix group are kept together against the
    # cost order (pipeline/sorting/order.py grouped_buckets): 0 sorts by cost first, 1 puts a
    # group's rows side by side at its costliest row's place; for prefix caching.
    sort_prefix_locality: float = field(default=0.0, metadata={"bounds": within(0, 1), "help": (
        "blendserve: 0..1, how far rows sharing a prompt prefix are kept together against the cost order "
        "(0: cost first; 1: a prefix group's rows side by side; pairs with prefix caching)")})
    # several engines that cache prefixes (EngineSpec.prefix_caching): a batch goes to the engine
    # that served its prompt prefix last (actors/prefix_affinity.py), as SGLang's cache-aware router; False
    # routes as a plain pool (each dispatcher to its own engine).
    prefix_affinity: bool = field(default=True, metadata={"help": (
        "with prefix caching (--enable-prefix-caching; auto: on where exact) and several engines: send a batch "
        "to the engine that served its prompt prefix last, unless it is busier (default); --no-prefix-affinity: "
        "each batch to the engine that takes it")})
    # Engines post their stats (busy_s, padded_cells, ...) per rank after every batch;
    # read them with `processor.engine_stats()` (tests, benches).
    collect_engine_stats: bool = field(default=False, metadata={"cli": False, "help": "tests and benches"})
    # ray.data.llm's and vLLM's names for the same things (docs/usage.md's mapping table).
    should_continue_on_error: bool = field(default=False, metadata={"cli": False, "help": (
        "build_processor: False (ray.data.llm's default) raises on the first error row, naming its id and error, "
        "when the dataset is consumed; True passes error rows through with their `error` column. The job "
        "(run_offline, the CLI) always writes every row and judges by --max-error-fraction")})
    revision: Optional[str] = field(default=None, metadata={"help": (
        "hub revision (branch, tag or commit) of a hub id --model, as vLLM's --revision; not for a local folder "
        "or s3:// model (refused), nor for --adapter (fetched at its main branch)")})
    chat_template_kwargs: Optional[Dict[str, Any]] = field(default=None, metadata={"json": True, "help": (
        "keyword arguments of the chat template (passed to apply_chat_template), as ray.data.llm's and vLLM's, "
        "e.g. '{\"enable_thinking\": false}' (a JSON object)")})
    accelerator_type: Optional[str] = field(default=None, metadata={"help": (
        "the GPU type each engine needs, as Ray's accelerator_type (e.g. H200, A100-80G): engines are placed only "
        "on nodes with that GPU")})
    placement_group_config: Optional[Dict[str, Any]] = field(default=None, metadata={"json": True, "help": (
        "ray.data.llm's placement_group_config for one engine: {\"bundles\": [{\"GPU\": 1, \"CPU\": 1}], "
        "\"strategy\": \"PACK\"} (a JSON object); an engine is one actor on one node, so its bundles are summed "
        "into that actor's resources and must be packed (PACK / STRICT_PACK); instead of --num-gpus-per-engine, "
        "--num-cpus-per-engine and --engine-resource")})
    # Observability.
    enable_metrics: bool = field(default=True, metadata={"help": "export engine metrics to Ray's Prometheus endpoint"})
    record_batches: bool = field(default=False, metadata={"cli": False, "help": (
        "keep the engine's per-cycle batch log (tests, debugging)")})

    def __post_init__(self) -> None:
        err = out_of_bounds(self)
        if err:
            raise ValueError(err)
        self.attention = enum_value("attention", self.attention, Attention)
        if self.sort not in SORT_MODES:
            raise ValueError(f"sort must be one of {SORT_MODES}, got {self.sort!r}")
        if str(self.dtype).removeprefix("torch.") not in ("auto", *DTYPE_BYTES):  # else the engines fail to start
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        err = self.sampling.validate()
        if err:
            raise ValueError(f"sampling: {err}")
        check_revision(self.model, self.revision)
        if self.postprocess_error_rows and not self.should_continue_on_error:
            raise ValueError("postprocess_error_rows=True needs should_continue_on_error=True: without it the first "
                             "error row raises before any reaches postprocess")
        if self.chat_template_kwargs is not None and not (isinstance(self.chat_template_kwargs, dict) and all(
                isinstance(k, str) for k in self.chat_template_kwargs)):
            raise ValueError(f"chat_template_kwargs must be a dict of keyword arguments, got "
                             f"{self.chat_template_kwargs!r:.80}")
        reserved = sorted(set(self.chat_template_kwargs or ()) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise ValueError(f"chat_template_kwargs key {reserved[0]!r} is an argument of apply_chat_template itself, "
                             "not a variable of the template: blockray sets the template (chat_template), the "
                             "messages, tokenize, add_generation_prompt and continue_final_message per row, and "
                             "serves no tools or documents; leave it out")
        if self.accelerator_type is not None and (not isinstance(self.accelerator_type, str)
                                                  or not self.accelerator_type.strip()):
            raise ValueError(f"accelerator_type must name a GPU type (e.g. H200), got {self.accelerator_type!r}")
        self._sync_tensor_parallel()
        if self.placement_group_config is not None:
            rank_bundles(self.placement_group_config, self.tensor_parallel_size)  # refuses what cannot be placed
            given = [f"--{k.replace('_', '-')}" for k in ("num_gpus_per_engine", "num_cpus_per_engine")
                     if getattr(self, k) is not None] + (["--engine-resource"] if self.resources_per_engine else [])
            if given:
                raise ValueError(f"placement_group_config gives each engine's resources, and so does "
                                 f"{', '.join(given)}: give one of them")
        if self.accelerator_type is not None and not self.engine_resources(1.0)["num_gpus"]:
            raise ValueError(f"accelerator_type {self.accelerator_type!r} is a GPU type, and each engine asks for no "
                             "GPU (num_gpus_per_engine 0, or no GPU in placement_group_config): engines on CPU would "
                             "not use it; drop one of them")

    def _sync_tensor_parallel(self) -> None:
        """One tensor_parallel_size for the processor and its engines: this field, or the
        engine's (EngineConfig.tensor_parallel_size, e.g. from a model's blockray.json) when
        only that one is set; both set and different is refused. Under it, a rank is one
        device: num_gpus_per_engine is the engine's N GPUs (or 0, on CPU)."""
        tp, eng = self.tensor_parallel_size, getattr(self.engine, "tensor_parallel_size", 1)
        if tp != eng and tp != 1 and eng != 1:
            raise ValueError(f"tensor_parallel_size {tp}, but the engine config says {eng}: give one")
        tp = self.tensor_parallel_size = max(tp, eng)
        if eng != tp:
            self.engine = replace(self.engine, tensor_parallel_size=tp)
        if tp > 1 and self.num_cpus_per_engine == 0:  # Ray refuses a bundle of nothing
            raise ValueError(f"num_cpus_per_engine 0 with tensor_parallel_size {tp}: each rank's bundle of the "
                             "engine's placement group needs some CPU; give more than 0, or leave it unset")
        gpus = self.num_gpus_per_engine
        if tp > 1 and gpus is not None and gpus not in (0, tp):
            raise ValueError(f"num_gpus_per_engine {gpus:g} with tensor_parallel_size {tp}: each rank of an engine "
                             f"is one device, so an engine takes {tp} GPUs (or 0, on CPU); leave "
                             "--num-gpus-per-engine unset")

    def served_name(self) -> str:
        """served_model_name, else the adapter's (with one merged, the base alone is not
        served) or the model's folder name, or its hub id (vLLM's default is the --model
        text itself, a path that would tie requests to one machine's folders)."""
        if self.served_model_name:
            return self.served_model_name
        name = (self.adapter or self.model).rstrip("/")
        local = "://" in name or name.startswith(("/", ".", "~")) or os.path.exists(name)
        return posixpath.basename(name) if local else name

    def engine_resources(self, cluster_gpus: float) -> Dict[str, Any]:
        """num_gpus / num_cpus / custom resources / device of each engine actor on a cluster
        with this many GPUs: from placement_group_config's bundles when given, else unless
        set, one GPU each when the cluster has any (always with accelerator_type), and 1 CPU
        with a GPU, 0.5 without (so that read/tokenize/write tasks still get a core on small
        machines: an actor holding every CPU starves the pipeline). accelerator_type: Ray's
        resource `accelerator_type:<type>` (0.001 per engine, as Ray's option asks)."""
        resources = dict(self.resources_per_engine or {})
        n = self.tensor_parallel_size
        if self.placement_group_config is not None:  # one bundle per rank under tensor parallelism
            resources = bundle_of({"bundles": rank_bundles(self.placement_group_config, n)} if n > 1
                                  else self.placement_group_config)
            gpus, cpus = resources.pop("GPU", 0.0), resources.pop("CPU", 0.0)
        else:
            gpus = self.num_gpus_per_engine if self.num_gpus_per_engine is not None else (
                float(n) if cluster_gpus > 0 or self.accelerator_type else 0.0)
            cpus = self.num_cpus_per_engine if self.num_cpus_per_engine is not None else (float(n) if gpus else 0.5)
        if self.accelerator_type:
            resources[ACCELERATOR_PREFIX + self.accelerator_type] = ACCELERATOR_AMOUNT
        out = {"num_gpus": gpus, "num_cpus": cpus, "resources": resources, "device": "cuda" if gpus else "cpu"}
        if n > 1:  # totals above (the pool check's); each rank's bundle here
            out["placement"] = self.placement(gpus, cpus, resources)
        return out

    def placement(self, gpus: float, cpus: float, resources: Dict[str, float]) -> Dict[str, Any]:
        """The placement group of one engine of tensor_parallel_size N > 1: N bundles, one
        per rank (rank 0, the engine actor, on bundle 0), as ray.data.llm reserves one for a
        tensor-parallel vLLM engine ({"GPU": 1, "CPU": …} each, PACK): placement_group_config's
        own bundles when given, else the engine's GPUs and CPUs split evenly (on CPU, the
        engine's 0.5 CPU: a quarter each at N=2), accelerator_type's resource on each, a
        custom resource (--engine-resource) on bundle 0."""
        n = self.tensor_parallel_size
        if self.placement_group_config is not None:
            bundles = rank_bundles(self.placement_group_config, n)
            strategy = self.placement_group_config.get("strategy", "PACK")
        else:
            bundles = [{"CPU": cpus / n, **({"GPU": gpus / n} if gpus else {})} for _ in range(n)]
            bundles[0].update({k: v for k, v in resources.items() if not k.startswith(ACCELERATOR_PREFIX)})
            strategy = "PACK"
        if self.accelerator_type:
            for b in bundles:
                b[ACCELERATOR_PREFIX + self.accelerator_type] = ACCELERATOR_AMOUNT
        return {"bundles": bundles, "strategy": strategy}


# Ray's accelerator_type option is this resource, of this amount, on the task or actor
ACCELERATOR_PREFIX, ACCELERATOR_AMOUNT = "accelerator_type:", 0.001
PLACEMENT_STRATEGIES = ("PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD")


def bundle_of(pg: Any) -> Dict[str, float]:
    """The resources of one engine from ray.data.llm's `placement_group_config` ({"bundles":
    [...], "strategy": ...}, or its {"bundle_per_worker": {...}}), summed over its bundles, as
    ray.data.llm sums them for an engine of one device. Why summed, not a placement group:
    an engine is one actor on one node (at tensor_parallel_size 1), so its bundles are placed
    together; a SPREAD strategy over several bundles cannot be honoured and is refused.
    With tensor_parallel_size > 1 the bundles are the engine's placement group, one per
    rank (rank_bundles), and their sum is the engine's total (the pool check's)."""
    where = "placement_group_config"
    if not isinstance(pg, dict):
        raise ValueError(f"{where} must be a dict with 'bundles' and 'strategy', got {pg!r:.80}")
    unknown = sorted(set(pg) - {"bundles", "strategy", "bundle_per_worker"})
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; it takes 'bundles' (or "
                         "'bundle_per_worker') and 'strategy'")
    if ("bundles" in pg) == ("bundle_per_worker" in pg):
        raise ValueError(f"{where} needs 'bundles' (a list of resource dicts) or 'bundle_per_worker', one of them")
    bundles = pg["bundles"] if "bundles" in pg else [pg["bundle_per_worker"]]
    strategy = pg.get("strategy", "PACK")
    if strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(f"{where}: strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, got {strategy!r}")
    if not isinstance(bundles, list) or not bundles:
        raise ValueError(f"{where}: bundles must be a non-empty list of resource dicts, got {bundles!r:.80}")
    if len(bundles) > 1 and strategy not in ("PACK", "STRICT_PACK"):
        raise ValueError(f"{where}: strategy {strategy} over {len(bundles)} bundles, but an engine is one actor on "
                         "one node (at tensor_parallel_size 1): its bundles are placed together; use PACK or "
                         "STRICT_PACK, or one bundle")
    total: Dict[str, float] = {}
    for i, bundle in enumerate(bundles):
        if not isinstance(bundle, dict) or not bundle:
            raise ValueError(f"{where}: bundles[{i}] must be a non-empty dict of resources, got {bundle!r:.80}")
        for name, amount in bundle.items():
            if not isinstance(name, str) or isinstance(amount, bool) or not isinstance(amount, (int, float)) or (
                    not 0 <= amount < float("inf")):
                raise ValueError(f"{where}: bundles[{i}][{name!r}] must be a finite amount >= 0, got {amount!r}")
            total[name] = total.get(name, 0.0) + float(amount)
    return total


def rank_bundles(pg: Any, n: int) -> List[Dict[str, float]]:
    """The bundles of placement_group_config, checked (bundle_of), one per rank of an
    engine of tensor_parallel_size `n` ("bundle_per_worker": n copies, as ray.data.llm
    expands it): with n > 1 there must be n, each with at most one GPU (a rank is one
    device), packed on one node (PACK / STRICT_PACK)."""
    where = "placement_group_config"
    if n > 1 and isinstance(pg, dict) and pg.get("strategy", "PACK") not in ("PACK", "STRICT_PACK"):
        raise ValueError(f"{where}: strategy {pg['strategy']} for tensor_parallel_size {n}: an engine's ranks are "
                         "devices of one node; use PACK or STRICT_PACK")
    bundle_of(pg)
    bundles = [dict(b) for b in pg["bundles"]] if "bundles" in pg else [dict(pg["bundle_per_worker"]) for _ in range(n)]
    if n > 1 and len(bundles) != n:
        raise ValueError(f"{where}: {len(bundles)} bundle(s) for tensor_parallel_size {n}: give one bundle per rank "
                         "(or 'bundle_per_worker', repeated for each)")
    for i, b in enumerate(bundles):
        if n > 1 and not any(v > 0 for v in b.values()):
            raise ValueError(f"{where}: bundles[{i}] asks for nothing, and Ray places no empty bundle: give each rank "
                             "some CPU or a GPU")
        if n > 1 and b.get("GPU", 0) > 1:
            raise ValueError(f"{where}: bundles[{i}] asks for {b['GPU']:g} GPUs, and a rank of a tensor-parallel engine "
                             "is one device: at most 1 GPU per bundle")
    return bundles


MODEL_SETTINGS_FILE = "blockray.json"


def model_settings(model: str) -> Dict[str, Any]:
    """Decoding settings shipped beside a checkpoint (`blockray.json`: block_length,
    steps_per_block, cache, policy, threshold, max_new_tokens…), or {} when absent.
    The settings a model was trained for are better defaults than generic ones."""
    path = os.path.join(model, MODEL_SETTINGS_FILE)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            settings = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} does not read as JSON: {e}") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{path} must hold a JSON object of settings, got {type(settings).__name__}")
    return settings


def unknown_settings(settings: Dict[str, Any]) -> List[str]:
    """The keys of a blockray.json that are no EngineConfig or SamplingParams field, each
    with the field it may be a typo of: a key the run would otherwise drop silently."""
    known = [f.name for cls in (EngineConfig, SamplingParams) for f in fields(cls)]
    out = []
    for key in settings:
        if key not in known:
            near = difflib.get_close_matches(key, known, n=1)
            out.append(f"{key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    return out


def split_settings(settings: Dict[str, Any]) -> "tuple[Dict[str, Any], Dict[str, Any]]":
    """({EngineConfig fields}, {SamplingParams fields}) of a flat settings dict; other
    keys are ignored (`unknown_settings` names them)."""
    eng = {f.name for f in fields(EngineConfig)}
    smp = {f.name for f in fields(SamplingParams)}
    return ({k: v for k, v in settings.items() if k in eng}, {k: v for k, v in settings.items() if k in smp})
