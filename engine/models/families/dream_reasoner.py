"""DreamReasoner (Dream-org/DreamReasoner-8B): a block-diffusion model whose config.json
says model_type "Dream" (Dream-v0's) and architectures ["DreamForCausalLM"] (Dream-v0's
says "DreamModel"), with `block_size` and a mask id of its own (151669). It is not Dream-v0:
no logit shift, block-causal attention over blocks at absolute positions, per-head q/k
RMSNorm, no q/k/v biases. It is therefore recognised by its architecture or its
`block_size` key, never by model_type (`matches`; registered before Dream so that
family_for asks it first), and a Dream-v0 config.json (architectures DreamModel, no
block_size) is never taken for it. Written from Diffulex's diffulex/model/dream_reasoner.py
and its test fixture (SJTU-DENG-Lab/Diffulex 184ba97) and from the HF generation_utils.py
helpers as a fork copies them unchanged (never run).

The layer is Qwen3's (SDAR's here): q/k/v/o without bias, q_norm / k_norm per head before
rotate-half RoPE, GQA, head_dim from config.json or hidden / heads (DreamConfig's None).

Decoding: HF `block_diffusion_generate` (blocks of config.block_size = 32 at absolute
positions, the prompt's complete blocks prefilled, `low_confidence_dynamic`: every mask
whose probability is strictly greater than the threshold, at least the step's share k of
the block over `denoising_steps` (= block_length by default: k = 1), every mask forced on
the last step) is SDAR's rule, ThresholdRule.BLOCK_FLOOR. Diffulex's `dream_reasoner`
sampler (strictly greater than accept_threshold, else the most confident one when the
previous block is semi-complete) is the same rule when one block is decoded at a time (its
previous block is then complete) and steps_per_block = block_length; blockray decodes one
block at a time (Diffulex's multi-block buffer is not served). Diffulex also sets the mask
token's logit to -inf before the softmax; the HF loop does not, and neither does blockray
(the two agree wherever the model gives the mask probability 0, as tests/test_dream_reasoner.py's
model does)."""
from __future__ import annotations

from typing import Any, Dict, Mapping

from .base import BlockLayout, Family, ThresholdRule
from .dream import decoder_hf, decoder_sizes
from .llada_moe import PROJECTIONS
from .sdar import MODULES

ARCHITECTURE = "DreamForCausalLM"


class DreamReasonerFamily(Family):
    def matches(self, hf: Mapping[str, Any]) -> bool:
        """model_type Dream with DreamReasoner's architecture or its block_size key."""
        return hf.get("model_type") in ("Dream", "dream") and (
            ARCHITECTURE in (hf.get("architectures") or []) or "block_size" in hf)

    def parse(self, hf: Mapping[str, Any]) -> Dict[str, Any]:
        self._full_attention(hf)
        return dict(decoder_sizes(self, hf, 10000.0, 32768), qk_norm=True)

    def to_hf(self, cfg: Any) -> Dict[str, Any]:
        return decoder_hf(cfg, "Dream", ARCHITECTURE)


DREAM_REASONER = DreamReasonerFamily(
    name="DreamReasoner", model_type="dream_reasoner", layout="qwen3",
    examples="Dream-org/DreamReasoner-8B (config.json model_type 'Dream', architectures DreamForCausalLM)",
    honoured=frozenset({"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "intermediate_size", "rope_theta", "rope_parameters",
                        "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings", "layer_types"}),
    # block_size: generation_utils' default block_length (`block_length or config.block_size`), a
    # decoding setting the caller gives (--block-length 32), as Fast-dLLM v2's bd_size
    ignored=frozenset({"block_size"}),
    fixed={"hidden_act": ("silu",), "rope_scaling": (None,), "use_sliding_window": (False,),
           "attention_bias": (False,)},
    top_weights={"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "lm_head.weight": "lm_head.weight"},
    layer_prefix="model.layers.{i}.", layer_weights=MODULES, mlp_weights=PROJECTIONS,
    blocks=BlockLayout.ABSOLUTE, threshold=ThresholdRule.BLOCK_FLOOR, attention="block_causal",
    # config.json's mask_token_id (151669); eos: Qwen's <|endoftext|> where config.json names none
    defaults={"mask_token_id": 151669, "eos_token_id": 151643},
)
