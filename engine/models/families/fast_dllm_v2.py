"""Fast-dLLM v2 (Efficient-Large-Model/Fast_dLLM_v2_7B, -1.5B; model_type "Fast_dLLM_Qwen"):
Qwen2.5-7B-Instruct adapted to block diffusion. Written from the published configuration.py /
modeling.py and v2/generation_functions.py `batch_sample` (never run).

The layer is Qwen2's (q/k/v with bias, o without, RoPE, SwiGLU), Dream's weight names. The
model predicts token i from position i-1 (logit shift, as Dream), attends block-causally
over blocks at absolute positions (its eval mask: block(q) >= block(k), the prompt's
complete blocks prefilled), and a block's first token is the argmax of the last logit of
the block before it, once that block is complete and its K/V stored (the AR step:
`first_position`, which commits nothing where the prompt's tail holds that position). A
block is decoded in sub-blocks left to right (SamplingParams.sub_block_length, engine.
subblocks) with batch_sample's threshold rule (ThresholdRule.GREATER_AT_LEAST_TOP1)."""
from __future__ import annotations

from typing import Any, Dict, Mapping

from .base import LLAMA_MODULES, BlockLayout, ThresholdRule
from .dream import DreamFamily

class FastDLLMv2Family(DreamFamily):
    def parse(self, hf: Mapping[str, Any]) -> Dict[str, Any]:
        return dict(super().parse(hf), model_type=self.model_type, dllm_attention="block_causal")

    def to_hf(self, cfg: Any) -> Dict[str, Any]:
        return dict(super().to_hf(cfg), model_type=self.model_type, architectures=["Fast_dLLM_QwenForCausalLM"])


FAST_DLLM_V2 = FastDLLMv2Family(
    name="Fast-dLLM v2", model_type="Fast_dLLM_Qwen", layout="qwen2",
    examples="Efficient-Large-Model/Fast_dLLM_v2_7B, Fast_dLLM_v2_1.5B",
    honoured=frozenset({"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "intermediate_size", "rope_theta", "rope_parameters", "rms_norm_eps",
                        "tie_word_embeddings", "max_position_embeddings", "layer_types"}),
    # bd_size: read only by the training mask (inference takes the block size from the caller:
    # --block-length, 32 as trained); conplemenrary_mask (sic): read by no modeling code
    ignored=frozenset({"bd_size", "conplemenrary_mask"}),
    fixed={"hidden_act": ("silu",), "rope_scaling": (None,), "use_sliding_window": (False,),
           "attention_bias": (True,)},
    top_weights={"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "lm_head.weight": "lm_head.weight"},
    layer_prefix="model.layers.{i}.",
    layer_weights=LLAMA_MODULES,
    shift_logits=True, first_position=True, blocks=BlockLayout.ABSOLUTE,
    threshold=ThresholdRule.GREATER_AT_LEAST_TOP1, attention="block_causal",
    # batch_sample's mask_id / stop_token defaults (|<MASK>|, <|im_end|>); the mask is that added token
    defaults={"mask_token_id": 151665, "eos_token_id": 151645}, mask_token="|<MASK>|",
)
