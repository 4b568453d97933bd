"""The model-family registry: one module per family, each building a `Family` and
registering it here. The Checkpoint (engine.checkpoint), the loader and the sorter's
cost model reach a family through `family_for` (config.json) or `family_named`
(ModelConfig.model_type). A new family is one module plus `register(FAMILY)`
(docs/adding-a-family.md); a test may register one of its own. Torch-free."""
from __future__ import annotations

from typing import Any, Dict, Mapping

from .base import BlockLayout, ConfigRefused, Confidence, Family, FamilyNotSupported, Serving, Shard, ThresholdRule
from .diffusion_gemma import DIFFUSION_GEMMA
from .dream import DREAM
from .dream_reasoner import DREAM_REASONER
from .fast_dllm_v2 import FAST_DLLM_V2
from .illada import ILLADA
from .llada import LLADA
from .llada2_moe import LLADA2_MOE
from .llada_moe import LLADA_MOE
from .nemotron_labs_diffusion import NEMOTRON_LABS_DIFFUSION
from .sdar import SDAR, SDAR_MOE
from .stable_diffcoder import STABLE_DIFFCODER

FAMILIES: Dict[str, Family] = {}

# Published families the engine does not implement: (test on config.json, one-line name).
_NOT_IMPLEMENTED = (
    (lambda hf: hf.get("model_type") in ("llada", "LLaDA") and "d_model" not in hf and "num_experts" not in hf
     and "hidden_size" in hf,
     "a 'llada' config.json with Hugging Face style keys but no experts (neither LLaDA's nor LLaDA-MoE's layout)"),
    (lambda hf: "gemma" in str(hf.get("model_type", "")).lower(), "Gemma (autoregressive)"),
    # Stable-DiffCoder says 'llama' too: only its architecture / auto_map make it served
    (lambda hf: hf.get("model_type") == "llama",
     "an autoregressive Llama (model_type 'llama' without Stable-DiffCoder's architecture StableDiffcoderForCausalLM)"),
)


def register(family: Family) -> Family:
    """Make `family` known by its model_type and aliases (later registrations win)."""
    for name in (family.model_type, *family.aliases):
        FAMILIES[name] = family
    return family


# DreamReasoner before Dream: its config.json says model_type 'Dream' too (recognised by its keys)
for _family in (LLADA_MOE, LLADA, DREAM_REASONER, DREAM, LLADA2_MOE, DIFFUSION_GEMMA, SDAR, SDAR_MOE, FAST_DLLM_V2,
                STABLE_DIFFCODER, ILLADA, NEMOTRON_LABS_DIFFUSION):
    register(_family)


def supported() -> str:
    unique = {id(f): f for f in FAMILIES.values()}.values()
    return "; ".join(f"{f.name} (model_type {f.model_type!r}: {f.examples})" for f in unique)


def family_for(hf: Mapping[str, Any]) -> Family:
    """The family config.json `hf` describes; FamilyNotSupported (one line naming it)
    for one blockray does not implement. Families that recognise their config by its
    keys (LLaDA-MoE, whose model_type is LLaDA's) are asked first."""
    unique = list({id(f): f for f in FAMILIES.values()}.values())
    for family in unique:
        if family.matches(hf):
            return family
    for test, name in _NOT_IMPLEMENTED:
        if test(hf):
            raise FamilyNotSupported(f"{name} is not supported by blockray; supported: {supported()}")
    raise FamilyNotSupported(f"model_type {hf.get('model_type')!r} in config.json is not a family blockray "
                             f"supports; supported: {supported()}")


def family_named(model_type: str) -> Family:
    return FAMILIES[model_type]


__all__ = ["FAMILIES", "Family", "ConfigRefused", "FamilyNotSupported", "BlockLayout", "ThresholdRule", "Confidence",
           "Serving", "Shard", "register", "family_for", "family_named", "supported"]
