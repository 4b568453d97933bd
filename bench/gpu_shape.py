"""What an H200 would launch and wait for, counted on a CPU (issue 51): kernel launches per
layer and per forward, per family, for rows of one width and for the skewed mixed batch,
and at each family's published depth by multiplication; and host waits per engine step on
the stand-in CUDA device (bench/host_waits.py).

    python bench/gpu_shape.py --out bench/results/gpu_shape.json        # JSON, and a PNG beside it
    python bench/gpu_shape.py --out /tmp/before.json                    # in an older checkout (with
        this file and bench/counting.py copied in): the "before" figures
    python bench/gpu_shape.py --out bench/results/gpu_shape.json --before /tmp/before.json

Counted by bench/counting.py's LaunchCounter (a dispatch mode that decomposes composite ops
and counts those that launch a kernel on a GPU; RMSNorm's fused op as the one kernel CUDA
runs) over one steady denoising step of an Engine: block canvas, refresh cache, step
advance, B rows of one width (a 40-token prompt each), float32. Each family's model is its
published config.json with the sizes shrunk (tests/published.py), the MoE families with
their published expert counts and top-k restored (a layer's launches depend on them, not
on widths). `per_forward_published` is the forward's launches outside the layers plus each
published layer's count (dense and MoE layers apart) times the published number of layers.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))  # the published configs' readers

import torch  # noqa: E402

import checkpoints  # noqa: E402
import published  # noqa: E402
import test_fast_dllm_v2  # noqa: E402
from bench import host_waits  # noqa: E402
from bench.counting import LaunchCounter  # noqa: E402
from bench.engine_bench import git_state  # noqa: E402
from bench.workloads import SkewedSpec, skewed  # noqa: E402
from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model  # noqa: E402

# one published config.json per family the transformer serves: vendored (tests/published/), or,
# where no copy is vendored, the published keys the family's tests hold
FAMILIES = {"llada": "GSAI-ML__LLaDA-8B-Instruct", "dream": "Dream-org__Dream-v0-Instruct-7B",
            "sdar": "JetLM__SDAR-4B-Chat", "fast_dllm_v2": test_fast_dllm_v2.CONFIG,
            "llada_moe": checkpoints.LLADA_MOE_CONFIG, "llada2": "inclusionAI__LLaDA2.0-mini",
            "sdar_moe": "JetLM__SDAR-30B-A3B-Chat", "illada": "GSAI-ML__iLLaDA-8B-Instruct",
            "nemotron_labs_diffusion": "nvidia__Nemotron-Labs-Diffusion-8B"}
ROUTING_KEYS = ("num_experts", "num_experts_per_tok", "n_group", "topk_group")


def published_config(family: str) -> Dict[str, Any]:
    hf = FAMILIES[family]
    return dict(hf) if isinstance(hf, dict) else published.config(hf)


def config(family: str, experts: bool = False) -> ModelConfig:
    """`family`'s published config.json, sizes shrunk; with `experts`, its published
    expert count, top-k and expert groups kept, and one layer more (an MoE layer that
    is not the last)."""
    hf = published_config(family)
    small = published.shrink(hf)
    if experts and "num_experts" in hf:
        small.update({k: hf[k] for k in ROUTING_KEYS if k in hf})
        small["num_hidden_layers"] += 1
        if "moe_layer_freq" in small:
            small["moe_layer_freq"] = small["moe_layer_freq"] + [1]
    return ModelConfig.from_hf(small)


def layers_of(hf: Dict[str, Any]) -> Dict[str, int]:
    """The published model's layers: {"dense": n, "moe": m}."""
    cfg = ModelConfig.from_hf(hf)
    moe = 0 if cfg.moe is None else sum(not d for d in cfg.moe.dense_layers)
    return {"dense": cfg.n_layers - moe, "moe": moe}


def block_step(cfg: ModelConfig, rows: int = 8, prompt: int = 40) -> Dict[str, Any]:
    """One steady block step of `rows` rows of one width: launches per layer (dense and MoE
    layers apart, the last layer apart: it reads only the window), outside the layers."""
    model = build_model(cfg, dtype=torch.float32)
    e = Engine(model, EngineConfig(block_length=32, cache="refresh", canvas="block", advance="step",
                                   token_budget=8192, max_batch_size=rows))
    for i in range(rows):
        e.add_request(list(range(100 + i, 100 + i + prompt)),
                      SamplingParams(max_new_tokens=96, policy="fixed", ignore_eos=True))
    for _ in range(3):
        e.step()
    with LaunchCounter(model.layers, model=model) as c:
        e.step()
    routed = [getattr(layer, "routed", False) for layer in model.layers]
    calls = c.calls[:len(model.layers)]  # the step's one forward
    dense = [x["launches"] for x, r in zip(calls[:-1], routed) if not r]
    moe = [x["launches"] for x, r in zip(calls[:-1], routed) if r]
    return {"per_dense_layer": dense[0] if dense else None, "per_moe_layer": moe[0] if moe else None,
            "last_layer": calls[-1]["launches"], "outside_layers": c.forwards[0] - sum(x["launches"] for x in calls),
            "forward": c.forwards[0], "step": c.total, "ops_dense": dict(calls[0]["ops"]) if dense else None,
            "ops_moe": dict(next(x["ops"] for x, r in zip(calls, routed) if r)) if moe else None}


def mixed(n: int = 32) -> Dict[str, Any]:
    """The skewed workload's first `n` requests under the CPU engine's defaults at B=`n`:
    launches per layer over every forward of the first two block cycles (the catch-up
    planner's forward overhead fixed at about what it fits online, so that the plan does
    not depend on timings)."""
    w = skewed(SkewedSpec(n_requests=n))
    e = Engine(w.model, EngineConfig(max_batch_size=n, forward_overhead_cells=100))
    for p, sp in zip(w.prompts, w.params):
        e.add_request(p, sp)
    with LaunchCounter(w.model.model.layers) as c:
        for _ in range(2):
            e.step()
    first = [x["launches"] for x in c.calls if x["layer"] == 0]
    return {"per_layer_mean": round(statistics.mean(first), 2), "per_layer_max": max(first),
            "per_layer_min": min(first), "forwards": len(first)}


def measure() -> Dict[str, Any]:
    fams: Dict[str, Any] = {}
    for family in FAMILIES:
        hf = published_config(family)
        got = block_step(config(family, experts=True))
        n = layers_of(hf)
        got["published_layers"] = n
        got["per_forward_published"] = (got["outside_layers"] + got["last_layer"]
                                         + (got["per_dense_layer"] or 0) * n["dense"]
                                         + (got["per_moe_layer"] or 0) * n["moe"]
                                         - (got["per_moe_layer"] or got["per_dense_layer"]))
        fams[family] = got
        print(family, {k: v for k, v in got.items() if not k.startswith("ops")}, flush=True)
    mix = mixed()
    print("mixed", mix, flush=True)
    waits = {}
    for case, per in host_waits.measure(8).items():  # per step(): advance="step" (one denoising step) but "block"
        waits[case] = {"waits": [w for w, _, _ in per], "syncs": [y for _, y, _ in per]}
        print(case, waits[case], flush=True)
    return {"families": fams, "mixed_b32": mix, "waits_per_step": waits}


def plot(res: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fams = list(res["families"])
    before = (res.get("before") or {}).get("families", {})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, key, title in ((axes[0], "per_layer", "kernel launches per layer (block step, B=8)"),
                           (axes[1], "per_forward_published", "launches per forward at published depth")):
        def val(d, f):
            g = d.get(f, {})
            return (g.get("per_moe_layer") or g.get("per_dense_layer")) if key == "per_layer" else g.get(key)
        xs = range(len(fams))
        if before:
            ax.bar([x - 0.2 for x in xs], [val(before, f) or 0 for f in fams], 0.4, label="before")
        ax.bar([x + (0.2 if before else 0) for x in xs], [val(res["families"], f) or 0 for f in fams],
               0.4, label="after")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(fams, rotation=30)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--before", help="this script's JSON from an older checkout")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = {"command": "python bench/gpu_shape.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "git": git_state(),
           **measure()}
    if args.before:
        with open(args.before) as f:
            res["before"] = json.load(f)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.splitext(args.out)[0] + ".png")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
