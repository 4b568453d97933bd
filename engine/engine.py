"""The BlockServe engine: requests in, block cycles over a mixed-state batch, outputs
out. One `step()` is one block cycle for every active request, whatever its block
index: rows are left-padded to the batch's bounding box so that every current block
is the last L columns, and S denoising steps run one forward each for the whole
batch."""
from __future__ import annotations

import itertools
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from .config import EngineConfig, SamplingParams
from .decoding import RowParams, propose, select
from .models import DLLM, KVCache
from .scheduler import batch_cost, make_scheduler
from .sequence import Request, RequestOutput

Prompt = Union[str, Sequence[int]]


@dataclass
class EngineStats:
    """Counters since the engine started; `active`, `pending`, `budget_used` describe the last cycle."""

    cycles: int = 0
    steps: int = 0
    forwards: int = 0
    generated_tokens: int = 0
    forward_tokens: int = 0  # query columns forwarded
    padded_cells: int = 0  # pad query columns forwarded
    computed_cells: int = 0
    forward_s: float = 0.0
    busy_s: float = 0.0
    active: int = 0
    pending: int = 0
    budget_used: int = 0
    token_budget: int = 0
    finished: Dict[str, int] = field(default_factory=dict)

    @property
    def padding_fraction(self) -> float:
        return self.padded_cells / self.computed_cells if self.computed_cells else 0.0


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
        self.batch_log: Optional[List[BatchRecord]] = [] if record_batches else None
        self._intake: List[Request] = []
        self._finished: List[RequestOutput] = []
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._in_flight = 0

    # --- requests -----------------------------------------------------------------
    def add_request(self, prompt: Prompt, params: SamplingParams = SamplingParams(),
                    request_id: Any = None) -> Any:
        """Queue one request (thread-safe). A bad request is not raised: it comes back
        from the next step() with finish_reason "error" and a message naming the problem."""
        if request_id is None:
            request_id = next(self._ids)
        ids, error = self._tokenize(prompt)
        stop = list(params.stop_token_ids) if params.stop_token_ids is not None else self.mcfg.stop_token_ids
        req = Request(request_id, ids or [], params, self.cfg.block_length, stop)
        req.error = error or self._validate(req)
        if params.temperature and params.temperature > 0:
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
        """One block cycle; returns the requests that finished (including bad ones)."""
        t0 = time.perf_counter()
        with self._lock:
            intake, self._intake = self._intake, []
        for req in intake:
            if req.error:
                self._finish(req, "error")
            else:
                self.scheduler.add(req)
        rows = self.scheduler.schedule()
        if rows:
            self._run_cycle(rows)
        self.stats.active = len(rows)
        self.stats.pending = self.scheduler.num_pending()
        self.stats.busy_s += time.perf_counter() - t0
        out, self._finished = self._finished, []
        with self._lock:
            self._in_flight -= len(out)
        return out

    def _run_cycle(self, rows: List[Request]) -> None:
        L, S, dev = self.cfg.block_length, self.cfg.steps_per_block, self.device
        mask_id, shift = self.mcfg.mask_token_id, int(self.mcfg.shift_logits)
        frozen = [self.scheduler.is_frozen(r) for r in rows]
        B, W = len(rows), max(r.width for r in rows)
        self.stats.cycles += 1
        self.stats.budget_used = batch_cost(rows)
        if self.batch_log is not None:
            self.batch_log.append(BatchRecord([r.request_id for r in rows], W, batch_cost(rows)))

        ids = torch.full((B, W), self.mcfg.pad_token_id, dtype=torch.long)
        valid = torch.zeros((B, W), dtype=torch.bool)
        for i, r in enumerate(rows):
            block = [self.mcfg.pad_token_id] * L if frozen[i] else [mask_id] * L
            row = r.prompt + r.generated + block
            ids[i, W - len(row):] = torch.tensor(row)
            valid[i, W - len(row):] = True
        ids, valid = ids.to(dev), valid.to(dev)
        pos = (valid.long().cumsum(1) - 1).clamp(min=0)
        mask = self._attention_mask(valid, pos, torch.tensor([r.prompt_len for r in rows], device=dev))
        rp = RowParams.build([r.params for r in rows], [getattr(r, "noise_seed", None) for r in rows], dev)
        q = L + shift  # query columns of a block-only step (Dream reads block logits one column early)
        n_pad = int((~valid).sum())
        cache = None
        step_idx = torch.zeros(B, dtype=torch.long, device=dev)
        steps_taken = torch.zeros(B, dtype=torch.long, device=dev)
        for s in range(S):
            is_mask = ids[:, W - L:] == mask_id
            busy = is_mask.any(1)
            if not bool(busy.any()):
                break
            t0 = time.perf_counter()
            with torch.inference_mode():
                if self.cfg.cache == "none" or s == 0:
                    if self.cfg.cache != "none":
                        cache = KVCache.empty(self.mcfg, B, W, self.model.dtype, dev)
                    logits = self.model(ids, pos, mask, cache, 0, logits_last=q)
                    self._count_forward(B * W, n_pad)
                else:
                    logits = self.model(ids[:, -q:], pos[:, -q:], mask[:, :, -q:] if mask.shape[2] > 1 else mask,
                                        cache, W - q, logits_last=q)
                    self._count_forward(B * q, 0)
                logits = logits[:, :L]
                if dev.type == "cuda":
                    torch.cuda.synchronize()
            self.stats.forward_s += time.perf_counter() - t0
            keys = [None if seed is None else hash((seed, len(r.generated), s)) & (2**62 - 1)
                    for seed, r in zip(rp.seeds, rows)]
            x0, conf = propose(logits, rp, keys)
            sel = select(conf, is_mask, step_idx, rp, L, S)
            ids[:, W - L:] = torch.where(sel, x0, ids[:, W - L:])
            steps_taken += busy.long()
            step_idx += 1
            self.stats.steps += 1
        self._commit(rows, frozen, ids[:, W - L:], steps_taken)

    def _attention_mask(self, valid: torch.Tensor, pos: torch.Tensor, prompt_len: torch.Tensor) -> torch.Tensor:
        """Pad keys are never attended. Block-causal models: the prompt attends to the
        prompt, block j to the prompt, earlier blocks and itself."""
        if not self.mcfg.block_causal:
            return valid[:, None, None, :]
        seg = torch.where(pos < prompt_len[:, None], 0,
                          (pos - prompt_len[:, None]) // self.cfg.block_length + 1)
        return (valid[:, None, :] & (seg[:, None, :] <= seg[:, :, None]))[:, None]

    def _count_forward(self, cells: int, padded: int) -> None:
        self.stats.forwards += 1
        self.stats.computed_cells += cells
        self.stats.padded_cells += padded
        self.stats.forward_tokens += cells

    def _commit(self, rows: List[Request], frozen: List[bool], blocks: torch.Tensor, steps_taken: torch.Tensor) -> None:
        """Append each row's block; evict rows whose block holds a stop token or that
        reached their last block. Runs once per cycle, not per step."""
        L = self.cfg.block_length
        stop_hit = torch.zeros_like(blocks, dtype=torch.bool)
        stops = sorted({t for r in rows for t in r.stop_ids})
        if stops:
            table = torch.tensor(stops, device=blocks.device)
            stop_hit = torch.isin(blocks, table)
            if any(set(r.stop_ids) != set(stops) for r in rows):  # rows with their own stop sets
                own = torch.zeros((len(rows), len(stops)), dtype=torch.bool)
                for i, r in enumerate(rows):
                    own[i] = torch.tensor([t in r.stop_ids for t in stops])
                per = (blocks[:, :, None] == table[None, None, :]) & own.to(blocks.device)[:, None, :]
                stop_hit = per.any(-1)
        first_stop = torch.where(stop_hit.any(1), stop_hit.float().argmax(1), torch.full_like(blocks[:, 0], -1))
        for r, fz, blk, fs, st in zip(rows, frozen, blocks.tolist(), first_stop.tolist(), steps_taken.tolist()):
            if fz:
                continue
            r.num_steps += st
            n_before = len(r.generated)
            r.generated.extend(blk)
            g = r.params.max_new_tokens
            if fs >= 0 and n_before + fs < g:
                self._finish(r, "stop", n_before + fs)
            elif fs >= 0 or len(r.generated) >= r.num_blocks_needed * L:
                self._finish(r, "length", min(g, n_before + fs if fs >= 0 else g))

    def _finish(self, req: Request, reason: str, n_tokens: int = 0) -> None:
        toks = req.generated[:n_tokens] if reason != "error" else []
        if reason != "error":
            self.scheduler.finish(req)
            self.stats.generated_tokens += len(toks)
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        text = None
        if self.tokenizer is not None and reason != "error":
            text = self.tokenizer.decode(toks, skip_special_tokens=True)
        self._finished.append(RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt, token_ids=toks, finish_reason=reason,
            text=text, error=req.error, num_blocks=req.block_index, num_steps=req.num_steps,
            latency_s=time.perf_counter() - req.arrival))
