"""K/V cache modes and step-granular advancement, measured on one CPU.

    python bench/cache_bench.py --out bench/results/cache_cpu.json          # ~6 min
    python bench/cache_bench.py --quick --out /tmp/cache_quick.json         # ~30 s (CI)

Three questions, one JSON (+ a PNG next to it):

1. `caches`: tokens/s of EngineConfig(cache="none" | "refresh" | "persistent") at
   prompt lengths 32, 128 and 512 on a random block-causal LLaDA-layout model
   (hidden 256, 4 layers, vocab 2048), block length L = steps per block S = 8,
   threshold decoding, 64 requests of 2..8 blocks each (stop_token_ids=[] and a
   varied max_new_tokens, so requests leave at known, varied block counts), a token
   budget that admits all of them at once. `none` recomputes every row at every step
   and costs about (prompt + generated) forwarded tokens per generated token, so at
   the long prompts it runs on the first `none_requests` requests only; `refresh`
   and `persistent` run on that subset too, and the refresh/none ratio is taken on
   it (same requests, same batch shape), persistent/refresh on all 64. `refill`
   repeats persistent vs refresh at the longest prompt with a budget of a few rows,
   so that finished rows are refilled from the queue (continuous batching).
2. `advance`: advance="block" vs "step" with cache persistent and refresh, when
   block completion times vary: requests alternate threshold 0.5/V (every position
   clears it, so a block ends in 1 step) and 0.9 (a random model never reaches it,
   so a block takes all S steps); a budget of ~16 rows so that finished rows are
   refilled from the queue. Token outputs must be identical between the two.
3. `agreement`: on bidirectional checkpoints (LLaDA layout, and Dream layout with
   shifted logits, qkv bias and grouped-query attention) the persistent cache is an
   approximation: fraction of generated positions (and of requests) equal to
   cache="none", and refresh vs none for comparison. Random weights emit a few
   dominant tokens, so `chance_agreement` (none's output of request i against
   request i+1's) is recorded as the floor the numbers should be read against.

Random models are nearly uniform: their top-1 probability is ~1/V..10/V, so a
threshold such as 0.9 (or even 0.1) never fires and threshold decoding degenerates
to one token per step. The threshold of `caches` is therefore calibrated per prompt
length: the `threshold_quantile` quantile of the model's first-step top-1 probability
over a fully masked block (recorded, with the mean steps per block it produced).

Timing on a shared 2-core machine: torch runs one thread (two threads oversubscribed
by a neighbour's load ran 10x slower here), every group of runs alternates its order
round by round (ABBA) and the best round counts (another round only while the group
fits in `group_budget_s`); both wall and process-CPU tokens/s are reported, ratios and
expected-ratio checks on both (`met_wall`, `met_cpu`), with each run's cpu_share =
cpu_s / wall_s showing how much of a core it got. Only ratios within one run mean
anything.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model  # noqa: E402
from engine.batch import attention_mask  # noqa: E402

CACHES = ("none", "refresh", "persistent")
EXPECTED = {"persistent_over_refresh": 2.0, "refresh_over_none": 4.0, "step_over_block": 1.2}


# --- settings ---------------------------------------------------------------------
@dataclass
class Settings:
    hidden_size: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    intermediate_size: int = 688
    vocab_size: int = 2048
    dream_kv_heads: int = 2
    block_length: int = 8
    prompt_lengths: Sequence[int] = (32, 128, 512)
    requests: int = 64
    blocks: Sequence[int] = (2, 8)  # each request needs U{lo..hi} blocks (max_new_tokens = blocks * L)
    none_requests: Dict[int, int] = field(default_factory=lambda: {32: 16, 128: 8, 512: 8})
    threshold_quantile: float = 0.75
    # persistent vs refresh under continuous batching (rows refilled from the queue) at the longest prompt
    refill_requests: int = 32
    refill_rows: int = 8  # token budget = refill_rows * widest final row
    # advance=block vs step
    adv_prompt: Sequence[int] = (32, 128)  # prompt lengths U{lo..hi}
    adv_requests: int = 48
    adv_rows: int = 16  # token budget = adv_rows * widest final row
    # agreement on bidirectional models
    agr_prompt: int = 64
    agr_requests: int = 16
    agr_blocks: Sequence[int] = (2, 8)
    # timing
    max_rounds: int = 3
    group_budget_s: float = 45.0  # another round only if the group's rounds so far fit in this

    @classmethod
    def quick(cls) -> "Settings":
        return cls(hidden_size=64, n_layers=2, intermediate_size=172, vocab_size=256, requests=8,
                   blocks=(1, 4), none_requests={32: 4, 128: 4, 512: 4}, refill_requests=8, refill_rows=3,
                   adv_requests=16, adv_rows=4,
                   agr_prompt=32, agr_requests=6, agr_blocks=(1, 4), max_rounds=1)


def model_config(s: Settings, model_type: str = "llada", attention: str = "block_causal") -> ModelConfig:
    V = s.vocab_size
    return ModelConfig(model_type=model_type, dllm_attention=attention, hidden_size=s.hidden_size,
                       n_layers=s.n_layers, n_heads=s.n_heads,
                       n_kv_heads=s.n_kv_heads if model_type == "llada" else s.dream_kv_heads,
                       intermediate_size=s.intermediate_size, vocab_size=V, mask_token_id=V - 1,
                       eos_token_id=1, max_seq_len=2048, qkv_bias=model_type == "Dream")


# --- workloads --------------------------------------------------------------------
def random_prompts(rng: random.Random, n: int, lengths, vocab: int) -> List[List[int]]:
    lo, hi = (lengths, lengths) if isinstance(lengths, int) else lengths
    return [[rng.randrange(2, vocab - 1) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def calibrate_threshold(model, prompt_len: int, L: int, quantile: float, n: int = 8, seed: int = 0) -> float:
    """The `quantile` quantile of the top-1 probability at the first step of a fully
    masked block after random prompts of `prompt_len` tokens (what the engine's first
    denoising step sees)."""
    cfg = model.config
    prompts = random_prompts(random.Random(seed), n, prompt_len, cfg.vocab_size)
    W = prompt_len + L
    ids = torch.tensor([p + [cfg.mask_token_id] * L for p in prompts])
    pos = torch.arange(W)[None].expand(n, W)
    lens, plen = torch.full((n,), W), torch.full((n,), prompt_len)
    mask = attention_mask(lens, plen, W, L, cfg.block_causal)
    shift = int(cfg.shift_logits)
    with torch.inference_mode():
        logits = model(ids, pos, mask, logits_last=L + shift)[:, :L]
    top1 = logits.double().softmax(-1).max(-1).values.flatten()
    return round(float(torch.quantile(top1, quantile)), 5)


# --- one run ----------------------------------------------------------------------
def run_once(model, prompts, params, ecfg: EngineConfig) -> Dict[str, Any]:
    eng = Engine(model, ecfg)
    t0, c0 = time.perf_counter(), time.process_time()
    outs = eng.generate(prompts, params)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    s = eng.stats
    gen = s.generated_tokens
    blocks = sum(o.num_blocks for o in outs)
    m = dict(wall_s=round(wall, 4), cpu_s=round(cpu, 4), tokens_per_s=gen / wall, tokens_per_cpu_s=gen / cpu,
             generated_tokens=gen, requests=len(prompts), cycles=s.cycles, steps=s.steps, forwards=s.forwards,
             cpu_share=round(cpu / wall, 3), forward_s=round(s.forward_s, 4), busy_s=round(s.busy_s, 4),
             forward_tokens=s.forward_tokens, computed_cells=s.computed_cells, padded_cells=s.padded_cells,
             padding_fraction=round(s.padding_fraction, 4),
             forward_tokens_per_token=round(s.forward_tokens / gen, 3),
             computed_cells_per_token=round(s.computed_cells / gen, 3),
             cells_per_forward_s=round(s.computed_cells / s.forward_s, 1) if s.forward_s else None,
             host_fraction=round(1 - s.forward_s / s.busy_s, 4) if s.busy_s else None,
             mean_busy_steps_per_block=round(sum(o.num_steps for o in outs) / blocks, 3) if blocks else None,
             finished=dict(s.finished), **s.memory_figures())
    sig = [(o.token_ids, o.finish_reason, o.num_blocks, o.num_steps) for o in outs]
    return {"metrics": m, "outputs": sig}


def run_group(runs: Dict[str, tuple], st: Settings, log) -> Dict[str, Dict[str, Any]]:
    """Run every entry (model, prompts, params, EngineConfig) round-robin, alternating
    the order each round; keep the best wall and best CPU time of each. Another round
    only while the group's rounds so far fit in `group_budget_s`."""
    names = list(runs)
    best: Dict[str, Dict[str, Any]] = {}
    walls: Dict[str, List[float]] = {n: [] for n in names}
    deterministic: Dict[str, bool] = {n: True for n in names}
    t_group = time.perf_counter()
    for rnd in range(st.max_rounds):
        t_round = time.perf_counter()
        for name in (names if rnd % 2 == 0 else names[::-1]):
            model, prompts, params, ecfg = runs[name]
            r = run_once(model, prompts, params, ecfg)
            m = r["metrics"]
            walls[name].append(m["wall_s"])
            log(f"  {name:<34} round {rnd}: {m['tokens_per_s']:8.1f} tok/s wall, {m['tokens_per_cpu_s']:8.1f} "
                f"tok/s cpu, {m['wall_s']:6.1f}s, fwd tok/token {m['forward_tokens_per_token']:.1f}, "
                f"pad {m['padding_fraction']:.2f}")
            if name not in best:
                best[name] = r
            else:
                deterministic[name] &= r["outputs"] == best[name]["outputs"]
                b = best[name]["metrics"]
                b["wall_s"] = min(b["wall_s"], m["wall_s"])
                b["tokens_per_s"] = max(b["tokens_per_s"], m["tokens_per_s"])
                b["cpu_s"] = min(b["cpu_s"], m["cpu_s"])
                b["cpu_share"] = max(b["cpu_share"], m["cpu_share"])
                b["tokens_per_cpu_s"] = max(b["tokens_per_cpu_s"], m["tokens_per_cpu_s"])
                b["forward_s"] = min(b["forward_s"], m["forward_s"])
        elapsed, last = time.perf_counter() - t_group, time.perf_counter() - t_round
        if elapsed + last > st.group_budget_s:
            break
    for n in names:
        best[n]["metrics"]["wall_s_all_rounds"] = walls[n]
        best[n]["metrics"]["rounds"] = len(walls[n])
        best[n]["metrics"]["outputs_identical_across_rounds"] = deterministic[n]
        for k in ("tokens_per_s", "tokens_per_cpu_s"):
            best[n]["metrics"][k] = round(best[n]["metrics"][k], 3)
    return best


def ratio(a: Dict[str, Any], b: Dict[str, Any]) -> Dict[str, float]:
    """a over b: throughput (wall and CPU) and the stats that explain it."""
    return {"tokens_per_s": round(a["tokens_per_s"] / b["tokens_per_s"], 3),
            "tokens_per_cpu_s": round(a["tokens_per_cpu_s"] / b["tokens_per_cpu_s"], 3),
            "forward_tokens_per_token_inverse": round(b["forward_tokens_per_token"] / a["forward_tokens_per_token"], 3),
            "computed_cells_per_token_inverse": round(b["computed_cells_per_token"] / a["computed_cells_per_token"], 3),
            "steps_inverse": round(b["steps"] / a["steps"], 3) if a["steps"] else None,
            "cells_per_forward_s": round(a["cells_per_forward_s"] / b["cells_per_forward_s"], 3)
            if a["cells_per_forward_s"] and b["cells_per_forward_s"] else None}


def agreement(a: List[tuple], b: List[tuple], first_block: Optional[int] = None) -> Dict[str, Any]:
    """Fraction of generated positions where a and b hold the same token (positions one
    has and the other lacks count as different), and of requests exactly equal; with
    `first_block` (= L) also the positional agreement of the first generated block
    alone, before any difference can feed back through committed tokens."""
    same = total = exact = same1 = total1 = 0
    for (ta, *_), (tb, *_) in zip(a, b):
        total += max(len(ta), len(tb))
        same += sum(x == y for x, y in zip(ta, tb))
        exact += ta == tb
        if first_block:
            total1 += min(first_block, max(len(ta), len(tb)))
            same1 += sum(x == y for x, y in zip(ta[:first_block], tb[:first_block]))
    out = {"positions": round(same / total, 4) if total else None, "requests": round(exact / len(a), 4),
           "n_positions": total, "n_requests": len(a)}
    if first_block:
        out["first_block_positions"] = round(same1 / total1, 4) if total1 else None
    return out


# --- the three sections -----------------------------------------------------------
def bench_caches(st: Settings, model, log) -> Dict[str, Any]:
    L = st.block_length
    out: Dict[str, Any] = {"per_prompt": {}}
    for P in st.prompt_lengths:
        thr = calibrate_threshold(model, P, L, st.threshold_quantile)
        rng = random.Random(1000 + P)
        prompts = random_prompts(rng, st.requests, P, st.vocab_size)
        params = [SamplingParams(max_new_tokens=L * rng.randint(*st.blocks), policy="threshold", threshold=thr,
                                 stop_token_ids=[]) for _ in prompts]
        n_sub = min(st.none_requests.get(P, st.requests), st.requests)
        budget = st.requests * (P + st.blocks[1] * L)  # every request fits at once
        ecfg = {c: EngineConfig(block_length=L, steps_per_block=L, cache=c, token_budget=budget) for c in CACHES}
        log(f"caches: prompt {P}, threshold {thr}, {st.requests} requests (none on {n_sub}), budget {budget}")
        runs = {f"{c}/all": (model, prompts, params, ecfg[c]) for c in ("refresh", "persistent")}
        runs.update({f"{c}/subset": (model, prompts[:n_sub], params[:n_sub], ecfg[c]) for c in CACHES})
        if n_sub == st.requests:  # the subset is the whole workload: no need to run it twice
            runs = {k: v for k, v in runs.items() if k != "refresh/subset" and k != "persistent/subset"}
        res = run_group(runs, st, log)
        if n_sub == st.requests:
            res["refresh/subset"], res["persistent/subset"] = res["refresh/all"], res["persistent/all"]
        M = {k: v["metrics"] for k, v in res.items()}
        out["per_prompt"][str(P)] = {
            "prompt_len": P, "threshold": thr, "requests": st.requests, "none_requests": n_sub,
            "token_budget": budget, "max_new_tokens": [p.max_new_tokens for p in params],
            "runs": M,
            "ratios": {"persistent_over_refresh": ratio(M["persistent/all"], M["refresh/all"]),
                       "persistent_over_refresh_subset": ratio(M["persistent/subset"], M["refresh/subset"]),
                       "refresh_over_none": ratio(M["refresh/subset"], M["none/subset"]),
                       "persistent_over_none": ratio(M["persistent/subset"], M["none/subset"])},
            # block-causal: the caches must not change tokens (float32 may flip near-ties)
            "exactness_vs_none": {c: agreement(res[f"{c}/subset"]["outputs"], res["none/subset"]["outputs"])
                                  for c in ("refresh", "persistent")},
        }
    # the same comparison when the budget holds only a few rows and finished rows are
    # refilled from the queue: every admission is a prompt prefill inside the batch
    P = max(st.prompt_lengths)
    thr = out["per_prompt"][str(P)]["threshold"]
    rng = random.Random(2000 + P)
    prompts = random_prompts(rng, st.refill_requests, P, st.vocab_size)
    params = [SamplingParams(max_new_tokens=L * rng.randint(*st.blocks), policy="threshold", threshold=thr,
                             stop_token_ids=[]) for _ in prompts]
    budget = st.refill_rows * (P + st.blocks[1] * L)
    log(f"caches with refill: prompt {P}, {len(prompts)} requests, budget {budget} ({st.refill_rows} rows)")
    res = run_group({c: (model, prompts, params, EngineConfig(block_length=L, steps_per_block=L, cache=c,
                                                              token_budget=budget)) for c in ("refresh", "persistent")},
                    st, log)
    M = {k: v["metrics"] for k, v in res.items()}
    out["refill"] = {"prompt_len": P, "threshold": thr, "requests": len(prompts), "token_budget": budget,
                     "runs": M, "ratios": {"persistent_over_refresh": ratio(M["persistent"], M["refresh"])},
                     "outputs_identical": res["persistent"]["outputs"] == res["refresh"]["outputs"]}

    r = out["per_prompt"][str(P)]["ratios"]
    h = out["headline"] = {
        "prompt_len": P,
        "persistent_over_refresh": r["persistent_over_refresh"]["tokens_per_s"],
        "persistent_over_refresh_cpu": r["persistent_over_refresh"]["tokens_per_cpu_s"],
        "refresh_over_none": r["refresh_over_none"]["tokens_per_s"],
        "refresh_over_none_cpu": r["refresh_over_none"]["tokens_per_cpu_s"],
        "persistent_over_refresh_with_refill": out["refill"]["ratios"]["persistent_over_refresh"]["tokens_per_s"],
        "persistent_over_refresh_with_refill_cpu":
            out["refill"]["ratios"]["persistent_over_refresh"]["tokens_per_cpu_s"],
        "expected": {k: EXPECTED[k] for k in ("persistent_over_refresh", "refresh_over_none")},
    }
    keys = ("persistent_over_refresh", "refresh_over_none", "persistent_over_refresh_with_refill")
    h["met_wall"] = {k: h[k] >= EXPECTED[k.replace("_with_refill", "")] for k in keys}
    h["met_cpu"] = {k: h[k + "_cpu"] >= EXPECTED[k.replace("_with_refill", "")] for k in keys}
    h["cpu_share"] = {k: out["per_prompt"][str(P)]["runs"][k]["cpu_share"]
                      for k in ("refresh/all", "persistent/all", "none/subset", "refresh/subset")}
    return out


def bench_advance(st: Settings, model, log) -> Dict[str, Any]:
    L, V = st.block_length, st.vocab_size
    rng = random.Random(7)
    prompts = random_prompts(rng, st.adv_requests, tuple(st.adv_prompt), V)
    fast, slow = 0.5 / V, 0.9  # top-1 probability is >= 1/V: `fast` unmasks a whole block in one step
    params = [SamplingParams(max_new_tokens=L * rng.randint(*st.blocks), policy="threshold",
                             threshold=(fast, slow)[i % 2], stop_token_ids=[]) for i in range(len(prompts))]
    budget = st.adv_rows * (max(st.adv_prompt) + st.blocks[1] * L)
    log(f"advance: {len(prompts)} requests, thresholds {fast:.2e}/{slow} alternating, budget {budget}")
    runs = {f"{c}/{a}": (model, prompts, params, EngineConfig(block_length=L, steps_per_block=L, cache=c,
                                                               token_budget=budget, advance=a))
            for c in ("persistent", "refresh") for a in ("block", "step")}
    res = run_group(runs, st, log)
    M = {k: v["metrics"] for k, v in res.items()}
    out: Dict[str, Any] = {"requests": len(prompts), "prompt_lengths": list(st.adv_prompt), "token_budget": budget,
                           "thresholds": {"fast": fast, "slow": slow}, "runs": M, "ratios": {},
                           "outputs_identical": {}}
    for c in ("persistent", "refresh"):
        out["ratios"][f"{c}_step_over_block"] = ratio(M[f"{c}/step"], M[f"{c}/block"])
        out["outputs_identical"][c] = res[f"{c}/step"]["outputs"] == res[f"{c}/block"]["outputs"]
    out["expected"] = {"step_over_block": EXPECTED["step_over_block"]}
    for kind, key in (("met_wall", "tokens_per_s"), ("met_cpu", "tokens_per_cpu_s")):
        out[kind] = {c: out["ratios"][f"{c}_step_over_block"][key] >= EXPECTED["step_over_block"]
                     for c in ("persistent", "refresh")}
    return out


def bench_agreement(st: Settings, log) -> Dict[str, Any]:
    L = st.block_length
    out: Dict[str, Any] = {}
    for name, mt in (("llada-bidirectional", "llada"), ("Dream-bidirectional", "Dream")):
        cfg = model_config(st, mt, "bidirectional")
        model = build_model(cfg, dtype=torch.float32, seed=0)
        thr = calibrate_threshold(model, st.agr_prompt, L, st.threshold_quantile)
        rng = random.Random(11)
        prompts = random_prompts(rng, st.agr_requests, st.agr_prompt, st.vocab_size)
        params = [SamplingParams(max_new_tokens=L * rng.randint(*st.agr_blocks), policy="threshold", threshold=thr,
                                 stop_token_ids=[]) for _ in prompts]
        budget = len(prompts) * (st.agr_prompt + st.agr_blocks[1] * L)
        log(f"agreement: {name}, threshold {thr}, {len(prompts)} requests")
        res = {}
        for c in CACHES:
            res[c] = run_once(model, prompts, params, EngineConfig(block_length=L, steps_per_block=L, cache=c,
                                                                   token_budget=budget))
            log(f"  {c:<12} {res[c]['metrics']['tokens_per_s']:8.1f} tok/s")
        ref = res["none"]["outputs"]
        out[name] = {"model": asdict(cfg), "threshold": thr, "requests": len(prompts), "prompt_len": st.agr_prompt,
                     "persistent_vs_none": agreement(res["persistent"]["outputs"], ref, L),
                     "refresh_vs_none": agreement(res["refresh"]["outputs"], ref, L),
                     "chance_agreement": agreement(ref, ref[1:] + ref[:1], L),
                     "tokens_per_s": {c: round(res[c]["metrics"]["tokens_per_s"], 2) for c in CACHES}}
    return out


def explain(result: Dict[str, Any]) -> List[str]:
    """The engine stats behind the ratios, in words (numbers from this run)."""
    notes = []
    c = result["caches"]
    for P, v in c["per_prompt"].items():
        R, M = v["ratios"], v["runs"]
        pr, rn = R["persistent_over_refresh"], R["refresh_over_none"]
        notes.append(
            f"prompt {P}: persistent/refresh {pr['tokens_per_s']}x wall "
            f"({pr['tokens_per_cpu_s']}x CPU): forwarded tokens per generated token "
            f"{M['refresh/all']['forward_tokens_per_token']} -> {M['persistent/all']['forward_tokens_per_token']} "
            f"({pr['forward_tokens_per_token_inverse']}x fewer; refresh re-forwards the "
            f"prompt at every block), cells per forward-second {pr['cells_per_forward_s']}x. "
            f"refresh/none {rn['tokens_per_s']}x wall ({rn['tokens_per_cpu_s']}x "
            f"CPU) on {v['none_requests']} requests: {M['none/subset']['forward_tokens_per_token']} -> "
            f"{M['refresh/subset']['forward_tokens_per_token']} forwarded tokens per token "
            f"({rn['forward_tokens_per_token_inverse']}x; none re-forwards every row at each of the "
            f"{M['none/subset']['steps'] / max(M['none/subset']['cycles'], 1):.2f} steps of a cycle), but refresh "
            f"computes {rn['cells_per_forward_s']}x none's cells per forward-second: its "
            f"block-only steps are small matmuls (rows x L columns) with attention over the whole row.")
    rf = c["refill"]
    notes.append(
        f"with refill (budget {rf['token_budget']}, prompt {rf['prompt_len']}): persistent/refresh "
        f"{rf['ratios']['persistent_over_refresh']['tokens_per_s']}x wall "
        f"({rf['ratios']['persistent_over_refresh']['tokens_per_cpu_s']}x CPU): persistent forwards "
        f"{rf['runs']['persistent']['forward_tokens_per_token']} real tokens per token but computes "
        f"{rf['runs']['persistent']['computed_cells_per_token']} cells (padding "
        f"{rf['runs']['persistent']['padding_fraction']}): what remains is what the catch-up sub-batches "
        f"(engine.runner.catch_up_groups) pad, and the admitted rows' block computed twice.")
    a = result["advance"]
    for cm in ("persistent", "refresh"):
        r, b, s_ = a["ratios"][f"{cm}_step_over_block"], a["runs"][f"{cm}/block"], a["runs"][f"{cm}/step"]
        notes.append(
            f"advance {cm}: step/block {r['tokens_per_s']}x wall ({r['tokens_per_cpu_s']}x CPU): step needs "
            f"{r['steps_inverse']}x fewer steps ({b['steps']} -> {s_['steps']}) and "
            f"{r['forward_tokens_per_token_inverse']}x "
            f"fewer real forwarded tokens, but computes {s_['computed_cells_per_token']} cells per token vs "
            f"{b['computed_cells_per_token']} (padding {b['padding_fraction']} -> {s_['padding_fraction']}) and its "
            f"host "
            f"share (re-layout every step) is {s_['host_fraction']} vs {b['host_fraction']}; outputs identical: "
            f"{a['outputs_identical'][cm]}.")
    notes.append("agreement numbers come from random weights whose outputs are dominated by a few tokens; "
                 "compare them with chance_agreement, not with 1.0, and do not read them as a trained model's.")
    return notes


# --- main -------------------------------------------------------------------------
def machine_info() -> Dict[str, Any]:
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "machine": platform.machine(),
            "processor": platform.processor(), "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def plot(result: Dict[str, Any], path: str) -> Optional[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    per = result["caches"]["per_prompt"]
    Ps = list(per)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    w = 0.27
    for i, c in enumerate(CACHES):
        key = f"{c}/subset" if c == "none" else f"{c}/all"
        ax.bar([j + (i - 1) * w for j in range(len(Ps))], [per[P]["runs"][key]["tokens_per_s"] for P in Ps], w,
               label=c if c != "none" else "none (subset)")
    ax.set_xticks(range(len(Ps)), [f"prompt {P}" for P in Ps])
    ax.set_yscale("log")
    ax.set_ylabel("generated tokens / s (wall, best round)")
    ax.set_title("cache mode (advance=block)")
    ax.legend()
    adv = result["advance"]["runs"]
    names = list(adv)
    ax2.bar(range(len(names)), [adv[n]["tokens_per_s"] for n in names], color=["C2", "C3", "C1", "C4"])
    ax2.set_xticks(range(len(names)), names, rotation=15)
    ax2.set_ylabel("generated tokens / s")
    ax2.set_title("advance block vs step (mixed 1-step / S-step blocks)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


MEMORY_KEYS = ("peak_kv_over_budget", "kv_bytes_copied_per_token", "host_ms_per_step", "syncs_per_step")


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model and workload, for CI (~30 s)")
    ap.add_argument("--out", default="bench/results/cache_cpu.json")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1: see the module docstring)")
    ap.add_argument("--rounds", type=int, default=None, help="max rounds per group (default 3, quick 1)")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    st = Settings.quick() if args.quick else Settings()
    if args.rounds:
        st.max_rounds = args.rounds

    def log(msg: str) -> None:
        print(msg, flush=True)

    t0 = time.perf_counter()
    model_cfg = model_config(st)
    model = build_model(model_cfg, dtype=torch.float32, seed=0)
    result: Dict[str, Any] = {
        "benchmark": "cache_bench", "quick": args.quick,
        "command": shlex.join(["python", "bench/cache_bench.py"] + list(argv if argv is not None else sys.argv[1:])),
        "machine": machine_info(),
        "settings": {k: (dict(v) if isinstance(v, dict) else list(v) if isinstance(v, tuple) else v)
                     for k, v in asdict(st).items()},
        "model": {**asdict(model_cfg), "dtype": "float32", "seed": 0, "num_params": model_cfg.num_params()},
        "engine": {"block_length": st.block_length, "steps_per_block": st.block_length, "policy": "threshold",
                   "scheduler": "blockserve"},
    }
    result["caches"] = bench_caches(st, model, log)
    result["advance"] = bench_advance(st, model, log)
    result["agreement"] = bench_agreement(st, log)
    result["total_wall_s"] = round(time.perf_counter() - t0, 1)
    adv = result["advance"]
    result["summary"] = {"headline": result["caches"]["headline"],
                         "step_over_block": {c: adv["ratios"][f"{c}_step_over_block"]["tokens_per_s"]
                                             for c in ("persistent", "refresh")},
                         "step_over_block_cpu": {c: adv["ratios"][f"{c}_step_over_block"]["tokens_per_cpu_s"]
                                                 for c in ("persistent", "refresh")},
                         "step_over_block_met_wall": adv["met_wall"], "step_over_block_met_cpu": adv["met_cpu"],
                         "block_step_outputs_identical": result["advance"]["outputs_identical"],
                         "agreement_persistent_vs_none": {k: v["persistent_vs_none"]
                                                          for k, v in result["agreement"].items()},
                         "agreement_refresh_vs_none": {k: v["refresh_vs_none"] for k, v in result["agreement"].items()},
                         "memory": {f"advance/{label}": {k: run.get(k) for k in MEMORY_KEYS}
                                    for label, run in adv["runs"].items()}}
    result["summary"]["met_basis"] = ("met_cpu compares process-CPU tokens/s, met_wall wall-clock tokens/s; on a "
                                      "machine shared with other jobs the wall clock also measures their load "
                                      "(see cpu_share = cpu_s / wall_s of each run)")
    result["notes"] = explain(result)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if not args.no_plot:
        result["plot"] = plot(result, os.path.splitext(args.out)[0] + ".png")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    log(json.dumps(result["summary"], indent=1))
    log(f"wrote {args.out} in {result['total_wall_s']} s")
    return result


if __name__ == "__main__":
    main()
