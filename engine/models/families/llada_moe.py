"""LLaDA-MoE (inclusionAI/LLaDA-MoE-7B-A1B-Base, -Instruct): the classic LLaDA loop
(bidirectional, full canvas, fixed schedule) over an OLMoE-style backbone: Hugging Face
config keys under model_type "llada" (recognised from its keys, not that string: LLaDA's
own config.json says "llada" too), QK RMSNorm per head, (partial) RoPE, softmax top-k
routing without renormalisation (the published block hard-codes norm_topk_prob=False),
an optional expert bias added to the softmax scores before top-k and kept in the
weights, optional shared expert, dense layers where moe_layer_freq is 0. Written from
the published modeling_lladamoe.py / configuration_lladamoe.py."""
from __future__ import annotations

from typing import Any, Dict, Mapping

from .base import Family
from .moe import MoESpec

# internal module (after "layers.{i}.") -> checkpoint module (after "model.layers.{i}.")
MODULES = {"attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
           "v": "self_attn.v_proj", "o": "self_attn.o_proj", "q_norm": "self_attn.q_norm",
           "k_norm": "self_attn.k_norm", "mlp_norm": "post_attention_layernorm", "router": "mlp.gate",
           "expert_bias": "mlp.expert_bias", "dense": "mlp", "shared": "shared_expert", "experts": "mlp.experts"}
PROJECTIONS = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}  # inside an MLP module


class LLaDAMoEFamily(Family):
    def matches(self, hf: Mapping[str, Any]) -> bool:
        """LLaDA-MoE's config.json: model_type 'llada' with Hugging Face keys and experts."""
        return hf.get("model_type") in ("llada", "LLaDA", "lladamoe") and "d_model" not in hf and "num_experts" in hf

    def parse(self, hf: Mapping[str, Any]) -> Dict[str, Any]:
        n = hf["num_hidden_layers"]
        freq = hf.get("moe_layer_freq") or [1] * n
        if len(freq) != n:
            raise ValueError(f"config.json moe_layer_freq has {len(freq)} entries for num_hidden_layers={n}")
        shared = hf.get("shared_expert_intermediate_size")
        moe = MoESpec(num_experts=hf["num_experts"], top_k=hf["num_experts_per_tok"],
                      expert_size=hf["expert_intermediate_size"], dense_size=hf.get("dense_intermediate_size", -1),
                      dense_layers=tuple(f == 0 for f in freq), shared_size=shared if shared and shared > 0 else None,
                      score="softmax", expert_bias=bool(hf.get("moe_router_enable_expert_bias")),
                      bias_in_weights=True, renormalize=False, scaling=1.0)
        prf = hf.get("partial_rotary_factor", 1.0)
        return dict(
            self._common(hf), vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], n_layers=n,
            n_heads=hf["num_attention_heads"], n_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            intermediate_size=max(moe.dense_size, 0), rope_theta=hf.get("rope_theta", 10000.0),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5), tie_word_embeddings=hf.get("tie_word_embeddings", False),
            max_seq_len=hf.get("max_position_embeddings", 4096), moe=moe, qk_norm=bool(hf.get("qk_layernorm")),
            partial_rotary_factor=1.0 if prf in (None, -1) else float(prf))

    def to_hf(self, cfg: Any) -> Dict[str, Any]:
        m = cfg.moe
        return dict(model_type="llada", architectures=["LLaDAMoEModelLM"], vocab_size=cfg.vocab_size,
                    hidden_size=cfg.hidden_size, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                    num_key_value_heads=cfg.n_kv_heads, dense_intermediate_size=m.dense_size,
                    expert_intermediate_size=m.expert_size, shared_expert_intermediate_size=m.shared_size,
                    num_experts=m.num_experts, num_experts_per_tok=m.top_k,
                    moe_layer_freq=[0 if dl else 1 for dl in m.dense_layers],
                    moe_router_enable_expert_bias=m.expert_bias, moe_router_score_function="softmax",
                    qk_layernorm=cfg.qk_norm, partial_rotary_factor=cfg.partial_rotary_factor,
                    rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
                    tie_word_embeddings=cfg.tie_word_embeddings, max_position_embeddings=cfg.max_seq_len)


LLADA_MOE = LLaDAMoEFamily(
    name="LLaDA-MoE", model_type="llada_moe",
    examples="inclusionAI/LLaDA-MoE-7B-A1B-Instruct, LLaDA-MoE-7B-A1B-Base",
    honoured=frozenset({"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "dense_intermediate_size", "expert_intermediate_size",
                        "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok", "moe_layer_freq",
                        "moe_router_enable_expert_bias", "qk_layernorm", "partial_rotary_factor", "rope_theta",
                        "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings"}),
    # training-only (dropout, aux loss, router logits output); norm_topk_prob,
    # routed_scaling_factor, router_num_group and router_topk_group are read by the published
    # configuration class but never by its modeling code (norm_topk_prob is hard-coded False),
    # so they cannot change what the published network computes
    ignored=frozenset({"attention_dropout", "output_router_logits", "router_aux_loss_coef", "norm_topk_prob",
                       "routed_scaling_factor", "router_num_group", "router_topk_group"}),
    fixed={"hidden_act": ("silu",), "rope_scaling": (None,), "attention_bias": (False,), "clip_qkv": (None,),
           "moe_router_score_function": ("softmax", None)},
    top_weights={"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "lm_head.weight": "lm_head.weight"},
    layer_prefix="model.layers.{i}.",
    layer_weights=MODULES, mlp_weights=PROJECTIONS,
    # the Ling tokenizer LLaDA-MoE and LLaDA2 share: <|endoftext|> 156892, <|mask|> 156895
    defaults={"mask_token_id": 156895, "eos_token_id": 156892},
)
