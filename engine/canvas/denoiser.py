"""DiffusionGemma's denoiser forward written over the weights of transformers'
DiffusionGemmaForBlockDiffusion (no copy), for the canvas engine's decoder steps.

It also runs the engine's fused passes (encoder work and denoising in one forward).

Why: at small widths (and on a GPU, where the matmuls are fast) a decoder step's cost is
per-call overhead, and transformers' module stack (wrappers, output recording, kwargs and
mask plumbing, ~70 module calls per forward) is most of it: this forward computes the
same operations in the same order and is bit-equal to transformers' decoder forward
(tests/test_diffusion_gemma.py checks it against `model.model.decoder` in float64 and
float32 on mid-run batches; the engine's tokens are checked against transformers'
`generate`), ~1.3x faster per call at hidden 32. Transformers' own classes stay the
reference; the engine falls back to them (`refusal`) for what this file does not
implement.

Written from transformers' modeling_diffusion_gemma.py (5.24): scaled embeddings,
self-conditioning (softmax of the previous logits through the embedding, zeroed per row by
its mask, a gated MLP, RMS norms), per layer RMS-normed attention with QK norm and a
scale-free V norm, RoPE per layer type (its inv_freq buffers and attention scaling), keys
as values on layers without v_proj, the canvas attending the read-only K/V view plus
itself under a boolean mask, the dense MLP plus the MoE block (router: scale-free RMS
norm, scale, softmax, top-k renormalised times per-expert scales; the experts are
transformers' own module, so its grouped kernels run them at every width) summed, the
layer scalar, the final norm, the LM head and the logit softcap. RMS norms compute in
float32 as transformers' do."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .kv import Pass


def refusal(model) -> Optional[str]:
    """Why this forward would not be transformers' for `model` (None when it is)."""
    tc = model.config.text_config
    if getattr(getattr(model, "tp", None), "size", 1) > 1:
        return "tensor-parallel shards (their row-parallel outputs are all-reduced by the modules)"
    if getattr(tc, "_attn_implementation", "sdpa") != "sdpa":
        return f"attention implementation {tc._attn_implementation!r} (this forward is sdpa's)"
    if tc.hidden_activation != "gelu_pytorch_tanh":
        return f"hidden_activation {tc.hidden_activation!r}"
    if getattr(tc, "attention_bias", False):
        return "attention biases"
    if not getattr(tc, "num_experts", None) or not getattr(tc, "enable_moe_block", True):
        return "no MoE block"
    if getattr(tc, "final_logit_softcapping", None) is None:
        return "no logit softcap"
    for kind, rp in (getattr(tc, "rope_parameters", None) or {}).items():
        if isinstance(rp, dict) and rp.get("rope_type", "default") not in ("default", "proportional"):
            return f"rope_type {rp.get('rope_type')!r} on {kind} layers"
    if model.training:
        return "training mode"
    return None


def _rms(x: torch.Tensor, w: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """transformers' RMS norm: float32, times the float32 weight (`w` given as such)."""
    h = x.float()
    h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    return (h * w if w is not None else h).type_as(x)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, L, H, D); cos/sin (B, L, 1, D)."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


class Denoiser:
    """The denoiser forward of `model` (transformers' DiffusionGemmaForBlockDiffusion)."""

    def __init__(self, model):
        tc = model.config.text_config
        dec = model.model.decoder
        self.eps, self.softcap = tc.rms_norm_eps, tc.final_logit_softcapping
        self.n_heads, self.top_k = tc.num_attention_heads, tc.top_k_experts
        self.hidden = tc.hidden_size
        self.types = list(tc.layer_types)
        self.embed = dec.embed_tokens.weight
        self.embed_scale = dec.embed_tokens.embed_scale
        self.rope_freqs = {t: (getattr(dec.rotary_emb, f"{t}_inv_freq"), getattr(dec.rotary_emb,
                                                                                  f"{t}_attention_scaling"))
                           for t in set(self.types)}
        sc = dec.self_conditioning
        self.sc = (sc.pre_norm.weight.float(), sc.gate_proj.weight, sc.up_proj.weight, sc.down_proj.weight)
        self.layers: List[Dict] = []
        norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                 "pre_feedforward_layernorm_2")
        for lyr in dec.layers:
            a = lyr.self_attn
            p = {n: getattr(lyr, n).weight.float() for n in norms}
            p.update(q=a.q_proj.weight, k=a.k_proj.weight, o=a.o_proj.weight, qn=a.q_norm.weight.float(),
                     kn=a.k_norm.weight.float(), v=a.v_proj.weight if a.v_proj is not None else None,
                     gate=lyr.mlp.gate_proj.weight, up=lyr.mlp.up_proj.weight, down=lyr.mlp.down_proj.weight,
                     router=lyr.router.proj.weight, head_dim=a.head_dim, router_scale=lyr.router.scale,
                     root=lyr.router.scalar_root_size, rep=tc.num_attention_heads * a.head_dim // a.k_proj.out_features,
                     expert_scale=lyr.router.per_expert_scale, experts=lyr.experts, scalar=lyr.layer_scalar)
            self.layers.append(p)
        self.norm, self.lm_head = dec.norm.weight.float(), model.lm_head.weight

    def rope(self, positions: torch.Tensor) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
        """Per layer type the (cos, sin) of `positions` (B, L), as transformers' rotary
        embedding computes them (the engine keeps them while the layout holds)."""
        dt, out = self.embed.dtype, {}
        for t, (inv, scale) in self.rope_freqs.items():
            f = positions[..., None].float() * inv.float()
            emb = torch.cat((f, f), dim=-1)
            out[t] = ((emb.cos() * scale).to(dt).unsqueeze(2), (emb.sin() * scale).to(dt).unsqueeze(2))
        return out

    @staticmethod
    def _mlp(x, gate, up, down):
        return F.linear(F.gelu(F.linear(x, gate), approximate="tanh") * F.linear(x, up), down)

    def _moe(self, p, x_route: torch.Tensor, x_expert: torch.Tensor) -> torch.Tensor:
        h = _rms(x_route, None, self.eps) * p["router_scale"] * p["root"]
        probs = torch.softmax(F.linear(h, p["router"]), dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, k=self.top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True) * p["expert_scale"][idx]
        return p["experts"](x_expert, idx, w)  # transformers' experts module (its grouped kernels)

    def _attention(self, p, x, cos, sin, attend, mask):
        """`mask` (B, 1, rep L, keys): the layer type's mask repeated for each query head
        of a K/V head (`grouped`)."""
        B, L, _ = x.shape
        hd = p["head_dim"]
        q = _rope(_rms(F.linear(x, p["q"]).view(B, L, -1, hd), p["qn"], self.eps), cos, sin).transpose(1, 2)
        k_raw = F.linear(x, p["k"]).view(B, L, -1, hd)
        v = F.linear(x, p["v"]).view(B, L, -1, hd) if p["v"] is not None else k_raw
        k = _rope(_rms(k_raw, p["kn"], self.eps), cos, sin).transpose(1, 2)
        v = _rms(v, None, self.eps).transpose(1, 2)
        k, v = attend(k, v)
        # the query heads of each K/V head as one longer query (transformers repeats the
        # keys and values per query head instead: a copy of the whole cache per layer)
        q = q.reshape(B, k.shape[1], -1, hd)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)  # (B, KV, rep L, D)
        return F.linear(out.unflatten(2, (-1, L)).permute(0, 3, 1, 2, 4).reshape(B, L, -1), p["o"])

    @staticmethod
    def grouped(mask: torch.Tensor, rep: int) -> torch.Tensor:
        """A (B, 1, L, keys) mask for `rep` query heads per K/V head grouped as one query
        of rep L rows (once per forward and layer type)."""
        return mask if rep == 1 else mask.repeat(1, 1, rep, 1)

    def __call__(self, canvas: torch.Tensor, kv, masks: Dict[str, torch.Tensor],
                 rope: Dict[str, Tuple[torch.Tensor, torch.Tensor]], sc_logits: Optional[torch.Tensor] = None,
                 sc_mask: Optional[torch.Tensor] = None, new_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """canvas (B, L) ids; kv the decoder's kv.Pass (the canvas's K/V placed after the
        cache's in the buffer, no copy) or kv[i] the cached (keys, values) of layer i, (B, KV, n, D);
        masks[type] boolean (B, 1, L, n + L); rope from `rope(positions)`; sc_logits
        (B, L, V) or None, sc_mask (B,) bool or None (a row's False: no self-conditioning).
        Returns the softcapped float32 logits (B, L, V), as transformers' forward.

        With `new_ids` (B, t): the fused pass (engine.canvas.engine `_fused`), bit-equal to
        transformers' encoder layers over it: the new tokens before the canvas (plain scaled
        embeddings), `kv` the kv.Pass that writes their K/V and returns the keys to attend
        (`update`, as transformers' encoder attention calls it), masks and rope over t + L
        queries; the logits are the canvas's."""
        dt = self.embed.dtype
        scale = self.embed_scale.to(dt)
        x = F.embedding(canvas, self.embed) * scale
        if sc_logits is not None:
            soft = torch.matmul(sc_logits.softmax(-1, dtype=torch.float32).to(dt), self.embed) * scale
            if sc_mask is not None:
                soft = soft * sc_mask.to(soft.dtype)[:, None, None]
        else:
            soft = torch.zeros_like(x)
        pre, gate, up, down = self.sc
        x = _rms(x + self._mlp(_rms(soft, pre, self.eps), gate, up, down), None, self.eps)
        t_new = 0
        if new_ids is not None:
            t_new = new_ids.shape[1]
            x = torch.cat([F.embedding(new_ids, self.embed) * scale, x], dim=1)
        group_masks = {}  # (layer type, query heads per K/V head): its mask for grouped queries
        for i, (p, t) in enumerate(zip(self.layers, self.types)):
            if new_ids is not None:
                def attend(k, v, i=i):
                    return kv.update(k, v, i)
            elif isinstance(kv, Pass):  # the canvas's K/V after the cache's, in the buffer (no copy)
                def attend(k, v, i=i):
                    return kv.with_canvas(i, k, v)
            else:  # (keys, values) per layer: concatenated, as transformers' decoder does
                def attend(k, v, i=i):
                    return torch.cat([kv[i][0], k], dim=-2), torch.cat([kv[i][1], v], dim=-2)
            if (t, p["rep"]) not in group_masks:
                group_masks[t, p["rep"]] = self.grouped(masks[t], p["rep"])
            h = self._attention(p, _rms(x, p["input_layernorm"], self.eps), *rope[t], attend, group_masks[t, p["rep"]])
            x = x + _rms(h, p["post_attention_layernorm"], self.eps)
            dense = _rms(self._mlp(_rms(x, p["pre_feedforward_layernorm"], self.eps), p["gate"], p["up"], p["down"]),
                         p["post_feedforward_layernorm_1"], self.eps)
            flat = x.reshape(-1, x.shape[-1])
            moe = self._moe(p, flat, _rms(flat, p["pre_feedforward_layernorm_2"], self.eps)).reshape(x.shape)
            x = (x + _rms(dense + _rms(moe, p["post_feedforward_layernorm_2"], self.eps),
                          p["post_feedforward_layernorm"], self.eps)) * p["scalar"]
        logits = F.linear(_rms(x[:, t_new:], self.norm, self.eps), self.lm_head).to(torch.float32)
        return torch.tanh(logits / self.softcap) * self.softcap


__all__ = ["Denoiser", "refusal"]
