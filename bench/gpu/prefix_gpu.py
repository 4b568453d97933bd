"""Prefix caching (issue 40) on one GPU at inclusionAI/LLaDA2.0-mini's shape: the 8-shot
GSM8K-shaped workload of bench/prefix_bench.py with and without
EngineConfig.enable_prefix_caching, under refresh and persistent, in tokens per second.

    VARIANT=prefix bash bench/gpu/run.sh                    # on an H200; JSON in $OUT/prefix/
    python bench/gpu/prefix_gpu.py --smoke --out /tmp/out   # CPU, tiny shape: checks it runs (CI)

Why on a GPU: on the CPU (bench/README.md) the cache gives 2.6x under refresh and 1.2x
under persistent at LLaDA2.0-mini's per-layer sizes (2 layers, 16 experts, a shrunk
vocabulary), against 3.35x and 1.28x fewer query cells. What a GPU changes is the balance
between the prefill the cache saves (compute-bound there) and the denoising steps it does
not touch (launch- and bandwidth-bound at a few rows), and the 157k-token head at every
step; this measures it with the model's whole shape (20 layers, 256 experts, random bf16
weights built on the device, gpu_bench.build_on_device). Every row decodes 256 tokens at
~4 per step (LLaDA2's threshold 0.95 with its schedule floor over 8 steps per block: on
random weights the floor decides). Per mode: off and on in alternating order (ROUNDS
pairs), wall seconds around Engine.generate (which reads the device every step), the
tokens of both runs checked equal; the JSON is rewritten after every run, and runs that
would start past the deadline are skipped and listed.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import random
import statistics
import sys
import time
from typing import Any, Dict

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench.engine_bench import git_state  # noqa: E402
from bench.gpu.gpu_bench import LLADA2_MINI, SMOKE_LLADA2, Report, build_on_device, target  # noqa: E402
from bench.prefix_bench import FULL, L, SMOKE, pair, params, run, tokens, workload  # noqa: E402
from engine import EngineConfig, ModelConfig  # noqa: E402

ROUNDS = 2  # off/on pairs per mode (off first, then on first)
MODES = ("refresh", "persistent")


def main(argv=None) -> Dict[str, Any]:
    t_start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "./out"), help="output folder (default $OUT or ./out)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shape: checks the script runs")
    ap.add_argument("--rows", type=int, default=None, help="rows sharing the preamble (default 32; smoke 3)")
    ap.add_argument("--deadline-s", type=float, default=None, help="start no run this long after start (default 330)")
    args = ap.parse_args(argv)
    smoke = args.smoke
    device, dtype = target(smoke)
    deadline = t_start + (args.deadline_s if args.deadline_s is not None else (60.0 if smoke else 330.0))
    s = dict(SMOKE if smoke else FULL, rows=args.rows or (3 if smoke else 32))
    os.makedirs(args.out, exist_ok=True)
    cfg = ModelConfig(**(SMOKE_LLADA2 if smoke else LLADA2_MINI))
    rep = Report(os.path.join(args.out, "prefix_gpu.json"), {
        "command": "python bench/gpu/prefix_gpu.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "git": git_state(),
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None, "smoke": smoke, "settings": s,
        "block_length": L, "model": {"config": cfg.to_hf(), "params": cfg.num_params(), "dtype": str(dtype)},
        "modes": {}})
    model = build_on_device(cfg, dtype, device)
    rng = random.Random(0)
    prompts, sp = workload(s, rng, tokens(rng, s["preamble"]), s["rows"]), params(s)
    budget = 2 * s["rows"] * (s["preamble"] + s["question"][1] + s["new"])  # every row at once, the cache beside it

    def base(cache: str) -> Dict[str, Any]:
        return dict(block_length=L, steps_per_block=8, cache=cache, token_budget=budget, max_batch_size=s["rows"])

    run(model, EngineConfig(**base("persistent"), enable_prefix_caching=True), prompts[:2], sp)  # warm-up
    for cache in MODES:
        pairs = []
        for r in range(ROUNDS):
            if time.perf_counter() > deadline:
                rep.data["skipped"].append(f"{cache} round {r}: past the deadline")
                break
            off, on = pair(model, base(cache), prompts, sp, r)
            pairs.append({"off": off, "on": on, "speedup_tokens_per_s": off["wall_s"] / on["wall_s"]})
            rep.data["modes"][cache] = {"rounds": pairs,
                                        "speedup_tokens_per_s": statistics.median(p["speedup_tokens_per_s"]
                                                                                  for p in pairs),
                                        "cells_ratio": off["computed_cells"] / on["computed_cells"]}
            rep.save()
            print(f"{cache} round {r}: {off['tokens'] / off['wall_s']:.0f} -> {on['tokens'] / on['wall_s']:.0f} "
                  f"tokens/s (x{pairs[-1]['speedup_tokens_per_s']:.2f}), hit rate {on['prefix_hit_rate']}", flush=True)
    rep.data["done"] = True
    rep.save()
    return rep.data


if __name__ == "__main__":
    main()
