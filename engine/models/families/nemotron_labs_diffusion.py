"""Nemotron-Labs-Diffusion (nvidia/Nemotron-Labs-Diffusion-3B, -8B, -14B; model_type
"nemotron_labs_diffusion", architecture NemotronLabsDiffusionModel). Written from the
published modeling_nemotron_labs_diffusion.py (`generate`, read in the public code index,
never run) and transformers' built-in Ministral3 layer it wraps.

The layer is Ministral3's (Llama's: separate q/k/v/o without bias, SwiGLU, RMSNorm, GQA,
explicit head_dim) with YaRN RoPE (its attention factor on cos and sin) and Llama-4's
query scaling by position, 1 + beta ln(1 + floor(pos / original_max_position_embeddings))
(engine.models.rope_scaling). Weights: `encoder.*` (a Ministral3Model) and an untied
`diffusion_head.weight`.

One checkpoint, attention switched per call: the diffusion mode (`generate`, causal_context
on) prefills the prompt causally, and the argmax of its last logit seeds position 0 of the
first block; a block [seed, mask x (L-1)] is denoised attending bidirectionally to itself and
to the cached prefix, with LLaDA's low-confidence top-k (L-1 masks over L steps: one a step)
or its threshold (>= threshold, at least the most confident); no logit shift; then a causal
forward over the finished block writes its K/V and its last logit seeds the next block. In
blockray that is the family's `causal_context`: the prefix's columns attend causally, the
row's current block bidirectionally (engine.batch.AttentionMask), and `first_position` reads
the column before the block at its first step, which commits the seed only (the finished
block's causal forward and the next block's first step are one forward)."""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from .base import LLAMA_MODULES, ConfigRefused, Family, ThresholdRule
from .dream import decoder_hf, decoder_sizes
from ..rope_scaling import yarn_from

ARCHITECTURE = "NemotronLabsDiffusionModel"

# rope_parameters keys transformers' yarn reads (plus Ministral3's llama_4_scaling_beta);
# `type` is transformers 4's spelling of rope_type
YARN_KEYS = frozenset({"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
                       "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate",
                       "llama_4_scaling_beta"})


# the decoding rules (engine.rules' names) that run generate()'s loop on this family's attention
SERVED_RULES = frozenset({"block"})


class NemotronLabsDiffusionFamily(Family):
    def parse(self, hf: Mapping[str, Any]) -> Dict[str, Any]:
        params = hf.get("rope_parameters")
        if not isinstance(params, Mapping) or params.get("rope_type", params.get("type")) != "yarn":
            raise ConfigRefused(f"config.json rope_parameters={params!r}: blockray's {self.name} model implements "
                                "Ministral3's yarn RoPE (rope_type 'yarn') only")
        unknown = sorted(set(params) - YARN_KEYS)
        if unknown:
            raise ConfigRefused(f"config.json rope_parameters keys {unknown} are not ones blockray's {self.name} "
                                f"model honours (honoured: {', '.join(sorted(YARN_KEYS))}); refusing rather than "
                                "ignoring them")
        if params.get("llama_4_scaling_beta") is None:
            raise ConfigRefused("config.json rope_parameters lacks 'llama_4_scaling_beta' (Ministral3's query "
                                "scaling by position reads it)")
        sizes = decoder_sizes(self, {**hf, "rope_parameters": None, "rope_theta": params.get("rope_theta", 1e6)},
                              1e6, 262144)
        yarn = yarn_from(params, hf.get("max_position_embeddings"))
        return dict(sizes, rms_norm_eps=hf.get("rms_norm_eps", 1e-5), rope_yarn=yarn,
                    q_position_scale=(float(params["llama_4_scaling_beta"]), yarn.original_max_position_embeddings))

    def to_hf(self, cfg: Any) -> Dict[str, Any]:
        out = decoder_hf(cfg, self.model_type, ARCHITECTURE)
        y, (beta, orig) = cfg.rope_yarn, cfg.q_position_scale
        out.pop("rope_theta")
        out.update(dlm_paradigm="bidirectional", rope_parameters=dict(
            rope_type="yarn", rope_theta=cfg.rope_theta, factor=y.factor, original_max_position_embeddings=orig,
            beta_fast=y.beta_fast, beta_slow=y.beta_slow, attention_factor=y.attention_factor, truncate=y.truncate,
            llama_4_scaling_beta=beta))
        return out

    def row_refusal(self, req: Any, layout: Any) -> Optional[str]:
        """The diffusion mode as generate() runs it: one block at a time on the block canvas,
        seeded from the token before it."""
        if req.rule.name not in SERVED_RULES:
            return (f"{self.name}'s diffusion mode decodes one block at a time (causal prefix, bidirectional "
                    f"block); the {req.rule.name!r} decoding is not served for it")
        if layout.full_canvas:
            return f"{self.name} attends causally to its prefix: serve it with canvas 'block' (or 'auto'), not 'full'"
        if req.params.first_position is False:
            return (f"{self.name}'s generate() seeds each block's first position from the causal logit before it; "
                    "first_position false is not its loop")
        if req.params.policy == "fixed" and layout.steps != layout.block_length:
            return (f"{self.name}'s generate() denoises a block in block_length steps (its L-1 masks one a step): "
                    f"steps_per_block={layout.steps} with block_length={layout.block_length} is not its schedule; "
                    "set them equal (or use policy 'threshold')")
        if not req.prompt:
            return f"{self.name}'s generate() prefills a prompt: an empty prompt has no logit to seed the first block"
        return None


# Ministral3Config's keys the family neither reads nor fixes (dropout, init, cache) are
# derived inert from `layout`; the ones below come from NemotronLabsDiffusionConfig
NEMOTRON_LABS_DIFFUSION = NemotronLabsDiffusionFamily(
    name="Nemotron-Labs-Diffusion", model_type="nemotron_labs_diffusion", layout="ministral3",
    examples="nvidia/Nemotron-Labs-Diffusion-3B, Nemotron-Labs-Diffusion-8B, Nemotron-Labs-Diffusion-14B",
    honoured=frozenset({"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "intermediate_size", "rope_parameters", "rms_norm_eps",
                        "tie_word_embeddings", "max_position_embeddings"}),
    # training only: ar_loss_weight / dlm_loss_weight weigh the losses, dp_varying_mask_ratio seeds the
    # noising; block_size is read only by the block_diff paradigm's training mask (refused below; the
    # block length is the request's, --block-length 32 as trained); attn_implementation picks a kernel
    ignored=frozenset({"ar_loss_weight", "dlm_loss_weight", "dp_varying_mask_ratio", "block_size",
                       "attn_implementation"}),
    # dlm_paradigm: 'autoregressive' decodes with causal attention only, 'block_diff' is a training
    # mask (flex attention over a doubled sequence); generate() is the 'bidirectional' model's
    fixed={"dlm_paradigm": ("bidirectional",), "hidden_act": ("silu",), "attention_bias": (False,),
           "mlp_bias": (False,), "sliding_window": (None,)},
    top_weights={"embed.weight": "encoder.embed_tokens.weight", "norm.weight": "encoder.norm.weight",
                 "lm_head.weight": "diffusion_head.weight"},
    layer_prefix="encoder.layers.{i}.",
    layer_weights=LLAMA_MODULES,
    first_position=True, threshold=ThresholdRule.AT_LEAST_TOP1, attention="block_causal", causal_context=True,
    # the published config's mask_token_id 100 and eos 11 (config.json names both)
    defaults={"mask_token_id": 100, "eos_token_id": 11},
)
