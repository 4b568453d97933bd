"""DLLMProcessorConfig: everything `build_processor` needs, in one dataclass.

Modelled on `ray.data.llm`'s processor configs: one object names the model, how many
engines run it, how rows are batched and how each request is decoded; the stages are
derived from it. Engine and decoding settings are the engine's own dataclasses so
there is one source of truth for their fields and validation.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from engine.config import Attention, EngineConfig, SamplingParams, enum_value

from .sorting.model import DTYPE_BYTES  # torch-free: the dtypes an engine loads, by name

SORT_MODES = ("none", "blendserve")


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
    adapter: Optional[str] = field(default=None, metadata={"help": (
        "PEFT LoRA adapter merged into the model's weights at load time (a local folder with adapter_config.json "
        "+ adapter_model.safetensors, an s3://… URL or a hub id, fetched and cached as --model is), e.g. "
        "SJTU-Deng-Lab/D2F_LLaDA_Instruct_8B_Lora")})
    attention: Attention = field(default=Attention.AUTO, metadata={"help": (
        "the model's attention: auto = what the checkpoint declares (dllm_attention in config.json), else "
        "bidirectional; block_causal for D2F adapters (prompt bidirectional, block j sees the prompt and blocks <= j)")})
    num_engines: int = field(default=1, metadata={"help": "engine actors; one GPU each when the cluster has GPUs"})
    batch_size: int = field(default=16, metadata={"help": "rows per map_batches call into an engine actor"})
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Batches one engine actor works on at once; > 1 keeps its queue fed across batch
    # boundaries (the engine admits rows of the next batch while the last one finishes).
    max_concurrent_batches: int = field(default=4, metadata={"help": "batches in flight per engine"})
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
    num_gpus_per_engine: Optional[float] = field(default=None, metadata={"help": (
        "GPUs per engine actor (none: 1 when the cluster has GPUs, else 0)")})
    # None: 1 CPU with a GPU; 0.5 on CPU so that read/tokenize/write tasks still get a
    # core on small machines (an actor holding every CPU starves the pipeline).
    num_cpus_per_engine: Optional[float] = field(default=None, metadata={"help": (
        "CPUs per engine actor (none: 1 with a GPU, 0.5 without)")})
    # Custom resources each engine actor needs, e.g. {"engine_slot": 1} on a cluster whose
    # engine nodes declare `--resources '{"engine_slot": N}'`: places engines on those nodes
    # (a restarted engine waits for a node with a free slot).
    resources_per_engine: Optional[Dict[str, float]] = None
    torch_threads: int = field(default=1, metadata={"help": "torch threads per CPU engine actor"})
    dtype: str = field(default="auto", metadata={"help": (
        f"weights' dtype: auto (bfloat16 on GPU, float32 on CPU) or {', '.join(DTYPE_BYTES)}")})
    cpu_stage_num_cpus: float = field(default=0.25, metadata={"help": (
        "CPUs per chat-template / tokenize / detokenize task")})
    # Each engine gets rows only once it has loaded its model, and each dispatcher holds its
    # first batches for its own engine, failing the job (naming this option) if that engine
    # has not loaded within this many seconds (actors/engine_router.py). 0: they go to any
    # engine up meanwhile, so the first engine ready takes the early batches and a small run
    # may never reach the others.
    wait_for_engines_s: int = field(default=600, metadata={"help": (
        "seconds to wait for every engine to load before rows flow (0: start with the first)")})
    # Request ordering. "blendserve": rows ordered by a per-row key (estimated cost,
    # costliest first; shared prompt prefix; prompt length) in windows of
    # `sort_window_rows`, feeding one pool of engines that pull blocks as they free up
    # (pipeline/sorting/order.py); lazy like every stage. "none": arrival order.
    sort: str = field(default="blendserve", metadata={"choices": SORT_MODES, "help": (
        "blendserve: costliest first over one engine pool; none: arrival order")})
    sort_window_rows: int = field(default=4096, metadata={"help": (
        "blendserve: rows ordered together (a shorter input is ordered whole)")})
    # sort="blendserve" only: prompts sharing at least this many leading tokens (compared
    # in pieces of 16) sit next to each other among requests of similar cost, so a shared
    # few-shot preamble is batched together. 0: no prefix grouping.
    sort_min_prefix: int = field(default=32, metadata={"help": (
        "blendserve: prompts sharing this many leading tokens sit together (0: off)")})
    # Engines post their stats (busy_s, padded_cells, ...) per rank after every batch;
    # read them with `processor.engine_stats()` (tests, benches).
    collect_engine_stats: bool = field(default=False, metadata={"cli": False, "help": "tests and benches"})
    # Observability.
    enable_metrics: bool = field(default=True, metadata={"help": "export engine metrics to Ray's Prometheus endpoint"})
    record_batches: bool = field(default=False, metadata={"cli": False, "help": (
        "keep the engine's per-cycle batch log (tests, debugging)")})

    def __post_init__(self) -> None:
        if self.num_engines < 1:
            raise ValueError("num_engines must be >= 1")
        if self.batch_size < 1:
            raise ValueError("batch_size must be >= 1")
        if self.max_concurrent_batches < 1:
            raise ValueError("max_concurrent_batches must be >= 1")
        if self.sort_window_rows < 1:
            raise ValueError(f"sort_window_rows must be >= 1, got {self.sort_window_rows!r}")
        if self.sort_min_prefix < 0:
            raise ValueError(f"sort_min_prefix must be >= 0, got {self.sort_min_prefix!r}")
        self.attention = enum_value("attention", self.attention, Attention)
        if self.sort not in SORT_MODES:
            raise ValueError(f"sort must be one of {SORT_MODES}, got {self.sort!r}")
        if str(self.dtype).removeprefix("torch.") not in ("auto", *DTYPE_BYTES):  # else the engines fail to start
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        err = self.sampling.validate()
        if err:
            raise ValueError(f"sampling: {err}")


MODEL_SETTINGS_FILE = "blockray.json"


def model_settings(model: str) -> Dict[str, Any]:
    """Decoding settings shipped beside a checkpoint (`blockray.json`: block_length,
    steps_per_block, cache, policy, threshold, max_new_tokens…), or {} when absent.
    The settings a model was trained for are better defaults than generic ones."""
    path = os.path.join(model, MODEL_SETTINGS_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def split_settings(settings: Dict[str, Any]) -> "tuple[Dict[str, Any], Dict[str, Any]]":
    """({EngineConfig fields}, {SamplingParams fields}) of a flat settings dict; other
    keys are ignored."""
    from dataclasses import fields

    eng = {f.name for f in fields(EngineConfig)}
    smp = {f.name for f in fields(SamplingParams)}
    return ({k: v for k, v in settings.items() if k in eng}, {k: v for k, v in settings.items() if k in smp})
