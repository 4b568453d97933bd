"""DiffusionGemma's decoding knobs under transformers' names, defaulting to the
checkpoint's generation_config.json (then transformers' own global defaults), and the
loader of the network itself."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

import torch

from ..config import SamplingParams, bounds_of

# The SamplingParams fields that are DiffusionGemma's knobs (transformers' names).
KNOBS = ("max_denoising_steps", "entropy_bound", "t_min", "t_max", "stability_threshold", "confidence_threshold")


@dataclass(frozen=True)
class CanvasParams:
    """One request's resolved DiffusionGemma settings (no None left)."""

    max_denoising_steps: int
    entropy_bound: float
    t_min: float
    t_max: float
    stability_threshold: int
    confidence_threshold: float

    @classmethod
    def from_generation_config(cls, model_dir: str) -> "CanvasParams":
        """The defaults of a checkpoint folder's generation_config.json (tests, tools; a run
        has its Checkpoint's: `from_generation`)."""
        path = os.path.join(model_dir, "generation_config.json")
        gc: Mapping[str, Any] = {}
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                gc = json.load(f)
        return cls.from_generation(gc)

    @classmethod
    def from_generation(cls, gc: Mapping[str, Any]) -> "CanvasParams":
        """generation_config.json's values, transformers' global defaults where it has none
        (exactly what `model.generate()` would use)."""
        from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

        defaults = DiffusionGemmaGenerationConfig._get_default_generation_params()
        sampler = gc.get("sampler_config") or {}
        out = {k: gc.get(k) if gc.get(k) is not None else defaults[k] for k in KNOBS if k != "entropy_bound"}
        out["entropy_bound"] = sampler.get("entropy_bound", defaults["sampler_config"].entropy_bound)
        return cls(**out)

    def override(self, sp: Any) -> "CanvasParams":
        """These defaults with the non-None knobs of a SamplingParams (or dict) applied."""
        get = (lambda k: sp.get(k)) if isinstance(sp, Mapping) else (lambda k: getattr(sp, k, None))
        return replace(self, **{k: get(k) for k in KNOBS if get(k) is not None})

    def validate(self) -> Optional[str]:
        """Why a row cannot be decoded with these knobs, or None: each within its
        SamplingParams field's bounds (declared there once), and t_min < t_max."""
        for k in KNOBS:
            err = bounds_of(SamplingParams, k).error(k, getattr(self, k))
            if err:
                return err
        if not float(self.t_min) < float(self.t_max):
            return f"t_min must be below t_max, got t_min={self.t_min!r} t_max={self.t_max!r}"
        return None


def budget_refusal(prompt_len: int, max_tokens: int, canvas_length: int, token_budget: int) -> Optional[str]:
    """Why a row of this prompt length and max_tokens never fits the token budget (its
    canvases rounded up to whole ones), or None; the engine's check, and the preflight's
    for a one-token prompt."""
    if prompt_len + math.ceil(max_tokens / canvas_length) * canvas_length > token_budget:
        return f"prompt + max_tokens exceed the token budget {token_budget}"
    return None


def load_diffusion_gemma(source: Any, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                         weights_dir: Optional[str] = None, tp: Any = None):
    """transformers' DiffusionGemmaForBlockDiffusion (the class ships with transformers: no
    remote code) of a checkpoint folder or a Checkpoint (engine.checkpoint), from local
    files only, built from the Checkpoint's config.json rather than a second read of it.
    Experts run grouped: transformers' grouped_mm where the dtype has it, else its eager
    path, which loops over experts (never tokens). `tp` (engine.parallel): this rank's
    shard (engine.canvas.sharding; the checkpoint is read whole, then cut)."""
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from ..checkpoint import Checkpoint
    from ..serving import CANVAS

    ckpt = source if isinstance(source, Checkpoint) else Checkpoint.open(str(source))
    if ckpt.serving != CANVAS:
        raise ValueError(f"{ckpt.model}: model_type {ckpt.hf.get('model_type')!r} is not diffusion_gemma")
    sharded = tp is not None and tp.size > 1
    experts = "eager" if dtype == torch.float64 or sharded else None  # sharded: the loop that skips others' experts
    kw = {"experts_implementation": experts} if experts else {}
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(
        weights_dir or ckpt.weights_dir(), config=DiffusionGemmaConfig.from_dict(ckpt.hf), dtype=dtype,
        local_files_only=True, trust_remote_code=False, **kw)
    if sharded:  # rank tp.rank's shard, cut in place (engine.canvas.sharding)
        from .sharding import shard_diffusion_gemma

        model = shard_diffusion_gemma(model, ckpt.family, tp)
    return model.to(device).eval()


__all__ = ["CanvasParams", "KNOBS", "budget_refusal", "load_diffusion_gemma"]
