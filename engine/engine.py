"""The BlockServe engine: requests in, block cycles over a mixed-state batch, outputs
out. One `step()` is one block cycle for every active request, whatever its block
index: rows are left-padded to the batch's bounding box (each row's current block sits
`tail` columns before its end: 0 under the block canvas, its masked later blocks under
the full canvas), and the denoising steps run one forward each for the whole batch.
With `advance="step"` a request whose block is complete commits it and starts the
next one at the very next step, and requests join and leave at any step.

Cache memory: with `cache` refresh or persistent, the K/V buffer holds one entry per
cell of the batch box, so a token budget of N cells costs
N * 2 * n_layers * n_kv_heads * head_dim * bytes_per_element bytes (LLaDA-8B in bf16:
N * 512 KiB; a 65,536-cell budget is 32 GiB)."""
from __future__ import annotations

import itertools
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from .config import EngineConfig, SamplingParams
from .decoding import propose, select, step_cap
from .batch import Batch, grow_in_place, relayout
from .budget import kv_bytes_per_token
from .models import DLLM
from .scheduler import make_scheduler
from .stats import EngineStats, ForwardFit
from .sequence import Request, RequestOutput

Prompt = Union[str, Sequence[int]]


# What one more forward costs, in query cells, beyond the cells it computes (kernel
# launches, per-layer host work); it keeps catch-up from splitting into tiny groups.
FORWARD_OVERHEAD_CELLS = 256


def catch_up_groups(need: List[int], floor: int, after: Optional[List[int]] = None,
                    overhead: float = FORWARD_OVERHEAD_CELLS) -> List[List[int]]:
    """Rows to bring up to date before the batch's forward, grouped by similar stretch.

    `need[i]` is how many columns row i must compute now (at least `floor`);
    `after[i]` (default `floor`) how many it still computes in the batch's forward once
    caught up (its block, and under the full canvas without dual cache its masked
    suffix). One forward over rows with different needs pads each to the largest, so
    rows with a long uncached stretch (just admitted, refreshing a prefix, or with a
    committed block to cache) are forwarded first in sub-batches of similar need.
    Picks the split with the fewest computed cells (dynamic programming over rows
    sorted by need, `overhead` cells per extra forward: the engine's online fit, or
    FORWARD_OVERHEAD_CELLS before it has one); [] when one forward is cheapest."""
    n = len(need)
    after = after if after is not None else [floor] * n
    order = sorted((i for i in range(n) if need[i] > after[i]), key=lambda i: -need[i])
    cand = set(order)
    base = max([floor] + [need[i] for i in range(n) if i not in cand])
    d = [need[i] for i in order] + [0]
    m = len(order)
    caught_after = [0] * (m + 1)  # widest `after` among order[:k]
    for k in range(1, m + 1):
        caught_after[k] = max(caught_after[k - 1], after[order[k - 1]])
    # best[k]: fewest cells for rows order[:k] in sub-batches; cut[k]: where its last group starts
    best, cut = [0.0] + [float("inf")] * m, [0] * (m + 1)
    for k in range(1, m + 1):
        for j in range(k):  # last group = order[j:k], padded to d[j]
            c = best[j] + (k - j) * d[j] + overhead
            if c < best[k]:
                best[k], cut[k] = c, j
    # the rest join the batch forward, as wide as its widest row
    k = min(range(m + 1), key=lambda k: best[k] + n * max(base, d[k], caught_after[k]))
    groups = []
    while k > 0:
        groups.append([order[i] for i in range(cut[k], k)])
        k = cut[k]
    return groups[::-1]


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
        self.scheduler = make_scheduler(config)
        self.stats = EngineStats(token_budget=config.token_budget)
        self.stats.kv_budget_bytes = 0 if config.cache == "none" else (
            config.token_budget * kv_bytes_per_token(self.mcfg, model.dtype))
        self.forward_fit = ForwardFit()  # forward time = a + b * cells, from this engine's own forwards
        self.batch_log: Optional[List[BatchRecord]] = [] if record_batches else None
        self._intake: List[Request] = []
        self._finished: List[RequestOutput] = []
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._in_flight = 0
        self.batch: Optional[Batch] = None
        self._grown: set = set()  # rows that committed a block and start their next one
        # canvas="auto": the full canvas where a masked suffix is visible (bidirectional models)
        self.full_canvas = config.canvas == "full" or (config.canvas == "auto" and not self.mcfg.block_causal)
        self.first_position = self.mcfg.model_type == "Dream"  # Dream's block decoding (SamplingParams)

    # --- requests -----------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams = SamplingParams(),
                    request_id: Any = None) -> Any:
        """Queue one request (thread-safe). A bad request is not raised: it comes back
        from the next step() with finish_reason "error" and a message naming the problem."""
        if request_id is None:
            request_id = next(self._ids)
        ids, error = self._tokenize(prompt)
        stop = list(params.stop_token_ids) if params.stop_token_ids is not None else self.mcfg.stop_token_ids
        req = Request(request_id, ids or [], params, self.cfg.block_length, stop, full_canvas=self.full_canvas)
        req.error = error or self._validate(req)
        if (params.temperature and params.temperature > 0) or params.remasking == "random":
            req.noise_seed = params.seed if params.seed is not None else random.getrandbits(62)
        with self._lock:
            self._in_flight += 1
            self._intake.append(req)
        return request_id

    def _tokenize(self, prompt: Prompt):
        try:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    return None, "prompt is text but the engine has no tokenizer; pass token ids"
                return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"]), None
            ids = [int(t) for t in prompt]
            if any(isinstance(t, bool) or t != int(t) for t in prompt):
                raise TypeError
            return ids, None
        except Exception as e:  # noqa: BLE001 - any tokenizer failure is a per-row error
            return None, f"prompt could not be tokenized: {type(e).__name__}: {e}"

    def _validate(self, req: Request) -> Optional[str]:
        err = req.params.validate()
        if err:
            return err
        if req.params.stop and self.tokenizer is None:
            return "stop strings need a tokenizer (the engine has none); use stop_token_ids"
        if not req.prompt:
            return "empty prompt"
        bad = [t for t in req.prompt if not 0 <= t < self.mcfg.vocab_size]
        if bad:
            return f"token id {bad[0]} outside the vocabulary [0, {self.mcfg.vocab_size})"
        if req.final_width > self.mcfg.max_seq_len:
            return (f"prompt of {req.prompt_len} tokens + {req.num_blocks_needed} blocks of "
                    f"{self.cfg.block_length} exceeds the model context of {self.mcfg.max_seq_len} tokens")
        if req.final_width > self.cfg.token_budget:
            return (f"request needs {req.final_width} tokens of batch budget alone "
                    f"(prompt {req.prompt_len} + {req.num_blocks_needed} blocks of {self.cfg.block_length}), "
                    f"more than token_budget={self.cfg.token_budget}")
        return None

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
                    done = self._denoise()
                    if self.cfg.advance == "step" or bool(done.all()):
                        break
                self._commit(done)
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
        """Admit/preempt, then lay the batch out again if its membership or widths changed."""
        old = self.batch
        mid_block = set()
        if old is not None:
            mid_block = {r for r, s in zip(old.rows, old.step.tolist()) if s > 0 and r not in self._grown}
        rows = self.scheduler.schedule(can_preempt=lambda r: r not in mid_block)
        self.stats.active = len(rows)
        if not rows:
            self.batch = None
            return
        same_rows = old is not None and len(rows) == len(old.rows) and all(a is b for a, b in zip(rows, old.rows))
        if not same_rows or self._grown:
            old_bytes = old.cache.nbytes() if old is not None and old.cache is not None else 0
            if not (same_rows and grow_in_place(
                    old, self._grown, cache_mode=self.cfg.cache, mask_token_id=self.mcfg.mask_token_id,
                    block_causal=self.mcfg.block_causal, full_canvas=self.full_canvas)):
                self.batch = relayout(old, rows, self._grown, mcfg=self.mcfg, block_length=self.cfg.block_length,
                                      cache_mode=self.cfg.cache, full_canvas=self.full_canvas,
                                      first_position=self.first_position, dtype=self.model.dtype,
                                      device=self.device)
            self._grown = set()
            b = self.batch
            new_bytes = b.cache.nbytes() if b.cache is not None else 0
            self.stats.kv_bytes_copied += b.kv_copied
            # a re-layout builds the new box while the old one is alive
            self.stats.kv_peak_bytes = max(self.stats.kv_peak_bytes, new_bytes + (old_bytes if b is not old else 0))
        cost = len(rows) * self.batch.width
        self.stats.budget_used = cost
        if self.batch_log is not None:
            self.batch_log.append(BatchRecord([r.request_id for r in rows], self.batch.width, cost))

    def _windows(self, b: Batch):
        """Per row, the query columns [q0, q1) a forward must compute now and [fresh, q1)
        those whose K/V it stores. The block's L columns always (and the column before
        it for Dream's shifted logits); without a cache the whole row; with one, what is
        not final yet: the whole row at a block start under refresh/dual, the new
        committed block under persistent, and the masked suffix under the full canvas
        unless the dual cache keeps it."""
        shift, L, W = int(self.mcfg.shift_logits), self.cfg.block_length, b.width
        start, bs = b.start, b.block_start
        q1 = torch.full_like(start, W)
        if self.cfg.cache == "none":
            return start, q1, start
        fresh = start + b.cached
        if self.cfg.cache == "dual":
            q1 = torch.where(b.cached > 0, bs + L, q1)
        return torch.minimum(fresh, bs - shift), q1, fresh

    def _denoise(self) -> torch.Tensor:
        """One denoising step for the whole batch; returns which rows' current block is
        complete. Rows with a long uncached stretch (just admitted, or refreshing a long
        prefix) are first brought up to date in sub-batches of similar stretch
        (`catch_up_groups`), so the batch's forward stays about one block wide instead
        of padding every row to the longest."""
        b, L, S = self.batch, self.cfg.block_length, self.cfg.steps_per_block
        mask_id = self.mcfg.mask_token_id
        cols = b.block_cols()
        block = b.ids.gather(1, cols)
        is_mask = block == mask_id
        busy = is_mask.any(1)
        if self.cfg.cache != "none":
            q0, q1, _ = self._windows(b)
            shift = int(self.mcfg.shift_logits)
            # once caught up, a row computes its block, and its suffix unless the dual cache holds it
            after = L + shift + (torch.zeros_like(b.tail) if self.cfg.cache == "dual" else b.tail)
            overhead = self.forward_fit.overhead_cells(FORWARD_OVERHEAD_CELLS)
            self.stats.forward_overhead_cells = overhead
            for group in catch_up_groups((q1 - q0).tolist(), L + shift, after.tolist(), overhead):
                self._forward(torch.tensor(group, device=self.device))
        logits = self._forward()

        rp = b.row_params
        keys = None
        if any(s is not None for s in rp.seeds):
            keys = [None if seed is None else hash((seed, len(r.generated), st)) & (2**62 - 1)
                    for seed, r, st in zip(rp.seeds, b.rows, b.step.tolist())]
        x0, conf = propose(logits, rp, keys, is_mask)
        sel = select(conf, is_mask, b.step, rp, L, S)
        block = torch.where(sel, x0, block)
        b.ids.scatter_(1, cols, block)
        b.step += 1
        b.busy_steps += busy.long()
        self.stats.steps += 1
        return ~(block == mask_id).any(1) | (b.step >= step_cap(rp, L, S))

    def _forward(self, idx: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Block logits [n, L, V] for the rows `idx` (all rows when None), read for Dream
        from the column before each position. With a cache only the columns whose K/V
        are not final are computed and stored (`_windows`); the query's other columns
        are padding. Rows' windows that all end at the box's edge are one slice of
        columns; otherwise (dual cache mid-block) each row's columns are gathered."""
        b, L, shift, W = self.batch, self.cfg.block_length, int(self.mcfg.shift_logits), self.batch.width
        rows = (lambda t: t) if idx is None else (lambda t: t[idx])
        q0, q1, fresh = (rows(t) for t in self._windows(b))
        start, bs, ids, pos, mask = rows(b.start), rows(b.block_start), rows(b.ids), rows(b.positions()), rows(b.mask)
        T = int((q1 - q0).max())
        first = q1 - T  # [n] each row's first query column, right-aligned at q1
        contiguous = bool((q1 == W).all())
        qcols = first[:, None] + torch.arange(T, device=self.device)[None]
        qc = qcols.clamp(min=0)
        real = qcols >= q0[:, None]
        write = real & (qcols >= fresh[:, None])
        at = bs[:, None] - shift - first[:, None] + torch.arange(L, device=self.device)[None]
        if shift and self.cfg.cache != "none":  # Fast-dLLM's Dream: a cached step reads the
            # block's first position (committed at the block's first step) from itself
            at[:, 0] += rows(b.row_params.first_position & (b.step > 0)).long()
        tokens = torch.where(real, ids.gather(1, qc), self.mcfg.pad_token_id)
        qmask = mask if mask.shape[2] == 1 else mask.gather(2, qc[:, None, :, None].expand(-1, 1, -1, W))
        t0 = time.perf_counter()
        with torch.inference_mode():
            if self.cfg.cache == "none":
                logits = self.model(tokens, pos.gather(1, qc), qmask[..., W - T:], logits_at=at)
            else:
                logits = self.model(tokens, pos.gather(1, qc), qmask, b.cache, W - T,
                                    write=None if bool(write.all()) else write, rows=idx,
                                    cols=None if contiguous else qc, logits_at=at)
                prefix = bs - start  # everything before the block is final now
                if idx is None:
                    b.cached = prefix
                else:
                    b.cached[idx] = prefix
            if self.cfg.profile and self.device.type == "cuda":  # exact forward_s, at the cost of a stall
                torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        self.stats.forward_s += seconds
        cells, n_real = ids.shape[0] * T, int(real.sum())
        if idx is not None:  # attention read a gathered copy of these rows' K/V, layer by layer
            self.stats.kv_bytes_copied += b.cache.nbytes() * len(idx) // b.ids.shape[0]
        if self.device.type != "cuda" or self.cfg.profile:  # timed to completion: fit on it
            self.forward_fit.add(cells, seconds)
        self.stats.forwards += 1
        self.stats.computed_cells += cells
        self.stats.padded_cells += cells - n_real
        counted = write if self.cfg.cache != "none" else real
        fwd = (counted & (qcols - start[:, None] < rows(b.prompt_len)[:, None])).sum(1)
        if idx is None:
            b.prompt_fwd += fwd
        else:
            b.prompt_fwd.index_add_(0, idx, fwd)
        return logits

    def _fail_active(self, exc: Exception) -> None:
        """The requests being served when the loop raised finish with an error naming it;
        queued requests are untouched and the engine keeps going."""
        msg = f"engine failed while serving this request: {type(exc).__name__}: {exc}"
        for r in list(self.scheduler.active):
            self.scheduler.remove(r)
            r.error = msg
            self._finish(r, "error")
        self.batch, self._grown = None, set()

    def _commit(self, done: torch.Tensor) -> None:
        """Append each completed block; a row whose block holds a stop token, or that
        reached its last block, leaves. Once per block, not per step."""
        b, L = self.batch, self.cfg.block_length
        rows_i = torch.nonzero(done & ~b.frozen).flatten().tolist()
        if not rows_i:
            return
        blocks = b.ids.gather(1, b.block_cols())[rows_i]
        rows = [b.rows[i] for i in rows_i]
        stops = sorted({t for r in rows for t in r.stop_ids})
        stop_hit = torch.zeros_like(blocks, dtype=torch.bool)
        if stops:
            table = torch.tensor(stops, device=blocks.device)
            own = torch.tensor([[t in r.stop_ids for t in stops] for r in rows], device=blocks.device)
            stop_hit = ((blocks[:, :, None] == table) & own[:, None, :]).any(-1)
        first_stop = torch.where(stop_hit.any(1), stop_hit.float().argmax(1), -1)
        for i, r, blk, fs in zip(rows_i, rows, blocks.tolist(), first_stop.tolist()):
            r.num_steps += int(b.busy_steps[i])
            r.prompt_forwarded = int(b.prompt_fwd[i])
            n_before = len(r.generated)
            r.generated.extend(blk)
            g = r.params.max_new_tokens
            end = n_before + fs if fs >= 0 else g
            cut = self._stop_string(r, n_before, min(end, g)) if r.params.stop else None
            if cut is not None:
                self._finish(r, "stop", *cut)
            elif fs >= 0 and n_before + fs < g:
                self._finish(r, "stop", n_before + fs)
            elif fs >= 0 or len(r.generated) >= r.num_blocks_needed * L:
                self._finish(r, "length", g)
            else:
                self._grown.add(r)
                continue
            b.frozen[i] = self.scheduler.is_frozen(r)  # a static batch keeps the finished row

    def _stop_string(self, req: Request, n_before: int, n_max: int):
        """(tokens, text) when a stop string appears in the first `n_max` generated
        tokens (it was not in the first `n_before`): the fewest tokens whose text holds
        it, and the text before it; else None. Decided on the detokenized text, as vLLM does."""
        def first(text: str) -> int:
            return min((i for i in (text.find(x) for x in req.params.stop) if i >= 0), default=-1)

        decode = lambda n: self.tokenizer.decode(req.generated[:n], skip_special_tokens=True)  # noqa: E731
        if first(decode(n_max)) < 0:
            return None
        for n in range(n_before + 1, n_max + 1):
            text = decode(n)
            at = first(text)
            if at >= 0:
                return n, text[:at]
        return None

    def _finish(self, req: Request, reason: str, n_tokens: int = 0, text: Optional[str] = None) -> None:
        toks = req.generated[:n_tokens] if reason != "error" else []
        if reason != "error":
            self.scheduler.finish(req)
            self.stats.generated_tokens += len(toks)
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        if text is None and self.tokenizer is not None and reason != "error":
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
        self._finished.append(RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt, token_ids=toks, finish_reason=reason,
            text=text, error=req.error, num_blocks=req.block_index, num_steps=req.num_steps,
            latency_s=time.perf_counter() - req.arrival, prompt_tokens_forwarded=req.prompt_forwarded))
