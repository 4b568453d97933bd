"""Stable-DiffCoder (ByteDance-Seed/Stable-DiffCoder-8B-Instruct, -Base): a block-diffusion
coder on Seed-Coder's Llama layout. Its config.json says model_type "llama" (an
autoregressive Llama's, which blockray does not serve), so it is recognised only by its
architecture (`StableDiffcoderForCausalLM`) or its auto_map (`modeling_stable_diffcoder...`),
as Diffulex's `is_stable_diffcoder_config` does; a plain Llama config.json stays refused.
Written from SJTU-DENG-Lab/Diffulex (184ba97) diffulex/model/stable_diffcoder.py, its
configuration_stable_diffcoder.py and test fixture (never run; the HF modeling code was
not located).

The layer is Llama's: q/k/v/o without bias, rotate-half RoPE (theta 500000 as published),
GQA, SwiGLU without bias, untied embeddings, head_dim from config.json or hidden / heads.

Decoding: no logit shift, block-causal attention over blocks at absolute positions (the
prompt's last block padded with masks, as Diffulex lays a request out), and Diffulex's
`stable_diffcoder` sampler: every mask whose confidence is strictly greater than
accept_threshold, else the single most confident one (ThresholdRule.GREATER_AT_LEAST_TOP1),
one block at a time. Diffulex sets the mask token's logit to -inf before the softmax;
blockray does not (the same tokens wherever the model gives the mask probability 0, as
tests/test_stable_diffcoder.py's model does). The mask is the tokenizer's `<[MASK_TOKEN]>`
(id 5 in Diffulex's fixture; the Seed tokenizer iLLaDA shares masks with 5 too)."""
from __future__ import annotations

from typing import Any, Dict, Mapping

from .base import BlockLayout, Family, ThresholdRule
from .dream import decoder_hf, decoder_sizes
from .llada_moe import PROJECTIONS
from .sdar import MODULES

ARCHITECTURE = "StableDiffcoderForCausalLM"


class StableDiffCoderFamily(Family):
    def matches(self, hf: Mapping[str, Any]) -> bool:
        """model_type llama with Stable-DiffCoder's architecture or auto_map (never model_type alone)."""
        arch = [str(a) for a in hf.get("architectures") or []]
        auto = [v for v in (hf.get("auto_map") or {}).values() if isinstance(v, str)]
        return hf.get("model_type") == "llama" and (any("StableDiffcoder" in a for a in arch)
                                                    or any("stable_diffcoder" in v for v in auto))

    def parse(self, hf: Mapping[str, Any]) -> Dict[str, Any]:
        return decoder_sizes(self, hf, 500000.0, 8192)

    def to_hf(self, cfg: Any) -> Dict[str, Any]:
        return decoder_hf(cfg, "llama", ARCHITECTURE)


STABLE_DIFFCODER = StableDiffCoderFamily(
    name="Stable-DiffCoder", model_type="stable_diffcoder", layout="llama",
    examples="ByteDance-Seed/Stable-DiffCoder-8B-Instruct (config.json model_type 'llama', "
             "architectures StableDiffcoderForCausalLM)",
    honoured=frozenset({"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "intermediate_size", "rope_theta", "rope_parameters",
                        "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings"}),
    fixed={"hidden_act": ("silu",), "rope_scaling": (None,), "attention_bias": (False,), "mlp_bias": (False,)},
    top_weights={"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "lm_head.weight": "lm_head.weight"},
    layer_prefix="model.layers.{i}.", layer_weights=MODULES, mlp_weights=PROJECTIONS,
    blocks=BlockLayout.ABSOLUTE, threshold=ThresholdRule.GREATER_AT_LEAST_TOP1, attention="block_causal",
    mask_token="<[MASK_TOKEN]>",
    # <[MASK_TOKEN]> at Diffulex's fixture id (the tokenizer's wins); eos: StableDiffCoderConfig's default
    defaults={"mask_token_id": 5, "eos_token_id": 2},
)
