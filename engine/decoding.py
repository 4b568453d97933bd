"""Decoding, vectorised over the batch: each row's proposals and their confidence
(`propose`), and which masked positions of each row's current block get a token this
denoising step (`select`: each row's policy, engine.selection). Each row carries its own
policy and parameters, so one forward serves requests with different settings. The
rules follow the reference code of each model family (LLaDA's `generate`, Fast-dLLM's
`get_transfer_index` / `get_transfer_index_dynamic`, Fast-dLLM's Dream block decoding,
Dream's `diffusion_generate` with its `alg`s); see SamplingParams for what each one does."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .models.families.base import Confidence, ThresholdRule
from .noise import draws_confidence, draws_tokens, perturbs_confidence
from .selection import POLICIES, POLICY_IDS, Candidates, Selection, policies_with, threshold_policy
from .transfer import to_device

LOW_CONFIDENCE, RANDOM, ENTROPY, MARGIN, SEQUENTIAL = 0, 1, 2, 3, 4
REMASKING_IDS = {"low_confidence": LOW_CONFIDENCE, "random": RANDOM, "entropy": ENTROPY, "margin": MARGIN,
                 "sequential": SEQUENTIAL}
ENTROPY_BOUND = POLICY_IDS["entropy_bound"]  # propose computes its entropies
ENTROPY_BOUND_DEFAULT = 0.35  # JetEngine's eb_threshold
ENTROPY_EPS = 1e-12  # JetEngine clamps probabilities at this before p log p
# d3LLM's entropy (engine.multi_block): a multi_block row's confidence kind in the remasking column (never a
# user's remasking): sum p log(p + 1e-12), minus the entropy of SGLang's FullAttnMultiBlock
MULTI_BLOCK_ENTROPY = 5
MULTI_BLOCK_EPS = 1e-12

REAL = ("threshold", "factor", "temperature", "top_p", "entropy_bound")  # Columns' float64 fields
INTS = ("policy", "remasking", "first_position", "top_k", "cap")  # Columns' integer fields


@dataclass
class Columns:
    """The rows' decoding values by name, [B] each: on the host (the loop decides from
    them without reading the device) or on the device (`upload`: one copy, not ten)."""

    threshold: torch.Tensor  # float64
    factor: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    entropy_bound: torch.Tensor
    policy: torch.Tensor  # long: the row's engine.selection.POLICIES index
    remasking: torch.Tensor  # long: REMASKING_IDS
    first_position: torch.Tensor  # bool: the block's first step commits only its first position
    top_k: torch.Tensor  # long
    cap: torch.Tensor  # long: a rule's own step cap (-1: the policy's, step_cap)

    def upload(self, device) -> "Columns":
        """These values on `device`: one pinned, non-blocking copy (the float64 bits as int64)."""
        real = torch.stack([getattr(self, n) for n in REAL]).view(torch.long)
        ints = torch.stack([getattr(self, n).long() for n in INTS])
        r, i = to_device([real, ints], device)
        vals = {**dict(zip(REAL, r.view(torch.float64))), **dict(zip(INTS, i))}
        vals["first_position"] = vals["first_position"].bool()
        return Columns(**vals)

    def take(self, index: torch.Tensor) -> "Columns":
        return Columns(**{f.name: getattr(self, f.name)[index] for f in fields(self)})


# DeviceParams was RowParams' device half: the same named columns
DeviceParams = Columns


@dataclass
class RowParams:
    """Per-row decoding parameters, built once per batch layout: host values (`host`) and
    their device tensors (`dev`), by name; `extra`: the device values the family's
    threshold policy declared (Selection.row_values)."""

    params: List  # the rows' SamplingParams
    seeds: List[Optional[int]]  # noise seed per row, None when the row draws no noise
    host: Columns
    dev: Columns
    any_entropy: bool
    any_margin: bool
    any_sequential: bool
    # Confidence.SAMPLED (Dream's sample_tokens): proposals drawn, and ranked, from the
    # tempered, top-p then top-k restricted distribution
    sampled: bool = False
    threshold: Selection = field(default_factory=lambda: threshold_policy(ThresholdRule.AT_LEAST_TOP1))
    extra: Dict[str, torch.Tensor] = field(default_factory=dict)
    any_multi_block: bool = False  # a multi_block row's confidence is minus its entropy (MULTI_BLOCK_ENTROPY)

    @property
    def policy(self) -> torch.Tensor:
        """Host [B] policy ids."""
        return self.host.policy

    @property
    def selections(self) -> Tuple[Selection, ...]:
        """The policy of each id, the `threshold` one the family's."""
        return policies_with(self.threshold)

    def caps(self, block_length: int, steps: int, dev: bool = False) -> torch.Tensor:
        """[B] steps after which a row's block is committed whatever it holds: its rule's
        cap, else its policy's (step_cap); host values, or the device's (`dev`). Found once
        per batch layout (the step path asks at every step)."""
        memo = self.__dict__.setdefault("_memo", {})
        key = ("caps", block_length, steps, dev)
        if key not in memo:
            cols = self.dev if dev else self.host
            memo[key] = torch.where(cols.cap >= 0, cols.cap, step_cap(cols.policy, block_length, steps))
        return memo[key]

    @property
    def policies(self) -> List[int]:
        """The policy ids the rows use, ascending (host values, found once)."""
        memo = self.__dict__.setdefault("_memo", {})
        if "policies" not in memo:
            memo["policies"] = sorted(set(self.policy.tolist()))
        return memo["policies"]

    @property
    def first_position(self) -> torch.Tensor:
        """Host bool [B]: the block's first step commits only its first position."""
        return self.host.first_position

    @classmethod
    def build(cls, params: Sequence, seeds: Sequence[Optional[int]], device, first_position_default: bool = False,
              threshold: Any = ThresholdRule.AT_LEAST_TOP1,
              floor_one: Optional[Sequence[bool]] = None, caps: Optional[Sequence[Optional[int]]] = None,
              confidence: Confidence = Confidence.MODEL) -> "RowParams":
        """`threshold`: the family's (a ThresholdRule, or an engine.selection.Selection)."""
        B = len(params)
        f64 = lambda vals: torch.tensor(vals, dtype=torch.float64).reshape(B)  # noqa: E731
        i64 = lambda vals: torch.tensor(vals, dtype=torch.long).reshape(B)  # noqa: E731
        host = Columns(
            threshold=f64([float(p.threshold) for p in params]), factor=f64([float(p.factor) for p in params]),
            temperature=f64([float(p.temperature) for p in params]), top_p=f64([float(p.top_p) for p in params]),
            entropy_bound=f64([ENTROPY_BOUND_DEFAULT if p.entropy_bound is None else float(p.entropy_bound)
                               for p in params]),
            policy=i64([POLICY_IDS[p.policy] for p in params]),
            remasking=i64([MULTI_BLOCK_ENTROPY if p.multi_block is True else REMASKING_IDS[p.remasking]
                           for p in params]),
            first_position=torch.tensor([first_position_default if p.first_position is None
                                         else bool(p.first_position) for p in params], dtype=torch.bool).reshape(B),
            top_k=i64([max(0, int(p.top_k)) for p in params]),
            cap=i64([-1 if c is None else int(c) for c in (caps or [None] * B)]))
        policy = threshold_policy(threshold)
        values = policy.row_values(params, list(floor_one or [False] * B))
        extra = dict(zip(values, to_device(list(values.values()), device))) if values else {}
        return cls(params=list(params), seeds=list(seeds), host=host, dev=host.upload(device),
                   any_entropy=any(p.remasking == "entropy" for p in params),
                   any_margin=any(p.remasking == "margin" for p in params),
                   any_sequential=any(p.remasking == "sequential" for p in params),
                   sampled=confidence == Confidence.SAMPLED, threshold=policy, extra=extra,
                   any_multi_block=any(p.multi_block is True for p in params))

    def take(self, index: torch.Tensor) -> "RowParams":
        """The parameters of rows `index` (a host tensor): one entry per decoding unit
        when rows hold several blocks in flight (D2F)."""
        ix = index.tolist()
        host = self.host.take(index)
        dev_index = to_device([index], self.dev.policy.device)[0]  # pinned, non-blocking: no host wait
        return RowParams(params=[self.params[i] for i in ix], seeds=[self.seeds[i] for i in ix], host=host,
                         dev=host.upload(self.dev.policy.device), any_entropy=self.any_entropy,
                         any_margin=self.any_margin, any_sequential=self.any_sequential, sampled=self.sampled,
                         threshold=self.threshold, extra={k: v[dev_index] for k, v in self.extra.items()},
                         any_multi_block=self.any_multi_block)


def step_cap(policy: torch.Tensor, block_length: int, steps: int) -> torch.Tensor:
    """[B] steps after which a row's block is committed whatever it holds: S for the
    scheduled policies (fixed, timestep, origin: Selection.scheduled), max(S, L) for
    threshold, factor and entropy_bound.
    `policy`: RowParams.policy (host) or RowParams.dev.policy."""
    scheduled = torch.zeros_like(policy, dtype=torch.bool)
    for i, p in enumerate(POLICIES):
        if p.scheduled:
            scheduled = scheduled | (policy == i)
    return torch.where(scheduled, steps, max(steps, block_length))


def _ranks(conf: torch.Tensor) -> torch.Tensor:
    """Rank of each position by descending confidence (0 = most confident); stable, so
    ties break by position the same way in any batch."""
    order = conf.argsort(dim=1, descending=True, stable=True)
    ar = torch.arange(conf.shape[1], device=conf.device).expand_as(order)
    return torch.empty_like(order).scatter_(1, order, ar)


def restrict(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """`logits` [L, V] with -inf outside each position's top-k tokens and outside the
    smallest set whose tempered probability reaches top_p (vLLM's order: temperature,
    top-k, top-p; the most likely token always stays)."""
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if top_p < 1.0:
        probs, order = torch.softmax(logits / temperature, dim=-1).sort(dim=-1, descending=True)
        drop = probs.cumsum(-1) - probs > top_p  # the mass before this token already reaches top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter_(-1, order, drop), -torch.inf)
    return logits


def _asking(flag: torch.Tensor) -> Optional[torch.Tensor]:
    """The positions whose row asks for a restriction (`flag` [N]): their indices on the CPU,
    where picking them costs no wait and spares sorting the others' vocabulary; None (every
    position, the others masked out) on an accelerator, where picking them is a host wait."""
    return flag.nonzero().flatten() if flag.device.type == "cpu" else None


def dream_logits(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                 top_k: torch.Tensor, any_top_p: bool = True, k_max: Optional[int] = None) -> torch.Tensor:
    """Dream's sample_tokens on `logits` [N, V] with per-row settings [N]: divided by the
    temperature where > 0, then top-p where < 1 (a token goes once the sorted mass before
    it exceeds top_p), then top-k where > 0; removed tokens at the dtype's minimum, as Dream
    fills them. `any_top_p` and `k_max` (the largest top_k, 0: none) are host values, so the
    device is never asked which rows restrict (a wait)."""
    logits = logits / torch.where(temperature > 0, temperature, torch.ones_like(temperature))[:, None]
    low, V = torch.finfo(logits.dtype).min, logits.shape[-1]
    k_max = int(top_k.max()) if k_max is None else k_max
    if any_top_p:
        ask = top_p < 1
        rows = _asking(ask)
        sub = logits if rows is None else logits[rows]
        srt, order = sub.sort(dim=-1, descending=True)
        drop = torch.softmax(srt, dim=-1).cumsum(-1) > (top_p if rows is None else top_p[rows])[:, None]
        drop = torch.cat([torch.zeros_like(drop[:, :1]), drop[:, :-1]], dim=1)  # the first token always stays
        if rows is None:
            drop &= ask[:, None]
        sub = sub.masked_fill(torch.zeros_like(drop).scatter_(-1, order, drop), low)
        logits = sub if rows is None else logits.index_put((rows,), sub)
    if k_max > 0:
        ask = top_k > 0
        rows = _asking(ask)
        sub = logits if rows is None else logits[rows]
        k = (top_k if rows is None else top_k[rows]).clamp(1, V)
        kth = sub.topk(min(k_max, V), dim=-1).values.gather(-1, (k - 1)[:, None])
        drop = sub < kth
        if rows is None:
            drop &= ask[:, None]
        sub = sub.masked_fill(drop, low)
        logits = sub if rows is None else logits.index_put((rows,), sub)
    return logits


# propose's float64 working rows per pass, in bytes: cache-sized on a CPU; on an accelerator
# few passes (each is a handful of launches); either way independent of the batch
PROPOSE_CHUNK_BYTES = {"cpu": 4 << 20}
PROPOSE_CHUNK_BYTES_DEVICE = 256 << 20


def chunk_rows(vocab: int, device: torch.device) -> int:
    """Positions per pass of propose's float64 working rows (PROPOSE_CHUNK_BYTES)."""
    return max(1, PROPOSE_CHUNK_BYTES.get(device.type, PROPOSE_CHUNK_BYTES_DEVICE) // (8 * vocab))


class _Rows:
    """Rows `at` [N] of `src` [R, V] (any float dtype), upcast to float64 a chunk at a time
    into one reused [C, V] buffer; `at` None: `src` is propose's own float64 [N, V], worked
    on in place. Softmax, argmax and the reductions below are computed row by row (the same
    bits whatever rows share a call: the published loops run them over [B, L, V] at once),
    so chunked passes give one pass's values without [N, V] float64 tensors."""

    def __init__(self, src: torch.Tensor, at: Optional[torch.Tensor], chunk: int):
        self.src, self.at = src, at
        n = src.shape[0] if at is None else at.shape[0]
        shape = (min(chunk, n), src.shape[-1])
        self.buf = None if at is None else torch.empty(shape, dtype=torch.float64, device=src.device)
        self.stage = None if at is None or src.dtype == torch.float64 else \
            torch.empty(shape, dtype=src.dtype, device=src.device)

    def load(self, s: int, e: int) -> torch.Tensor:
        """Rows s..e in float64, overwritable."""
        if self.at is None:
            return self.src[s:e]
        w = self.buf[:e - s]
        if self.stage is None:
            return torch.index_select(self.src, 0, self.at[s:e], out=w)
        return w.copy_(torch.index_select(self.src, 0, self.at[s:e], out=self.stage[:e - s]))


def propose(logits: torch.Tensor, rp: RowParams, noise_keys: Optional[Sequence[Optional[int]]],
            need: torch.Tensor, need_idx: Optional[Sequence[torch.Tensor]] = None, full_x0: bool = True):
    """Candidate tokens x0 [B, L] and their float64 confidence [B, L] (0 where `need`
    is False: only masked positions are ever selected). Rows at temperature > 0 take
    x0 from Gumbel-perturbed logits in float64 (as LLaDA's reference does); rows with
    random remasking or the origin policy draw their confidence (a uniform per
    position), rows with alg_temp > 0 perturb theirs (Gumbel top-k: the step's k positions
    drawn without replacement from softmax(confidence / alg_temp), Dream's multinomial);
    all from a generator seeded per row and step (`noise_keys`, None when no row draws
    noise), so a request's tokens do not depend on its batch. Under
    Confidence.SAMPLED (`rp.sampled`) the proposals at `need` are drawn from, and the
    confidence read off, Dream's sample_tokens distribution (dream_logits). `full_x0`
    False: x0 is only meaningful at `need` (the argmax over the vocabulary at every other
    position of the window is a large host cost, and only a rule that rewrites decoded
    tokens, LLaDA2.1's editing, reads it there).

    The float64 softmax over the vocabulary at each needed position (the step's largest
    allocation: [positions, vocabulary] float64, twice, 0.6 GB at B=8 with LLaDA's
    vocabulary) runs chunk_rows positions at a time in one reused buffer (_Rows); only
    Dream's restricted sampling keeps its processed [positions, vocabulary] logits, which
    its draw reads whole."""
    idx = tuple(need_idx) if need_idx is not None else need.nonzero(as_tuple=True)
    L, V, dev = logits.shape[1], logits.shape[-1], logits.device
    n, flat, at = idx[0].shape[0], logits.reshape(-1, V), idx[0] * L + idx[1]
    x0 = logits.argmax(-1) if full_x0 else torch.zeros(logits.shape[:-1], dtype=torch.long, device=dev)
    processed = x0_raw = None  # Dream's processed float64 logits at `need`, the argmax of the raw ones
    if rp.sampled and bool(((rp.host.temperature > 0) | (rp.host.top_p < 1) | (rp.host.top_k > 0)).any()):  # host values
        lg = flat.index_select(0, at).to(torch.float64)
        x0_raw = None if full_x0 else lg.argmax(-1)  # float -> float64 is exact: the float64 argmax
        processed = dream_logits(lg, rp.dev.temperature[idx[0]], rp.dev.top_p[idx[0]], rp.dev.top_k[idx[0]],
                                 any_top_p=bool((rp.host.top_p < 1).any()), k_max=int(rp.host.top_k.max()))  # host values
    drawn, gumbel = {}, {}
    drew = None  # [B] rows whose x0 was drawn (temperature > 0), when x0 is not proposed everywhere
    for i, key in enumerate(noise_keys or ()):
        if key is None:
            continue
        gen = torch.Generator(device=dev).manual_seed(key)
        p = rp.params[i]
        if draws_tokens(p):
            if not full_x0:
                drew = torch.zeros(x0.shape[0], dtype=torch.bool, device=dev) if drew is None else drew
                drew[i] = True
            noise = torch.rand(logits.shape[1:], generator=gen, dtype=torch.float64, device=dev)
            if rp.sampled:  # the processed logits are already tempered and restricted
                mine = idx[0] == i
                x0[i, idx[1][mine]] = (processed[mine] - torch.log(-torch.log(noise[idx[1][mine]]))).argmax(-1)
            else:
                r = restrict(logits[i].to(torch.float64), float(p.temperature), max(0, int(p.top_k)), float(p.top_p))
                x0[i] = (r - float(p.temperature) * torch.log(-torch.log(noise))).argmax(-1)
        if draws_confidence(p):
            drawn[i] = torch.rand(x0.shape[1], generator=gen, dtype=torch.float64, device=dev)
        if perturbs_confidence(p):  # Gumbel noise: the top-k of conf / alg_temp + G is Dream's multinomial draw
            gumbel[i] = -torch.log(-torch.log(torch.rand(x0.shape[1], generator=gen, dtype=torch.float64,
                                                         device=dev)))
    x0_at = x0[idx]  # the drawn proposals, or every proposal (full_x0)
    rem = rp.dev.remasking[idx[0]] if rp.any_entropy or rp.any_margin or rp.any_sequential or rp.any_multi_block \
        else None
    bound = ENTROPY_BOUND in rp.policies  # host values
    if bound:  # JetEngine's entropy is of the softmax at the row's temperature (the model's own at 0)
        t = rp.dev.temperature[idx[0]]
        t = torch.where(t > 0, t, torch.ones_like(t))
    chunk = chunk_rows(V, dev)
    raw = _Rows(flat, at, chunk) if processed is None or bound else None
    rows = raw if processed is None else _Rows(processed, None, chunk)
    spare = torch.empty((min(chunk, n), V), dtype=torch.float64, device=dev) \
        if rp.any_entropy or bound or rp.any_multi_block else None  # the entropies' p log p
    cs, xs = [], []
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        w = rows.load(s, e)
        chosen = x0_at[s:e]
        if not full_x0:  # the float64 argmax (of the raw logits), but where the row drew
            am = w.argmax(-1) if x0_raw is None else x0_raw[s:e]
            chosen = am if drew is None else torch.where(drew[idx[0][s:e]], chosen, am)
            xs.append(chosen)
        probs = torch.softmax(w, dim=-1, out=w)
        c = probs.gather(-1, chosen[:, None]).squeeze(-1)
        if rp.any_entropy:  # Dream's neg_entropy
            plogp = torch.add(probs, 1e-10, out=spare[:e - s]).log_().mul_(probs)  # probs * log(probs + 1e-10)
            c = torch.where(rem[s:e] == ENTROPY, plogp.sum(-1), c)
        if rp.any_margin:  # Dream's topk_margin
            top2 = probs.topk(2, dim=-1).values
            c = torch.where(rem[s:e] == MARGIN, top2[:, 0] - top2[:, 1], c)
        if rp.any_multi_block:  # d3LLM's entropy, in this softmax pass: sum p log(p + 1e-12) (the lowest entropy first)
            plogp = torch.add(probs, MULTI_BLOCK_EPS, out=spare[:e - s]).log_().mul_(probs)
            c = torch.where(rem[s:e] == MULTI_BLOCK_ENTROPY, plogp.sum(-1), c)
        if rp.any_sequential:  # SDAR's sequential: the leftmost masks rank first
            c = torch.where(rem[s:e] == SEQUENTIAL, -idx[1][s:e].to(c.dtype), c)
        if bound:  # probabilities clamped at 1e-12; minus the entropy is the confidence (the lowest first)
            pe = raw.load(s, e).div_(t[s:e, None])
            pe = torch.softmax(pe, dim=-1, out=pe).clamp_min_(ENTROPY_EPS)
            plogp = torch.log(pe, out=spare[:e - s]).mul_(pe)  # pe * pe.log()
            c = torch.where(rp.dev.policy[idx[0][s:e]] == ENTROPY_BOUND, plogp.sum(-1), c)
        cs.append(c)
    if not full_x0 and xs:
        x0[idx] = torch.cat(xs)
    conf = torch.zeros(x0.shape, dtype=torch.float64, device=dev)
    if cs:
        conf[idx] = torch.cat(cs)
    for i, r in drawn.items():
        conf[i] = torch.where(need[i], r, conf[i])
    for i, g in gumbel.items():
        conf[i] = torch.where(need[i], conf[i] / rp.params[i].alg_temp + g, conf[i])
    return x0, conf


def select(conf: torch.Tensor, is_mask: torch.Tensor, step: torch.Tensor, rp: RowParams,
           block_length: int, steps: int) -> torch.Tensor:
    """Boolean [B, L]: positions to unmask this step, each row's by its own policy
    (engine.selection; only the policies some row uses are computed)."""
    conf = torch.where(is_mask, conf, torch.full_like(conf, -torch.inf))
    cand = Candidates(conf, is_mask, step, rp, block_length, steps)
    chosen = rp.selections
    sel = None
    for pid in rp.policies:  # host values
        mine = chosen[pid].choose(cand)
        sel = mine if sel is None else torch.where(rp.dev.policy[:, None] == pid, mine, sel)
    # scheduled policies fill the block by step S; threshold, factor and entropy_bound run until it is
    # full (at most L steps, one token at least per step), forced at step max(S, L) only
    # if a model keeps proposing the mask token itself
    last = (step >= rp.caps(block_length, steps, dev=True) - 1)[:, None]
    sel = sel | last
    # (when that position is masked: under blocks at absolute positions the prompt's tail may hold it)
    first = (rp.dev.first_position & (step == 0) & is_mask[:, 0])[:, None]
    col0 = torch.arange(conf.shape[1], device=conf.device)[None] == 0
    return torch.where(first, col0, sel) & is_mask


def select_d2f(conf: torch.Tensor, is_mask: torch.Tensor, rp: RowParams, complete: torch.Tensor) -> torch.Tensor:
    """D2F's rule for a block in flight (engine.d2f.D2FRule): every masked position whose
    probability is strictly greater than the threshold (D2F's skip_threshold), and,
    for a block in the complete state (`complete` [U]) that has none, its most
    confident masked position. `conf` is the proposals' probability (D2F rows rank
    with low_confidence)."""
    conf = torch.where(is_mask, conf, torch.full_like(conf, -torch.inf))
    over = (conf > rp.dev.threshold[:, None]) & is_mask
    force = complete & ~over.any(1)
    return over | (force[:, None] & (_ranks(conf) == 0) & is_mask)
