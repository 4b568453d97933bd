"""Canvas-grained continuous batching for DiffusionGemma.

A row is its prompt plus committed canvases (their K/V written by transformers' encoder
into the row's slot of the engine's K/V buffers, engine.canvas.kv) plus the canvas being
denoised. Every step forwards the canvases of all active rows in ONE decoder call, over
a view of the buffers (no per-step copy of any row's K/V) with a boolean mask per layer
type and positions per row. The rows whose canvas stops in a step (stable and confident,
or out of steps) start their next canvas at once; the next step writes their canvases and
prefills the rows joining then (right padded, each row at its own positions: rows are
independent in it) in the same forward that denoises every canvas (`_fused`: encoder and
decoder share their weights), so a step is ONE model call. The decoder steps run
engine.canvas.denoiser, bit-equal to transformers' decoder module with less overhead.
A row leaves at EOS or max_tokens; new rows are admitted under the token budget at any
step (`blockserve`), only into an empty batch (`static`), or one at a time (`sequential`).

The per-step bookkeeping (temperature, sampling, entropy-bound acceptance, renoise,
stability and confidence, self-conditioning) runs on tensors over the batch; Python runs
per row only for each row's own random draws (its generator), when its canvas ends, and
when it joins or leaves. One device -> host read per step: which canvases ended, and
their tokens.

Rows grow by a canvas per commit, so the admitted rows can outgrow the token budget.
Then, like vLLM's recompute preemption (engine.admission: the block engine's rule), the
most recently admitted rows are preempted (their K/V dropped; tokens, canvas in progress
and generator kept) to the front of the waiting queue, and re-admitted by one encoder
pass over prompt + committed canvases when they fit again. No row is ever dropped or
mixed; the oldest row always stays.

With `enable_prefix_caching`, complete prompt blocks (canvas_length tokens) are kept in
a prefix cache (engine.canvas.prefix) counted in the token budget: a row whose leading
blocks are cached copies their K/V and encodes only the rest of its prompt; rows joining
in one step that lack the same block leave it to the first of them and join a step later
(`_leader_waits`), taking it from the cache.

Random draws come from a per-request torch.Generator seeded with the request's seed, in
transformers' order (initial canvas; per step the multinomial sample, then the renoise),
so a row's tokens equal `torch.manual_seed(S); model.generate(prompt alone)` whatever
batch it is served in. The multinomial sample is drawn as torch draws it for one sample
(an exponential per entry, argmax of probs / exponential: the same draws, the same
token), so the rows' draws come from their generators and the rest runs batched."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

import torch

from ..admission import AdmissionOrder, fits, preempt
from ..config import SchedulerKind, enum_value
from ..core import prompt_refusal
from ..transfer import to_device
from ..sequence import FinishReason, RequestOutput
from .denoiser import Denoiser, refusal
from .kv import Pass, RowKV
from .params import CanvasParams, budget_refusal
from .prefix import PrefixCache

# What a request gets back: the engine's RequestOutput (num_blocks counts canvases).
CanvasOutput = RequestOutput

# the per-row state tensors, in slot order (engine._state)
_STATE = ("canvas", "argmax", "has_sc", "cur", "run", "n_steps", "t_min", "t_span", "bound", "conf", "stab")


@dataclass(eq=False)
class _Row:
    request_id: Any
    prompt: List[int]
    max_tokens: int
    params: CanvasParams
    gen: torch.Generator
    generated: List[int] = field(default_factory=list)
    num_steps: int = 0  # decoder steps before its current stay in the batch
    joined_at: int = 0  # decoder_forwards when it (re)joined
    seq: int = 0  # admission order (engine.admission: the newest is preempted first)
    slot: Optional[int] = None  # its place in the batch while active
    saved: Optional[dict] = None  # a preempted row's canvas in progress (its state tensors' rows)
    chain: list = field(default_factory=list)  # the prefix-cache blocks it holds
    keys: list = field(default_factory=list)  # its complete prompt blocks' chain keys (with the cache), once

    @property
    def cur_len(self) -> int:
        return len(self.prompt) + len(self.generated)


def _picked(counts: Sequence[int], t: int) -> torch.Tensor:
    """Host indices into a right-padded (rows, t) pass of its real tokens (row j's first counts[j])."""
    return torch.cat([j * t + torch.arange(c) for j, c in enumerate(counts)] + [torch.zeros(0, dtype=torch.long)])


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """torch.distributions.Categorical(logits=logits).entropy(), the same operations in the
    same order (what transformers' sampler and stopping criteria compute), without building
    the distribution object on every step."""
    logits = logits - logits.logsumexp(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)
    return -(torch.clamp(logits, min=torch.finfo(logits.dtype).min) * probs).sum(-1)


class CanvasEngine:
    """Serves DiffusionGemma requests; `model` is transformers' DiffusionGemmaForBlockDiffusion.
    engine.canvas.serve.CanvasServe makes it an EngineCore (engine.core) for the actor.

    What it shares with the block engine (EngineCore + engine.scheduler), by calling the
    same code:
    - the admission order and recompute preemption (engine.admission.preempt: cached
      blocks first, then the newest admitted row; the oldest never goes), and the budget
      test with eviction (engine.admission.fits), in `_preempt`, `_admit` and `_keep`;
    - a prompt's checks (engine.core.prompt_refusal: empty, ids outside the vocabulary),
      in `refusal`; under CanvasServe, `refusal` is its EngineCore `check`, so a bad row
      is refused at intake and comes back through EngineCore's error path;
    - under CanvasServe: intake, SamplingParams validation and the refusal of fields it
      does not read (engine.reads.CANVAS), the step wrapper that fails the active rows
      when a step raises (`fail`), and the counting of outputs (EngineCore.output);
    - `sequential` is the same rule: one row at a time, in arrival order.

    Where it differs from EngineCore's engine (engine.engine + BlockServeScheduler), and why:
    1. A row's cost is what it holds, `cur_len + L` (prompt, committed canvases, the
       canvas being denoised; `_area` sums them), not the padded box |A| x max width:
       a row's decoder forward is its L canvas positions over its own slot's K/V (right
       padded, positions per row), never a left-padded box of whole rows whose padding
       is computed, so there is no padding for the budget to charge.
    2. Its queue is first come, first served (a preempted row goes back to its front),
       and admission stops at the first row that does not fit; the block engine sorts its
       queue by width and fills the box with the widest row that adds no padding. With no
       box (1.), sorting by width would buy nothing and would reorder arrivals.
    3. Into an empty batch the first row goes in whatever the prefix cache holds
       (`refusal` checked that its full width fits the budget alone): the cache's blocks
       may be the very ones it is about to copy; the next step's `_preempt` evicts
       unheld blocks if the budget needs it. The block engine evicts first, sparing the
       candidate's own blocks (PrefixCache.make_room(keep=...)).
    4. Any row may be preempted at any step: rows' canvases end at different steps, so
       there is no "block boundary" to prefer (the block engine's `can_preempt`), and a
       preempted row keeps its canvas in progress (its state tensors, self-conditioning
       logits and generator: `_save`), dropping only its K/V, which one encoder pass over
       prompt + committed canvases rebuilds; the block engine's row redoes its current
       block instead. Both are exact (tested against transformers' and the published loops).
    5. Left alone, the oldest row may evict prefix blocks it holds itself (`_preempt`):
       a canvas row holds its cached blocks for its whole stay (their K/V are copied into
       its slot, so evicting them loses nothing of its own); the block engine pins blocks
       only from admission until it copies them.
    6. Its prefix cache (engine.canvas.prefix) is at canvas granularity (blocks of
       canvas_length tokens), keeps each block's K/V as its own tensors, and is exact
       for any family it serves (a causal encoder: on unless refused); the block engine's
       (engine.prefix_cache) keeps chunks inside the K/V slots' storage and is decided per
       family and cache mode. Rows joining together that lack the same block leave it to
       the first and join a step later (`_leader_waits`), rather than the block engine's
       extra catch-up forward of a leader: a step here is ONE forward.
    7. `static` admits only into an empty batch and lets finished rows leave at once; the
       block engine's static baseline keeps them in the batch, frozen and computed, as
       Fast-dLLM's lock step does. No refill until the group is done holds in both; a
       finished canvas row kept would only cost a decoder row (rows are independent).
    8. Its token budget is the given one or the default (EngineConfig.fixed_token_budget,
       set by CanvasServe), never planned from GPU memory: engine.budget models blockray's
       transformer and its KV slots (engine.slots), not transformers' DiffusionGemma and
       this engine's per-row buffers (engine.canvas.kv).
    9. Finished rows leave at the end of their step, all in one `_leave` (the last slots
       move into the holes, K/V copied once) and a row's tokens are cut at EOS or
       max_tokens per canvas (`_ends`); the block engine's rows finish through their
       decoding rule's commit and its stop strings (no tokenizer here)."""

    def __init__(self, model, defaults: CanvasParams, scheduler: SchedulerKind = SchedulerKind.BLOCKSERVE,
                 max_batch_size: int = 64, token_budget: int = 65536, stop_token_ids: Optional[Sequence[int]] = None,
                 enable_prefix_caching: bool = False, prefix_block: Optional[int] = None, fuse_encoder: bool = True,
                 hand_denoiser: bool = True):
        self.model, self.defaults = model, defaults
        self.fuse_encoder = fuse_encoder  # encoder work rides in the step's denoising forward (`_fused`)
        # decoder steps through engine.canvas.denoiser (bit-equal to transformers' decoder module, less
        # per-call overhead) unless asked not to or the model has what it does not implement
        self.denoiser = Denoiser(model) if hand_denoiser and refusal(model) is None else None
        self.scheduler = enum_value("scheduler", scheduler, SchedulerKind)
        self.max_batch_size = 1 if self.scheduler == SchedulerKind.SEQUENTIAL else max_batch_size
        self.token_budget = token_budget
        cfg = model.config
        self.L, self.V = cfg.canvas_length, cfg.text_config.vocab_size
        self.image_token_id = getattr(cfg, "image_token_id", None)
        self.layer_types = list(cfg.text_config.layer_types)
        self.sliding_window = cfg.text_config.sliding_window
        self.device = model.device
        self.sc_dtype = model.model.decoder.embed_tokens.weight.dtype
        eos = model.generation_config.eos_token_id if stop_token_ids is None else list(stop_token_ids)
        if eos is None:
            eos = cfg.text_config.eos_token_id
        self.eos = set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.prefix = PrefixCache(prefix_block or self.L) if enable_prefix_caching else None
        self.kv = RowKV(len(self.layer_types), self.device)
        self.waiting: List[_Row] = []
        self.active: List[_Row] = []  # admission order (the newest is preempted first)
        self._order = AdmissionOrder()
        self.rows: List[_Row] = []  # slot order (the batch's)
        self._state = {k: None for k in _STATE}
        self.sc: Optional[torch.Tensor] = None  # (B, L, V) previous step's processed logits
        self._fresh: set = set()  # rows without self-conditioning logits (a canvas just started)
        self._to_commit: List[_Row] = []  # rows whose finished canvas the next encoder pass writes
        self._to_prefill: List[_Row] = []  # rows joining: the next encoder pass prefills them
        self._layout = None  # the decoder's cache view, masks and positions while no row joins, leaves or commits
        self._draw_bufs = None  # the step's draws (engine._draws)
        self.outputs: List[CanvasOutput] = []
        self.decoder_forwards = 0  # batched decoder calls
        self.row_forwards = 0  # sum over calls of rows in the call
        self.encoder_forwards = 0  # passes that encoded tokens: encoder calls, and fused forwards
        self.fused_forwards = 0  # denoising forwards that also encoded (`_fused`): no encoder call of their own
        self.cells = 0  # tokens forwarded: encoder tokens + L per decoder row (the sorter's `cells`)
        self.preemptions = 0
        self.syncs = 0  # device -> host reads by the loop

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: Any, prompt_ids: Sequence[int], max_tokens: int, seed: int,
                    params: Any = None) -> None:
        p = self.defaults.override(params) if params is not None else self.defaults
        prompt = [int(t) for t in prompt_ids]
        err = self.refusal(prompt, max_tokens, p)
        if err is not None:
            self.outputs.append(RequestOutput(request_id, prompt, [], FinishReason.ERROR, error=err))
            return
        self.enqueue(request_id, prompt, max_tokens, seed, p)

    def enqueue(self, request_id: Any, prompt: List[int], max_tokens: int, seed: int, params: CanvasParams) -> None:
        """Queue a row `refusal` passed (add_request; CanvasServe checks at intake)."""
        self.waiting.append(_Row(request_id, prompt, max_tokens, params, torch.Generator().manual_seed(int(seed)),
                                 keys=self.prefix.keys(prompt) if self.prefix is not None else []))

    def refusal(self, prompt: List[int], max_tokens: Any, params: CanvasParams) -> Optional[str]:
        """Why a row cannot be served, or None: its knobs, max_tokens, the prompt checks
        every engine makes (engine.core.prompt_refusal), image tokens, and its full width
        (prompt + whole canvases) against the token budget, so the oldest row always fits
        alone (engine.admission.preempt keeps it)."""
        err = params.validate()
        if err is None and (not isinstance(max_tokens, int) or max_tokens < 1):
            err = f"max_tokens must be an integer >= 1, got {max_tokens!r}"
        if err is None:
            err = prompt_refusal(prompt, self.V)
        if err is None and self.image_token_id is not None and self.image_token_id in prompt:
            err = "the prompt holds image tokens; blockray serves DiffusionGemma text only"
        if err is None:
            err = budget_refusal(len(prompt), max_tokens, self.L, self.token_budget)
        return err

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.active)

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int, seeds: Sequence[int],
                 params: Any = None) -> List[CanvasOutput]:
        for i, (p, s) in enumerate(zip(prompts, seeds)):
            self.add_request(i, p, max_tokens, s, params)
        while self.has_unfinished():
            self.step()
        out, self.outputs = sorted(self.outputs, key=lambda o: o.request_id), []
        return out

    def prefix_figures(self) -> dict:
        """The prefix cache's counters under the engine stats' names (zeros without it)."""
        return (self.prefix or PrefixCache(self.L)).figures()

    # ------------------------------------------------------------------ the loop
    def _area(self, rows: Sequence[_Row]) -> int:
        return sum(r.cur_len + self.L for r in rows)

    def _cached(self) -> int:
        return self.prefix.tokens if self.prefix is not None else 0

    def _admit(self) -> None:
        if self.scheduler == SchedulerKind.STATIC and self.active:
            return
        joining: List[_Row] = []
        leading = set()  # the first uncached prompt block of each joining row (`_leader_waits`)
        area = self._area(self.active)
        while self.waiting and len(self.active) + len(joining) < self.max_batch_size:
            row = self.waiting[0]
            need = area + row.cur_len + self.L
            if self._leader_waits(row, leading):
                break
            # into an empty batch a row goes whatever the cache holds (refusal checked its full width)
            if (self.active or joining) and not fits(need, self.token_budget, self._cached, self._evict):
                break
            self.waiting.pop(0)
            joining.append(row)
            area = need
        if joining:
            self._join(joining)

    def _leader_waits(self, row: _Row, leading: set) -> bool:
        """With the cache (not under static, which admits only into an empty batch): whether
        `row` waits a step because a row joining now is about to encode (and cache) the
        first prompt block `row` lacks; next step it takes that block, and the rest of the
        chain they share, from the cache. Records `row`'s own first uncached block."""
        if self.prefix is None or self.scheduler == SchedulerKind.STATIC or row.saved is not None:
            return False
        first = next((k for k in row.keys if k not in self.prefix.blocks), None)
        if first is None:
            return False
        if first in leading:
            return True
        leading.add(first)
        return False

    def _evict(self) -> bool:
        """One cached block no row holds goes (least recently used leaf): True if one went."""
        return self.prefix is not None and self.prefix.evict()

    def _preempt(self) -> None:
        """Recompute preemption (engine.admission.preempt, the block engine's rule): while
        the admitted rows (and the prefix cache) outgrow the token budget, unheld cached
        blocks go first, then the newest row gives back its K/V and waits at the front of
        the queue. The oldest row always stays (refusal checked its full width); alone, it
        evicts the blocks it holds itself if it must (it keeps their K/V in its slot)."""
        def evict() -> bool:
            return self._evict() or (len(self.active) <= 1 and self.prefix is not None and self.prefix.evict(held=True))
        leaving = preempt(self.active, lambda: self._area(self.active) + self._cached() > self.token_budget, evict)
        for row in leaving:
            self._save(row)
            self.preemptions += 1
            self.waiting.insert(0, row)
        if leaving:
            self._leave(leaving)

    @torch.inference_mode()  # not no_grad: no version counters or view tracking on the step path
    def step(self) -> List[CanvasOutput]:
        """Admit, one encoder forward (the last step's commits, the joining rows' prefill), one
        decoder forward over every active row, then the canvases that stopped are committed.
        Returns every output so far (`outputs`). A forward that raises propagates: the
        caller (engine.canvas.serve, an EngineCore) fails the active rows (`fail`)."""
        self._preempt()
        self._admit()
        if not self.fuse_encoder:
            self._flush()
        if not self.rows:
            return self.outputs
        logits = self._forward() if self.fuse_encoder else self._decode()
        done, canvases = self._denoise(logits)
        ends, commits = [], []
        for b, toks in zip(done, canvases):
            row = self.rows[b]
            (ends if self._ends(row, toks) else commits).append(row)
        self._commit(commits)
        if ends:
            self._leave(ends)
        return self.outputs

    def fail(self, message: str) -> None:
        """Every active row finishes with `message` (a step raised); waiting rows go on."""
        for r in list(self.active):
            self._finish(r, FinishReason.ERROR, error=message)
            r.slot, r.saved = None, None
            if self.prefix is not None:
                self.prefix.release(r.chain)
            r.chain = []
        self.rows, self._state, self.sc, self._layout = [], {k: None for k in _STATE}, None, None
        self._fresh.clear()
        self._to_commit, self._to_prefill = [], []

    # ------------------------------------------------------------------ joins and leaves
    def _row_state(self, row: _Row) -> dict:
        """A new row's state tensors (one row each, on the host: `_join` uploads them); its
        first canvas drawn from its generator. A preempted row's, as it kept them (device)."""
        p = row.params
        if row.saved is not None:
            st, row.saved = row.saved, None
            return st
        canvas = torch.randint(0, self.V, (1, self.L), generator=row.gen)
        f32 = dict(dtype=torch.float32)
        return dict(canvas=canvas, argmax=canvas, has_sc=torch.zeros(1, dtype=torch.bool),
                    cur=torch.full((1,), p.max_denoising_steps, dtype=torch.int32),
                    run=torch.zeros(1, dtype=torch.long),
                    n_steps=torch.full((1,), p.max_denoising_steps, dtype=torch.int32),
                    t_min=torch.tensor([p.t_min], **f32), t_span=torch.tensor([p.t_max - p.t_min], **f32),
                    bound=torch.tensor([float(p.entropy_bound)], **f32),
                    conf=torch.tensor([float(p.confidence_threshold)], **f32),
                    stab=torch.full((1,), int(p.stability_threshold), dtype=torch.long),
                    sc=None)

    def _upload(self, states: List[dict]) -> None:
        """The joining rows' host state tensors onto the device, in place: one pinned,
        non-blocking copy per dtype (not one blocking copy per tensor)."""
        by_dtype: dict = {}
        for st in states:
            for k in _STATE:
                if st[k].device != self.device:
                    by_dtype.setdefault(st[k].dtype, []).append((st, k))
        for items in by_dtype.values():
            for (st, k), t in zip(items, to_device([st[k] for st, k in items], self.device)):
                st[k] = t

    def _save(self, row: _Row) -> None:
        """A preempted row keeps its canvas in progress (K/V dropped)."""
        s = row.slot
        st = {k: self._state[k][s:s + 1].clone() for k in _STATE}
        st["sc"] = self.sc[s:s + 1].clone() if self.sc is not None and row not in self._fresh else None
        row.saved = st
        row.num_steps += self.decoder_forwards - row.joined_at

    def _join(self, rows: List[_Row]) -> None:
        """Rows take slots B.. (the active list first: a failing prefill fails them with the
        others) and their state is appended; their prompt + committed canvases are encoded
        by the step's encoder pass (`_flush`)."""
        B = len(self.rows)
        for i, r in enumerate(rows):
            r.slot = B + i
            self._order.stamp(r)
        self.active += rows
        self.rows += rows
        self._layout = None
        states = [self._row_state(r) for r in rows]
        self._upload(states)
        self._to_prefill += rows
        for k in _STATE:
            parts = ([self._state[k]] if self._state[k] is not None else []) + [s[k] for s in states]
            self._state[k] = torch.cat(parts)
        sc_new = [s["sc"] for s in states]
        if self.sc is not None or any(x is not None for x in sc_new):
            zeros = lambda: torch.zeros((1, self.L, self.V), dtype=self.sc_dtype, device=self.device)  # noqa: E731
            old = [self.sc] if self.sc is not None else [zeros() for _ in range(B)]
            self.sc = torch.cat(old + [x if x is not None else zeros() for x in sc_new])
        self._fresh.update(r for r, x in zip(rows, sc_new) if x is None)
        for r in rows:
            r.joined_at = self.decoder_forwards

    def _leave(self, rows: List[_Row]) -> None:
        """Rows give back their slots: the rows in the last slots move into the holes (their
        K/V and state copied once), so slots stay 0..B-1 in batch order."""
        gone = {r.slot for r in rows}
        left = set(rows)
        self._to_commit = [r for r in self._to_commit if r not in left]  # a preempted row re-encodes them all
        B = len(self.rows)
        n = B - len(gone)
        holes = sorted(s for s in gone if s < n)
        movers = [s for s in range(n, B) if s not in gone]
        for r in rows:
            r.slot = None
            self._fresh.discard(r)
            if self.prefix is not None and r.chain:
                self.prefix.release(r.chain)
                r.chain = []
        self.kv.move(holes, movers)
        order = list(range(n))
        for h, m in zip(holes, movers):
            order[h] = m
        idx = to_device([torch.tensor(order, dtype=torch.long)], self.device)[0]
        for k in _STATE:
            self._state[k] = self._state[k].index_select(0, idx)
        if self.sc is not None:
            self.sc = self.sc.index_select(0, idx) if n else None
        rows_by_slot = self.rows
        self.rows = [rows_by_slot[s] for s in order]
        for s, r in enumerate(self.rows):
            r.slot = s
        if not n:
            self._state = {k: None for k in _STATE}
        self._layout = None

    # ------------------------------------------------------------------ encoder passes
    def _masks(self, starts: torch.Tensor, lens: torch.Tensor, q: int, lo: dict, hi: int, causal: bool,
               extra: int = 0) -> dict:
        """Per layer type the boolean (B, 1, q, hi - lo + extra) mask. Columns are absolute
        positions lo..hi-1 of the rows' K/V, then `extra` new columns (the decoder's canvas).
        `causal` (the encoder; query j of row b at position starts[b] + j): key position <=
        query position, and within the sliding window on sliding layers, as transformers'
        own masks; else (the denoiser) every key below the row's length `lens`, on sliding
        layers only the last sliding_window - 1 (what its sliding cache keeps), and the canvas."""
        dev, out = self.device, {}
        for kind in set(self.layer_types):
            col = torch.arange(lo[kind], hi, device=dev).view(1, 1, -1)
            sliding = kind == "sliding_attention" and self.sliding_window
            if causal:
                qpos = starts.view(-1, 1, 1) + torch.arange(q, device=dev).view(1, q, 1)
                m = col <= qpos
                if sliding:
                    m = m & (col > qpos - self.sliding_window)
            else:
                n = lens.view(-1, 1, 1)
                m = col < n
                if sliding:
                    m = m & (col >= n - (self.sliding_window - 1))
                m = m.expand(-1, q, -1)
                if extra:
                    m = torch.cat([m, torch.ones((m.shape[0], q, extra), dtype=torch.bool, device=dev)], dim=-1)
            out[kind] = m.unsqueeze(1)
        return out

    def _lo(self, first: int) -> dict:
        """The first column each layer type reads: 0, or on sliding layers the window's start
        of the row that starts lowest (`first`)."""
        lo = {k: 0 for k in set(self.layer_types)}
        if "sliding_attention" in lo and self.sliding_window:
            lo["sliding_attention"] = max(0, first - self.sliding_window + 1)
        return lo

    def _encode(self, slots, ids: torch.Tensor, starts: Sequence[int], counts: Sequence[int]) -> None:
        """ONE encoder forward: row j's ids[j, :counts[j]] at positions starts[j].. (right
        padded), its K/V written into its slot."""
        m, dev = self.model, self.device
        J, t = ids.shape
        host = torch.tensor(list(starts), dtype=torch.long)
        pick = None if all(c == t for c in counts) else _picked(counts, t)
        st, *pick = to_device([host] + ([] if pick is None else [pick]), dev)
        pick = pick[0] if pick else None
        ar = torch.arange(t, device=dev).view(1, t)
        cols = st.view(J, 1) + ar
        hi = max(starts) + t  # the padding's columns too (never read by a real token)
        self.kv.reserve(len(self.rows), hi + self.L)  # and the next decoder step's canvas (Pass.with_canvas)
        lo = self._lo(min(starts))
        masks = self._masks(st, None, t, lo, hi, causal=True)
        cache = Pass(self.kv, self.layer_types, slots, lo, hi, cols=cols, pick=pick)
        text = getattr(m.model.encoder, "language_model", m.model.encoder)  # text only: its text model direct
        text(input_ids=ids, attention_mask=masks, cache=cache, position_ids=cols.to(torch.int32))
        self.encoder_forwards += 1
        self.cells += sum(counts)

    def _work(self):
        """The encoder work the step owes, emptied: (slot, tokens, start) per row in slot
        order (the canvases the last step committed, at positions cur_len - L..; the joining
        rows' prefill as `generate` runs it at batch size 1: prompt + committed canvases, a
        preempted row's recompute, after the leading prompt blocks the prefix cache holds,
        which `_reuse` copies into the row's slot now), and the joining rows."""
        commits, joins = self._to_commit, self._to_prefill
        self._to_commit, self._to_prefill = [], []
        work = []
        for r in commits:
            work.append((r.slot, r.generated[-self.L:], r.cur_len - self.L))
        for r in joins:
            toks, start = r.prompt + r.generated, 0
            if self.prefix is not None:
                start = self._reuse(r)
            if len(toks) > start:
                work.append((r.slot, toks[start:], start))
        work.sort(key=lambda w: w[0])
        return work, joins

    def _flush(self) -> None:
        """The step's ONE encoder forward, before its decoder forward (`fuse_encoder` off,
        and `decoder_inputs`): the work of `_work`, each row at its own positions, right
        padded. Rows are independent in it (causal masks by absolute position), so one pass
        serves commits and prefills: a row joining where others commit costs no extra call."""
        work, joins = self._work()
        if work:
            slots = [w[0] for w in work]
            t = max(len(w[1]) for w in work)
            ids = torch.tensor([w[1] + [0] * (t - len(w[1])) for w in work], dtype=torch.long)
            contiguous = slots == list(range(slots[0], slots[0] + len(slots)))
            ids, *sl = to_device([ids] + ([] if contiguous else [torch.tensor(slots)]), self.device)
            sl = sl[0] if sl else slice(slots[0], slots[-1] + 1)
            self._encode(sl, ids, [w[2] for w in work], [len(w[1]) for w in work])
            self._layout = None
        self._kept(joins)

    def _kept(self, joins: Sequence[_Row]) -> None:
        if self.prefix is not None:
            for r in joins:
                self._keep(r)

    def _reuse(self, row: _Row) -> int:
        """Copies the row's cached leading prompt blocks into its slot; the tokens they cover."""
        pc = self.prefix
        chain = pc.match(row.keys)
        pc.count_lookup(len(row.prompt), len(chain))
        pc.hold(chain)
        row.chain = list(chain)
        if chain:
            self.kv.reserve(len(self.rows), len(chain) * pc.block)
        for j, blk in enumerate(chain):
            a = j * pc.block
            for i, (k, v) in enumerate(blk.kv):
                self.kv.keys[i][row.slot, :, a:a + pc.block] = k
                self.kv.values[i][row.slot, :, a:a + pc.block] = v
                pc.stats.copied_bytes += 2 * k.numel() * k.element_size()
        return len(chain) * pc.block

    def _keep(self, row: _Row) -> None:
        """Caches the row's complete prompt blocks not cached yet, as the budget allows."""
        pc = self.prefix
        parent = row.chain[-1] if row.chain else None
        for j in range(len(row.chain), len(row.keys)):
            blk = pc.blocks.get(row.keys[j])
            if blk is None:
                if not fits(self._area(self.active) + pc.block, self.token_budget, self._cached, pc.evict):
                    break
                if parent is not None and parent.key not in pc.blocks:
                    break  # its parent was evicted: the chain is broken
                a = j * pc.block
                kv = [(self.kv.keys[i][row.slot, :, a:a + pc.block].clone(),
                       self.kv.values[i][row.slot, :, a:a + pc.block].clone()) for i in range(self.kv.n_layers)]
                blk = pc.insert(row.keys[j], parent, kv)
                pc.stats.copied_bytes += sum(2 * k.numel() * k.element_size() for k, _ in kv)
            pc.hold([blk])
            row.chain.append(blk)
            parent = blk

    def _commit(self, rows: Sequence[_Row]) -> None:
        """The rows' finished canvases (appended to `generated`) are encoded by the next
        step's encoder pass (`_flush`, with the rows joining then); each starts its next
        canvas now (drawn from its generator)."""
        if not rows:
            return
        L, dev = self.L, self.device
        self._to_commit += rows
        idx, canvas = to_device([torch.tensor([r.slot for r in rows], dtype=torch.long),
                                 torch.cat([torch.randint(0, self.V, (1, L), generator=r.gen) for r in rows])], dev)
        s = self._state
        s["canvas"][idx] = canvas
        s["argmax"][idx] = canvas
        s["has_sc"][idx] = False
        s["cur"][idx] = s["n_steps"][idx]
        s["run"][idx] = 0
        self._fresh.update(rows)
        self._layout = None

    # ------------------------------------------------------------------ the denoiser
    def _decoder_layout(self):
        """The decoder's cache view, masks and positions (kept while no row joins, leaves
        or commits: its inputs change only then)."""
        if self._layout is None:
            dev = self.device
            lens = to_device([torch.tensor([r.cur_len for r in self.rows], dtype=torch.long)], dev)[0]
            hi = max(r.cur_len for r in self.rows)
            self.kv.reserve(len(self.rows), hi + self.L)  # the canvas's K/V after the cache's (done at encoding)
            lo = self._lo(min(r.cur_len for r in self.rows))
            masks = self._masks(None, lens, self.L, lo, hi, causal=False, extra=self.L)
            pos = (lens.view(-1, 1) + torch.arange(self.L, device=dev).view(1, -1)).to(torch.int32)
            rope = self.denoiser.rope(pos) if self.denoiser is not None else None
            self._layout = (Pass(self.kv, self.layer_types, slice(0, len(self.rows)), lo, hi), masks, pos, rope)
        return self._layout

    @torch.inference_mode()
    def decoder_inputs(self):
        """What the next decoder forward is given: (cache, masks, positions, canvas,
        self-conditioning logits or None), the step's admissions and encoder work done
        (bench/diffusion_gemma_backbone_bench.py); None when no row is active."""
        self._preempt()
        self._admit()
        self._flush()
        if not self.rows:
            return None
        cache, masks, pos, _ = self._decoder_layout()
        return cache, masks, pos, self._state["canvas"], self.sc if len(self._fresh) < len(self.rows) else None

    def _self_conditioning(self):
        """The decoder's self-conditioning inputs: (previous logits or None, per-row mask or None)."""
        B = len(self.rows)
        if len(self._fresh) == B:
            return None, None
        return self.sc, (self._state["has_sc"] if self._fresh else None)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """transformers' LM head and logit softcap, as DiffusionGemmaForBlockDiffusion.forward
        applies them (its two wrappers skipped: per-call overhead); float32 logits."""
        m = self.model
        logits = m.lm_head(hidden).to(torch.float32)
        return torch.tanh(logits / m.final_logit_softcapping) * m.final_logit_softcapping

    def _counted(self, B: int) -> None:
        self.decoder_forwards += 1
        self.row_forwards += B
        self.cells += B * self.L

    def _decode(self) -> torch.Tensor:
        """One decoder forward over every row's canvas; (B, L, V) float32 logits."""
        B = len(self.rows)
        cache, masks, pos, rope = self._decoder_layout()
        sc, sc_mask = self._self_conditioning()
        if self.denoiser is not None:
            self._counted(B)
            logits = self.denoiser(self._state["canvas"], cache, masks, rope, sc, sc_mask)
            cache.restore()  # the columns the canvas's K/V were attended in (Pass.with_canvas)
            return logits
        # transformers' decoder module, then its LM head and logit softcap
        hidden = self.model.model.decoder(decoder_input_ids=self._state["canvas"], cache=cache,
                                          self_conditioning_logits=sc, self_conditioning_mask=sc_mask,
                                          decoder_attention_mask=masks, decoder_position_ids=pos).last_hidden_state
        self._counted(B)
        return self._head(hidden)

    def _forward(self) -> torch.Tensor:
        """The step's ONE forward (`fuse_encoder`): the decoder's when no encoder work is
        owed, else the fused pass that encodes it and denoises every canvas (`_fused`)."""
        work, joins = self._work()
        logits = self._fused(work) if work else self._decode()
        self._kept(joins)
        return logits

    def _canvas_embeds(self) -> torch.Tensor:
        """The canvases' input embeddings as DiffusionGemmaDecoderModel.forward computes them
        (scaled token embeddings; the previous logits' softmax through the embedding, zero
        for a row whose canvas just started, through transformers' self-conditioning module)."""
        dec = self.model.model.decoder
        emb = dec.embed_tokens
        x = emb(self._state["canvas"])
        sc, sc_mask = self._self_conditioning()
        if sc is not None:
            soft = torch.matmul(sc.softmax(dim=-1, dtype=torch.float32).to(emb.weight.dtype), emb.weight) \
                * emb.embed_scale.to(x.dtype)
            if sc_mask is not None:
                soft = soft * sc_mask.to(soft.dtype)[:, None, None]
        else:
            soft = torch.zeros_like(x)
        return dec.self_conditioning(x, soft)

    def _fused(self, work) -> torch.Tensor:
        """The step's encoder work and its denoising in ONE forward of the encoder's layers
        (they ARE the decoder's: encoder and decoder share every weight, and their layers
        differ only in how attention meets the cache): engine.canvas.denoiser's, or
        transformers' encoder text model without it. Row b holds t slots, its new
        tokens (right padded; none for a row without work), then its canvas. The new tokens
        attend causally by absolute position, as in `_encode`, and their K/V are written
        into the row's slot; the canvas attends the row's K/V including them, as the next
        decoder forward would (the decoder's mask), plus the whole canvas, whose K/V are
        appended in place, never kept (kv.Pass with `canvas`). A padding slot sees only its row's
        canvas (never empty: no NaN), and nothing reads it. (B, L, V) float32 logits."""
        m, dev, L = self.model, self.device, self.L
        B = len(self.rows)
        t = max(len(w[1]) for w in work)
        lens = [r.cur_len for r in self.rows]
        toks, starts, counts = [[0] * t for _ in range(B)], list(lens), [0] * B
        for slot, ids, start in work:
            toks[slot], starts[slot], counts[slot] = ids + [0] * (t - len(ids)), start, len(ids)
        # the pass's host values in one pinned, non-blocking upload; the tokens written picked by index
        ids, st, n, cnt, pick = to_device([torch.tensor(toks, dtype=torch.long), torch.tensor(starts),
                                           torch.tensor(lens), torch.tensor(counts), _picked(counts, t)], dev)
        ar = torch.arange(t, device=dev).view(1, t)
        cols = st.view(B, 1) + ar
        valid = ar < cnt.view(B, 1)
        hi, lo = max(lens), self._lo(min(starts))
        self.kv.reserve(B, hi + L)  # and the next decoder step's canvas (Pass.with_canvas)
        top = self._masks(st, None, t, lo, hi, causal=True)
        bottom = self._masks(None, n, L, lo, hi, causal=False, extra=L)
        pad = (~valid).view(B, 1, t, 1).expand(B, 1, t, L)
        masks = {k: torch.cat([torch.cat([top[k] & valid.view(B, 1, t, 1), pad], dim=-1), bottom[k]], dim=2)
                 for k in top}
        pos = torch.cat([cols, n.view(B, 1) + torch.arange(L, device=dev).view(1, L)], dim=1).to(torch.int32)
        cache = Pass(self.kv, self.layer_types, slice(0, B), lo, hi, cols=cols, pick=pick, canvas=L)
        self._layout = None
        self.encoder_forwards += 1
        self.fused_forwards += 1
        self.cells += sum(counts)
        self._counted(B)
        if self.denoiser is not None:  # the same pass written by hand (bit-equal, tested)
            sc, sc_mask = self._self_conditioning()
            logits = self.denoiser(self._state["canvas"], cache, masks, self.denoiser.rope(pos), sc, sc_mask,
                                   new_ids=ids)
        else:
            text = getattr(m.model.encoder, "language_model", m.model.encoder)
            x = torch.cat([text.embed_tokens(ids), self._canvas_embeds()], dim=1)
            hidden = text(inputs_embeds=x, attention_mask=masks, cache=cache, position_ids=pos).last_hidden_state
            logits = self._head(hidden[:, t:])
        cache.restore()  # the columns the canvas's K/V were attended in (Pass.with_canvas)
        return logits

    def _denoise(self, raw: torch.Tensor):
        """transformers' `_denoising_step` for every row at once (each as at batch size 1:
        its own temperature schedule, entropy bound and stopping thresholds). Returns the
        slots whose canvas is done (stopped, or out of steps) and those canvases' tokens."""
        s = self._state
        # the rows' draws, in transformers' order per row: the sample's exponentials, then the renoise
        q, noise = self._draws()
        temp = s["t_min"] + s["t_span"] * (s["cur"] / s["n_steps"])  # LinearTemperatureScheduleLogitsProcessor
        processed = raw / temp.view(-1, 1, 1)
        probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
        denoiser = torch.argmax(probs / q, dim=-1)  # torch.multinomial(probs, 1) with these exponentials
        new_argmax = torch.argmax(processed, dim=-1)
        entropy = _entropy(processed)  # (B, L)
        # EntropyBoundSampler: accept the lowest-entropy tokens within the bound, renoise the rest
        sorted_e, order = torch.sort(entropy, dim=-1, descending=False)
        chosen = torch.cumsum(sorted_e, dim=-1) - sorted_e <= s["bound"].view(-1, 1)
        accepted = torch.scatter(torch.zeros_like(chosen), -1, order, chosen)
        s["canvas"] = torch.where(accepted, denoiser, noise)
        # StableAndConfidentStoppingCriteria: the argmax unchanged over the last `stab` steps, and confident
        same = (new_argmax == s["argmax"]).all(dim=-1) & (s["run"] > 0)
        s["run"] = torch.where(same, s["run"] + 1, torch.ones_like(s["run"]))
        stop = (s["run"] - 1 >= s["stab"]) & (entropy.mean(dim=-1) < s["conf"])
        s["argmax"] = new_argmax
        self.sc = processed.to(self.sc_dtype)
        if self._fresh:
            s["has_sc"].fill_(True)
            self._fresh.clear()
        s["cur"] = s["cur"] - 1
        done = stop | (s["cur"] == 0)
        host = torch.cat([done.view(-1, 1).long(), new_argmax], dim=1).tolist()  # the step's one read
        self.syncs += 1
        slots = [b for b, h in enumerate(host) if h[0]]
        return slots, [host[b][1:] for b in slots]

    def _draws(self):
        """Every row's draws of this step from its own generator, in transformers' order (the
        multinomial sample's (L, V) exponentials, then the (L,) renoise), written into
        host buffers kept while the batch size holds (no per-row tensors, no stack)."""
        B, L, V = len(self.rows), self.L, self.V
        if self._draw_bufs is None or self._draw_bufs[0].shape[0] != B:
            self._draw_bufs = (torch.empty((B, L, V), dtype=torch.float32), torch.empty((B, L), dtype=torch.long))
        q, noise = self._draw_bufs
        for i, r in enumerate(self.rows):
            q[i].exponential_(generator=r.gen)
            torch.randint(0, V, (L,), generator=r.gen, out=noise[i])
        return to_device([q], self.device)[0], to_device([noise], self.device)[0]  # two dtypes: two uploads

    # ------------------------------------------------------------------ per row
    def _ends(self, row: _Row, canvas: List[int]) -> bool:
        """Appends the finished canvas to the row; True (and the row finished) when it ends
        the row: EOS in it, or max_tokens reached. Such a canvas is never encoded."""
        row.generated += canvas
        if any(t in self.eos for t in canvas):
            cut = len(row.generated) - self.L + next(i for i, t in enumerate(canvas) if t in self.eos) + 1
            toks = row.generated[:cut]
            if len(toks) > row.max_tokens:
                self._finish(row, FinishReason.LENGTH, toks[:row.max_tokens])
            else:
                self._finish(row, FinishReason.STOP, toks)
            return True
        if len(row.generated) >= row.max_tokens:
            self._finish(row, FinishReason.LENGTH, row.generated[:row.max_tokens])
            return True
        return False

    def _finish(self, row: _Row, reason: FinishReason, tokens: Optional[List[int]] = None,
                error: Optional[str] = None) -> None:
        """The row's output; it leaves the batch with the step's other finished rows (`_leave`)."""
        self.active.remove(row)
        self.outputs.append(RequestOutput(row.request_id, row.prompt, tokens or [], reason, error=error,
                                          num_blocks=math.ceil(len(row.generated) / self.L),
                                          num_steps=row.num_steps + self.decoder_forwards - row.joined_at))


__all__ = ["CanvasEngine", "CanvasOutput"]
