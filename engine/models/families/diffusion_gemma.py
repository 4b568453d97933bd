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
