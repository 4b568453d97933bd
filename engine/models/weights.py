"""Real checkpoint weight names for each layout, mapped to the internal DLLM names."""
from __future__ import annotations

from typing import Dict

from .config import ModelConfig

_LLADA = {"attn_norm": "attn_norm", "q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "attn_out",
          "mlp_norm": "ff_norm", "gate": "ff_proj", "up": "up_proj", "down": "ff_out"}
_DREAM = {"attn_norm": "input_layernorm", "q": "self_attn.q_proj", "k": "self_attn.k_proj",
          "v": "self_attn.v_proj", "o": "self_attn.o_proj", "mlp_norm": "post_attention_layernorm",
          "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def checkpoint_names(cfg: ModelConfig, internal_names) -> Dict[str, str]:
    """{internal parameter name: checkpoint key} for every name in `internal_names`."""
    if cfg.model_type == "llada":
        top = {"embed.weight": "model.transformer.wte.weight", "norm.weight": "model.transformer.ln_f.weight",
               "lm_head.weight": "model.transformer.ff_out.weight", "lm_head.bias": "model.transformer.ff_out.bias"}
        layer_prefix, table = "model.transformer.blocks.{i}.", _LLADA
    else:
        top = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
               "lm_head.weight": "lm_head.weight", "lm_head.bias": "lm_head.bias"}
        layer_prefix, table = "model.layers.{i}.", _DREAM
    out = {}
    for name in internal_names:
        if name in top:
            out[name] = top[name]
            continue
        _, i, module, kind = name.split(".")  # layers.{i}.{module}.{weight|bias}
        out[name] = layer_prefix.format(i=i) + f"{table[module]}.{kind}"
    return out
