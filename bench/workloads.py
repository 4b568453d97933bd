"""Benchmark workloads: the requests, the model and the decoding every scheduler runs.

Why here and not in the engine: a workload is a measurement choice (which prompts,
which difficulty mix, which model), and every scheduler of one run must get exactly
the same one. Two kinds:

* `skewed`: a random-weights LLaDA-layout model wrapped in `PlantedStops`, prompts with
  long-tailed (clipped lognormal) lengths, and a planted difficulty per request: the
  number of 32-token blocks before EOS, drawn from an 11-level distribution where most
  answers end in 1-3 blocks and a tail runs to 11 (the shape reported for LLaDA on
  GSM8K with 32-token blocks; the exact weights are ours, see DIFFICULTY_11).
* `tiny-eval`: the embedded tiny dLLM on its shipped eval prompts, with exact-match
  accuracy, so a speedup is shown on a model that really decodes.
* `sdar`: the skewed workload on an SDAR-shaped block-diffusion model (Qwen3 layer,
  block-causal, blocks at absolute positions) decoded as TraDo's evaluation does: blocks
  of 4, 4 steps, low_confidence_dynamic at 0.9; answers of 1-24 blocks.
"""
from __future__ import annotations

import math
from collections import Counter
import os
import random
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Dict, List, Optional, Sequence

import torch

from engine import ModelConfig, SamplingParams, build_model, load_model, save_model

from .planted import Markers, PlantedStops

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_MODEL_DIR = os.path.join(REPO, "engine", "assets", "tiny-dllm")
TINY_EVAL_PARQUET = os.path.join(REPO, "jobs", "data", "tiny_eval.parquet")

# P(request ends after k blocks), k = 1..11: 70% end within 3 blocks, 8% need 8 or more.
DIFFICULTY_11 = (0.30, 0.25, 0.15, 0.08, 0.06, 0.045, 0.035, 0.03, 0.02, 0.015, 0.015)


@dataclass
class Workload:
    """Everything a scheduler run needs; identical across the runs of one benchmark."""

    name: str
    model: torch.nn.Module
    prompts: List[Any]  # token ids, or text when `tokenizer` is set
    params: List[SamplingParams]
    block_length: int
    steps_per_block: int
    tokenizer: Any = None
    references: Optional[List[str]] = None  # exact-match targets (tiny-eval)
    planted_blocks: Optional[List[int]] = None  # k per request (skewed)
    info: Dict[str, Any] = field(default_factory=dict)  # written to the JSON

    def subset(self, n: int) -> "Workload":
        """The first n requests (the workload order is already random)."""
        pick = lambda xs: None if xs is None else xs[:n]  # noqa: E731
        return Workload(self.name, self.model, self.prompts[:n], self.params[:n], self.block_length,
                        self.steps_per_block, self.tokenizer, pick(self.references), pick(self.planted_blocks),
                        dict(self.info))


@dataclass
class SkewedSpec:
    """The skewed workload; defaults give a CPU run of minutes (model ~4.5M params)."""

    name: ClassVar[str] = "skewed"
    n_requests: int = 128
    block_length: int = 32
    steps_per_block: int = 32
    threshold: float = 0.9
    difficulty: Sequence[float] = DIFFICULTY_11  # P(k) for k = 1..len(difficulty)
    prompt_median: float = 96.0
    prompt_sigma: float = 0.8
    prompt_min: int = 8
    prompt_max: int = 1024
    seed: int = 0
    # model (random weights, LLaDA layout)
    hidden_size: int = 256
    n_layers: int = 4
    n_heads: int = 4
    intermediate_size: int = 768
    vocab_size: int = 4096
    dllm_attention: str = "bidirectional"

    @property
    def max_blocks(self) -> int:
        return len(self.difficulty)

    def model_config(self) -> ModelConfig:
        return ModelConfig(model_type="llada", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_heads,
                           intermediate_size=self.intermediate_size, mask_token_id=self.vocab_size - 1,
                           eos_token_id=1, pad_token_id=0, max_seq_len=self.prompt_max + self.max_blocks
                           * self.block_length + 64, dllm_attention=self.dllm_attention)


# P(answer ends after k blocks of 4), k = 1..24: geometric, most answers short, a long tail
SDAR_DIFFICULTY = tuple(round(0.88 ** k, 4) for k in range(24))


@dataclass
class SDARSpec(SkewedSpec):
    """The skewed workload on an SDAR-shaped model (random weights, model_type "sdar":
    QK norm, head_dim 64 with 8 query and 2 K/V heads on a 256-wide model, theta 1e6,
    block-causal, blocks at absolute positions), TraDo's evaluation decoding (blocks of 4,
    4 steps, threshold 0.9: low_confidence_dynamic)."""

    name: ClassVar[str] = "sdar"
    n_requests: int = 64
    block_length: int = 4
    steps_per_block: int = 4
    difficulty: Sequence[float] = SDAR_DIFFICULTY
    prompt_median: float = 64.0
    prompt_max: int = 512
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 64
    dllm_attention: str = "block_causal"

    def model_config(self) -> ModelConfig:
        return ModelConfig(model_type="sdar", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           n_layers=self.n_layers, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
                           head_dim=self.head_dim, qk_norm=True, rope_theta=1e6, rms_norm_eps=1e-6,
                           intermediate_size=self.intermediate_size, mask_token_id=self.vocab_size - 1,
                           eos_token_id=1, pad_token_id=0, dllm_attention=self.dllm_attention,
                           max_seq_len=self.prompt_max + self.max_blocks * self.block_length + 64)


SMOKE_SDAR = SDARSpec(n_requests=12, difficulty=(0.4, 0.3, 0.2, 0.1), prompt_median=12, prompt_sigma=0.6,
                      prompt_min=3, prompt_max=40, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12,
                      intermediate_size=64, vocab_size=512)

SMOKE_SKEWED = SkewedSpec(n_requests=12, block_length=8, steps_per_block=8, difficulty=(0.4, 0.3, 0.2, 0.1),
                          prompt_median=12, prompt_sigma=0.6, prompt_min=3, prompt_max=40, hidden_size=32,
                          n_layers=2, n_heads=4, intermediate_size=64, vocab_size=512)


def write_tiny_model(path: str, seed: int = 0, **overrides) -> str:
    """A random tiny LLaDA-style checkpoint (float32) plus the tiny char tokenizer, in the
    HF layout that engine.load_model and the pipeline's tokenizer loader read."""
    from tiny.tokenizer import save_tokenizer

    ids = save_tokenizer(path)
    cfg = ModelConfig.tiny("llada", vocab_size=ids["vocab_size"], mask_token_id=ids["mask"],
                           eos_token_id=ids["eos"], pad_token_id=ids["pad"], **overrides)
    save_model(build_model(cfg, dtype=torch.float32, seed=seed), path)
    return path


def markers_for(cfg: ModelConfig, n_markers: int) -> Markers:
    """Marker tokens just below the lowest special id (mask, EOS, EoT), body tokens below them."""
    top = min([cfg.vocab_size, cfg.mask_token_id] + [t for t in cfg.stop_token_ids if t > 2])
    base = top - n_markers
    if base < 3 + 16:
        raise ValueError(f"vocabulary of {cfg.vocab_size} is too small for {n_markers} marker tokens")
    return Markers(marker_base=base, n_markers=n_markers)


def draw_requests(spec: SkewedSpec, markers: Markers, rng: random.Random):
    """(prompt token ids, planted k) per request. A prompt is [marker of T] + body, with
    T = p + (k-1) L + o the absolute position of its first EOS (0 < o < L)."""
    L, ks = spec.block_length, range(1, spec.max_blocks + 1)
    prompts, blocks = [], []
    for _ in range(spec.n_requests):
        p = int(round(math.exp(rng.gauss(math.log(spec.prompt_median), spec.prompt_sigma))))
        p = max(spec.prompt_min, min(spec.prompt_max, p))
        k = rng.choices(ks, weights=spec.difficulty)[0]
        o = rng.randrange(1, L)
        body = [rng.randrange(markers.first_body, markers.marker_base) for _ in range(p - 1)]
        prompts.append([markers.encode(p + (k - 1) * L + o)] + body)
        blocks.append(k)
    return prompts, blocks


def skewed(spec: SkewedSpec = SkewedSpec(), dtype=torch.float32, device="cpu", model=None) -> Workload:
    """The skewed workload (builds the random model unless `model`, a DLLM, is given)."""
    cfg = model.config if model is not None else spec.model_config()
    model = model if model is not None else build_model(cfg, dtype=dtype, device=device, seed=spec.seed)
    markers = markers_for(cfg, spec.prompt_max + spec.max_blocks * spec.block_length)
    wrapped = PlantedStops(model, markers, spec.block_length)
    prompts, blocks = draw_requests(spec, markers, random.Random(spec.seed))
    sp = SamplingParams(max_new_tokens=spec.max_blocks * spec.block_length, policy="threshold",
                        threshold=spec.threshold)
    lens = sorted(len(p) for p in prompts)
    info = {"spec": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(spec).items()},
            "model_params": cfg.num_params(), "dtype": str(dtype).replace("torch.", ""),
            "prompt_len": _quantiles(lens), "planted_blocks_hist": _hist(blocks, spec.max_blocks),
            "mean_planted_blocks": sum(blocks) / len(blocks)}
    return Workload(spec.name, wrapped, prompts, [sp] * len(prompts), spec.block_length, spec.steps_per_block,
                    planted_blocks=blocks, info=info)


@dataclass
class TinyEvalSpec:
    """The embedded model on its eval prompts with the decoding it was trained for."""

    n_requests: Optional[int] = None  # None = every row of the parquet
    block_length: int = 8
    steps_per_block: int = 8
    threshold: float = 0.9
    max_new_tokens: int = 56
    model_dir: str = TINY_MODEL_DIR
    eval_parquet: str = TINY_EVAL_PARQUET


def tiny_model_available(model_dir: str = TINY_MODEL_DIR) -> bool:
    return os.path.isfile(os.path.join(model_dir, "config.json"))


def tiny_eval(spec: TinyEvalSpec = TinyEvalSpec(), dtype=torch.float32, device="cpu") -> Workload:
    import pyarrow.parquet as pq

    if not tiny_model_available(spec.model_dir):
        raise FileNotFoundError(f"tiny-eval needs the embedded model at {spec.model_dir} (config.json missing)")
    model, tok = load_model(spec.model_dir, dtype=dtype, device=device)
    if tok is None:
        raise FileNotFoundError(f"{spec.model_dir} has no tokenizer files")
    table = pq.read_table(spec.eval_parquet, columns=["id", "prompt", "reference", "task"]).to_pylist()
    if spec.n_requests is not None:
        table = table[: spec.n_requests]
    sp = SamplingParams(max_new_tokens=spec.max_new_tokens, policy="threshold", threshold=spec.threshold)
    lens = sorted(len(r["prompt"]) for r in table)  # one token per char
    info = {"spec": asdict(spec), "model_params": model.config.num_params(), "dtype": str(dtype).replace("torch.", ""),
            "prompt_len": _quantiles(lens), "tasks": _count(r["task"] for r in table)}
    return Workload("tiny-eval", model, [r["prompt"] for r in table], [sp] * len(table), spec.block_length,
                    spec.steps_per_block, tokenizer=tok, references=[r["reference"] for r in table], info=info)


def _quantiles(xs: List[int]) -> Dict[str, float]:
    q = lambda f: xs[min(len(xs) - 1, int(f * len(xs)))]  # noqa: E731
    return {"min": xs[0], "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": xs[-1], "mean": sum(xs) / len(xs)}


def _hist(ks: List[int], n: int) -> List[int]:
    return [sum(1 for k in ks if k == i) for i in range(1, n + 1)]


def _count(items) -> Dict[str, int]:
    return dict(Counter(items))
