"""The model-family registry: one module per family (llada.py, dream.py); the loader,
the preflight and the sorter's cost model all reach a family through `family_for`
(config.json) or `family_named` (ModelConfig.model_type). A new family is one new
module and one line in FAMILIES. Torch-free."""
from __future__ import annotations

from typing import Any, Dict, Mapping

from .base import ConfigRefused, Family, FamilyNotSupported
from .diffusion_gemma import is_diffusion_gemma
from .dream import DREAM
from .llada import LLADA
from .llada2_moe import LLADA2_MOE
from .llada_moe import LLADA_MOE, is_llada_moe

FAMILIES: Dict[str, Family] = {f.model_type: f for f in (LLADA, DREAM, LLADA_MOE, LLADA2_MOE)}
_ALIASES = {"LLaDA": "llada", "dream": "Dream", "llada2": "llada2_moe"}

# Published families the engine does not implement: (test on config.json, one-line name).
_NOT_IMPLEMENTED = (
    (lambda hf: hf.get("model_type") in ("llada", "LLaDA") and "d_model" not in hf and "num_experts" not in hf
     and "hidden_size" in hf,
     "a 'llada' config.json with Hugging Face style keys but no experts (neither LLaDA's nor LLaDA-MoE's layout)"),
    (lambda hf: "gemma" in str(hf.get("model_type", "")).lower(), "Gemma (autoregressive)"),
)


def supported() -> str:
    return "; ".join(f"{f.name} (model_type {f.model_type!r}: {f.examples})" for f in FAMILIES.values())


def family_for(hf: Mapping[str, Any]) -> Family:
    """The family a config.json describes; FamilyNotSupported (one line naming the family)
    for a family the engine does not implement. DiffusionGemma is no `Family` (it is
    served by engine.canvas): callers test `is_diffusion_gemma` first."""
    if is_diffusion_gemma(hf):
        raise FamilyNotSupported("DiffusionGemma has no masked-diffusion family: it is served by engine.canvas")
    for test, name in _NOT_IMPLEMENTED:
        if test(hf):
            raise FamilyNotSupported(f"{name} is not supported by blockray; supported: {supported()}")
    if is_llada_moe(hf):  # recognised from its keys: its model_type is LLaDA's "llada"
        return LLADA_MOE
    mt = hf.get("model_type")
    if mt is None and "d_model" in hf:
        mt = "llada"
    mt = _ALIASES.get(mt, mt)
    if mt not in FAMILIES:
        raise FamilyNotSupported(f"model_type {hf.get('model_type')!r} in config.json is not a family blockray "
                                 f"supports; supported: {supported()}")
    return FAMILIES[mt]


def family_named(model_type: str) -> Family:
    return FAMILIES[_ALIASES.get(model_type, model_type)]


__all__ = ["FAMILIES", "Family", "ConfigRefused", "FamilyNotSupported", "family_for", "family_named", "supported"]
