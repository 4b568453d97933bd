"""Dream (Dream-org/Dream-v0-Instruct-7B, -Base-7B; apple/DiffuCoder-7B-Instruct, -cpGRPO
and Dream-org/Dream-Coder-v0-Instruct-7B are the same architecture under the same
model_type, with the same modeling_dream.py): a Qwen2.5 network (transformers'
Qwen2Config keys and Qwen2 weight names, q/k/v biases) adapted to diffusion, so it
predicts token i from position i-1 (logit shift). Fast-dLLM's block decoding commits a
block's first position first (the `first_position` default); its own
`diffusion_generate` is one block of max_new_tokens with `first_position` off (its `alg`s:
docs/models/dream.md). Both draw and rank proposals from Dream's `sample_tokens`
distribution (Confidence.SAMPLED: temperature, then top-p, then top-k)."""
from __future__ import annotations

from typing import Any, Dict, Mapping

from .base import LLAMA_MODULES, ConfigRefused, Confidence, Family


class DreamFamily(Family):
    def parse(self, hf: Mapping[str, Any]) -> Dict[str, Any]:
        self._full_attention(hf)
        return dict(
            self._common(hf), vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
            n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"], rope_theta=rope_theta(hf, 10000.0),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), tie_word_embeddings=hf.get("tie_word_embeddings", False),
            qkv_bias=True, max_seq_len=hf.get("max_position_embeddings", 32768))

    def to_hf(self, cfg: Any) -> Dict[str, Any]:
        return dict(model_type="Dream", architectures=["DreamModel"], vocab_size=cfg.vocab_size,
                    hidden_size=cfg.hidden_size, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                    num_key_value_heads=cfg.n_kv_heads, intermediate_size=cfg.intermediate_size,
                    rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
                    tie_word_embeddings=cfg.tie_word_embeddings, max_position_embeddings=cfg.max_seq_len)


def rope_theta(hf: Mapping[str, Any], default: float) -> float:
    """RoPE's base from `rope_theta` (transformers 4), or from `rope_parameters` (transformers 5),
    whose rope_type must be the default (no scaling)."""
    params = hf.get("rope_parameters")
    if params is None:
        return float(hf.get("rope_theta", default))
    if not isinstance(params, Mapping) or params.get("rope_type", "default") != "default":
        raise ConfigRefused(f"config.json rope_parameters={params!r}: blockray implements the default RoPE only")
    return float(params.get("rope_theta", hf.get("rope_theta", default)))


def decoder_sizes(family: Any, hf: Mapping[str, Any], theta: float, max_len: int) -> Dict[str, Any]:
    """ModelConfig's sizes from a Llama-style config.json (the keys Llama, Qwen2/3 and the
    block-diffusion families on them name alike), with the family's ids and attention."""
    d, H = hf["hidden_size"], hf["num_attention_heads"]
    return dict(
        family._common(hf), vocab_size=hf["vocab_size"], hidden_size=d, n_layers=hf["num_hidden_layers"],
        n_heads=H, n_kv_heads=hf.get("num_key_value_heads") or H, head_dim=hf.get("head_dim") or d // H,
        intermediate_size=hf["intermediate_size"], rope_theta=rope_theta(hf, theta),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6), tie_word_embeddings=hf.get("tie_word_embeddings", False),
        max_seq_len=hf.get("max_position_embeddings", max_len))


def decoder_hf(cfg: Any, model_type: str, architecture: str) -> Dict[str, Any]:
    """decoder_sizes' inverse: the config.json a test checkpoint is written with."""
    return dict(model_type=model_type, architectures=[architecture], vocab_size=cfg.vocab_size,
                hidden_size=cfg.hidden_size, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
                rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_word_embeddings,
                max_position_embeddings=cfg.max_seq_len)


DREAM = DreamFamily(
    name="Dream", model_type="Dream", aliases=("dream",), layout="qwen2",
    examples="Dream-org/Dream-v0-Instruct-7B, Dream-v0-Base-7B, Dream-Coder-v0-Instruct-7B; "
             "apple/DiffuCoder-7B-Instruct, DiffuCoder-7B-cpGRPO",
    honoured=frozenset({"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "intermediate_size", "rope_theta", "rope_parameters", "rms_norm_eps",
                        "tie_word_embeddings", "max_position_embeddings", "layer_types"}),
    # Qwen2Config's other keys (dropout, init, cache; sliding_window and max_window_layers,
    # inert while use_sliding_window is off) are derived inert from `layout`
    fixed={"hidden_act": ("silu",), "rope_scaling": (None,), "use_sliding_window": (False,),
           "attention_bias": (True,), "use_mrope": (False, None)},  # use_mrope: Qwen2.5's multimodal RoPE, off
    top_weights={"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "lm_head.weight": "lm_head.weight", "lm_head.bias": "lm_head.bias"},
    layer_prefix="model.layers.{i}.",
    layer_weights=LLAMA_MODULES,
    shift_logits=True, first_position=True, confidence=Confidence.SAMPLED,
    defaults={"mask_token_id": 151666, "eos_token_id": 151643},
)
