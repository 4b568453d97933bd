"""SDAR and TraDo (JetLM/SDAR-1.7B/4B/8B-Chat, SDAR-30B-A3B-Chat; Gen-Verse/TraDo-4B/8B-Instruct,
which share SDAR's architecture): model_type "sdar" (dense) and "sdar_moe". Written from the
published configuration_sdar(_moe).py / modeling_sdar(_moe).py and JetAstra/SDAR's
generate.py `block_diffusion_generate` (the checkpoints' own .py files are never run).

The layer is Qwen3's: separate q/k/v/o projections without bias, per-head RMSNorm of q and k
(`q_norm`, `k_norm`) before rotate-half RoPE (float32, default rope type), an explicit
`head_dim` (the dense configuration class defaults it to 128; the MoE one to hidden / heads),
GQA, tied or untied embeddings as config.json says. SDAR-MoE: the router's logits softmaxed in
float32, the top `num_experts_per_tok` experts, renormalised when `norm_topk_prob`, no shared
expert; a layer is sparse unless listed in `mlp_only_layers` or off `decoder_sparse_step`
(the published 30B: every layer).

Decoding traits: blocks at absolute positions (the prompt's complete blocks prefilled, its
tail opening the first decoded block), block-causal attention everywhere, no logit shift,
the threshold rule of block_diffusion_generate (ThresholdRule.BLOCK_FLOOR). Neither config
names a mask id nor a block size: the mask is the tokenizer's `<|MASK|>` (151669 in
tokenizer_config.json; the dense added_tokens.json's `<MASK>` names no token the tokenizer
has), the block length is the request's (published default 4)."""
from __future__ import annotations

from typing import Any, Dict, Mapping

from .base import BlockLayout, ConfigRefused, Family, ThresholdRule
from .dream import rope_theta
from .llada_moe import PROJECTIONS
from .moe import MoESpec

# internal module (after "layers.{i}.") -> checkpoint module (after "model.layers.{i}.")
MODULES = {"attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
           "o": "self_attn.o_proj", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
           "mlp_norm": "post_attention_layernorm", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
           "down": "mlp.down_proj", "router": "mlp.gate", "dense": "mlp", "experts": "mlp.experts"}

# config.json keys of the published SDAR-4B/8B-Chat that no published modeling code reads:
# the training launcher's switches (debug, ep_size, micro_forward, skip_checkpoint,
# use_deepep), fuse_cross_entropy (read only when training) and attn_implementation (the
# published forward never calls the mask builder that reads it: attention is SDPA under the
# block mask the caller passes)
LAUNCHER_KEYS = frozenset({"debug", "ep_size", "micro_forward", "skip_checkpoint", "use_deepep",
                           "fuse_cross_entropy", "attn_implementation"})


class SDARFamily(Family):
    def parse(self, hf: Mapping[str, Any]) -> Dict[str, Any]:
        self._full_attention(hf)
        n, d, H = hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]
        out = dict(
            self._common(hf), vocab_size=hf["vocab_size"], hidden_size=d, n_layers=n, n_heads=H,
            n_kv_heads=hf.get("num_key_value_heads") or H, head_dim=hf.get("head_dim") or self._head_dim(d, H),
            intermediate_size=hf["intermediate_size"], rope_theta=rope_theta(hf, 10000.0),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6), tie_word_embeddings=hf.get("tie_word_embeddings", False),
            qk_norm=True, max_seq_len=hf.get("max_position_embeddings", 32768))
        if self.model_type == "sdar_moe":
            out["moe"] = self._moe(hf, n)
        return out

    def _head_dim(self, hidden: int, heads: int) -> int:
        """head_dim where config.json has none: SDARConfig's default 128; the MoE modeling
        code's getattr fallback, hidden / heads."""
        return hidden // heads if self.model_type == "sdar_moe" else 128

    @staticmethod
    def _moe(hf: Mapping[str, Any], n: int) -> MoESpec:
        """SDARMoeSparseMoeBlock's routing; a dense SDARMoeMLP (intermediate_size) where the
        published decoder layer builds one."""
        experts, step = hf.get("num_experts", 128), hf.get("decoder_sparse_step", 1)
        if experts < 1 or step < 1:
            raise ConfigRefused(f"config.json num_experts={experts!r}, decoder_sparse_step={step!r}: blockray's "
                                "SDAR-MoE needs at least one expert and a sparse step >= 1")
        dense_only = set(hf.get("mlp_only_layers") or [])
        return MoESpec(num_experts=experts, top_k=hf.get("num_experts_per_tok", 8),
                       expert_size=hf.get("moe_intermediate_size", 768), dense_size=hf["intermediate_size"],
                       dense_layers=tuple(i in dense_only or (i + 1) % step != 0 for i in range(n)),
                       score="softmax", renormalize=bool(hf.get("norm_topk_prob", False)))

    def to_hf(self, cfg: Any) -> Dict[str, Any]:
        arch = "SDARMoeForCausalLM" if cfg.moe is not None else "SDARForCausalLM"
        out = dict(model_type=self.model_type, architectures=[arch], vocab_size=cfg.vocab_size,
                   hidden_size=cfg.hidden_size, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                   num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.intermediate_size,
                   rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
                   tie_word_embeddings=cfg.tie_word_embeddings, max_position_embeddings=cfg.max_seq_len)
        m = cfg.moe
        if m is not None:
            out.update(num_experts=m.num_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.expert_size,
                       norm_topk_prob=m.renormalize, decoder_sparse_step=1,
                       mlp_only_layers=[i for i, dense in enumerate(m.dense_layers) if dense])
        return out


_COMMON = dict(
    fixed={"hidden_act": ("silu",), "rope_scaling": (None,), "use_sliding_window": (False,),
           "attention_bias": (False,)},
    top_weights={"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "lm_head.weight": "lm_head.weight"},
    layer_prefix="model.layers.{i}.", layer_weights=MODULES, mlp_weights=PROJECTIONS, mask_token="<|MASK|>",
    blocks=BlockLayout.ABSOLUTE, threshold=ThresholdRule.BLOCK_FLOOR, attention="block_causal")
_HONOURED = frozenset({"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                       "head_dim", "intermediate_size", "rope_theta", "rope_parameters", "rms_norm_eps",
                       "tie_word_embeddings", "max_position_embeddings", "layer_types"})

# mask: <|MASK|> (the tokenizer's, generate.py's mask_id), eos: <|endoftext|>
SDAR = SDARFamily(
    name="SDAR", model_type="sdar", layout="qwen3",
    examples="JetLM/SDAR-1.7B-Chat, SDAR-4B-Chat, SDAR-8B-Chat, Gen-Verse/TraDo-4B-Instruct, TraDo-8B-Instruct",
    honoured=_HONOURED, ignored=LAUNCHER_KEYS,
    defaults={"mask_token_id": 151669, "eos_token_id": 151643}, **_COMMON)

# Qwen3MoeConfig's keys; max_window_layers is inert while use_sliding_window is off (fixed)
SDAR_MOE = SDARFamily(
    name="SDAR-MoE", model_type="sdar_moe", layout="qwen3_moe", examples="JetLM/SDAR-30B-A3B-Chat",
    honoured=_HONOURED | {"num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                          "decoder_sparse_step", "mlp_only_layers"},
    ignored=LAUNCHER_KEYS | {"max_window_layers"},
    defaults={"mask_token_id": 151669, "eos_token_id": 151643}, **_COMMON)
