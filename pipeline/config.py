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
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional

from engine.config import (Attention, Bounds, EngineConfig, SamplingParams, above, at_least, enum_value,
                           out_of_bounds, within)

from .sorting.model import DTYPE_BYTES  # torch-free: the dtypes an engine loads, by name

SORT_MODES = ("none", "blendserve")

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
    # Engines post their stats (busy_s, padded_cells, ...) per rank after every batch;
    # read them with `processor.engine_stats()` (tests, benches).
    collect_engine_stats: bool = field(default=False, metadata={"cli": False, "help": "tests and benches"})
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
        """num_gpus / num_cpus / device of each engine actor on a cluster with this many
        GPUs: unless set, one GPU each when the cluster has any, and 1 CPU with a GPU, 0.5
        without (so that read/tokenize/write tasks still get a core on small machines: an
        actor holding every CPU starves the pipeline)."""
        gpus = self.num_gpus_per_engine if self.num_gpus_per_engine is not None else (1.0 if cluster_gpus > 0 else 0.0)
        cpus = self.num_cpus_per_engine if self.num_cpus_per_engine is not None else (1.0 if gpus else 0.5)
        return {"num_gpus": gpus, "num_cpus": cpus, "device": "cuda" if gpus else "cpu"}


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
