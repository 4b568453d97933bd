"""DiffusionGemma (google/diffusiongemma-26B-A4B-it; model_type "diffusion_gemma"): a Gemma 4
backbone (sliding and global layers with two RoPE bases, QK norm, final logit softcap,
128 experts top-8 plus a shared MLP, scaled embeddings) run as a causal encoder that
writes a K/V cache and a bidirectional denoiser over a random canvas with
self-conditioning. Not a masked-diffusion model: there is no mask token and no
LLaDA-style block schedule, so it does not fit `Family` (whose parse builds the
hand-written DLLM); the engine drives transformers' own DiffusionGemmaForBlockDiffusion
(native in transformers, never remote code) through engine.canvas. Torch-free."""
from __future__ import annotations

from typing import Any, Mapping, Optional

from .base import ConfigRefused

MODEL_TYPE = "diffusion_gemma"
NAME = "DiffusionGemma"
EXAMPLES = "google/diffusiongemma-26B-A4B-it"


def is_diffusion_gemma(hf: Mapping[str, Any]) -> bool:
    return hf.get("model_type") == MODEL_TYPE


def checkpoint_config(model_dir: str) -> Optional[dict]:
    """config.json of `model_dir` when it is a DiffusionGemma checkpoint; None when it is
    another model's or cannot be read (the callers' other paths then report it)."""
    import json
    import os

    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            hf = json.load(f)
    except (OSError, ValueError, TypeError):
        return None
    return hf if isinstance(hf, dict) and is_diffusion_gemma(hf) else None


def check_config(hf: Mapping[str, Any]) -> None:
    """What the canvas engine needs from config.json beyond what transformers' class reads
    (every key of it is computed by transformers' own modules, so none is ignored)."""
    tc: Optional[Mapping[str, Any]] = hf.get("text_config")
    if not isinstance(tc, Mapping):
        raise ConfigRefused("config.json of a diffusion_gemma checkpoint has no text_config")
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "layer_types"):
        if key not in tc:
            raise ConfigRefused(f"config.json text_config lacks {key!r}")
    if not isinstance(hf.get("canvas_length", 256), int) or hf.get("canvas_length", 256) < 1:
        raise ConfigRefused(f"config.json canvas_length={hf.get('canvas_length')!r} must be an integer >= 1")


def approx_model_config(hf: Mapping[str, Any]) -> Any:
    """An approximate engine ModelConfig of a diffusion_gemma config.json, for what only
    needs a model's sizes (the sorter's cost model, the preflight's vocabulary check): its
    text backbone's widths, layer count, heads, vocabulary and context; the MoE width one
    token computes as a dense MLP. Approximate: it ignores the sliding window, the two head
    sizes and the canvas's per-step decoder forwards. Never loads a network."""
    from ..config import ModelConfig

    check_config(hf)
    tc = hf["text_config"]
    heads = int(tc.get("num_attention_heads", 8))
    kv = int(tc.get("num_key_value_heads", heads))
    width = int(tc.get("intermediate_size", 4 * tc["hidden_size"]))
    if tc.get("enable_moe_block"):
        width += int(tc.get("moe_intermediate_size", 0)) * int(tc.get("top_k_experts", 0))
    eos = tc.get("eos_token_id", 1)
    return ModelConfig(model_type="llada", vocab_size=int(tc["vocab_size"]), hidden_size=int(tc["hidden_size"]),
                       n_layers=int(tc["num_hidden_layers"]), n_heads=heads, n_kv_heads=kv,
                       intermediate_size=width, mask_token_id=int(tc.get("pad_token_id") or 0),
                       eos_token_id=int(eos[0] if isinstance(eos, list) else eos),
                       max_seq_len=int(tc.get("max_position_embeddings", 131072)))


# transformers' DiffusionGemmaGenerationConfig default (checked by tests/test_diffusion_gemma.py):
# read here without importing transformers, since the sorter runs in data-side workers.
DEFAULT_MAX_DENOISING_STEPS = 48


def cost_shape(model_dir: str, max_denoising_steps: Optional[int] = None) -> Optional[dict]:
    """The sorter's account (pipeline/sorting/cost.py `work`) of a DiffusionGemma row, or
    None when `model_dir` holds no diffusion_gemma config.json. A block is a canvas
    (`canvas_length`) of at most `max_denoising_steps` decoder steps (the request's
    knob, else generation_config.json's, else transformers' default); the encoder writes
    the prompt once and every committed canvas once, the last one never: cache
    "persistent" on a block canvas, p + K S L + (K - 1) L cells for K = ceil(g / L)
    canvases. An upper bound of what the canvas engine forwards (its `cells`), reached
    when no canvas stops early and no row ends before max_tokens; a preempted row's
    recompute is not charged."""
    import json
    import os

    hf = checkpoint_config(model_dir)
    if hf is None:
        return None
    steps = max_denoising_steps
    if steps is None:
        try:
            with open(os.path.join(model_dir, "generation_config.json"), encoding="utf-8") as f:
                steps = json.load(f).get("max_denoising_steps")
        except (OSError, ValueError):
            steps = None
    return dict(block_length=int(hf.get("canvas_length", 256)),
                steps_per_block=int(steps or DEFAULT_MAX_DENOISING_STEPS), cache="persistent", full_canvas=False)


# Options of blockray's masked-diffusion engine that DiffusionGemma's canvas decoding has
# no use for: set to anything but their default, a run is refused (never ignored).
MASKED_ONLY_SAMPLING = ("policy", "threshold", "factor", "temperature", "stop_token_ids", "remasking",
                        "first_position", "top_p", "top_k", "stop", "block_add_threshold",
                        "decoded_token_threshold")
MASKED_ONLY_ENGINE = ("block_length", "steps_per_block", "cache", "canvas", "advance")


def masked_only_settings(sampling: Any = None, engine: Any = None) -> list:
    """The names of the masked-diffusion-only settings `sampling` / `engine` set to a
    non-default value (SamplingParams / EngineConfig), for a one-line refusal."""
    out = []
    for obj, names in ((sampling, MASKED_ONLY_SAMPLING), (engine, MASKED_ONLY_ENGINE)):
        if obj is not None:
            default = type(obj)()
            out += [n for n in names if getattr(obj, n, None) != getattr(default, n, None)]
    return out
