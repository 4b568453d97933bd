"""A Fast-dLLM-style batch-size-1 dual-cache decoding loop: the peer the engine's batching
is measured against (issue 28, acceptance 1).

What it reimplements (NVlabs/Fast-dLLM, llada/generate.py `generate_with_dual_cache`,
threshold rule of `get_transfer_index`): one request at a time, the full canvas (prompt
and every masked block); at each block's first step one forward over the whole row
that fills the K/V cache, then forwards of the block's L columns only, attending to the
cached prefix and suffix and overwriting the block's own K/V; a step commits every
masked position whose float64 softmax probability of its argmax is >= threshold, and
at least the most confident one. Like the engine, it stops after the block that holds
a stop token. No scheduler, no batch bookkeeping, no slots: the loop a user of the
published code runs, on the engine's own model object (so the planted-stop wrapper and
the FLOP meter work the same), which makes its tokens comparable one for one."""
from __future__ import annotations

import time
from typing import List, Sequence, Tuple

import torch
import torch.nn.functional as F

from engine import SamplingParams
from engine.models import KVCache


def generate_dual_bs1(model, prompt: Sequence[int], params: SamplingParams, block_length: int
                      ) -> Tuple[List[int], int]:
    """(generated tokens cut at the first stop token, forwards) for one request."""
    cfg, dev, L = model.config, model.device, block_length
    stop = set(params.stop_token_ids if params.stop_token_ids is not None else cfg.stop_token_ids)
    p, K = len(prompt), -(-params.max_new_tokens // L)
    W = p + K * L
    x = torch.tensor([list(prompt) + [cfg.mask_token_id] * (K * L)], device=dev)
    pos = torch.arange(W, device=dev)[None]
    mask = torch.ones(1, 1, 1, W, dtype=torch.bool, device=dev)
    cache = KVCache.empty(cfg, 1, W, model.dtype, dev)
    at = torch.arange(L, device=dev)[None]
    forwards = 0
    with torch.inference_mode():
        for k in range(K):
            s = p + k * L
            first = True
            while bool((x[0, s:s + L] == cfg.mask_token_id).any()):
                if first:  # the whole row: fills the prefix and suffix K/V (the dual cache)
                    logits = model(x, pos, mask, cache, 0, logits_at=at + s)
                else:  # the block's L columns against the cached rest
                    logits = model(x[:, s:s + L], pos[:, s:s + L], mask, cache, s, logits_at=at)
                first, forwards = False, forwards + 1
                blk = x[0, s:s + L]
                is_mask = blk == cfg.mask_token_id
                prob = F.softmax(logits[0].to(torch.float64), dim=-1)
                conf, x0 = prob.max(-1)
                conf = torch.where(is_mask, conf, -torch.inf)
                take = (conf >= params.threshold) & is_mask
                take[int(conf.argmax())] = True
                x[0, s:s + L] = torch.where(take, x0, blk)
            if stop & set(x[0, s:s + L].tolist()):
                break
    gen = x[0, p:].tolist()
    cut = next((i for i, t in enumerate(gen) if t in stop), params.max_new_tokens)
    return gen[:min(cut, params.max_new_tokens)], forwards


def run_peer(w, label: str = "fastdllm-bs1-dual"):
    """Every request of workload `w` one after the other, measured as bench.runner.run
    measures an engine run (same clocks, same result record; engine-only counters 0)."""
    from .runner import RunResult, _quantile

    c0, t0 = time.process_time(), time.perf_counter()
    outs, lat, forwards = [], [], 0
    for prompt, sp in zip(w.prompts, w.params):
        toks, n = generate_dual_bs1(w.model, prompt, sp, w.block_length)
        outs.append(toks)
        forwards += n
        lat.append(time.perf_counter() - t0)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(map(len, outs))
    return RunResult(
        label=label, scheduler="fastdllm-bs1", cache="dual", advance="block", canvas="full", token_budget=0,
        max_batch_size=1, requests=len(outs), tokens=tokens, wall_s=wall, tokens_per_s=tokens / wall,
        requests_per_s=len(outs) / wall, cpu_s=cpu, tokens_per_cpu_s=tokens / cpu if cpu else 0.0,
        forward_s=wall, forward_fraction=1.0, host_overhead=0.0, padding_fraction=0.0, computed_cells=0,
        padded_cells=0, idle_row_fraction=None, latency_p50_s=_quantile(lat, 0.5), latency_p99_s=_quantile(lat, 0.99),
        latency_mean_s=sum(lat) / max(1, len(lat)), cycles=0, forwards=forwards, steps=forwards, mean_rows=1.0,
        max_rows=1, peak_cost=0, mean_budget_use=None, tokens_per_step=tokens / forwards if forwards else 0.0,
        preemptions=0, finished={}, latencies_s=lat, output_digests=[hash(tuple(t)) for t in outs])
