"""Dream (Dream-org/Dream-v0-Instruct-7B, -Base-7B): a Qwen2.5 network (Qwen2 config.json
and weight names, q/k/v biases) adapted to diffusion, so it predicts token i from
position i-1 (logit shift)."""
from __future__ import annotations

from typing import Any, Dict, Mapping

from .base import Family


class DreamFamily(Family):
    def parse(self, hf: Mapping[str, Any]) -> Dict[str, Any]:
        return dict(
            self._common(hf), vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"], rope_theta=hf.get("rope_theta", 10000.0),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), tie_word_embeddings=hf.get("tie_word_embeddings", False),
            qkv_bias=True, max_seq_len=hf.get("max_position_embeddings", 32768))

    def to_hf(self, cfg: Any) -> Dict[str, Any]:
        return dict(model_type="Dream", architectures=["DreamModel"], vocab_size=cfg.vocab_size,
                    hidden_size=cfg.hidden_size, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                    num_key_value_heads=cfg.n_kv_heads, intermediate_size=cfg.intermediate_size,
                    rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
                    tie_word_embeddings=cfg.tie_word_embeddings, max_position_embeddings=cfg.max_seq_len)


DREAM = DreamFamily(
    name="Dream", model_type="Dream", examples="Dream-org/Dream-v0-Instruct-7B, Dream-v0-Base-7B",
    honoured=frozenset({"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "intermediate_size", "rope_theta", "rms_norm_eps",
                        "tie_word_embeddings", "max_position_embeddings"}),
    # dropout is training-only; sliding_window / max_window_layers only matter with
    # use_sliding_window, which `fixed` refuses; use_mrope (Qwen2.5's config: multimodal RoPE)
    # is accepted only off
    ignored=frozenset({"attention_dropout", "sliding_window", "max_window_layers"}),
    fixed={"hidden_act": ("silu",), "rope_scaling": (None,), "use_sliding_window": (False,),
           "attention_bias": (True,), "use_mrope": (False, None)},
    top_weights={"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "lm_head.weight": "lm_head.weight", "lm_head.bias": "lm_head.bias"},
    layer_prefix="model.layers.{i}.",
    layer_weights={"attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
                   "v": "self_attn.v_proj", "o": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
                   "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"},
    shift_logits=True, first_position=True,
    defaults={"mask_token_id": 151666, "eos_token_id": 151643},
)
