"""LinearSpec self-speculation and plain AR decoding, served in batches: Nemotron-Labs-
Diffusion's `linear_spec_generate` and `ar_generate`, one checkpoint trained both
bidirectional (diffusion) and causal.

LinearSpec, per block of L and per row, exactly two forwards: a DRAFT (the block
[seed, mask x (L-1)] attending bidirectionally to itself and to the row's cached prefix,
its argmax filling every mask; the published loop does not exclude the mask id from it),
then a VERIFY (the drafted block, causal, its K/V written). `ar` is the verify's argmax;
the row keeps the longest prefix where draft[i+1] == ar[i] plus one token (the bonus),
`accepted` tokens in all, and its K/V are cropped to cache + accepted: the K/V of the
block's first `accepted` columns are kept, the rest dropped. ar[accepted-1], already
emitted, seeds the next block. A causal prefill of the prompt gives the first token.
AR mode is the same loop with no draft and a block of one: one causal forward a token.

Why an engine of its own rather than a rule of engine.engine.Engine: that engine's rows
grow by whole blocks (its widths, K/V slot shifts and finish test count in L), and
LinearSpec grows a row by 1..L tokens a block. Here every row's K/V live in one box
(RowBox), a slot per row, its tokens from column 0 and its block written right after its
own cached length (DLLM.forward's per-row columns), so a batch of rows with different
prompts and different accepted lengths runs as one draft and one verify forward, and the
crop is the row's cached length: nothing is copied. Admission and preemption are
blockray's schedulers' (blockserve, static, sequential; engine.scheduler), a row's width
being prompt + generated + L; a preempted row drops its K/V and recomputes them causally
when it comes back (its state is its tokens and its seed, so the result is unchanged).

Greedy only (the published loops' temperature 0). The published `threshold` draft
iteration is SamplingParams.draft_threshold (passes until the block holds no mask, so
more than two forwards a block). The thinking budget and LoRA are not served
(LinearSpec's LoRA variant toggles the adapter on for the draft only; blockray merges an
adapter into the weights, so LinearSpecEngine refuses its rows). Output token ids end
before the first stop id, as the block engine's; the published loop can overshoot
max_new_tokens by up to L - 1 tokens within its last block, which are cut here.

The box holds as many slots as rows ever ran at once, each as wide as the widest row:
on a GPU that memory is outside the block engine's planned budget (engine.budget), so a
job serving both modes at once may hold both engines' K/V."""
from __future__ import annotations

import dataclasses
import itertools
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, List, Optional

import torch

from .config import EngineConfig, SamplingParams
from .core import EngineCore
from .engine import Engine
from .models import DLLM
from .models.transformer import KVCache
from .reads import LINEAR_SPEC
from .scheduler import make_scheduler
from .sequence import FinishReason, Request, RequestOutput, RowShape
from .speculative import row_refusal, serves
from .stats import EngineStats
from .transfer import indices


@dataclass
class SpecState:
    """A row's LinearSpec / AR state: its slot in the engine's K/V box (None until its
    prefill, and again after a preemption) and how many of its tokens the box holds there
    (prompt + generated tokens but the last); the seed of its next block (its last
    generated token); its forwards and, per block, its accepted length (what the bench and
    the tests read)."""

    slot: Optional[int] = None
    cached: int = 0
    seed: Optional[int] = None
    forwards: int = 0
    accepted: List[int] = field(default_factory=list)


class RowBox:
    """Every served row's K/V in one cache, a row per slot: a row's tokens in its columns
    [0, cached), its block written right after them (DLLM.forward's per-row `cols`). A
    forward stores in place and a crop is a shorter `cached`: nothing moves but when the box
    grows (both sizes doubled, the old contents copied once)."""

    def __init__(self, mcfg: Any, dtype: torch.dtype, device: Any):
        self.mcfg, self.dtype, self.device = mcfg, dtype, device
        self.cache: Optional[KVCache] = None
        self.slots, self.width = 0, 0  # capacity
        self.used = 0  # slots handed out so far (the free ones are in `free`)
        self.free: List[int] = []
        self.grows = 0  # times it grew: the only copies of K/V it makes

    def take(self) -> int:
        if self.free:
            return self.free.pop()
        self.used += 1
        return self.used - 1

    def release(self, slot: int) -> None:
        self.free.append(slot)

    def fit(self, width: int) -> None:
        """Room for every slot handed out, `width` columns each."""
        if self.used <= self.slots and width <= self.width:
            return
        slots, cols = max(self.used, 2 * self.slots if self.used > self.slots else self.slots), \
            max(width, 2 * self.width if width > self.width else self.width)
        new = KVCache.empty(self.mcfg, slots, cols, self.dtype, self.device)
        if self.cache is not None:
            for dst, src in ((new.k, self.cache.k), (new.v, self.cache.v)):
                for d, o in zip(dst, src):
                    d[:self.slots, :, :self.width] = o
        self.cache, self.slots, self.width = new, slots, cols
        self.grows += 1

    def nbytes(self) -> int:
        return 0 if self.cache is None else self.cache.nbytes()


class SpecRule:
    """What the schedulers' RowShape asks of a row's rule: one block in flight, the row
    needing max_new_tokens rounded up to blocks."""

    name = "linear_spec"

    def n_active(self, req: Request) -> int:
        return 1

    def blocks_needed(self, req: Request, block_length: int) -> int:
        return -(-req.params.max_new_tokens // block_length)


SPEC_RULE = SpecRule()


def accepted_lengths(draft: torch.Tensor, ar: torch.Tensor) -> torch.Tensor:
    """Per row of `draft` and `ar` ([n, T] each, on any device): the longest prefix where
    draft[i+1] == ar[i], plus the bonus token."""
    return (ar[:, :-1] == draft[:, 1:]).long().cumprod(1).sum(1) + 1


class LinearSpecEngine(EngineCore):
    """Rows decoded with SamplingParams.decoding "linear_spec" or "ar" (see the module
    docstring). One `step()`: rows admitted, new ones prefilled, then one block for every
    row: one draft forward for the LinearSpec rows and one verify forward for all."""

    reads = LINEAR_SPEC

    def __init__(self, model: DLLM, config: EngineConfig = EngineConfig(), tokenizer: Any = None,
                 adapter: Optional[str] = None):
        self.adapter = adapter  # the Checkpoint's (merged into every forward): its rows are refused
        config = replace(config, token_budget=config.fixed_token_budget())
        super().__init__(config, tokenizer, model.config.vocab_size)
        self.model, self.mcfg, self.device = model, model.config, model.device
        self.L = config.block_length
        self.shape = RowShape(self.L)
        self.scheduler = make_scheduler(config, self.shape)
        self.forwards = 0  # batched forwards
        self.accepted: Counter = Counter()  # LinearSpec blocks by accepted length (benches read it)
        self._holding: set = set()  # rows whose K/V are held
        self.box = RowBox(self.mcfg, model.dtype, self.device)

    # --- requests -----------------------------------------------------------------
    stop_ids = Engine.stop_ids  # the row's stop_token_ids, else the checkpoint's (none with ignore_eos)

    def check(self, req: Request) -> Optional[str]:
        err = row_refusal(req.params, self.mcfg, self.cfg, len(req.prompt), self.adapter)
        if err:
            return err
        req.rule, req.state = SPEC_RULE, SpecState()
        return None

    def admit(self, req: Request) -> None:
        self.scheduler.add(req)

    def pending(self) -> int:
        return self.scheduler.num_pending()

    def fail_active(self, message: str) -> None:
        for r in list(self.scheduler.active):
            frozen = self.scheduler.is_frozen(r)  # a static batch's finished row: already answered
            self.scheduler.remove(r)
            if frozen:
                continue
            r.error = message
            self._release(r)
            self._finish(r, FinishReason.ERROR)
        self._holding = set()

    # --- the loop -----------------------------------------------------------------
    def run(self) -> None:
        rows = self.scheduler.schedule()
        for r in self._holding - set(rows):  # preempted: its K/V go, its tokens and seed stay
            self._release(r)
        live = [r for r in rows if not self.scheduler.is_frozen(r)]
        self._holding = set(live)
        self.stats.active = len(live)
        if not live:
            return
        self.stats.cycles += 1
        fresh = [r for r in live if r.state.slot is None]
        if fresh:
            for r in self._prefill(fresh):
                live.remove(r)
        if live:
            self._block(live)

    def _prefill(self, rows: List[Request]) -> List[Request]:
        """One causal forward over each row's uncached tokens (its prompt, or after a
        preemption its prompt and generated tokens but the last); a new row's first token
        is the argmax of its last logit. Returns the rows that finished with it."""
        seqs = [r.prompt + r.generated[:-1] for r in rows]
        P = max(map(len, seqs))
        for r, seq in zip(rows, seqs):
            r.state.slot, r.state.cached = self.box.take(), 0
        ids = indices([s + [0] * (P - len(s)) for s in seqs], self.device)  # padding after: causal
        cols = torch.arange(P, device=self.device)[None].expand(len(rows), -1)
        mask = (cols[:, None, :] <= cols[:, :, None])[:, None]
        last = indices([[len(s) - 1] for s in seqs], self.device)
        seeds = self._forward(rows, ids, cols, mask, P, logits_at=last)[:, 0].argmax(-1).tolist()  # the prefill's read
        done = []
        for i, r in enumerate(rows):
            st = r.state
            st.cached = len(seqs[i])
            st.forwards += 1
            r.prompt_forwarded += len(r.prompt)  # again after a preemption
            if not r.generated:
                st.seed = seeds[i]
                if self._emit(r, [seeds[i]]):
                    done.append(r)
            else:
                st.seed = r.generated[-1]
        return done

    def _block(self, rows: List[Request]) -> None:
        """One block for every row: the LinearSpec rows' draft, then one verify forward
        for all (an AR row's block is its seed alone, its other columns padding after
        it), the accepted tokens emitted and the K/V cropped. The block stays on the
        device from the draft to the accepted lengths (accepted_lengths):
        the block's one host wait is the read of the verify's tokens and those lengths
        (a draft_threshold row's extra draft passes read whether masks are left)."""
        L, mask_id = self.L, self.mcfg.mask_token_id
        spec = [r.params.decoding == "linear_spec" for r in rows]
        T = L if any(spec) else 1
        blocks = indices([[r.state.seed] + [mask_id] * (T - 1) for r in rows], self.device)
        blocks = self._draft(rows, blocks, [i for i, s in enumerate(spec) if s and L > 1])
        ar = self._attend(rows, blocks, causal=True).argmax(-1)
        agree = accepted_lengths(blocks, ar)
        n_acc = torch.where(indices(spec, self.device, torch.bool), agree, torch.ones_like(agree))
        got = torch.cat([ar, n_acc[:, None]], 1).tolist()  # the block's read
        for i, r in enumerate(rows):
            st = r.state
            *ar_i, n = got[i]
            st.cached += n  # the crop: the verify's K/V of the block's first n columns kept, the rest dropped
            st.forwards += 1
            st.accepted.append(n)
            if spec[i]:
                self.accepted[n] += 1
            st.seed = ar_i[n - 1]
            r.num_steps += 1
            self._emit(r, ar_i[:n])

    def _draft(self, rows: List[Request], blocks: torch.Tensor, drafting: List[int]) -> torch.Tensor:
        """The draft of rows `drafting`: `blocks` [n, T] on the device with their masks
        filled, returned. One bidirectional pass whose argmax fills every mask; with a
        draft_threshold, passes until no mask is left, each filling the masks whose
        probability is at least it (at least the first most confident), a read after each
        pass saying which rows go on. At most L passes (the published loop would spin
        forever on a model that keeps proposing the mask id)."""
        mask_id = self.mcfg.mask_token_id
        for _ in range(self.L):
            if not drafting:
                break
            idx = indices(drafting, self.device)
            mine = blocks.index_select(0, idx)
            logits = self._attend([rows[i] for i in drafting], mine, causal=False)
            tokens = logits.argmax(-1)
            masked = mine == mask_id
            ths = [rows[i].params.draft_threshold or 0.0 for i in drafting]
            for i in drafting:
                rows[i].state.forwards += 1
            if not any(ths):
                return blocks.index_copy(0, idx, torch.where(masked, tokens, mine))
            conf = torch.softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
            c = conf.masked_fill(~masked, float("-inf"))
            th = indices(ths, self.device, conf.dtype)[:, None]
            fill = (c >= th) | (th == 0)  # no threshold: every mask
            first = torch.zeros_like(fill).scatter_(1, c.argmax(-1, keepdim=True), True)  # torch.argmax: the first
            fill = torch.where(fill.any(-1, keepdim=True), fill, first) & masked
            mine = torch.where(fill, tokens, mine)
            blocks = blocks.index_copy(0, idx, mine)
            left = ((mine == mask_id).any(-1) & (th[:, 0] > 0)).tolist()  # a threshold pass's read
            drafting = [i for i, go in zip(drafting, left) if go]
        return blocks

    def _attend(self, rows: List[Request], blocks: torch.Tensor, causal: bool) -> torch.Tensor:
        """One forward of `blocks` ([n, T] on the device), each right after its row's cached
        tokens in the row's slot, attending to them and to itself bidirectionally or
        causally; its K/V stored in the block's columns. Returns the block's logits [n, T, V]."""
        T = blocks.shape[1]
        cached = [r.state.cached for r in rows]
        c = indices(cached, self.device)[:, None, None]
        cols = c[:, 0] + torch.arange(T, device=self.device)[None]
        K = max(cached) + T
        j = torch.arange(K, device=self.device)[None, None]
        in_block = (j >= c) & (j < c + T)
        mask = (j < c) | (in_block & (j <= cols[:, :, None] if causal else in_block))
        return self._forward(rows, blocks, cols, mask[:, None], K, logits_last=T)

    def _forward(self, rows: List[Request], ids: torch.Tensor, cols: torch.Tensor, mask: torch.Tensor, K: int,
                 **logits: Any) -> torch.Tensor:
        """The model over `ids` [n, T] at columns (= positions) `cols` of the rows' slots,
        attending keys [0, K) under `mask` [n, 1, T, K]."""
        self.box.fit(K)
        self.forwards += 1
        self.stats.steps += 1
        self.stats.forwards += 1
        self.stats.kv_peak_bytes = self.box.nbytes()
        slots = [r.state.slot for r in rows]
        order = sorted(range(len(rows)), key=slots.__getitem__)  # by slot: adjacent slots attend in one call
        runs: List[List[int]] = []
        for i in order:
            if runs and runs[-1][1] == slots[i]:
                runs[-1][1] += 1
            else:
                runs.append([slots[i], slots[i] + 1, 0])
        idx = indices(order, self.device)
        at = {k: v.index_select(0, idx) for k, v in logits.items() if isinstance(v, torch.Tensor)}
        with torch.no_grad():
            out = self.model(ids.index_select(0, idx), cols.index_select(0, idx), mask.index_select(0, idx),
                             cache=self.box.cache, runs=[tuple(r) for r in runs], cols=cols.index_select(0, idx),
                             **{**logits, **at})
        return out.index_select(0, torch.argsort(idx))

    def _release(self, r: Request) -> None:
        if r.state is not None and r.state.slot is not None:
            self.box.release(r.state.slot)
            r.state.slot, r.state.cached = None, 0

    # --- output -------------------------------------------------------------------
    def _emit(self, r: Request, tokens: List[int]) -> bool:
        """Append `tokens` to `r`; finish it (True) at a stop id or at max_new_tokens."""
        n_before = len(r.generated)
        r.generated.extend(tokens)
        budget = r.params.max_new_tokens
        stop_at = next((n_before + j for j, t in enumerate(tokens) if t in r.stop_ids), -1)
        if 0 <= stop_at < budget:
            self._finish(r, FinishReason.STOP, stop_at)
        elif len(r.generated) >= budget:
            self._finish(r, FinishReason.LENGTH, budget)
        else:
            return False
        return True

    def _finish(self, r: Request, reason: FinishReason, n_tokens: int = 0) -> None:
        toks = r.generated[:n_tokens] if reason != FinishReason.ERROR else []
        if reason != FinishReason.ERROR:
            self.scheduler.finish(r)
            self._holding.discard(r)
            self._release(r)  # frees its K/V (a static batch keeps the row, frozen)
        text = self.tokenizer.decode(toks, skip_special_tokens=True) \
            if self.tokenizer is not None and reason != FinishReason.ERROR else None
        self.output(RequestOutput(
            request_id=r.request_id, prompt_token_ids=list(r.prompt), token_ids=toks, finish_reason=reason, text=text,
            error=r.error, num_blocks=len(r.state.accepted) if r.state is not None else 0,
            num_steps=r.state.forwards if r.state is not None else 0, latency_s=time.perf_counter() - r.arrival,
            prompt_tokens_forwarded=r.prompt_forwarded))


# the EngineStats that the LinearSpec engine counts too (the rest are the block engine's own)
ADDED_STATS = ("cycles", "steps", "forwards", "generated_tokens", "busy_s", "busy_cpu_s", "active", "pending",
               "step_failures")


class DecodingModes:
    """One engine over one Nemotron-Labs-Diffusion model serving its three modes: a
    request goes to the block engine (engine.engine: decoding "diffusion") or to the
    LinearSpec / AR engine, as its SamplingParams.decoding says; a step steps both (each
    only when it has requests). What the engine actor and its loop use of an engine:
    add_request, step, has_unfinished, generate, stats (the block engine's, with the other
    engine's counters added)."""

    def __init__(self, block: Any, spec: LinearSpecEngine):
        self.block, self.spec = block, spec
        self._ids = itertools.count()

    @classmethod
    def over(cls, block: Any, adapter: Optional[str] = None) -> "DecodingModes":
        """The modes over block engine `block` (engine.engine.Engine): the LinearSpec engine
        shares its model, tokenizer and budget (the settings it reads)."""
        cfg = block.cfg
        spec_cfg = EngineConfig(block_length=cfg.block_length, token_budget=cfg.token_budget, scheduler=cfg.scheduler,
                                max_batch_size=cfg.max_batch_size)
        return cls(block, LinearSpecEngine(block.model, spec_cfg, tokenizer=block.tokenizer, adapter=adapter))

    def add_request(self, prompt: Any, params: SamplingParams = SamplingParams(), request_id: Any = None) -> Any:
        if request_id is None:  # one numbering for both engines
            request_id = ("modes", next(self._ids))
        engine = self.spec if serves(params) else self.block
        return engine.add_request(prompt, params, request_id=request_id)

    def has_unfinished(self) -> bool:
        return self.block.has_unfinished() or self.spec.has_unfinished()

    def step(self) -> List[RequestOutput]:
        out: List[RequestOutput] = []
        for engine in (self.block, self.spec):
            if engine.has_unfinished():
                out += engine.step()
        return out

    generate = EngineCore.generate  # over this add_request and step

    @property
    def stats(self) -> EngineStats:
        """The block engine's EngineStats, the LinearSpec engine's counts and times added."""
        a, b = self.block.stats, self.spec.stats
        merged = dataclasses.replace(a)
        for name in ADDED_STATS:
            setattr(merged, name, getattr(a, name) + getattr(b, name))
        merged.finished = {k: a.finished.get(k, 0) + b.finished.get(k, 0) for k in {*a.finished, *b.finished}}
        return merged


__all__ = ["LinearSpecEngine", "SpecState", "accepted_lengths", "DecodingModes"]
