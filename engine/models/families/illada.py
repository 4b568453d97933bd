"""iLLaDA (GSAI-ML/iLLaDA-8B-Base, -Instruct): LLaDA retrained from scratch on a Llama-style
layout. Written from the published remote code (modeling file of `ILLaDAForCausalLM`,
"Copyright (c) 2025 ByteDance", read in the public code index; never run) and the release
note of the LLaDA repository ("By setting `mask_id=5`, iLLaDA can directly reuse the
existing LLaDA inference code").

The layer: RMSNorm (`layer_norm_eps` null; a LayerNorm otherwise, refused), q/k/v/o and
SwiGLU gate/up/down without bias (`attention_bias`, `mlp_bias`), GQA, rotate-half RoPE
with the default rope type only (the published code raises on any rope scaling), head_dim
= hidden_size / num_attention_heads (the published code reads no `head_dim`), SDPA with
is_causal=False and no mask: every position attends to every position, no KV cache, no
logit shift; the LM head tied to the embedding as config.json says.

Its config.json names no mask id: the mask is the tokenizer's added token `<[MASK]>` (id 5,
the README's mask_id). Its model_type is not printed in any file we could read; the
architecture `ILLaDAForCausalLM` is what recognises it (model_type "illada" too, the value
third-party code loading the published checkpoint checks for). Decoding is LLaDA's
generate(): blocks after the prompt, the fixed low-confidence schedule."""
from __future__ import annotations

from typing import Any, Dict, Mapping

from .base import LLAMA_MODULES, ConfigRefused, Family
from .llada_moe import PROJECTIONS

ARCHITECTURE = "ILLaDAForCausalLM"


class ILLaDAFamily(Family):
    def matches(self, hf: Mapping[str, Any]) -> bool:
        """By its architecture (its model_type is unconfirmed): ILLaDAForCausalLM in
        `architectures`, or model_type "illada" where config.json names no architecture
        (blockray's own tiny checkpoints)."""
        archs = hf.get("architectures") or []
        return ARCHITECTURE in archs or (not archs and hf.get("model_type") == self.model_type)

    def parse(self, hf: Mapping[str, Any]) -> Dict[str, Any]:
        d, H = hf["hidden_size"], hf["num_attention_heads"]
        if d % H:
            raise ConfigRefused(f"config.json hidden_size={d} does not divide by num_attention_heads={H}: the "
                                f"published {self.name} code's head_dim is hidden_size / num_attention_heads")
        head_dim = hf.get("head_dim")
        if head_dim is not None and head_dim != d // H:
            raise ConfigRefused(f"config.json head_dim={head_dim!r} differs from hidden_size / num_attention_heads = "
                                f"{d // H}, the head size the published {self.name} code computes (it reads no "
                                "head_dim); refusing rather than guessing which is meant")
        return dict(
            self._common(hf), vocab_size=hf["vocab_size"], hidden_size=d, n_layers=hf["num_hidden_layers"],
            n_heads=H, n_kv_heads=hf.get("num_key_value_heads") or H, intermediate_size=hf["intermediate_size"],
            rope_theta=hf["rope_theta"], rms_norm_eps=hf["rms_norm_eps"],
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            max_seq_len=hf.get("max_position_embeddings", 8192))

    def to_hf(self, cfg: Any) -> Dict[str, Any]:
        return dict(model_type=self.model_type, architectures=[ARCHITECTURE], vocab_size=cfg.vocab_size,
                    hidden_size=cfg.hidden_size, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                    num_key_value_heads=cfg.n_kv_heads, intermediate_size=cfg.intermediate_size,
                    rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
                    tie_word_embeddings=cfg.tie_word_embeddings, max_position_embeddings=cfg.max_seq_len)


ILLADA = ILLaDAFamily(
    name="iLLaDA", model_type="illada", examples="GSAI-ML/iLLaDA-8B-Instruct, iLLaDA-8B-Base",
    honoured=frozenset({"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "intermediate_size", "rope_theta", "rms_norm_eps",
                        "tie_word_embeddings", "max_position_embeddings"}),
    # dropout the published code applies only in training (attention_dropout, resid_pdrop)
    ignored=frozenset({"attention_dropout", "resid_pdrop"}),
    fixed={"architectures": ([ARCHITECTURE],), "hidden_act": ("silu",), "attention_bias": (False,),
           "mlp_bias": (False,), "layer_norm_eps": (None,), "rope_scaling": (None,)},
    top_weights={"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "lm_head.weight": "lm_head.weight"},
    layer_prefix="model.layers.{i}.", layer_weights=LLAMA_MODULES, mlp_weights=PROJECTIONS,
    attention="bidirectional",
    # mask: the added token <[MASK]>, 5 (the README's mask_id); eos 2 (the published files' eos_token_id,
    # tests/published/GSAI-ML__iLLaDA-8B-Instruct/SOURCE.md)
    defaults={"mask_token_id": 5, "eos_token_id": 2}, mask_token="<[MASK]>",
)
