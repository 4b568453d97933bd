"""Prefix caching (issue 40) on the CPU: an 8-shot GSM8K-shaped workload on a tiny
LLaDA2-layout model, with and without EngineConfig.enable_prefix_caching, and with two
engines, the prefix hit rate when batches are routed by prefix affinity
(actors/prefix_affinity.py) against routing them as a pool does (to whichever engine is
free: alternately).

    python bench/prefix_bench.py --out bench/results/prefix_cpu.json     # ~15 min on a quiet core
    python bench/prefix_bench.py --full-width --out bench/results/prefix_cpu.json   # then ~30 min more
    python bench/prefix_bench.py --deep --out bench/results/prefix_cpu.json         # then ~55 min more
    python bench/prefix_bench.py --unshared --out bench/results/prefix_cpu.json     # then ~4 min more
    python bench/prefix_bench.py --dual --canvas --out bench/results/prefix_cpu.json  # then ~8 min more
    python bench/prefix_bench.py --smoke --no-wide --out /tmp/prefix.json   # ~40 s (a local Ray)

Model: inclusionAI/LLaDA2.0-mini's published config.json (../shared/checkpoints), shrunk
(hidden 64, 2 layers, 16 experts), random weights, float32, one thread. Workload: a
shared preamble of ~900 tokens (8 worked examples), a 60-120-token question per row,
256 new tokens, block_length 32, LLaDA2's threshold policy (0.95, with its schedule floor
over steps_per_block=8: at least 4 tokens per step, about what LLaDA2-mini commits per
forward). Every figure is a ratio within this run, in CPU seconds (time.thread_time of
the one thread that runs the engine: less moved by other processes' load than wall time),
ROUNDS off/on pairs per setting in alternating order, the median of the per-round ratios;
the tokens of both runs are checked equal.

`single`: tokens per CPU-second with vs without the cache, under the engine's default
cache mode (refresh: a block's first step recomputes the row; with the cache its prompt
blocks come from the cache instead) and under persistent (the prompt is computed once
per row; the cache saves the shared preamble of every row after the first); and the same
at steps_per_block=2 (at least 16 tokens per step: a decoding-light workload, where the
prompt's share of the work is larger).

`*_wide`: the same settings at half LLaDA2.0-mini's width (WIDE: hidden 1024, 8 heads of
128, its expert sizes halved, 8 of 16 experts per token): at hidden 64 attention is ~3/4 of
a ~1k-token row's FLOPs, in LLaDA2.0-mini ~1/10; the cache saves prefill, whose cost is
mostly linear, so the ratio depends on that balance. `*_full` (`--full-width`, ~30 min, added
to the JSON --out holds): refresh and persistent at ~4 tokens per step at LLaDA2.0-mini's
own per-layer sizes (FULL_WIDTH). These have 2 layers, which understates the cache's gain
(the last layer computes little for prefill columns, see DEEP): `*_deep` (`--deep`, ~55
min, added like `--full-width`) runs refresh and persistent at ~4 tokens per step at
hidden 64 with the published 20 layers, and `*_full4` at LLaDA2.0-mini's per-layer sizes
with 4 layers. `*_deep_unshared` (`--unshared`): the 20-layer hidden-64 setting with a
preamble of its own per row (nothing shared): what the cache costs where it cannot hit.
`dual_deep*` (`--dual`): those two under the dual cache. `canvas` (`--canvas`):
DiffusionGemma's canvas engine (CANVAS_MODEL; blockserve, every row admitted at once) on
the same workload, preamble shared and not: what auto (on) gives and costs there.

`ceilings`: per setting, the query cells forwarded without / with the cache (about the
most the cache can give, see `ceilings`).

`routing`: two engines in this process, each with a prefix cache that holds about one
preamble beside its batch (token_budget), fed the batches of a workload of several
preambles (4 tasks, each a shared preamble; the sorter puts a task's rows together, so a
batch holds one preamble). Batches go to engines by the router's logic
(actors.prefix_affinity.PrefixAffinity, the dispatcher's), not through a Ray cluster
(too slow here for the point): `affinity` sends a batch to the engine that served its
prefix last (falling back to the least loaded), `pool` alternates as Ray Data's pool does
when both engines are free. The hit rate is the engines' own (EngineStats).

`routing_ray`: the same batches through the job's path on a local Ray cluster: the
processor with two engine actors, prefix affinity on and off (`prefix_affinity`,
`--no-prefix-affinity`)."""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

from actors.prefix_affinity import PrefixAffinity, prefix_key
from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model

# the vendored copy of the published file (tests/test_published.py checks it byte for byte)
CHECKPOINT = os.path.join(os.path.dirname(__file__), "..", "tests", "published", "inclusionAI__LLaDA2.0-mini",
                          "config.json")
SHRINK = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              intermediate_size=128, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=4, n_group=4,
              topk_group=2, vocab_size=1024, pad_token_id=1000, max_position_embeddings=4096)
# LLaDA2.0-mini at half its width (2 layers, 16 experts): its balance of attention and
# linear work per token at this workload's ~1k-token rows (attention ~20% of a decode query's
# FLOPs against ~10% in the published model, ~77% in SHRINK's hidden 64), where the cache's
# saving is the prefill's linear work
WIDE = dict(SHRINK, hidden_size=1024, num_attention_heads=8, head_dim=128, intermediate_size=2560,
            moe_intermediate_size=256, num_experts_per_tok=8)
# LLaDA2.0-mini's own per-layer sizes (2 of its 20 layers, 16 of its 256 experts, 8 per token
# as published, the vocabulary shrunk): a layer's balance of attention and linear work as
# in the published model
FULL_WIDTH = dict(WIDE, hidden_size=2048, num_attention_heads=16, num_key_value_heads=4, intermediate_size=5120,
                  moe_intermediate_size=512)
# Depth: the last layer runs attention and its MLP at the window's columns only (only
# their output is read, engine.models.transformer); a prefill column there only has its
# q/k/v projected. So in a 2-layer model a prefill column costs about 0.6 of a window
# column, which understates what the cache (which saves prefill) gives; at LLaDA2.0-mini's
# 20 layers the two cost about the same. DEEP: SHRINK at the published depth; FULL_DEEP:
# FULL_WIDTH at 4 layers (at 20, one run without the cache would take ~50 CPU-minutes)
DEEP = {k: v for k, v in SHRINK.items() if k != "num_hidden_layers"}
FULL_DEEP = dict(FULL_WIDTH, num_hidden_layers=4)
TWO = (("refresh", 8), ("persistent", 8))
DUAL = (("dual", 8),)
# --flag: [(sizes, name suffix, preamble shared, settings)], added to --out's results
ADDED = {"full_width": [(FULL_WIDTH, "_full", True, TWO)],
         "deep": [(DEEP, "_deep", True, TWO), (FULL_DEEP, "_full4", True, TWO)],
         "unshared": [(DEEP, "_deep_unshared", False, TWO)],
         "dual": [(DEEP, "_deep", True, DUAL), (DEEP, "_deep_unshared", False, DUAL)]}
FULL = dict(rows=8, preamble=900, question=(60, 120), new=256, tasks=4, task_rows=12, batch=3)
SMOKE = dict(rows=3, preamble=120, question=(20, 40), new=64, tasks=3, task_rows=2, batch=2)
L = 32
ROUNDS = 3  # off/on pairs per setting, alternating which runs first; the median of the per-round ratios


def tiny_llada2(sizes: Dict = SHRINK) -> ModelConfig:
    """LLaDA2.0-mini's config.json with its sizes shrunk (ids inside the shrunk vocabulary)."""
    with open(CHECKPOINT) as f:
        published = json.load(f)
    # the published mask / eos ids (156895 / 156892) lie outside the shrunk vocabulary
    hf = {**published, **sizes, "model_type": "llada2_moe", "mask_token_id": 1023, "eos_token_id": 1001}
    hf["rotary_dim"] = int(hf["head_dim"] * hf.get("partial_rotary_factor", 0.5))  # a size: half the head, as published
    return ModelConfig.from_hf(hf)


def tokens(rng: random.Random, n: int) -> List[int]:
    """n prompt token ids: inside the shrunk vocabulary, clear of its special ids."""
    return [rng.randrange(3, 999) for _ in range(n)]


def workload(s: Dict, rng: random.Random, preamble: List[int], rows: int):
    return [preamble + tokens(rng, rng.randint(*s["question"])) for _ in range(rows)]


def abba(run_with: Callable[[bool], Dict], r: int, what: str):
    """Round r's runs without and with the cache (`run_with(flag)`; off first in even
    rounds: ABBA), their tokens checked equal; (off, on) without the tokens."""
    order = (False, True) if r % 2 == 0 else (True, False)
    got = {flag: run_with(flag) for flag in order}
    off, on = got[False], got[True]
    assert on.pop("out") == off.pop("out"), f"{what}: tokens differ with the prefix cache"
    return off, on


def pair(model, base: Dict, prompts, sp, r: int):
    """`abba` on the masked-diffusion engine with `base`'s settings."""
    return abba(lambda flag: run(model, EngineConfig(**base, enable_prefix_caching=flag), prompts, sp), r, base["cache"])


def median_round(pair_of_round: Callable[[int], tuple]) -> Dict:
    """ROUNDS rounds of `pair_of_round(r) -> (off, on)`: the median round's runs, its ratio
    of tokens per CPU-second (with / without), and every round's."""
    ratios, runs = [], []
    for r in range(ROUNDS):
        off, on = pair_of_round(r)
        ratios.append(on["tokens_per_cpu_s"] / off["tokens_per_cpu_s"])
        runs.append((off, on))
    off, on = runs[ratios.index(statistics.median(ratios))] if ROUNDS % 2 else runs[-1]
    return {"off": off, "on": on, "speedup_tokens_per_cpu_s": statistics.median(ratios), "round_ratios": ratios}


def params(s: Dict) -> SamplingParams:
    return SamplingParams(max_new_tokens=s["new"], policy="threshold", threshold=0.95, stop_token_ids=[])


def run(model, cfg: EngineConfig, prompts, sp) -> Dict:
    eng = Engine(model, cfg)
    t0, c0 = time.perf_counter(), time.thread_time()
    outs = eng.generate(prompts, [sp] * len(prompts))
    cpu, wall = time.thread_time() - c0, time.perf_counter() - t0
    st = eng.stats
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tokens": tokens, "cpu_s": cpu, "wall_s": wall, "tokens_per_cpu_s": tokens / cpu,
            "forward_tokens": st.forward_tokens, "computed_cells": st.computed_cells, "steps": st.steps,
            "prefix_hit_rate": st.prefix_hit_rate, "prefix_token_hit_rate": st.prefix_token_hit_rate,
            "prefix_hit_blocks": st.prefix_hit_blocks, "prefix_evictions": st.prefix_evictions,
            "prefix_cached_blocks": st.prefix_cached_blocks, "kv_peak_over_budget": st.kv_peak_bytes / st.kv_budget_bytes,
            "out": [o.token_ids for o in outs]}


def single(model, s: Dict, settings=(("refresh", 8), ("persistent", 8), ("refresh", 2), ("persistent", 2)),
           suffix: str = "", shared: bool = True) -> Dict:
    """`shared` False: each row opens with a preamble of its own (what the cache costs, or
    gives, where rows share nothing)."""
    rng = random.Random(0)
    preamble = tokens(rng, s["preamble"])
    prompts = workload(s, rng, preamble, s["rows"]) if shared else [
        workload(s, rng, tokens(rng, s["preamble"]), 1)[0] for _ in range(s["rows"])]
    sp = params(s)
    res = {}
    for cache, steps in settings:
        base = dict(block_length=L, steps_per_block=steps, cache=cache, token_budget=32768, max_batch_size=64)
        name = (cache if steps == 8 else f"{cache}_steps{steps}") + suffix
        res[name] = median_round(lambda r: pair(model, base, prompts, sp, r))
        off, on = res[name]["off"], res[name]["on"]
        print(f"single {name}: {off['tokens_per_cpu_s']:.1f} -> {on['tokens_per_cpu_s']:.1f} tokens/CPU-s "
              f"(x{res[name]['speedup_tokens_per_cpu_s']:.2f}), hit rate {on['prefix_hit_rate']}", flush=True)
    return res


def ceilings(single: Dict) -> Dict:
    """Per setting, the query cells forwarded without / with the cache: what the cache
    saves is the shared preamble's prefill (under refresh, at every block start), so this
    is about the most it can give if a CPU-second bought the same cells either way; the
    decode steps' cells, each attending the whole prompt, are the rest."""
    return {name: v["off"]["computed_cells"] / v["on"]["computed_cells"] for name, v in single.items()}


def routing_batches(s: Dict):
    """(batches, token_budget) of the multi-task workload: the sorter's order (a task's rows
    together in a batch, tasks interleaved over time); an engine's budget holds one batch
    and about 2.2 preambles of cached blocks (it cannot hold every task's)."""
    rng = random.Random(1)
    tasks = [tokens(rng, s["preamble"]) for _ in range(s["tasks"])]
    batches = [workload(s, rng, pre, s["batch"]) for _ in range(s["task_rows"] // s["batch"]) for pre in tasks]
    rng.shuffle(batches)
    width = max(len(p) for b in batches for p in b) + 2 * L
    return batches, s["batch"] * width + (9 * s["preamble"]) // 4


ROUTING_PARAMS = SamplingParams(max_new_tokens=L, policy="threshold", threshold=0.95, stop_token_ids=[])


def routing(model, s: Dict) -> Dict:
    """Batches of a multi-task workload over two engines: affinity vs pool routing."""
    batches, budget = routing_batches(s)
    res = {}
    for policy in ("affinity", "pool"):
        engines = [Engine(model, EngineConfig(block_length=L, steps_per_block=8, cache="persistent", token_budget=budget,
                                              max_batch_size=s["batch"], enable_prefix_caching=True)) for _ in range(2)]
        router = PrefixAffinity()
        for i, b in enumerate(batches):
            loads = {0: 0, 1: 0}  # replayed one batch at a time: both engines are free
            default = i % 2  # the pool: whichever dispatcher Ray Data hands the block to
            e = router.choose(prefix_key(b, L), loads, default) if policy == "affinity" else default
            if policy == "affinity":
                router.record(prefix_key(b, L), e)
            engines[e].generate(b, [ROUTING_PARAMS] * len(b))
        hit = sum(e.stats.prefix_hit_blocks for e in engines)
        query = sum(e.stats.prefix_query_blocks for e in engines)
        res[policy] = {"prefix_hit_rate": hit / query if query else None, "hit_blocks": hit, "query_blocks": query,
                       "evictions": sum(e.stats.prefix_evictions for e in engines), "token_budget": budget}
        print(f"routing {policy}: hit rate {res[policy]['prefix_hit_rate']:.3f}", flush=True)
    return res


def routing_ray(model, s: Dict, folder: str) -> Dict:
    """`routing`'s workload through the job's path on a real local Ray (2 CPUs): the
    processor with two engine actors and the prefix cache, rows in the order of `routing`'s
    batches (sort none, batch_size = its batch), prefix affinity on and off
    (DLLMProcessorConfig.prefix_affinity); the engines' own hit rates (collect_engine_stats),
    every row once."""
    import ray

    from bench.sorter_scale import bench_ray
    from engine import save_model
    from pipeline import DLLMProcessorConfig, build_processor

    save_model(model, folder)
    batches, budget = routing_batches(s)
    rows = [{"id": f"r{i:04d}", "prompt_token_ids": p} for i, p in enumerate(p for b in batches for p in b)]
    res = {}
    with bench_ray():
        for affinity in (True, False):
            cfg = DLLMProcessorConfig(
                model=folder, num_engines=2, batch_size=s["batch"], max_concurrent_batches=1, sort="none",
                dtype="float32", detokenize=False, prefix_affinity=affinity, collect_engine_stats=True,
                engine=EngineConfig(block_length=L, steps_per_block=8, cache="persistent", token_budget=budget,
                                    max_batch_size=s["batch"], enable_prefix_caching=True), sampling=ROUTING_PARAMS)
            proc = build_processor(cfg)
            t0 = time.perf_counter()
            out = proc(ray.data.from_items(rows, override_num_blocks=len(batches))).take_all()
            wall = time.perf_counter() - t0
            assert sorted(r["id"] for r in out) == [r["id"] for r in rows], "rows lost or repeated"
            st = proc.engine_stats().values()
            hit, query = sum(e["prefix_hit_blocks"] for e in st), sum(e["prefix_query_blocks"] for e in st)
            name = "affinity" if affinity else "pool"
            res[name] = {"prefix_hit_rate": hit / query if query else None, "hit_blocks": hit, "query_blocks": query,
                         "evictions": sum(e["prefix_evictions"] for e in st), "rows": len(out), "wall_s": wall,
                         "token_budget": budget}
            print(f"routing on Ray, {name}: hit rate {res[name]['prefix_hit_rate']:.3f} ({hit}/{query} blocks), "
                  f"{wall:.1f} s", flush=True)
    return res


def sorter(s: Dict) -> Dict:
    """The sorter's prefix locality knob (DLLMProcessorConfig.sort_prefix_locality) on a
    window of several tasks' rows with budgets of 64..512 tokens: per locality, the
    preambles the engines compute (one per prefix per batch of `batch_size` rows, what a
    prefix cache that starts each batch cold computes; fewer is better) and the balance
    of two engines taking the ordered batches as they free up (makespan over its lower
    bound, from the ordering's own cost model; 1 is perfect)."""
    import numpy as np
    import pyarrow as pa

    from common.schema import TOKEN_IDS
    from pipeline.sorting.cost import CostModel
    from pipeline.sorting.order import SortWindowUDF

    rng = random.Random(2)
    pre = [tokens(rng, s["preamble"]) for _ in range(s["tasks"])]
    rows = [(p + tokens(rng, rng.randint(*s["question"])), rng.randint(64, 512))
            for p in pre for _ in range(4 * s["task_rows"])]
    rng.shuffle(rows)
    table = pa.table({TOKEN_IDS: [r[0] for r in rows], "sampling_params": [{"max_new_tokens": r[1]} for r in rows],
                      "task": [next(i for i, p in enumerate(pre) if r[0][:len(p)] == p) for r in rows]})
    cost = CostModel(a=0.0, b=1.0, block_length=L, steps_per_block=8)
    batch = 2 * s["batch"]
    out = {}
    for loc in (0.0, 0.5, 0.75, 1.0):
        udf = SortWindowUDF(cost, SamplingParams(), "sampling_params", 2, None, loc)
        t = udf(table)
        lens = np.array([len(p) for p in t.column(TOKEN_IDS).to_pylist()])
        gens = np.array([o["max_new_tokens"] for o in t.column("sampling_params").to_pylist()], dtype=np.float64)
        secs = cost.times(lens, gens)
        tasks = t.column("task").to_pylist()
        preambles = sum(len(set(tasks[i:i + batch])) for i in range(0, len(tasks), batch))
        loads, work = [0.0, 0.0], [float(secs[i:i + batch].sum()) for i in range(0, len(tasks), batch)]
        for w in work:  # each batch to the engine that frees first
            loads[loads.index(min(loads))] += w
        bound = max(sum(work) / 2, max(work))
        out[str(loc)] = {"preambles_computed": preambles, "batches": len(work), "makespan_over_bound": max(loads) / bound}
        print(f"sorter locality {loc}: {preambles} preambles over {len(work)} batches, "
              f"makespan / bound {max(loads) / bound:.3f}", flush=True)
    return out


def plot(res: Dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(18, 4), gridspec_kw={"width_ratios": [3, 1, 1.3]})
    modes = list(res["single"])
    bars = {**res["single"], **{f"gemma_{k}": v for k, v in res.get("canvas", {}).items()}}  # DiffusionGemma last
    x = range(len(bars))
    a.bar(x, [v["speedup_tokens_per_cpu_s"] for v in bars.values()], 0.6, label="measured (median of rounds)")
    ceiling = ceilings(res["single"])
    a.plot(range(len(modes)), [ceiling[m] for m in modes], "k_", markersize=14, label="query cells without / with")
    a.axhline(3.0, color="C3", linestyle=":", label="issue 40's target")
    a.set_xticks(list(x), [m.replace("_steps", "\nS=").replace("_", "\n") for m in bars], fontsize=7)
    a.set_ylabel("tokens / CPU-s, with / without the cache")
    a.set_title("8-shot workload, LLaDA2 layout (wide: half width, full: its width, deep: 20 layers, full4: 4); "
                "gemma: DiffusionGemma", fontsize=9)
    a.legend(fontsize=7)
    pol = list(res["routing"])
    b.bar(pol, [res["routing"][p]["prefix_hit_rate"] for p in pol])
    b.set_ylabel("prefix hit rate (blocks)")
    b.set_title("2 engines: routing")
    locs = list(res["sorter"])
    c.plot([float(x) for x in locs], [res["sorter"][x]["preambles_computed"] for x in locs], "o-", label="preambles computed")
    c.set_xlabel("sort_prefix_locality")
    c.set_ylabel("preambles computed")
    c2 = c.twinx()
    c2.plot([float(x) for x in locs], [res["sorter"][x]["makespan_over_bound"] for x in locs], "s--", color="C1")
    c2.set_ylabel("2-engine makespan / bound (dashed)")
    c.set_title("sorter: prefix locality vs balance")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# DiffusionGemma for `canvas` (tiny.diffusion_gemma.build): the `compute` size of
# bench/diffusion_gemma_bench.py, with LLaDA2's block length as its canvas
CANVAS_MODEL = dict(hidden=256, layers=3, vocab=64, canvas=16)


def canvas_run(model, defaults, prompts, new: int, flag: bool) -> Dict:
    from engine.canvas import CanvasEngine

    eng = CanvasEngine(model, defaults, token_budget=32768, max_batch_size=64, stop_token_ids=[],  # every token
                       enable_prefix_caching=flag)
    c0 = time.thread_time()
    for i, p in enumerate(prompts):
        eng.add_request(i, p, new, 100 + i)
    while eng.has_unfinished():
        eng.step()
    cpu = time.thread_time() - c0
    outs = sorted(eng.outputs, key=lambda o: o.request_id)
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tokens": tokens, "cpu_s": cpu, "tokens_per_cpu_s": tokens / cpu, **eng.prefix_figures(),
            "out": [o.token_ids for o in outs]}


def canvas(s: Dict) -> Dict:
    """DiffusionGemma's canvas engine (engine.canvas) with / without its prefix cache: the
    same workload (ids inside its vocabulary), its preamble shared or one per row; rounds
    and ratios as `single`'s, the tokens checked equal."""
    import tempfile

    from engine.canvas import CanvasParams, load_diffusion_gemma
    from tiny.diffusion_gemma import build

    with tempfile.TemporaryDirectory() as d:
        ckpt = build(d, **CANVAS_MODEL)
        model, defaults = load_diffusion_gemma(ckpt, torch.float32), CanvasParams.from_generation_config(ckpt)
    rng = random.Random(0)
    ids = lambda n: [2] + [rng.randrange(5, 59) for _ in range(n - 1)]  # noqa: E731 (BOS first)
    preamble = ids(s["preamble"])
    question = lambda: ids(rng.randint(*s["question"]))[1:]  # noqa: E731
    prompts = {"shared": [preamble + question() for _ in range(s["rows"])],
               "unshared": [ids(s["preamble"]) + question() for _ in range(s["rows"])]}
    res = {}
    for name, ps in prompts.items():
        res[name] = median_round(lambda r: abba(lambda flag: canvas_run(model, defaults, ps, s["new"], flag), r,
                                                f"canvas {name}"))
        off, on = res[name]["off"], res[name]["on"]
        print(f"canvas {name}: {off['tokens_per_cpu_s']:.1f} -> {on['tokens_per_cpu_s']:.1f} tokens/CPU-s "
              f"(x{res[name]['speedup_tokens_per_cpu_s']:.2f}), {on['prefix_hit_blocks']} blocks hit", flush=True)
    return res


def add(res: Dict, s: Dict, which: str) -> None:
    """ADDED[which]'s settings (at ~4 tokens per step), added to `res`'s."""
    for sizes, suffix, shared, settings in ADDED[which]:
        model = build_model(tiny_llada2(sizes), dtype=torch.float32, seed=0)
        res["single"].update(single(model, s, settings=settings, suffix=suffix, shared=shared))


def save(res: Dict, out: str) -> Dict:
    """`res` with its ceilings, as JSON at `out` and a PNG beside it."""
    res["ceilings"] = ceilings(res["single"])
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.splitext(out)[0] + ".png")
    return res


def main(argv=None) -> Dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="bench/results/prefix_cpu.json")
    ap.add_argument("--no-ray", action="store_true", help="skip routing_ray (a local Ray cluster)")
    ap.add_argument("--no-wide", action="store_true", help="skip the settings at half LLaDA2.0-mini's width (~10 min)")
    ap.add_argument("--full-width", action="store_true", help="only refresh and persistent at ~4 tokens/step at "
                    "LLaDA2.0-mini's width (FULL_WIDTH, ~30 min), added to --out's other results")
    ap.add_argument("--deep", action="store_true", help="only refresh and persistent at ~4 tokens/step at "
                    "LLaDA2.0-mini's depth (DEEP, ~3 min) and at its width with 4 layers (FULL_DEEP, ~50 min), "
                    "added to --out's other results")
    ap.add_argument("--unshared", action="store_true", help="only refresh and persistent at DEEP with no prefix "
                    "shared between rows (~4 min), added to --out's other results")
    ap.add_argument("--dual", action="store_true", help="only dual at DEEP, the preamble shared and not, added "
                    "to --out's other results")
    ap.add_argument("--canvas", action="store_true", help="only DiffusionGemma's canvas engine (CANVAS_MODEL), "
                    "the preamble shared and not, added to --out's other results")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    s = SMOKE if args.smoke else FULL
    command = "python bench/prefix_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    which = [w for w in ADDED if getattr(args, w)]
    if which or args.canvas:
        with open(args.out) as f:
            res = json.load(f)
        for w in which:
            add(res, s, w)
            res[f"command_{w}"] = command
        if args.canvas:
            res["canvas"], res["command_canvas"] = canvas(s), command
        return save(res, args.out)
    model = build_model(tiny_llada2(), dtype=torch.float32, seed=0)
    res = {"command": command, "settings": s, "block_length": L, "sorter": sorter(s), "single": single(model, s),
           "routing": routing(model, s)}
    if not args.no_wide:  # the same at half LLaDA2.0-mini's width (WIDE)
        wide = build_model(tiny_llada2(WIDE), dtype=torch.float32, seed=0)
        res["single"].update(single(wide, s, suffix="_wide"))
    if not args.no_ray:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            res["routing_ray"] = routing_ray(model, s, d)
    return save(res, args.out)


if __name__ == "__main__":
    main()
