"""LLaDA (GSAI-ML/LLaDA-8B-Instruct, -Base, LLaDA-1.5): OLMo-style config.json and weight
names, LLaMA blocks (SwiGLU, RMSNorm, RoPE), no logit shift. transformers has no config
class for these OLMo keys, so the irrelevant ones are listed by hand."""
from __future__ import annotations

from typing import Any, Dict, Mapping

from .base import Family


class LLaDAFamily(Family):
    def matches(self, hf: Mapping[str, Any]) -> bool:
        """model_type 'llada' (or none) with OLMo's keys: LLaDA-MoE's config.json says 'llada' too."""
        mt = hf.get("model_type")
        return "d_model" in hf and (mt is None or super().matches(hf))

    def parse(self, hf: Mapping[str, Any]) -> Dict[str, Any]:
        d = hf["d_model"]
        return dict(
            self._common(hf), vocab_size=hf["vocab_size"], hidden_size=d, n_layers=hf["n_layers"],
            n_heads=hf["n_heads"], n_kv_heads=hf.get("n_kv_heads") or hf["n_heads"],
            intermediate_size=hf.get("mlp_hidden_size") or hf.get("mlp_ratio", 4) * d,
            embedding_size=hf.get("embedding_size"), rope_theta=hf.get("rope_theta", 10000.0),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5), tie_word_embeddings=hf.get("weight_tying", False),
            linear_bias=hf.get("include_bias", False),
            qkv_bias=hf.get("include_bias", False) or hf.get("include_qkv_bias", False),
            max_seq_len=hf.get("max_sequence_length", 4096))

    def to_hf(self, cfg: Any) -> Dict[str, Any]:
        return dict(model_type="llada", vocab_size=cfg.vocab_size, embedding_size=cfg.embedding_size,
                    d_model=cfg.hidden_size, n_layers=cfg.n_layers, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                    mlp_hidden_size=cfg.intermediate_size, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
                    weight_tying=cfg.tie_word_embeddings, include_bias=cfg.linear_bias,
                    include_qkv_bias=cfg.qkv_bias, max_sequence_length=cfg.max_seq_len)


LLADA = LLaDAFamily(
    name="LLaDA", model_type="llada", aliases=("LLaDA",),
    examples="GSAI-ML/LLaDA-8B-Instruct, LLaDA-8B-Base, LLaDA-1.5",
    honoured=frozenset({"vocab_size", "embedding_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                        "mlp_hidden_size", "mlp_ratio", "rope_theta", "rms_norm_eps", "weight_tying", "include_bias",
                        "include_qkv_bias", "max_sequence_length"}),
    # training-only (dropout, init, mixed precision) or a kernel choice; alibi_bias_max and
    # attention_layer_norm_with_affine only matter when alibi / attention_layer_norm are on,
    # which `fixed` refuses
    ignored=frozenset({"attention_dropout", "residual_dropout", "embedding_dropout", "init_device", "init_fn",
                       "init_std", "init_cutoff_factor", "precision", "flash_attention", "alibi_bias_max",
                       "attention_layer_norm_with_affine"}),
    fixed={"activation_type": ("silu",), "block_type": ("llama",), "attention_layer_norm": (False,),
           "scale_logits": (False,), "input_emb_norm": (False,), "alibi": (False,), "rope": (True,),
           "rope_full_precision": (True,), "layer_norm_type": ("rms",), "layer_norm_with_affine": (True,),
           "bias_for_layer_norm": (False, None), "multi_query_attention": (None, False),
           "block_group_size": (1,), "clip_qkv": (None,), "rope_scaling": (None,)},
    top_weights={"embed.weight": "model.transformer.wte.weight", "norm.weight": "model.transformer.ln_f.weight",
                 "lm_head.weight": "model.transformer.ff_out.weight", "lm_head.bias": "model.transformer.ff_out.bias"},
    layer_prefix="model.transformer.blocks.{i}.",
    layer_weights={"attn_norm": "attn_norm", "q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "attn_out",
                   "mlp_norm": "ff_norm", "gate": "ff_proj", "up": "up_proj", "down": "ff_out"},
    defaults={"mask_token_id": 126336, "eos_token_id": 126081},
)
