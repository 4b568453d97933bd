"""LLaDA2's block (modeling_llada2_moe.py's LLaDA2MoeDecoderLayer): engine.models.moe's
block with the fused `query_key_value` projection (q heads, then k, then v, split per
head) and an attention output projection that has a bias when config.json's use_bias."""
from __future__ import annotations

from torch import nn

from .config import ModelConfig
from .moe import MoELayer


class LLaDA2Layer(MoELayer):
    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__(cfg, index)
        del self.q, self.k, self.v
        H, Hkv, D, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden_size
        self.qkv_proj = nn.Linear(d, (H + 2 * Hkv) * D, bias=cfg.qkv_bias)
        self.o = nn.Linear(H * D, d, bias=cfg.attn_out_bias)

    def heads(self, x):
        """q [B, T, H, D], k and v [B, T, H_kv, D] from the fused projection."""
        B, T, _ = x.shape
        H, Hkv, D = self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim
        return self.qkv_proj(x).view(B, T, H + 2 * Hkv, D).split([H, Hkv, Hkv], dim=2)
