"""LLaDA2.x (inclusionAI/LLaDA2.0-mini, LLaDA2.1-mini, -flash; model_type "llada2_moe"):
written from the published configuration_llada2_moe.py / modeling_llada2_moe.py. Fused
`attention.query_key_value` (q heads, then k, then v), per-head QK RMSNorm before partial
RoPE, `attention.dense` (bias when use_bias), the first `first_k_dense_replace` layers a
dense MLP, then MoE layers: sigmoid router scores in float32, `gate.expert_bias` for
selection only, group-limited top-k (top-2 sum per group), weights renormalised and times
routed_scaling_factor, a shared expert of moe_intermediate_size * num_shared_experts.
LLaDA2.2's block routing (config `expert_capacity` > 0, `block_size`, default 32): per
block of block_size positions, the expert_capacity experts with the best biased score
over the block's tokens are admitted, each token takes its top-k among them, n_group /
topk_group unused (engine.models.moe.route). LLaDA2.2's Levenshtein edit tokens
(`delete_token_id`, `split_token_id`) are read into the config for LLaDA2.2's edit loop
(engine.indel, SamplingParams.edit_ops; preset "llada2.2"). Rows of the other rules
decode the same weights without DELETE / SPLIT (as FluxServe's threshold decoder does).

Decoding traits: blocks at absolute positions (multiples of the block length from
position 0: the prompt's tail opens the first decoded block), the prompt block-causal,
LLaDA2's threshold rule, LLaDA2.1's token editing. The config names only `pad_token_id`;
EOS and <|mask|> come from the tokenizer, else generate()'s defaults 156892 / 156895."""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional

from .base import BlockLayout, ConfigRefused, Family, ThresholdRule
from .llada_moe import PROJECTIONS
from .moe import MoESpec

# internal module (after "layers.{i}.") -> checkpoint module (after "model.layers.{i}.")
MODULES = {"attn_norm": "input_layernorm", "qkv_proj": "attention.query_key_value", "o": "attention.dense",
           "q_norm": "attention.query_layernorm", "k_norm": "attention.key_layernorm",
           "mlp_norm": "post_attention_layernorm", "router": "mlp.gate", "expert_bias": "mlp.gate.expert_bias",
           "dense": "mlp", "shared": "mlp.shared_experts", "experts": "mlp.experts"}


# LLaDA2.2's edit tokens (engine.indel reads them from ModelConfig)
EDIT_TOKENS = ("delete_token_id", "split_token_id")


class LLaDA2Family(Family):
    def tokenizer_ids(self, hf: Mapping[str, Any], tokens: Mapping[str, int], eos: Optional[int]) -> Dict[str, Any]:
        """<|mask|> and the tokenizer's eos_token where config.json names neither (it does not)."""
        out: Dict[str, Any] = {}
        if "mask_token_id" not in hf and "<|mask|>" in tokens:
            out["mask_token_id"] = tokens["<|mask|>"]
        if "eos_token_id" not in hf and eos is not None:
            out.update(eos_token_id=eos, eos_token_ids=None)
        return out

    def parse(self, hf: Mapping[str, Any]) -> Dict[str, Any]:
        n, d, H = hf["num_hidden_layers"], hf["hidden_size"], hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or d // H  # the published attention: config.head_dim or hidden / heads
        prf = float(hf.get("partial_rotary_factor", 0.5))
        rotary = hf.get("rotary_dim")
        if rotary is not None and rotary != int(head_dim * prf):
            raise ConfigRefused(f"config.json rotary_dim={rotary!r} is not head_dim x partial_rotary_factor "
                                f"({head_dim} x {prf}), the dims the published modeling code rotates")
        experts = hf.get("num_experts")
        if experts is None:
            raise ConfigRefused("config.json num_experts=None (an all-dense LLaDA2) is not supported by blockray")
        shared = hf.get("num_shared_experts")
        if shared is not None and shared < 1:
            raise ConfigRefused(f"config.json num_shared_experts={shared!r}: the published block builds a "
                                f"zero-width shared expert; blockray supports null or >= 1")
        first_dense = int(hf.get("first_k_dense_replace", 0))
        # LLaDA2.2's gate dispatches on expert_capacity > 0 (absent or 0: 2.1's grouped top-k);
        # block_size alone routes nothing
        capacity = hf.get("expert_capacity") or None
        block_size = int(hf.get("block_size") or 32) if capacity else None
        moe = MoESpec(num_experts=experts, top_k=hf.get("num_experts_per_tok", 2),
                      expert_size=hf["moe_intermediate_size"], dense_size=hf.get("intermediate_size") or -1,
                      dense_layers=tuple(i < first_dense for i in range(n)),
                      shared_size=hf["moe_intermediate_size"] * shared if shared else None, score="sigmoid",
                      expert_bias=True, bias_in_weights=False, renormalize=True,
                      scaling=float(hf.get("routed_scaling_factor", 2.5)), n_group=hf.get("n_group", 8),
                      topk_group=hf.get("topk_group", 4), expert_capacity=capacity, block_size=block_size)
        kv = hf.get("num_key_value_heads") or H
        return dict(
            self._common(hf), vocab_size=hf["vocab_size"], hidden_size=d, n_layers=n, n_heads=H, n_kv_heads=kv,
            head_dim=head_dim, intermediate_size=max(moe.dense_size, 0), rope_theta=hf.get("rope_theta", 10000.0),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5), tie_word_embeddings=hf.get("tie_word_embeddings", False),
            max_seq_len=hf.get("max_position_embeddings", 16384), moe=moe, qk_norm=bool(hf.get("use_qk_norm", True)),
            partial_rotary_factor=prf, qkv_bias=bool(hf.get("use_qkv_bias", False)),
            attn_out_bias=bool(hf.get("use_bias", True)), **edit_tokens(hf))

    def to_hf(self, cfg: Any) -> Dict[str, Any]:
        m = cfg.moe
        return dict(model_type="llada2_moe", architectures=["LLaDA2MoeModelLM"], vocab_size=cfg.vocab_size,
                    hidden_size=cfg.hidden_size, num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                    num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                    intermediate_size=m.dense_size if m.dense_size > 0 else None,
                    moe_intermediate_size=m.expert_size, num_experts=m.num_experts, num_experts_per_tok=m.top_k,
                    num_shared_experts=(m.shared_size // m.expert_size) if m.shared_size else None,
                    first_k_dense_replace=sum(m.dense_layers), n_group=m.n_group, topk_group=m.topk_group,
                    routed_scaling_factor=m.scaling, use_qk_norm=cfg.qk_norm, use_qkv_bias=cfg.qkv_bias,
                    use_bias=cfg.attn_out_bias, partial_rotary_factor=cfg.partial_rotary_factor,
                    rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
                    tie_word_embeddings=cfg.tie_word_embeddings, max_position_embeddings=cfg.max_seq_len,
                    **({} if not m.block_routed else dict(expert_capacity=m.expert_capacity, block_size=m.block_size)),
                    **{k: getattr(cfg, k) for k in EDIT_TOKENS if getattr(cfg, k) is not None})


def edit_tokens(hf: Mapping[str, Any]) -> Dict[str, int]:
    """LLaDA2.2's DELETE / SPLIT ids: both or neither (the loop needs the two)."""
    named = {k: hf[k] for k in EDIT_TOKENS if hf.get(k) is not None}
    if len(named) == 1:
        (have,) = named
        (lack,) = set(EDIT_TOKENS) - {have}
        raise ConfigRefused(f"config.json names {have}={named[have]!r} but no {lack}: LLaDA2.2's Levenshtein edit "
                            f"loop needs both its DELETE and SPLIT tokens")
    for k, v in named.items():
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < hf["vocab_size"]:
            raise ConfigRefused(f"config.json {k}={v!r} is not a token id of the vocabulary ({hf['vocab_size']})")
    return named


LLADA2_MOE = LLaDA2Family(
    name="LLaDA2", model_type="llada2_moe", aliases=("llada2",),
    examples="inclusionAI/LLaDA2.0-mini, LLaDA2.1-mini, LLaDA2.0-flash, LLaDA2.1-flash, LLaDA2.2-flash",
    honoured=frozenset({"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                        "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
                        "num_shared_experts", "first_k_dense_replace", "n_group", "topk_group",
                        "routed_scaling_factor", "use_qk_norm", "use_qkv_bias", "use_bias", "partial_rotary_factor",
                        "rotary_dim", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
                        "expert_capacity", "block_size", "delete_token_id", "split_token_id"}),
    # dropout, init and training-only outputs; norm_topk_prob is read by no published
    # modeling code (the gate renormalises whenever top_k > 1); the sliding-window keys are
    # inert while use_sliding_window is false (fixed below)
    ignored=frozenset({"embedding_dropout", "attention_dropout", "output_dropout", "output_router_logits",
                       "norm_topk_prob", "sliding_window", "max_window_layers", "router_aux_loss_coef"}),
    fixed={"hidden_act": ("silu",), "rope_scaling": (None,), "norm_head": (False,), "use_sliding_window": (False,),
           "score_function": ("sigmoid", None), "router_dtype": ("fp32", None),
           "moe_router_enable_expert_bias": (True, None), "num_nextn_predict_layers": (0, None),
           # the published config.json's layout switches, at the values its modeling code computes
           "norm_softmax": (False, None), "use_rmsnorm": (True, None), "using_split_qkv_in_self_attention": (False, None)},
    top_weights={"embed.weight": "model.word_embeddings.weight", "norm.weight": "model.norm.weight",
                 "lm_head.weight": "lm_head.weight"},
    layer_prefix="model.layers.{i}.",
    layer_weights=MODULES, mlp_weights=PROJECTIONS, fused_qkv=True,
    blocks=BlockLayout.ABSOLUTE, threshold=ThresholdRule.SCHEDULE_FLOOR, editing=True, attention="block_causal",
    # generate()'s eos_id / mask_id defaults (the Ling tokenizer: <|endoftext|>, <|mask|>)
    defaults={"mask_token_id": 156895, "eos_token_id": 156892},
)
