"""A hand-written DiffusionGemma denoiser forward (the option issue #26 left open against
driving transformers' own modules), kept in bench/ for the measurement only: the engine
does not use it (docs/models/diffusion_gemma.md says why).

Pure torch over the weights of a transformers DiffusionGemmaForBlockDiffusion, written
from transformers' modeling_diffusion_gemma.py: scaled embeddings, self-conditioning
(softmax of the previous logits through the embedding, a gated MLP, RMS norms), per
layer RMS-normed attention with QK norm and a scale-free V norm, RoPE per layer type
(sliding: its base over the whole head; full: the checkpoint's partial rotary
frequencies, read from the model's inv_freq buffer), keys equal values on full layers
(no v_proj), the canvas attending a read-only K/V cache plus itself under a boolean
mask, the dense MLP plus the MoE block (router: scale-free RMS norm, scale, softmax,
top-k renormalised times per-expert scales; experts looped over, never tokens) summed,
the layer scalar, the final norm, the LM head and the logit softcap. RMS norms compute
in float32 as transformers' do (so a float64 model matches it to float32 rounding of
the norms only)."""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F


def _rms(x: torch.Tensor, w: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (h * w.float() if w is not None else h).type_as(x)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, L, H, D); cos/sin (B, L, D)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(2) + rot * sin.unsqueeze(2)


class HandDecoder:
    """The denoiser forward of `model` (transformers' DiffusionGemmaForBlockDiffusion),
    written by hand over its parameters (no copy)."""

    def __init__(self, model):
        tc = model.config.text_config
        dec = model.model.decoder
        self.eps, self.softcap = tc.rms_norm_eps, tc.final_logit_softcapping
        self.n_heads, self.top_k = tc.num_attention_heads, tc.top_k_experts
        self.hidden = tc.hidden_size
        self.types = list(tc.layer_types)
        self.embed = dec.embed_tokens.weight
        self.embed_scale = dec.embed_tokens.embed_scale
        self.rope = {t: (getattr(dec.rotary_emb, f"{t}_inv_freq"), getattr(dec.rotary_emb, f"{t}_attention_scaling"))
                     for t in set(self.types)}
        sc = dec.self_conditioning
        self.sc = (sc.pre_norm.weight, sc.gate_proj.weight, sc.up_proj.weight, sc.down_proj.weight)
        self.layers: List[Dict[str, torch.Tensor]] = []
        for lyr in dec.layers:
            a = lyr.self_attn
            p = {n: m.weight for n, m in (("q", a.q_proj), ("k", a.k_proj), ("o", a.o_proj), ("qn", a.q_norm),
                                          ("kn", a.k_norm), ("ln_in", lyr.input_layernorm),
                                          ("ln_post_attn", lyr.post_attention_layernorm),
                                          ("ln_pre_ff", lyr.pre_feedforward_layernorm),
                                          ("ln_post_ff", lyr.post_feedforward_layernorm),
                                          ("ln_post_ff1", lyr.post_feedforward_layernorm_1),
                                          ("ln_post_ff2", lyr.post_feedforward_layernorm_2),
                                          ("ln_pre_ff2", lyr.pre_feedforward_layernorm_2),
                                          ("gate", lyr.mlp.gate_proj), ("up", lyr.mlp.up_proj),
                                          ("down", lyr.mlp.down_proj), ("router", lyr.router.proj))}
            p["v"] = a.v_proj.weight if a.v_proj is not None else None
            p.update(head_dim=a.head_dim, router_scale=lyr.router.scale, expert_scale=lyr.router.per_expert_scale,
                     gate_up=lyr.experts.gate_up_proj, expert_down=lyr.experts.down_proj, scalar=lyr.layer_scalar)
            self.layers.append(p)
        self.norm, self.lm_head = dec.norm.weight, model.lm_head.weight

    @staticmethod
    def _mlp(x, gate, up, down):
        return F.linear(F.gelu(F.linear(x, gate), approximate="tanh") * F.linear(x, up), down)

    def _moe(self, p, x_route: torch.Tensor, x_expert: torch.Tensor) -> torch.Tensor:
        h = _rms(x_route, None, self.eps) * p["router_scale"] * self.hidden ** -0.5
        probs = torch.softmax(F.linear(h, p["router"]), dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, k=self.top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True) * p["expert_scale"][idx]
        out = torch.zeros_like(x_expert)
        for e in idx.unique().tolist():  # grouped by expert: one matmul per expert hit
            tok, slot = torch.where(idx == e)
            g, u = F.linear(x_expert[tok], p["gate_up"][e]).chunk(2, dim=-1)
            y = F.linear(F.gelu(g, approximate="tanh") * u, p["expert_down"][e]) * w[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out

    def _attention(self, p, x, cos, sin, keys, values, mask):
        B, L, _ = x.shape
        hd = p["head_dim"]
        q = _rope(_rms(F.linear(x, p["q"]).view(B, L, -1, hd), p["qn"], self.eps), cos, sin).transpose(1, 2)
        k_raw = F.linear(x, p["k"]).view(B, L, -1, hd)
        v = F.linear(x, p["v"]).view(B, L, -1, hd) if p["v"] is not None else k_raw
        k = _rope(_rms(k_raw, p["kn"], self.eps), cos, sin).transpose(1, 2)
        v = _rms(v, None, self.eps).transpose(1, 2)
        k, v = torch.cat([keys, k], dim=-2), torch.cat([values, v], dim=-2)
        rep = self.n_heads // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        return F.linear(out.transpose(1, 2).reshape(B, L, -1), p["o"])

    @torch.no_grad()
    def __call__(self, canvas: torch.Tensor, kv: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                 masks: Dict[str, torch.Tensor], positions: torch.Tensor,
                 sc_logits: Optional[torch.Tensor] = None) -> torch.Tensor:
        """canvas (B, L) ids; kv[i] the cached (keys, values) of layer i, (B, KV, n, D);
        masks[type] boolean (B, 1, L, n + L); positions (B, L); sc_logits (B, L, V) or None.
        Returns the softcapped float32 logits (B, L, V), as transformers' forward."""
        dt = self.embed.dtype
        x = F.embedding(canvas, self.embed) * self.embed_scale.to(dt)
        if sc_logits is not None:
            soft = torch.matmul(sc_logits.softmax(-1, dtype=torch.float32).to(dt), self.embed) * self.embed_scale.to(dt)
        else:
            soft = torch.zeros_like(x)
        pre, gate, up, down = self.sc
        x = _rms(x + self._mlp(_rms(soft, pre, self.eps), gate, up, down), None, self.eps)
        rope = {}
        for t, (inv, scale) in self.rope.items():
            f = positions[..., None].float() * inv.float()
            emb = torch.cat((f, f), dim=-1)
            rope[t] = ((emb.cos() * scale).to(dt), (emb.sin() * scale).to(dt))
        for p, t, (keys, values) in zip(self.layers, self.types, kv):
            h = self._attention(p, _rms(x, p["ln_in"], self.eps), *rope[t], keys, values, masks[t])
            x = x + _rms(h, p["ln_post_attn"], self.eps)
            dense = _rms(self._mlp(_rms(x, p["ln_pre_ff"], self.eps), p["gate"], p["up"], p["down"]),
                         p["ln_post_ff1"], self.eps)
            flat = x.reshape(-1, x.shape[-1])
            moe = self._moe(p, flat, _rms(flat, p["ln_pre_ff2"], self.eps)).reshape(x.shape)
            x = (x + _rms(dense + _rms(moe, p["ln_post_ff2"], self.eps), p["ln_post_ff"], self.eps)) * p["scalar"]
        logits = F.linear(_rms(x, self.norm, self.eps), self.lm_head).to(torch.float32)
        return torch.tanh(logits / self.softcap) * self.softcap


__all__ = ["HandDecoder"]
