"""Bench-only model wrapper that plants *where* each request stops and *how many
tokens per step* its blocks unmask, so a random-weights model decodes like a trained
dLLM on a skewed workload.

Why: random weights never emit EOS on purpose and their softmax is flat, so every
request would run to max_new_tokens at one token per step; a benchmark needs the shape
of real work: most answers end in 1-3 blocks with a long tail, and threshold decoding
unmasks a few tokens per step, more in easy blocks than in hard ones. The wrapper runs
the real forward (so cost and memory are the model's) and then edits the logits it
returns, per row, from what every forward can see:

* **Stop.** The row's first prompt token is a marker `marker_base + T`, where T is the
  absolute position (the first prompt token is position 0) where the answer ends:
  T = p + (k - 1) * L + o with prompt length p, k blocks, 0 < o < L. Logit columns at
  positions >= T get EOS forced (logit = BIG); columns before T get every stop token
  (and the mask token) suppressed. So the first EOS of the request is at position T,
  in block k - 1, and the engine evicts it after exactly k blocks with (k-1) L + o tokens.
* **Speed.** Among the row's still-masked columns before T, the leftmost c get one
  confident token (logit = BIG); the rest keep the model's own flat logits, whose
  confidence stays far below any useful threshold. So under threshold decoding a block
  takes about ceil(n_masked / c) steps. c is drawn per (request, block) from
  `tokens_per_step` by a hash of (T, block start position): the same in any batch.

A forward that does not carry the prompt (a cached step runs only the columns whose
K/V are not final, and forwards the others as pad) cannot read the marker token, so
the wrapper reads it back from the layer-0 V cache: V = v_proj(norm(embed(token)))
has no position in it (RoPE rotates q and k only), so the cached V of the row's first
real column is matched to the nearest V of the marker tokens, and a poor match raises
instead of guessing.

Only LLaDA-layout models (logits not shifted) are supported. The wrapper also counts
what each forward computes (`meter`) so benchmarks can report FLOPs and idle rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import nn

from engine.models import DLLM, KVCache

BIG = 1.0e4  # a logit that wins any softmax in float64 (exp(-1e4) == 0), exact in bf16


@dataclass(frozen=True)
class Markers:
    """Token-id layout of planted prompts: body tokens in [first_body, marker_base),
    marker tokens in [marker_base, marker_base + n_markers)."""

    marker_base: int
    n_markers: int
    first_body: int = 3

    def encode(self, stop_position: int) -> int:
        if not 0 <= stop_position < self.n_markers:
            raise ValueError(f"stop position {stop_position} needs more than {self.n_markers} marker tokens")
        return self.marker_base + stop_position


@dataclass
class ForwardMeter:
    """What the wrapped model computed, forward by forward (counted in the forward, so
    the engine's forward timer covers it)."""

    forwards: int = 0
    row_columns: int = 0  # rows x query columns forwarded
    idle_row_columns: int = 0  # ... of rows with no masked position left (idle or frozen rows)
    flops: float = 0.0  # matmul FLOPs as executed (pads included), attention included

    def as_dict(self) -> Dict[str, float]:
        return {"forwards": self.forwards, "row_columns": self.row_columns,
                "idle_row_columns": self.idle_row_columns, "flops": self.flops,
                "idle_row_fraction": self.idle_row_columns / self.row_columns if self.row_columns else 0.0}


def forward_flops(cfg, rows: int, cols: int, keys: int, logit_cols: int) -> float:
    """2 * MACs of one forward: the linear layers over rows*cols columns, attention over
    `keys` key columns per query, and the LM head over rows*logit_cols columns."""
    d, f, kv = cfg.hidden_size, cfg.intermediate_size, cfg.n_kv_heads * cfg.head_dim
    linear = 2 * d * d + 2 * d * kv + 3 * d * f
    attn = 2 * keys * d  # q.k and p.v
    return 2.0 * rows * (cols * cfg.n_layers * (linear + attn) + logit_cols * d * cfg.embedding_size)


class PlantedStops(nn.Module):
    """Wrap a DLLM; same call signature and attributes the engine uses."""

    def __init__(self, model: DLLM, markers: Markers, block_length: int,
                 tokens_per_step: Sequence[Tuple[int, float]] = ((1, 0.05), (2, 0.15), (3, 0.25),
                                                                  (4, 0.25), (6, 0.15), (8, 0.15))):
        super().__init__()
        cfg = model.config
        if cfg.shift_logits:
            raise ValueError("PlantedStops supports LLaDA-layout models (unshifted logits) only")
        if markers.marker_base + markers.n_markers > cfg.vocab_size:
            raise ValueError("marker tokens exceed the vocabulary")
        if cfg.mask_token_id in range(markers.first_body, markers.marker_base + markers.n_markers) or any(
                t in range(markers.first_body, markers.marker_base + markers.n_markers) for t in cfg.stop_token_ids):
            raise ValueError("body/marker token ranges must not contain the mask or stop tokens")
        self.model = model
        self.config = cfg
        self.markers = markers
        self.block_length = block_length
        speeds, weights = zip(*tokens_per_step)
        cdf = torch.tensor(weights, dtype=torch.float64).cumsum(0)
        self._speeds = torch.tensor(speeds, dtype=torch.long)
        self._cdf = cdf / cdf[-1]
        self._v_table: Dict[Tuple, torch.Tensor] = {}
        self.meter = ForwardMeter()

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    # --- the planted rules -------------------------------------------------------------
    def tokens_per_step_for(self, stop_pos: torch.Tensor, block_start: torch.Tensor) -> torch.Tensor:
        """c per row: a deterministic hash of (T, block start) mapped through the speed CDF."""
        h = ((stop_pos * 40503 + block_start * 9973 + 12345) * 2654435761) % 1000003
        u = h.to(torch.float64) / 1000003.0
        idx = torch.searchsorted(self._cdf.to(u.device), u, right=True).clamp(max=len(self._speeds) - 1)
        return self._speeds.to(u.device)[idx]

    def stop_positions(self, ids: torch.Tensor, mask: torch.Tensor, cache: Optional[KVCache],
                       qcols: torch.Tensor, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """T per row, from the marker token in the row's first real column: read from the
        forwarded ids when that column was forwarded with its token, else from the cache
        (the engine forwards cached columns as pad, or not at all). `qcols` [B, T] are
        the forwarded columns, `rows` the forward's rows of the cache."""
        keys_valid = mask[:, 0, -1, :]  # every real column of the row (its last query sees them all)
        first = keys_valid.to(torch.uint8).argmax(1)  # absolute column of the first prompt token
        local = torch.arange(ids.shape[0], device=ids.device)
        hit = qcols == first[:, None]
        tok = torch.where(hit.any(1), ids[local, hit.to(torch.uint8).argmax(1)], torch.full_like(first, -1))
        is_marker = (tok >= self.markers.marker_base) & (tok < self.markers.marker_base + self.markers.n_markers)
        need = ~is_marker & keys_valid.any(1)  # a compiled step's padded rows see no key (engine.buckets)
        if bool(need.any()):
            if cache is None:
                raise RuntimeError("PlantedStops: a row's first token is neither forwarded nor cached")
            cache_rows = (local if rows is None else rows)[need]
            tok = tok.clone()
            tok[need] = self._marker_from_v(cache.v[0][cache_rows, :, first[need], :].flatten(1))
        return tok - self.markers.marker_base

    def _marker_from_v(self, v: torch.Tensor) -> torch.Tensor:
        key = (v.device, v.dtype)
        if key not in self._v_table:
            m, layer = self.markers, self.model.layers[0]
            toks = torch.arange(m.marker_base, m.marker_base + m.n_markers, device=v.device)
            with torch.inference_mode():
                x = layer.attn_norm(self.model.embed(toks))
                v_of = layer.heads(x[None])[1][0].flatten(1)  # the v heads
                self._v_table[key] = v_of.float()
        table = self._v_table[key]
        vf = v.float()
        d2 = (vf * vf).sum(1, keepdim=True) - 2 * vf @ table.T + (table * table).sum(1)[None]
        best = d2.argmin(1)
        resid = (vf - table[best]).norm(dim=1) / table[best].norm(dim=1).clamp(min=1e-6)
        if bool((resid > 0.05).any()):  # bf16 rounding is ~1e-2 relative; other tokens are ~1.4
            raise RuntimeError(f"PlantedStops: cached V matches no marker token (residual {float(resid.max()):.3f})")
        return best + self.markers.marker_base

    # --- forward -----------------------------------------------------------------------
    def forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                cache: Optional[KVCache] = None, offset: int = 0, logits_last: Optional[int] = None,
                logits_at: Optional[torch.Tensor] = None, runs=None,
                cols: Optional[torch.Tensor] = None, **kw) -> torch.Tensor:
        logits = self.model(ids, pos, mask, cache, offset, logits_last=logits_last, logits_at=logits_at,
                            runs=runs, cols=cols, **kw)
        return self._plant(logits, ids, pos, mask, cache, offset, logits_at, runs, cols)

    @torch.compiler.disable  # data-dependent host rules: the compiled step (compile_decode) graphs the model only
    def _plant(self, logits, ids, pos, mask, cache, offset, logits_at, runs, cols) -> torch.Tensor:
        rows = None if runs is None else torch.cat([torch.arange(a, b) for a, b, *_ in runs]).to(ids.device)
        B, n = logits.shape[:2]
        Tq = ids.shape[1]
        at = logits_at if logits_at is not None else torch.arange(Tq - n, Tq, device=ids.device)[None].expand(B, n)
        qcols = cols if cols is not None else torch.arange(offset, offset + Tq, device=ids.device)[None].expand(B, Tq)
        qpos = pos.gather(1, at)
        T = self.stop_positions(ids, mask, cache, qcols, rows)[:, None]
        after = qpos >= T  # forced EOS
        masked = ids.gather(1, at) == self.config.mask_token_id
        # c confident tokens per step: the leftmost c masked columns before T, c drawn for the
        # block of the leftmost one (the engine asks for whole blocks: one, or a D2F row's window of
        # several, whose c confident tokens spill into the next block when the first runs out)
        open_ = masked & ~after
        first = (open_.to(torch.uint8).argmax(1) // self.block_length * self.block_length)[:, None]
        c = self.tokens_per_step_for(T[:, 0], qpos.gather(1, first)[:, 0])[:, None]
        order = open_.long().cumsum(1)
        confident = open_ & (order <= c)
        for t in set(self.config.stop_token_ids) | {self.config.mask_token_id}:
            logits[..., t] = torch.where(after, logits[..., t], torch.full_like(logits[..., t], -BIG))
        eos = self.config.eos_token_id
        logits[..., eos] = torch.where(after, torch.full_like(logits[..., eos], BIG), logits[..., eos])
        content = self.markers.first_body + qpos % max(1, min(97, self.markers.marker_base - self.markers.first_body))
        boost = torch.zeros_like(logits[..., 0]).masked_fill(confident, BIG)
        logits.scatter_add_(-1, content[..., None], boost[..., None])
        self._count(ids, mask, logits, masked)
        return logits

    def _count(self, ids, mask, logits, masked) -> None:
        B, T = ids.shape
        busy = masked[:, -self.block_length:].any(1)
        m = self.meter
        m.forwards += 1
        m.row_columns += B * T
        m.idle_row_columns += int((~busy).sum()) * T
        m.flops += forward_flops(self.config, B, T, mask.shape[-1], logits.shape[1])
