"""Which rows the LinearSpec / AR engine (engine.linear_spec) serves, and why it refuses
one: torch-free, because the job's preflight (engine.engines.BlockEngine.
every_row_refusal) checks a run's settings with it before anything loads torch.

SamplingParams.decoding "linear_spec" and "ar" need a model trained for causal and
bidirectional attention alike (Nemotron-Labs-Diffusion): a causal forward of a
bidirectional-only model (LLaDA, Dream) computes nothing it was trained for."""
from __future__ import annotations

from typing import Any, Optional

from .reads import LINEAR_SPEC

# the families trained for both attentions
SELF_SPECULATIVE = frozenset({"nemotron_labs_diffusion"})
DECODINGS = ("linear_spec", "ar")  # SamplingParams.decoding values served by engine.linear_spec


def serves(params: Any) -> bool:
    """Whether SamplingParams `params` ask for LinearSpec or AR decoding."""
    return params.decoding in DECODINGS


def adapter_refusal(adapter: Any) -> Optional[str]:
    if adapter is None:
        return None
    return (f"adapter {str(adapter)!r}: LinearSpec's LoRA applies to its draft forward only, and blockray merges an "
            "adapter into the weights of every forward; drop the adapter or decode with decoding 'diffusion'")


def row_refusal(params: Any, mcfg: Any, config: Any, prompt_len: int, adapter: Any = None) -> Optional[str]:
    """Why the LinearSpec / AR engine cannot serve a row of `prompt_len` tokens decoded with
    `params` on a model of `mcfg` (ModelConfig) under EngineConfig `config` (its
    token_budget resolved, or None), or None."""
    if not serves(params):
        return (f"decoding {params.decoding!r} is not served by {LINEAR_SPEC.name}: it serves decoding "
                f"{' and '.join(map(repr, DECODINGS))}")
    if mcfg.model_type not in SELF_SPECULATIVE:
        return (f"decoding {params.decoding!r} needs a model trained for causal and bidirectional attention alike "
                f"(Nemotron-Labs-Diffusion); model_type {mcfg.model_type!r} is not")
    if params.decoding == "ar" and params.draft_threshold is not None:
        return "draft_threshold is read by decoding 'linear_spec' only (AR drafts nothing); leave it unset"
    err = adapter_refusal(adapter)
    if err:
        return err
    L = config.block_length
    width = prompt_len + params.max_new_tokens + L
    if width > mcfg.max_seq_len:
        return (f"prompt of {prompt_len} tokens + max_new_tokens {params.max_new_tokens} + a block of {L} exceeds "
                f"the model context of {mcfg.max_seq_len} tokens")
    if config.token_budget is not None and width > config.token_budget:
        return f"request needs {width} tokens of batch budget alone, more than token_budget={config.token_budget}"
    return None


def settings_refusal(params: Any, mcfg: Any, config: Any, adapter: Any = None) -> Optional[str]:
    """The preflight's check of a run decoded with LinearSpec / AR: the settings its engine
    would ignore (engine.reads.LINEAR_SPEC: the diffusion loop's knobs, the engine's cache
    and canvas settings), then the shortest row there is (one token)."""
    return params.validate() or LINEAR_SPEC.refusal(params, config) or row_refusal(params, mcfg, config, 1, adapter)


__all__ = ["SELF_SPECULATIVE", "DECODINGS", "serves", "row_refusal", "settings_refusal", "adapter_refusal"]
