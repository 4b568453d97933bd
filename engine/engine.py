"""The BlockServe engine: requests in, block cycles over a mixed-state batch, outputs
out. One `step()` is admit -> lay out -> denoise -> commit: one block cycle for every
active request (`advance="block"`), or one denoising step (`advance="step"`: a request
whose block is complete commits it and starts the next one at the very next step, and
requests join and leave at any step). Rows are left-padded to the batch's bounding box
(each row's current block sits `tail` columns before its end: 0 under the block canvas,
its masked later blocks under the full canvas), and each denoising step runs one
forward for the whole batch (engine.runner), after catch-up sub-batches for rows with
a long uncached stretch. D2F rows (engine.d2f) hold several blocks in flight, add and
commit them at any step, and make their batch advance by steps.

The host decides from host copies of the batch's bookkeeping; the device is read once
per denoising step (the block's tokens after it, which say who finished and who hit a
stop token). K/V live in slots that outlive batches (engine.slots): peak K/V memory is
the token budget's (N cells cost N * 2 * n_layers * n_kv_heads * head_dim * bytes; LLaDA-8B
in bf16: N * 512 KiB, a 65,536-cell budget is 32 GiB) plus one layer while they grow."""
from __future__ import annotations

import itertools
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .batch import Batch, relayout
from .config import EngineConfig, SamplingParams
from . import llada2
from .d2f import D2FState
from .decoding import propose, select, select_d2f, step_cap
from .models import DLLM
from .runner import ModelRunner
from .scheduler import make_scheduler
from .sequence import Prompt, Request, RequestOutput, RowShape, tokenize, validate
from .slots import KVSlots, place
from .stats import EngineStats


@dataclass
class BatchRecord:
    request_ids: List[Any]
    width: int
    cost: int


class Engine:
    def __init__(self, model: DLLM, config: EngineConfig = EngineConfig(), tokenizer=None,
                 record_batches: bool = False):
        self.model = model
        self.cfg = config
        self.mcfg = model.config
        self.tokenizer = tokenizer
        self.device = model.device
        self.full_canvas = config.full_canvas(self.mcfg.block_causal)
        self.shape = RowShape(config.block_length, self.full_canvas)  # what a request's row holds
        self.scheduler = make_scheduler(config, self.shape)
        self.stats = EngineStats(token_budget=config.token_budget)
        self.runner = ModelRunner(model, config, self.stats)
        self.slots = None if not config.mode.caches else KVSlots(
            self.mcfg, config.token_budget, model.dtype, self.device, max_rows=config.max_batch_size)
        self.stats.kv_budget_bytes = 0 if self.slots is None else config.token_budget * self.slots.cell_bytes
        self.batch_log: Optional[List[BatchRecord]] = [] if record_batches else None
        self._intake: List[Request] = []
        self._finished: List[RequestOutput] = []
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._in_flight = 0
        self.batch: Optional[Batch] = None
        self._grown: set = set()  # rows that committed a block and start their next one (D2F: added one)
        self._relayout = False  # D2F rows changed their blocks in flight: lay the batch out again
        self.first_position = self.mcfg.family.first_position  # the family's block decoding (SamplingParams)

    # --- requests -----------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams = SamplingParams(),
                    request_id: Any = None) -> Any:
        """Queue one request (thread-safe). A bad request is not raised: it comes back
        from the next step() with finish_reason "error" and a message naming the problem."""
        if request_id is None:
            request_id = next(self._ids)
        ids, error = tokenize(prompt, self.tokenizer)
        stop = list(params.stop_token_ids) if params.stop_token_ids is not None else self.mcfg.stop_token_ids
        req = Request(request_id, ids or [], params, stop)
        req.error = error or validate(req, self.shape, self.mcfg, self.cfg, self.tokenizer is not None) \
            or llada2.unsupported(req, self.mcfg.llada2)
        if self.mcfg.llada2 and not req.error:  # blocks at absolute positions (engine.llada2)
            llada2.split_prompt(req, self.cfg.block_length)
        if params.d2f and not req.error:
            req.d2f = D2FState(float(params.block_add_threshold), float(params.decoded_token_threshold),
                               self.cfg.block_length, self.shape.blocks_needed(req), self.mcfg.mask_token_id, stop)
        if (params.temperature and params.temperature > 0) or params.remasking == "random":
            req.noise_seed = params.seed if params.seed is not None else random.getrandbits(62)
        with self._lock:
            self._in_flight += 1
            self._intake.append(req)
        return request_id

    def has_unfinished(self) -> bool:
        with self._lock:
            return self._in_flight > 0

    def generate(self, prompts: Sequence[Prompt],
                 params: Union[SamplingParams, Sequence[SamplingParams]] = SamplingParams()) -> List[RequestOutput]:
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} SamplingParams")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        want = set(ids)
        got: Dict[Any, RequestOutput] = {}
        while len(got) < len(ids):
            for out in self.step():
                if out.request_id in want:
                    got[out.request_id] = out
        return [got[i] for i in ids]

    # --- the loop -----------------------------------------------------------------
    def step(self) -> List[RequestOutput]:
        """One block cycle (`advance="block"`) or one denoising step (`advance="step"`)
        for every active request; returns the requests that finished, bad ones included."""
        t0, c0 = time.perf_counter(), time.thread_time()
        with self._lock:
            intake, self._intake = self._intake, []
        for req in intake:
            if req.error:
                self._finish(req, "error")
            else:
                self.scheduler.add(req)
        try:
            self._form_batch()
            if self.batch is not None:
                self.stats.cycles += 1
                while True:
                    done, blocks = self._denoise()
                    # D2F rows add and commit blocks at any step: a batch holding them advances by steps
                    if self.cfg.advance == "step" or self.batch.has_d2f or bool(done.all()):  # host values
                        break
                self._commit(done, blocks)
        except Exception as e:  # noqa: BLE001 - a failing forward fails its rows, not the engine
            self._fail_active(e)
        self.stats.pending = self.scheduler.num_pending()
        self.stats.busy_s += time.perf_counter() - t0
        self.stats.busy_cpu_s += time.thread_time() - c0
        out, self._finished = self._finished, []
        with self._lock:
            self._in_flight -= len(out)
        return out

    def _form_batch(self) -> None:
        """Admit/preempt; when membership or widths changed, lay the batch out again in
        slot order and move in the K/V slots only the rows that must move."""
        old = self.batch
        mid_block = set()
        if old is not None:
            mid_block = {r for r, s in zip(old.rows, old.step.tolist()) if s > 0 and r not in self._grown}
        rows = self.scheduler.schedule(can_preempt=lambda r: r not in mid_block)
        self.stats.active = len(rows)
        if not rows:
            self.batch = None
            return
        rows, moves = place(old.rows if old is not None else [], rows)
        if old is None or self._grown or self._relayout or rows != old.rows:  # Request compares by identity
            b = self.batch = relayout(old, rows, self._grown, mcfg=self.mcfg, shape=self.shape, mode=self.cfg.mode,
                                      first_position=self.first_position, device=self.device)
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
        slots.fit(len(b.rows), b.width, kept, widest(kept))
        shifted = [i for i in kept if b.rows[i] in self._grown] if not self.full_canvas else []
        slots.shift(shifted, widest(shifted), L)
        b.cache = slots.box(len(b.rows), b.width)
        self.stats.kv_peak_bytes = slots.peak_bytes
        for k in ("regrow", "move", "shift"):
            self.stats.kv_copied_by[k] = slots.copied[k]

    def _fetch(self, t: torch.Tensor) -> torch.Tensor:
        """The loop's one device -> host read per denoising step (counted)."""
        self.stats.syncs += 1
        return t.cpu()

    def _denoise(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """One denoising step for the whole batch; returns, on the host, which rows'
        current block is complete and the window's tokens (engine.batch: each row's
        current block, or NB blocks when D2F rows hold several in flight, decoded as
        B x NB units of L positions)."""
        b, L, S = self.batch, self.cfg.block_length, self.cfg.steps_per_block
        mask_id, B, NB = self.mcfg.mask_token_id, len(self.batch.rows), self.batch.n_window
        cols = b.block_cols
        window = b.ids.gather(1, cols)
        is_mask = window == mask_id
        if b.valid_dev is not None:  # only the rows' own blocks (not earlier committed ones) are denoised
            is_mask &= b.valid_dev
        logits = self.runner.step_logits(b)
        rp = b.unit_params
        keys = self._noise_keys(b)
        units = lambda t: t.reshape(B * NB, L, *t.shape[2:])  # noqa: E731
        need_idx = [t.to(self.device) for t in units(b.masked).nonzero(as_tuple=True)]
        x0, conf = propose(units(logits), rp, keys, units(is_mask), need_idx)
        step = b.step.repeat_interleave(NB) if NB > 1 else b.step
        sel = select(conf, units(is_mask), step.to(self.device), rp, L, S)
        editing = llada2.editing_rows(b) if self.mcfg.llada2 else []
        if editing:  # LLaDA2.1 token editing, in the same step as the mask commits
            sel = sel | llada2.edits(b, editing, logits, x0, window, is_mask)
        if b.has_d2f:
            complete = torch.tensor(self._d2f_complete(b), dtype=torch.bool)
            d2f = b.d2f_rows.repeat_interleave(NB).to(self.device)[:, None]
            sel = torch.where(d2f, select_d2f(conf, units(is_mask), rp, complete.to(self.device)), sel)
        window = torch.where(sel.reshape(B, NB * L), x0.reshape(B, NB * L), window)
        b.ids.scatter_(1, cols, window)
        b.busy_steps += b.masked.any(1).long()
        b.step += 1
        self.stats.steps += 1
        blocks = self._fetch(window)
        b.masked = (blocks == mask_id) & b.valid
        done = ~b.masked[:, -L:].any(1) | (b.step >= step_cap(b.row_params.policy, L, S))
        if editing:
            done = llada2.after_step(b, editing, blocks, done)
        return done, blocks

    def _noise_keys(self, b: Batch) -> Optional[List[Optional[int]]]:
        """Per unit, the seed of its noise at this step (None: no row draws noise): a
        row's block from (seed, tokens before it, step in the block); a D2F block from
        (seed, tokens before it, the request's step)."""
        rp, L, NB = b.row_params, self.cfg.block_length, b.n_window
        if all(s is None for s in rp.seeds):
            return None
        keys: List[Optional[int]] = []
        for seed, r, st, n in zip(rp.seeds, b.rows, b.step.tolist(), b.nact.tolist()):
            row = [None] * (NB - n)
            if seed is None:
                row += [None] * n
            elif r.d2f is not None:
                row += [hash((seed, (r.d2f.first_active + j) * L, r.d2f.steps)) & (2**62 - 1) for j in range(n)]
            else:
                row.append(hash((seed, len(r.generated), st)) & (2**62 - 1))
            keys += row
        return keys

    @staticmethod
    def _d2f_complete(b: Batch) -> List[bool]:
        """Per unit, whether it is a D2F block in the complete state (may force a token)."""
        out: List[bool] = []
        for r, n in zip(b.rows, b.nact.tolist()):
            out += [False] * (b.n_window - n)
            out += [blk.complete for blk in r.d2f.active] if r.d2f is not None else [False] * n
        return out

    def _fail_active(self, exc: Exception) -> None:
        """The requests being served when the loop raised finish with an error naming it;
        queued requests are untouched and the engine keeps going."""
        msg = f"engine failed while serving this request: {type(exc).__name__}: {exc}"
        for r in list(self.scheduler.active):
            self.scheduler.remove(r)
            r.error = msg
            self._finish(r, "error")
        self.batch, self._grown = None, set()

    def _commit(self, done: torch.Tensor, blocks: torch.Tensor) -> None:
        """Append each completed block; a row whose block holds a stop token, or that
        reached its last block, leaves. Once per block, not per step (D2F rows: per step,
        `_advance_d2f`); host values only."""
        b, L = self.batch, self.cfg.block_length
        if b.has_d2f:
            done = done & ~b.d2f_rows
            self._advance_d2f(blocks)
        for i in torch.nonzero(done & ~b.frozen).flatten().tolist():
            r, blk = b.rows[i], blocks[i, -L:].tolist()
            r.num_steps += int(b.busy_steps[i])
            r.prompt_forwarded = int(b.prompt_fwd[i])
            if self._committed(r, blk):
                b.frozen[i] = self.scheduler.is_frozen(r)  # a static batch keeps the finished row
            else:
                self._grown.add(r)

    def _advance_d2f(self, blocks: torch.Tensor) -> None:
        """The D2F rows after the step (engine.d2f): their blocks in flight take the
        step's tokens, leading finished blocks are committed (the row may leave), and
        the next step's block is added (the row grows by L) and complete flags set."""
        b, L = self.batch, self.cfg.block_length
        for i in torch.nonzero(b.d2f_rows & ~b.frozen).flatten().tolist():
            r, st = b.rows[i], b.rows[i].d2f
            before = st.n_active
            done = st.observe(blocks[i, -before * L:].tolist())
            r.num_steps = st.steps
            r.prompt_forwarded = int(b.prompt_fwd[i])
            if done and self._committed(r, done):
                b.frozen[i] = self.scheduler.is_frozen(r)
                self._relayout = True  # a frozen row's blocks stop being denoised
                continue
            if st.plan():
                self._grown.add(r)
            self._relayout |= st.n_active != before

    def _committed(self, r: Request, blk: List[int]) -> bool:
        """Append committed tokens `blk` to `r`; True when the request finished (a stop
        token or string in them, or its last block)."""
        n_before = len(r.output_ids)
        lead = 0 if r.generated else len(r.lead)  # LLaDA2: the prompt's tail opens the first block
        r.generated.extend(blk)
        blk = blk[lead:]
        stop_at = next((j for j, t in enumerate(blk) if t in r.stop_ids), -1)
        budget = r.params.max_new_tokens
        end = n_before + stop_at if stop_at >= 0 else budget
        cut = self._stop_string(r, n_before, min(end, budget)) if r.params.stop else None
        if cut is not None:
            self._finish(r, "stop", *cut)
        elif stop_at >= 0 and n_before + stop_at < budget:
            self._finish(r, "stop", n_before + stop_at)
        elif stop_at >= 0 or len(r.generated) >= self.shape.blocks_needed(r) * self.cfg.block_length:
            self._finish(r, "length", budget)
        else:
            return False
        return True

    def _stop_string(self, req: Request, n_before: int, n_max: int):
        """(tokens, text) when a stop string appears in the first `n_max` generated
        tokens (it was not in the first `n_before`): the fewest tokens whose text holds
        it, and the text before it; else None. Decided on the detokenized text, as vLLM does."""
        def first(text: str) -> int:
            return min((i for i in (text.find(x) for x in req.params.stop) if i >= 0), default=-1)

        decode = lambda n: self.tokenizer.decode(req.output_ids[:n], skip_special_tokens=True)  # noqa: E731
        if first(decode(n_max)) < 0:
            return None
        for n in range(n_before + 1, n_max + 1):
            text = decode(n)
            at = first(text)
            if at >= 0:
                return n, text[:at]
        return None

    def _finish(self, req: Request, reason: str, n_tokens: int = 0, text: Optional[str] = None) -> None:
        toks = req.output_ids[:n_tokens] if reason != "error" else []
        if reason != "error":
            self.scheduler.finish(req)
            self.stats.generated_tokens += len(toks)
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        if text is None and self.tokenizer is not None and reason != "error":
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
        self._finished.append(RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt + req.lead, token_ids=toks, finish_reason=reason,
            text=text, error=req.error, num_blocks=self.shape.block_index(req), num_steps=req.num_steps,
            latency_s=time.perf_counter() - req.arrival, prompt_tokens_forwarded=req.prompt_forwarded))
