"""The one transformer every masked-diffusion family is: pre-norm blocks, RoPE (full or
partial), a SwiGLU MLP (dense, or routed experts with a shared expert), attention under an
explicit boolean mask, and an optional K/V cache that forwards write into in place (so a
block-only step attends to a prefix computed by an earlier full-row step). What a layer
holds is what its family declares (engine.models.families: fused or separate q/k/v, QK
norm, head_dim, biases) and its ModelConfig says (sizes, MoE, tied embeddings)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from . import attention
from .config import ModelConfig
from .fusion import Fusing, fuse
from .moe import MLP, RoutingBlocks, experts_forward, plus_linear, routing_blocks, swiglu
from .ops import RMSNorm, Rope, rms_norm
from .rope_scaling import llama4_q_scale


@dataclass
class KVCache:
    """Per-layer K and V, [B, H_kv, W, D]; a forward at `offset` writes its columns in place."""

    k: List[torch.Tensor]
    v: List[torch.Tensor]

    @classmethod
    def empty(cls, cfg: ModelConfig, batch: int, width: int, dtype: torch.dtype, device) -> "KVCache":
        shape = (batch, cfg.n_kv_heads, width, cfg.head_dim)
        # zeros, not empty: masked-out pad keys must not hold NaN (NaN * 0 poisons attention)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.n_layers)])

    @property
    def width(self) -> int:
        return self.k[0].shape[2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def attend(self, layer: int, k: torch.Tensor, v: torch.Tensor, offset: int, width: int,
               write: Optional[torch.Tensor], runs: Optional[Sequence[Tuple[int, int, int]]],
               cols: Optional[torch.Tensor]):
        """Store a forward's K/V [n, H_kv, T, D] and return the keys and values it attends
        to ([n, H_kv, width, D]). The T query columns are [offset, offset+T) of every row,
        or `cols` [n, T] per row; the forward's rows are all of the cache's, or the cache
        rows of `runs` [(start, stop, first key), ...] one after the other (then a list of
        one (keys, values) view per run, of keys [first key, width): attention reads the
        cache in place, never a copy, and skips the keys before a run's first; runs of
        adjacent slots are stored in one go, a few ops per forward rather than per run).
        Only columns where `write` [n, 1, T, 1] holds are stored; the others keep the
        K/V already cached (padding, or columns whose K/V are final)."""
        K, V = self.k[layer], self.v[layer]
        if runs is None:
            return self._store(K, V, k, v, offset, width, write, cols)
        if all(b == a2 for (_, b, _), (a2, _, _) in zip(runs, runs[1:])):  # adjacent slots: one store for all
            s = runs[0][0]
            self._store(K[s:runs[-1][1]], V[s:runs[-1][1]], k, v, offset, width, write, cols)
            return [(K[a:b, :, first:width], V[a:b, :, first:width]) for a, b, first in runs]
        out, o = [], 0
        for a, b, first in runs:
            part = slice(o, o + b - a)
            kr, vr = self._store(K[a:b], V[a:b], k[part], v[part], offset, width,
                                 None if write is None else write[part], None if cols is None else cols[part])
            out.append((kr[:, :, first:], vr[:, :, first:]))
            o += b - a
        return out

    @staticmethod
    def _store(K, V, k, v, offset: int, width: int, write, cols):
        if cols is None:
            ck, cv = K[:, :, offset:offset + k.shape[2]], V[:, :, offset:offset + k.shape[2]]
            if write is not None:
                k, v = torch.where(write, k, ck), torch.where(write, v, cv)
            ck.copy_(k)
            cv.copy_(v)
            return K[:, :, :width], V[:, :, :width]
        r = torch.arange(k.shape[0], device=k.device)[:, None]
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [n, T, H_kv, D], the layout of K[r, :, c]
        if write is not None:
            w = write.reshape(k.shape[0], k.shape[2], 1, 1)
            kt, vt = torch.where(w, kt, K[r, :, cols]), torch.where(w, vt, V[r, :, cols])
        K[r, :, cols] = kt
        V[r, :, cols] = vt
        return K[:, :, :width], V[:, :, :width]


class Layer(Fusing):
    """One pre-norm block: what its family declares (fused or separate q/k/v) and its config
    says (head_dim, QK norm, biases, a dense or MoE MLP). Under tensor parallelism
    (engine.models.sharding) `tp` is the rank's group and `owned` its experts."""

    tp = None
    owned = None

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        d, hd, H, Hkv = cfg.hidden_size, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
        family, qkv_b = cfg.family, cfg.qkv_bias or cfg.linear_bias
        self.cfg = cfg
        self.attn_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.q = nn.Linear(d, H * hd, bias=qkv_b)
        self.k = nn.Linear(d, Hkv * hd, bias=qkv_b)
        self.v = nn.Linear(d, Hkv * hd, bias=qkv_b)
        self.o = nn.Linear(H * hd, d, bias=cfg.linear_bias or (cfg.attn_out_bias and not family.fused_qkv))
        if cfg.qk_norm:
            self.q_norm, self.k_norm = RMSNorm(hd, cfg.rms_norm_eps), RMSNorm(hd, cfg.rms_norm_eps)
        self.mlp_norm = RMSNorm(d, cfg.rms_norm_eps)
        spec = cfg.moe
        self.routed = spec is not None and not spec.dense_layers[index]
        if spec is None:  # a dense model's MLP, its projections on the layer itself
            f, b = cfg.intermediate_size, cfg.linear_bias
            self.gate, self.up, self.down = nn.Linear(d, f, bias=b), nn.Linear(d, f, bias=b), nn.Linear(f, d, bias=b)
        elif not self.routed:
            self.dense = MLP(d, spec.dense_size)
        else:
            self.router = nn.Linear(d, spec.num_experts, bias=False)
            self.expert_bias = nn.Parameter(torch.zeros(spec.num_experts)) if spec.expert_bias else None
            self.experts = nn.ModuleList(MLP(d, spec.expert_size) for _ in range(spec.num_experts))
            self.shared = MLP(d, spec.shared_size) if spec.shared_size else None
        if family.fused_qkv:  # q, k and v in one matrix (q heads, then k, then v), fused last, as this
            # layer was always built: seeded random models (build_model) keep their weights
            del self.q, self.k, self.v
            self.qkv_proj = nn.Linear(d, (H + 2 * Hkv) * hd, bias=qkv_b)
            self.o = nn.Linear(H * hd, d, bias=cfg.linear_bias or cfg.attn_out_bias)
        self.fuse_()

    def fuse_(self) -> None:
        """Fuse the layer's weights for its forward (engine.models.fusion): q/k/v in one
        matrix, gate and up in one, the q and k norms' weights as one per-head weight, the
        routed experts stacked for grouped GEMMs (w13 [E, 2f, d], w2 [E, d, f])."""
        cfg = self.cfg
        if hasattr(self, "qkv_proj"):
            b = self.qkv_proj.bias  # views of the parameters: plain tensors, not parameters of their own
            self.wqkv, self.bqkv = self.qkv_proj.weight.detach(), None if b is None else b.detach()
        else:
            self.wqkv = fuse([[(self.q, "weight"), (self.k, "weight"), (self.v, "weight")]])
            self.bqkv = fuse([[(self.q, "bias"), (self.k, "bias"), (self.v, "bias")]]) if self.q.bias is not None else None
        if cfg.qk_norm:  # [H + H_kv, D]: a view of the two norms' weights would not be one tensor
            self.qk_norm_w = torch.cat([self.q_norm.weight.expand(cfg.n_heads, -1),
                                        self.k_norm.weight.expand(cfg.n_kv_heads, -1)])
        if hasattr(self, "gate"):
            self.w13 = fuse([[(self.gate, "weight"), (self.up, "weight")]])
            self.b13 = fuse([[(self.gate, "bias"), (self.up, "bias")]]) if self.gate.bias is not None else None
        for mlp in (getattr(self, "dense", None), getattr(self, "shared", None)):
            if mlp is not None:
                mlp.fuse_()
        if self.routed:  # the experts this rank holds (others are nn.Identity under expert parallelism) stacked
            own, d, f = [e for e in self.experts if isinstance(e, MLP)], cfg.hidden_size, cfg.moe.expert_size
            none = self.router.weight.new_empty(0, 2 * f, d)
            self.w13 = fuse([[(e.gate, "weight"), (e.up, "weight")] for e in own]).view(-1, 2 * f, d) if own else none
            self.w2 = fuse([[(e.down, "weight")] for e in own]).view(-1, d, f) if own else none.view(0, d, f)
            for e, w in zip(own, self.w13):  # each expert's own gate/up matrix: a view of the stack
                e.w13, e.b13 = w, None
            self.expert_ids = torch.arange(len(own), device=self.w13.device)  # grouped offsets' bounds, made once

    def forward(self, h, rope: Rope, mask, cache: Optional[KVCache], idx: int, offset: int,
                write: Optional[torch.Tensor] = None, runs: Optional[Sequence[Tuple[int, int, int]]] = None,
                cols: Optional[torch.Tensor] = None, keep: Optional[torch.Tensor] = None,
                blocks: Optional[RoutingBlocks] = None):
        """`mask` [B, 1, T|1, K] additive, in h's dtype (DLLM.forward prepares it once; on
        CUDA [B, 1, g*T|1, K], GQA folded: engine.models.attention).
        `keep` [B, n]: the query columns whose output is wanted (the last layer's, for
        the logits read): K/V are computed and stored for every column, attention and the
        MLP only for these, and the output is [B, n, d]."""
        H, Hkv, D = self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim
        x = self.attn_norm(h)
        q, k, v = self.qkv(x, rope)
        kv = cache.attend(idx, k, v, offset, mask.shape[-1], write, runs, cols) if cache is not None else (k, v)
        if keep is not None:
            mask = attention.keep_rows(mask, keep, h.shape[1], attention.group(H, Hkv, q.device))
            h = h.gather(1, keep[..., None].expand(-1, -1, h.shape[-1]))
            q = q.gather(2, keep[:, None, :, None].expand(-1, q.shape[1], -1, q.shape[-1]))
        B, T, _ = h.shape
        a, o = [], 0
        for kr, vr in kv if isinstance(kv, list) else [kv]:  # one attention per run of cache rows
            part = slice(o, o + kr.shape[0])
            keys = mask[part][..., mask.shape[-1] - kr.shape[2]:]  # the run's keys (left padding skipped)
            a.append(attention.attend(q[part], kr, vr, keys))  # [n, T, H, D], as the o projection reads it
            o += kr.shape[0]
        a = a[0] if len(a) == 1 else torch.cat(a)
        h = plus_linear(h, a.reshape(B, T, H * D), self.o)
        x = self.mlp_norm(h)
        return self.ffn(x, h, blocks)

    def heads(self, x: torch.Tensor):
        """The projection of the normed input [B, T, d] as its q and k heads [B, T, H + H_kv, D]
        and v heads [B, T, H_kv, D] (views of one matmul's output)."""
        B, T, _ = x.shape
        H, Hkv, D = self.cfg.n_heads, self.cfg.n_kv_heads, self.cfg.head_dim
        qkv = F.linear(x, self.wqkv, self.bqkv).view(B, T, H + 2 * Hkv, D)
        return qkv[:, :, :H + Hkv], qkv[:, :, H + Hkv:]

    def qkv(self, x: torch.Tensor, rope: Rope):
        """q [B, H, T, D], k and v [B, H_kv, T, D] of the normed input: one projection,
        the q and k heads QK-normed and rotated together (views, not copies, apart from
        them)."""
        H = self.cfg.n_heads
        qk, v = self.heads(x)
        if self.cfg.qk_norm:
            qk = rms_norm(qk, self.qk_norm_w, self.cfg.rms_norm_eps)
        qk = rope(qk)
        q = qk[:, :, :H] if rope.q_scale is None else qk[:, :, :H] * rope.q_scale
        return q.transpose(1, 2), qk[:, :, H:].transpose(1, 2), v.transpose(1, 2)

    def ffn(self, x: torch.Tensor, h: torch.Tensor, blocks: Optional[RoutingBlocks] = None) -> torch.Tensor:
        """h + the MLP of x (the normed h): the residual joins the MLP's last matmul, or,
        routed, the shared expert's, and the experts' mixture is added into that.
        `blocks`: x's tokens' routing blocks, under block routing (engine.models.moe)."""
        if hasattr(self, "gate"):
            return swiglu(x, self.w13, self.b13, self.down, h)
        if not self.routed:
            return self.dense(x, h)
        experts = lambda into: experts_forward(x, self.router.weight, self.expert_bias, self.w13, self.w2,  # noqa: E731
                                               self.cfg.moe, self.owned, self.expert_ids, into, blocks)
        if self.tp is not None:  # the ranks' experts and shared partials, summed before the residual joins
            return h + self.tp.all_reduce(experts(None if self.shared is None else self.shared(x)))
        return experts(h if self.shared is None else self.shared(x, h))  # h: this layer's own, added into in place


def _embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding, without its own init on the meta device (the loader's, weights loaded
    next): normal_ on meta imports torch._dynamo, 2.5 CPU-s at every engine start. On a real
    device it draws as before, so that seeded random test models keep their weights."""
    weight = torch.empty(num, dim)
    return nn.Embedding(num, dim, _weight=weight) if weight.is_meta else nn.Embedding(num, dim)


class DLLM(nn.Module):
    """Internal parameter names are layout-neutral; engine.models.weights maps them to
    each checkpoint format's real names. `tp`: the rank's group when the model is a
    tensor-parallel shard (engine.models.sharding), whose logits are all-gathered."""

    tp = None

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed = _embedding(cfg.embedding_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.embedding_size,
                                                                       bias=cfg.linear_bias)

    def fuse_(self) -> "DLLM":
        """Fuse every layer's weights for the forward (Layer.fuse_): again after anything
        that replaces or rewrites parameters besides `_apply` (which Layer handles):
        `load_state_dict`, init_weights_."""
        for layer in self.layers:
            layer.fuse_()
        return self

    def load_state_dict(self, *args, **kwargs):
        out = super().load_state_dict(*args, **kwargs)
        self.fuse_()
        return out

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                cache: Optional[KVCache] = None, offset: int = 0,
                logits_last: Optional[int] = None, write: Optional[torch.Tensor] = None,
                runs: Optional[Sequence[Tuple[int, int, int]]] = None, cols: Optional[torch.Tensor] = None,
                logits_at: Optional[torch.Tensor] = None) -> torch.Tensor:
        """ids/pos [B, T]; mask bool [B, 1, T|1, K] (True = may attend) where K = T without a
        cache, or the number of cache columns attended with one. With a cache, this
        forward's K/V land in columns [offset, offset+T) (or `cols` [B, T]) of the cache
        rows of `runs` [(start, stop, first key), ...] (all rows when None), only where `write` [B, T] is True when it is given
        (the other columns are padding or already cached). Logits only for the last
        `logits_last` columns, or the query columns `logits_at` [B, n] (the LM head over
        every column is the biggest waste)."""
        h = self.embed(ids)
        cfg = self.config
        rope = Rope.at(pos, cfg.rotary_dim, cfg.head_dim, cfg.rope_theta, h.dtype, cfg.rope_yarn)
        if cfg.q_position_scale is not None:  # Llama-4's query scale by position (Ministral3's layer)
            rope.q_scale = llama4_q_scale(pos, *cfg.q_position_scale, h.dtype)
        first = self.layers[0].cfg  # a tensor-parallel rank's layers hold its own heads
        g = attention.group(first.n_heads, first.n_kv_heads, h.device)
        mask = attention.additive_mask(mask, h.dtype, g)  # once per forward, not per layer and attention call
        runs = attention.key_aligned(runs, h.device)
        if write is not None:
            write = write[:, None, :, None]
        keep = logits_at
        if logits_last is not None:
            keep = torch.arange(ids.shape[1] - logits_last, ids.shape[1], device=ids.device).expand(ids.shape[0], -1)
        blocks = kept = None
        if cfg.moe is not None and cfg.moe.block_routed:  # once per forward; the last layer's MLP: the kept columns'
            blocks = routing_blocks(pos, cfg.moe.block_size)
            kept = blocks if keep is None else routing_blocks(pos.gather(1, keep), cfg.moe.block_size)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h = layer(h, rope, mask, cache, i, offset, write, runs, cols, keep=keep if i == last else None,
                      blocks=kept if i == last else blocks)
        h = self.norm(h)
        logits = F.linear(h, self.embed.weight) if self.lm_head is None else self.lm_head(h)
        if self.tp is not None:  # vocab-parallel LM head: every rank gets every logit
            logits = self.tp.all_gather(logits, -1)
        return logits[..., : self.config.vocab_size]


def build_model(cfg: ModelConfig, dtype: torch.dtype = torch.float32, device="cpu",
                seed: Optional[int] = 0) -> DLLM:
    """A randomly initialised model (tests, benchmarks); real weights come from load_model.
    Weights ~ N(0, 1/fan_in) so that random logits are peaked enough for threshold
    decoding to behave like a trained model (several tokens per step, some stops)."""
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        model = init_weights_(DLLM(cfg))
    return model.to(dtype=dtype, device=device).eval()  # .to fuses the weights (DLLM._apply)


@torch.no_grad()
def init_weights_(model: DLLM, generator: Optional[torch.Generator] = None) -> DLLM:
    """Fill `model` in place: weights ~ N(0, 1/fan_in), embeddings N(0, 1), biases
    N(0, 0.02), norms 1 (from `generator`, else the global RNG)."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.normal_(0.0, 0.02, generator=generator)
        else:
            p.normal_(0.0, 1.0 if name.startswith("embed") else p.shape[1] ** -0.5, generator=generator)
    return model.fuse_()
