"""Named decoding settings (`blockray --preset NAME`, or `preset(NAME)` in Python): a
published method's recommended EngineConfig and SamplingParams values for a task, so a
user does not copy five numbers from a paper's scripts.

The D2F presets are D2F-LLaDA's evaluation settings, from
zhijie-group/Discrete-Diffusion-Forcing, D2F-eval/eval_llada.sh (commit 771f745):
gsm8k `block_size=64 block_add_threshold=0.7 decoded_token_threshold=0.95
skip_threshold=0.9`, humaneval `block_size=32 block_add_threshold=0.1
decoded_token_threshold=0.95 skip_threshold=0.9`, both `max_new_tokens=512
temperature=0`; D2F caches completed blocks (blockray: cache "persistent"). They need a
block-causal model (D2F-LLaDA: LLaDA-8B-Instruct with the D2F LoRA adapter, attention
block_causal)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Dict, Optional, Tuple

from .config import EngineConfig, SamplingParams


@dataclass(frozen=True)
class Preset:
    engine: Dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    sampling: Dict[str, Any] = field(default_factory=dict)  # SamplingParams fields
    source: str = ""


_D2F_LLADA = "zhijie-group/Discrete-Diffusion-Forcing D2F-eval/eval_llada.sh (commit 771f745)"
PRESETS: Dict[str, Preset] = {
    "d2f-gsm8k": Preset(
        engine=dict(block_length=64, cache="persistent"),
        sampling=dict(block_add_threshold=0.7, decoded_token_threshold=0.95, threshold=0.9, max_new_tokens=512,
                      temperature=0.0, policy="threshold", remasking="low_confidence"),
        source=f"{_D2F_LLADA}, gsm8k"),
    "d2f-humaneval": Preset(
        engine=dict(block_length=32, cache="persistent"),
        sampling=dict(block_add_threshold=0.1, decoded_token_threshold=0.95, threshold=0.9, max_new_tokens=512,
                      temperature=0.0, policy="threshold", remasking="low_confidence"),
        source=f"{_D2F_LLADA}, humaneval"),
}


def get(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None


def preset(name: str, engine: Optional[EngineConfig] = None,
           sampling: Optional[SamplingParams] = None) -> Tuple[EngineConfig, SamplingParams]:
    """`engine` and `sampling` (default: the defaults) with preset `name` applied."""
    p = get(name)
    return replace(engine or EngineConfig(), **p.engine), replace(sampling or SamplingParams(), **p.sampling)
