"""LLaDA-MoE on the CPU: the engine's mixed batches against the same model run one
request at a time, where a MoE forward's time goes, and routing + grouped experts
against a dense MLP of the same active width.

    python bench/moe_bench.py --out bench/results/moe_cpu.json     # ~2 min on a quiet core
    python bench/moe_bench.py --smoke --out /tmp/moe.json           # seconds

One process, one thread, one model (random weights, float32): every number that
matters is a ratio within this run. `engine`: tokens/s of Engine.generate over all
requests (blockserve, full canvas, no cache) and of one Engine.generate per request;
`share`: fraction of forward time in the MoE layers' expert MLP (routing + experts +
shared expert) and in routing alone, timed by wrapping the layer's `ffn`; `layer`:
one layer's expert MLP against a dense SwiGLU of the active width (top_k x expert +
shared) on the same tokens."""
from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch

from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model
from engine.models import moe as moe_mod
from engine.models.families.moe import MoESpec

FULL = dict(hidden=256, layers=4, heads=8, experts=16, top_k=4, expert=128, shared=128, vocab=4096, rows=16)
SMOKE = dict(hidden=32, layers=2, heads=4, experts=4, top_k=2, expert=16, shared=16, vocab=256, rows=4)


def config(s: dict) -> ModelConfig:
    spec = MoESpec(num_experts=s["experts"], top_k=s["top_k"], expert_size=s["expert"], dense_size=4 * s["hidden"],
                   dense_layers=(True,) + (False,) * (s["layers"] - 1), shared_size=s["shared"])
    return ModelConfig(model_type="llada_moe", vocab_size=s["vocab"], hidden_size=s["hidden"], n_layers=s["layers"],
                       n_heads=s["heads"], n_kv_heads=s["heads"], intermediate_size=4 * s["hidden"],
                       mask_token_id=s["vocab"] - 1, eos_token_id=1, moe=spec, qk_norm=True)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", default="bench/results/moe_cpu.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    s = SMOKE if args.smoke else FULL
    cfg = config(s)
    model = build_model(cfg, dtype=torch.float32, seed=0)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, s["vocab"] - 2) for _ in range(rng.randint(8, 48))] for _ in range(s["rows"])]
    params = [SamplingParams(max_new_tokens=16, policy="fixed", stop_token_ids=[]) for _ in prompts]
    ecfg = EngineConfig(block_length=8, steps_per_block=4, cache="none", token_budget=4096, max_batch_size=s["rows"])

    # where a forward's time goes: wrap the MoE layers' ffn and the router
    spent = {"ffn": 0.0, "route": 0.0}
    moe_layers = [m for m in model.layers if hasattr(m, "experts")]
    real_route = moe_mod.route

    def timed_route(*a, **k):
        t = time.perf_counter()
        out = real_route(*a, **k)
        spent["route"] += time.perf_counter() - t
        return out

    def wrap(layer):
        real = layer.ffn

        def ffn(*a):
            t = time.perf_counter()
            out = real(*a)
            spent["ffn"] += time.perf_counter() - t
            return out
        layer.ffn = ffn

    for layer in moe_layers:
        wrap(layer)
    moe_mod.route = timed_route
    forward_s = {"t": 0.0}
    real_forward = model.forward

    def forward(*a, **k):
        t = time.perf_counter()
        out = real_forward(*a, **k)
        forward_s["t"] += time.perf_counter() - t
        return out
    model.forward = forward
    with torch.inference_mode():
        Engine(model, ecfg).generate(prompts[:2], params[:2])  # warm up
        spent.update(ffn=0.0, route=0.0)
        forward_s["t"] = 0.0
        outs, batched_s = timed(lambda: Engine(model, ecfg).generate(prompts, params))
        share = {"forward_s": forward_s["t"], "moe_ffn_s": spent["ffn"], "routing_s": spent["route"],
                 "moe_ffn_share_of_forward": spent["ffn"] / forward_s["t"],
                 "routing_share_of_forward": spent["route"] / forward_s["t"]}
        singles, single_s = timed(lambda: [Engine(model, ecfg).generate([p], [sp])[0] for p, sp in zip(prompts, params)])
    moe_mod.route = real_route
    assert [o.token_ids for o in outs] == [o.token_ids for o in singles]  # same tokens, batched or alone
    tokens = sum(len(o.token_ids) for o in outs)

    # one layer: routing + grouped experts against a dense MLP of the active width
    layer = moe_layers[0]
    width = s["top_k"] * s["expert"] + s["shared"]
    dense = moe_mod.MLP(s["hidden"], width).float()
    x = torch.randn(1, 2048 if not args.smoke else 64, s["hidden"])
    reps = 5 if not args.smoke else 1
    with torch.inference_mode():
        zero = torch.zeros_like(x)  # the residual the layer adds its MLP into (the mixture's own cost alone)
        layer.ffn(x, zero.clone()), dense(x)
        _, moe_t = timed(lambda: [layer.ffn(x, zero.clone()) for _ in range(reps)])
        _, dense_t = timed(lambda: [dense(x) for _ in range(reps)])
        _, route_t = timed(lambda: [real_route(torch.nn.functional.linear(x[0], layer.router.weight), cfg.moe, None)
                                    for _ in range(reps)])
    data = {
        "command": "python bench/moe_bench.py" + (" --smoke" if args.smoke else "") + f" --out {args.out}",
        "shape": s, "threads": 1, "tokens": tokens, "active_params": cfg.active_params(), "params": cfg.num_params(),
        "engine": {"batched_s": batched_s, "one_at_a_time_s": single_s, "batched_tokens_per_s": tokens / batched_s,
                   "one_at_a_time_tokens_per_s": tokens / single_s, "speedup": single_s / batched_s},
        "share": share,
        "layer": {"tokens": x.shape[1], "moe_ffn_s": moe_t / reps, "dense_same_active_width_s": dense_t / reps,
                  "routing_s": route_t / reps, "moe_over_dense": moe_t / dense_t, "routing_share_of_moe": route_t / moe_t},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=2)
    print(json.dumps({k: data[k] for k in ("engine", "share", "layer")}, indent=2))
    return data


if __name__ == "__main__":
    main()
