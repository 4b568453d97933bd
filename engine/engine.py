"""The BlockServe engine: requests in, block cycles over a mixed-state batch, outputs
out. One `step()` is admit -> lay out -> denoise -> commit: one block cycle for every
active request (`advance="block"`), or one denoising step (`advance="step"`: a request
whose block is complete commits it and starts the next one at the very next step, and
requests join and leave at any step). Rows are left-padded to the batch's bounding box
(each row's current block sits `tail` columns before its end: 0 under the block canvas,
its masked later blocks under the full canvas), and each denoising step runs one
forward for the whole batch (engine.runner), after catch-up sub-batches for rows with
a long uncached stretch.

How a row is decoded is its decoding rule's (engine.rules; engine.decoders picks it from
the request's SamplingParams): the engine calls every rule's hooks for the rows of that
rule (select, after a step, commit) and names none itself. What the model's family
says (where blocks start, its logit shift, its threshold rule) reaches the rules, the
batch layout and the runner through its `Layout` (engine.layout).

The host decides from host copies of the batch's bookkeeping; the device is read once
per denoising step (the block's tokens after it, which say who finished and who hit a
stop token). K/V live in slots that outlive batches (engine.slots): peak K/V memory is
the token budget's (N cells cost N * 2 * n_layers * n_kv_heads * head_dim * bytes; LLaDA-8B
in bf16: N * 512 KiB, a 65,536-cell budget is 32 GiB) plus one layer while they grow."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace
from typing import Any, FrozenSet, List, Optional, Tuple

import torch

from .batch import Batch, relayout
from .budget import kv_slack, resolve_token_budget
from .config import EngineConfig
from .core import EngineCore
from .decoders import rule_for
from .decoding import propose, select
from .logprobs import collect
from .models import DLLM
from .models.sharding import tensor_parallel_of
from .reads import MASKED
from .layout import Layout
from .rules import row_refusal
from . import prefix_cache
from .processors import Processing, StepLogits, default_processors, draws_noise
from .runner import ModelRunner
from .transfer import to_device
from .scheduler import make_scheduler
from .sequence import FinishReason, Request, RequestOutput, RowShape
from .slots import KVSlots, place
from .step_view import StepView
from .structured.guide import StructuredOutputs
from .structured.params import parse as parse_constraint


@dataclass
class BatchRecord:
    request_ids: List[Any]
    width: int
    cost: int


class Engine(EngineCore):
    reads = MASKED

    def __init__(self, model: DLLM, config: EngineConfig = EngineConfig(), tokenizer=None,
                 record_batches: bool = False):
        self.tp = tensor_parallel_of(model, config)  # None on one device
        # resolved once, here (engine.budget): everything below reads the resolved number
        # a shard's config is already its rank's (engine.models.sharding): planned as it stands
        plan_as = config if self.tp is None else replace(config, tensor_parallel_size=1)
        self.budget = resolve_token_budget(plan_as, model.config, model.dtype, model.device)
        if self.tp is not None:  # each rank planned from its own free memory: run with what fits on all
            self.budget = replace(self.budget, token_budget=self.tp.min_int(self.budget.token_budget))
        config = replace(config, token_budget=self.budget.token_budget)
        super().__init__(config, tokenizer, model.config.vocab_size)
        self.model = model
        self.mcfg = model.config
        self.device = model.device
        self.full_canvas = config.full_canvas(self.mcfg.block_causal)
        self.shape = RowShape(config.block_length, self.full_canvas)  # what a request's row holds
        self.layout = Layout(self.mcfg, self.shape, config)
        self.scheduler = make_scheduler(config, self.shape)
        self.runner = ModelRunner(model, config, self.stats)
        self.slots = None if not config.mode.caches else KVSlots(
            self.mcfg, config.token_budget, model.dtype, self.device, max_rows=config.max_batch_size,
            slack=kv_slack(config.compile_decode))
        self.stats.kv_budget_bytes = 0 if self.slots is None else config.token_budget * self.slots.cell_bytes
        self.runner.slots = self.slots  # compiled steps view whole shape buckets of them
        err = (prefix_cache.refusal(self.mcfg.family, self.mcfg.block_causal, config, self.full_canvas)
               or (self.mcfg.moe and self.mcfg.moe.block_length_refusal(config.block_length)))
        if err:
            raise ValueError(err)
        on = prefix_cache.enabled(self.mcfg.family, self.mcfg.block_causal, config, self.full_canvas)
        self.cfg = replace(self.cfg, enable_prefix_caching=on)  # auto resolved
        self.prefix = None if not on else prefix_cache.PrefixCache(
            self.slots, config.block_length, config.token_budget, self.stats)
        self.scheduler.prefix = self.prefix
        self.batch_log: Optional[List[BatchRecord]] = [] if record_batches else None
        self.batch: Optional[Batch] = None
        self._grown: set = set()  # rows that committed a block and start their next one (or added one)
        self._relayout = False  # rows changed their blocks in flight: lay the batch out again
        # plan and upload the next forward before the step's device read (engine.runner.prepare): on an
        # accelerator that host work runs while the device computes; on a CPU it would only move it
        self.overlap = self.device.type == "cuda"
        self.structured = StructuredOutputs(model.config.vocab_size, self.device, config)  # engine.structured
        self.processors = default_processors(self.structured)  # the step's per-row features (engine.processors)

    # --- requests -----------------------------------------------------------------
    def stop_ids(self, params) -> List[int]:
        """The row's explicit stop_token_ids, else the checkpoint's (none with ignore_eos, as vLLM's)."""
        if params.stop_token_ids is not None:
            return list(params.stop_token_ids)
        return [] if params.ignore_eos else list(self.mcfg.stop_token_ids)

    def sampling_reads(self, req: Request) -> Tuple[FrozenSet[str], str]:
        """A row's decoding rule (engine.decoders) is chosen here: the fields it reads."""
        req.rule = rule_for(req.params)
        return req.rule.reads, f"this row's decoding ({req.rule.name})"

    def check(self, req: Request) -> Optional[str]:
        """The prompt placed as the family lays out blocks, the rule's checks, the row's
        width against the context and the budget; then the rule's state of the row."""
        if req.params.stop and self.tokenizer is None:
            return "stop strings need a tokenizer (the engine has none); use stop_token_ids"
        err = row_refusal(req, self.layout)
        if err:
            return err
        if req.params.structured_outputs is not None:
            err = self.structured.admit(req, parse_constraint(req.params.structured_outputs), req.stop_ids,
                                        self.tokenizer)
            if err:
                return err
        req.state = req.rule.start(req, self.layout)
        params = req.params
        if draws_noise(params):
            if params.seed is None and self.tp is not None:  # a rank's own draw would differ from the others'
                return ("seed is required under tensor_parallel_size > 1 (every rank must draw the same noise; "
                        "the Ray side fills each row's seed on rank 0 before it broadcasts the requests)")
            req.noise_seed = params.seed if params.seed is not None else random.getrandbits(62)
        return None

    def admit(self, req: Request) -> None:
        self.scheduler.add(req)

    # --- the loop -----------------------------------------------------------------
    def run(self) -> None:
        """One block cycle (`advance="block"`) or one denoising step (`advance="step"`)
        for every active request."""
        self._form_batch()
        if self.batch is not None:
            self.stats.cycles += 1
            while True:
                done, blocks = self._denoise()
                # rows whose rule commits at any step make their batch advance by steps
                if self.cfg.advance == "step" or self.batch.stepwise or bool(done.all()):  # host values
                    break
            self._commit(done, blocks)

    def pending(self) -> int:
        return self.scheduler.num_pending()

    def _form_batch(self) -> None:
        """Admit/preempt; when membership or widths changed, lay the batch out again in
        slot order and move in the K/V slots only the rows that must move."""
        old = self.batch
        if self.prefix is not None and old is not None:  # prompt blocks the last steps made final
            self.prefix.insert(old, len(old.rows) * old.width)
        mid_block: Optional[set] = None

        def can_preempt(r: Request) -> bool:  # the rows mid-block, found once the scheduler asks (it rarely does)
            nonlocal mid_block
            if mid_block is None:
                mid_block = set() if old is None else {
                    r for r, s in zip(old.rows, old.step.tolist()) if s > 0 and r not in self._grown}
            return r not in mid_block
        rows = self.scheduler.schedule(can_preempt=can_preempt)
        self.stats.active = len(rows)
        if not rows:
            self.batch = None
            return
        rows, moves = place(old.rows if old is not None else [], rows)
        if old is None or self._grown or self._relayout or rows != old.rows:  # Request compares by identity
            b = self.batch = relayout(old, rows, self._grown, layout=self.layout, device=self.device)
            if self.slots is not None:
                self._lay_out_kv(old, b, moves)
            self._grown, self._relayout = set(), False
        cost = len(rows) * self.batch.width
        self.stats.budget_used = cost
        if self.batch_log is not None:
            self.batch_log.append(BatchRecord([r.request_id for r in rows], self.batch.width, cost))

    def _lay_out_kv(self, old: Optional[Batch], b: Batch, moves) -> None:
        """Rows whose K/V are worth keeping (cached > 0) move out of slots >= B, the
        buffers grow if the box outgrew them, and (block canvas, persistent) a row
        starting its next block shifts its cached prefix left by L."""
        slots, L = self.slots, self.cfg.block_length
        keep = {r for r, c in zip(b.rows, b.cached.tolist()) if c > 0}
        old_len = {r: n for r, n in zip(old.rows, old.lens.tolist())} if old is not None else {}
        widest = lambda slots_: max((old_len[b.rows[i]] for i in slots_), default=0)  # noqa: E731
        moving = [(f, t) for f, t in moves if b.rows[t] in keep]
        slots.move(moving, widest([t for _, t in moving]))
        kept = [i for i, r in enumerate(b.rows) if r in keep]
        slots.fit(*self.runner.room(len(b.rows), b.width), kept, widest(kept))  # compile_decode: its bucket
        shifted = [i for i in kept if b.rows[i] in self._grown] if not self.full_canvas else []
        slots.shift(shifted, widest(shifted), L)
        if self.prefix is not None:  # joining rows start after their cached prompt blocks
            b.cache = slots.box(len(b.rows), b.width)
            refresh = self.cfg.mode.recomputes_at_block_start()
            self.prefix.join(b, [i for i, r in enumerate(b.rows) if r not in old_len],
                             [i for i, r in enumerate(b.rows) if refresh and r in self._grown and r in old_len],
                             lambda rows: self.runner.forward(b, rows, catch_up=True))
        b.cache = slots.box(len(b.rows), b.width)
        self.stats.kv_peak_bytes = slots.peak_bytes
        for k in ("regrow", "move", "shift"):
            self.stats.kv_copied_by[k] = slots.copied[k]

    def _fetch(self, t: torch.Tensor) -> torch.Tensor:
        """A device -> host read of the step path (counted in EngineStats.syncs): the step's one
        (its window's tokens), and a logprob row's; nothing else on the step path waits."""
        self.stats.syncs += 1
        return t.cpu()

    def _denoise(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """One denoising step for the whole batch; returns, on the host, which rows'
        current block is complete and the window's tokens (engine.batch: each row's
        current block, or NB blocks when rows hold several in flight, decoded as
        B x NB units of L positions)."""
        b, L, S = self.batch, self.cfg.block_length, self.cfg.steps_per_block
        mask_id, B, NB = self.mcfg.mask_token_id, len(self.batch.rows), self.batch.n_window
        cols = b.block_cols
        window = b.ids.gather(1, cols)
        is_mask = window == mask_id
        if b.valid_dev is not None:  # only the rows' own blocks (not earlier committed ones) are denoised
            is_mask &= b.valid_dev
        logits = self.runner.step_logits(b)
        live = self._live(b)
        if b.processing is None:
            b.processing = Processing(self.processors, b)
        procs = StepLogits(b, window, is_mask, logits, live, self._fetch) if b.processing.active else None
        if procs is not None:  # min_tokens, the structured-outputs guide: the logits proposals come from
            b.processing.before(procs)
        rp = b.unit_params
        units = lambda t: t.reshape(B * NB, L, *t.shape[2:])  # noqa: E731
        # the masked positions (host values) and the step counts: one pinned, non-blocking upload
        step = b.step.repeat_interleave(NB) if NB > 1 else b.step
        *need_idx, step_dev = to_device([*units(b.masked).nonzero(as_tuple=True), step], self.device)
        x0, conf = propose(units(logits), rp, self._noise_keys(b), units(is_mask), need_idx, full_x0=b.full_x0)
        chosen = units(is_mask)
        view = StepView.of(b, conf=conf, is_mask=units(is_mask), x0=x0, window=window, logits=logits)
        for rule, rows in live:  # each rule's rows: the positions their step may unmask
            chosen = rule.candidates(view, rows, chosen)
        sel = select(conf, chosen, step_dev, rp, L, S)
        for rule, rows in live:  # each rule's rows: its own selection
            sel = rule.select(view, rows, sel)
        if procs is not None:  # the guide settles, min_tokens' mask goes, logprobs are recorded
            procs.conf = conf
            sel, x0 = b.processing.after(procs, sel, x0)
        window = torch.where(sel.reshape(B, NB * L), x0.reshape(B, NB * L), window)
        for rule, rows in live:  # each rule's rows: blocks it rewrites whole (engine.indel)
            window = rule.rewrite(view, rows, window)
        b.ids.scatter_(1, cols, window)
        b.busy_steps += b.masked.any(1).long()
        b.step += 1
        self.stats.steps += 1
        if self.overlap:  # the next forward's plan and upload, while the device runs this step
            self.runner.prepare(b)
        blocks = self._fetch(window)
        b.masked = (blocks == mask_id) & b.valid
        done = ~b.masked[:, -L:].any(1) | (b.step >= b.row_params.caps(L, S))
        view = StepView.of(b)
        for rule, rows in live:  # each rule's verdict, applied here: no rule writes to the batch
            verdict = rule.after_step(view, rows, blocks, done)
            done = verdict.done
            if verdict.busy is not None:
                b.busy_steps += verdict.busy
        return done, blocks

    @staticmethod
    def _live(b: Batch) -> List[Tuple[Any, List[int]]]:
        """(rule, its rows that are not frozen) for every rule in the batch: found again only
        once a row froze (Engine.commit), not at every step."""
        if b.live is None:
            frozen = b.frozen.tolist()
            b.live = [(rule, [i for i in rows if not frozen[i]]) for rule, rows in b.groups.items()]
        return b.live

    def _noise_keys(self, b: Batch) -> Optional[List[Optional[int]]]:
        """Per unit, the seed of its noise at this step (None: no row draws noise), from
        the row's rule (engine.rules)."""
        rp, NB = b.row_params, b.n_window
        if all(s is None for s in rp.seeds):
            return None
        keys: List[Optional[int]] = []
        for seed, r, st, n in zip(rp.seeds, b.rows, b.step.tolist(), b.nact.tolist()):
            keys += [None] * (NB - n) + ([None] * n if seed is None else r.rule.noise_keys(r, seed, st))
        return keys

    def fail_active(self, message: str) -> None:
        """The requests being served when the loop raised finish with `message`; queued
        requests are untouched and the engine keeps going."""
        for r in list(self.scheduler.active):
            self.scheduler.remove(r)
            if self.prefix is not None:
                self.prefix.release(r)
            r.error = message
            self._finish(r, FinishReason.ERROR)
        self.batch, self._grown = None, set()

    def _commit(self, done: torch.Tensor, blocks: torch.Tensor) -> None:
        """Every rule commits its rows' completed blocks (engine.rules); host values only."""
        view = StepView.of(self.batch)
        for rule, rows in self._live(self.batch):
            rule.commit(self, view, rows, blocks, done)

    # --- what the rules' commit hooks call ---------------------------------------------
    def commit(self, i: int, tokens: List[int]) -> bool:
        """Append committed `tokens` to the batch's row i; True when its request finished
        (then a static batch keeps it, frozen)."""
        b = self.batch
        r = b.rows[i]
        r.prompt_forwarded = int(b.prompt_fwd[i])
        if not self._committed(r, tokens):
            return False
        b.frozen[i] = self.scheduler.is_frozen(r)
        b.live = None  # the rules' live rows change with it
        return True

    def grow(self, r: Request) -> None:
        """`r` starts its next block (or added one) at the next step."""
        self._grown.add(r)

    def relayout(self) -> None:
        """Rows changed their blocks in flight: lay the batch out again before the next step."""
        self._relayout = True

    def _committed(self, r: Request, blk: List[int]) -> bool:
        """Append committed tokens `blk` to `r`; True when the request finished (a stop
        token or string in them, or its last block)."""
        n_before = len(r.output_ids)
        lead = 0 if r.generated else len(r.lead)  # BlockLayout.ABSOLUTE: the prompt's tail opens the first block
        r.generated.extend(blk)
        blk = blk[lead:]
        stop_at = next((j for j, t in enumerate(blk) if t in r.stop_ids), -1)
        budget = r.params.max_new_tokens
        end = n_before + stop_at if stop_at >= 0 else budget
        cut = self._stop_string(r, n_before, min(end, budget)) if r.params.stop else None
        if cut is not None:
            self._finish(r, FinishReason.STOP, *cut)
        elif stop_at >= 0 and n_before + stop_at < budget:
            self._finish(r, FinishReason.STOP, n_before + stop_at)
        elif stop_at >= 0 or len(r.generated) >= self.shape.blocks_needed(r) * self.cfg.block_length:
            self._finish(r, FinishReason.LENGTH, budget)
        else:
            return False
        return True

    def _stop_string(self, req: Request, n_before: int, n_max: int):
        """(tokens, text) when a stop string appears in the first `n_max` generated
        tokens (it was not in the first `n_before`): the fewest tokens whose text holds
        it, and the text before it (with it: include_stop_str_in_output); else None. Decided
        on the detokenized text, as vLLM does; with min_tokens a stop string counts only
        where it ends past the text of the first min_tokens - 1 tokens (vLLM checks none
        before then)."""
        p = req.params
        decode = lambda n: self.tokenizer.decode(req.output_ids[:n], skip_special_tokens=True)  # noqa: E731
        floor = len(decode(p.min_tokens - 1)) if p.min_tokens > 1 else 0

        def first(text: str) -> Optional[Tuple[int, int, str]]:
            """(where, which, the string) of the earliest stop string in `text`."""
            hits = [(text.find(x, max(0, floor - len(x) + 1)), j, x) for j, x in enumerate(p.stop)]
            return min((h for h in hits if h[0] >= 0), default=None)

        if first(decode(n_max)) is None:
            return None
        for n in range(max(n_before + 1, p.min_tokens), n_max + 1):
            text = decode(n)
            hit = first(text)
            if hit is not None:
                at, _, x = hit
                return n, text[:at + len(x) if p.include_stop_str_in_output else at]
        return None

    def _finish(self, req: Request, reason: FinishReason, n_tokens: int = 0, text: Optional[str] = None) -> None:
        toks = req.output_ids[:n_tokens] if reason != FinishReason.ERROR else []
        if reason != FinishReason.ERROR:
            self.scheduler.finish(req)
        if text is None and self.tokenizer is not None and reason != FinishReason.ERROR:
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
        logprobs, top = collect(req, len(toks)) if reason != FinishReason.ERROR else (None, None)
        self.output(RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt + req.lead, token_ids=toks, finish_reason=reason,
            text=text, error=req.error, num_blocks=self.shape.block_index(req), num_steps=req.num_steps,
            latency_s=time.perf_counter() - req.arrival, prompt_tokens_forwarded=req.prompt_forwarded,
            logprobs=logprobs, top_logprobs=top))
