"""Acceptance 2/3 of the sorter on CPU: sort="blendserve" vs sort="none" through the
processor on a skewed workload with 2 engine actors and a random tiny model.

Workload: `--rows` prompts, 20% of them 8x longer than the rest, in each of `--orders`:
`long_first` (every long prompt first: adversarial for a contiguous split, but already
grouped by length, so arrival order pads little), `front_loaded` (every long prompt in
the first 40% of the input, alternating with short ones: adversarial for a contiguous
split and for padding) and `random`. Reports, per order, from one run of each mode:
  * measured per-engine busy time (engine stats busy_s per rank: wall time inside
    the engine's steps) and its spread (max - min) / max; the same for busy_cpu_s (CPU
    time of the stepping thread), which co-tenants' load on a shared machine does not
    inflate;
  * engine padding fraction (padded_cells / computed_cells over both engines);
  * end-to-end wall time of each mode and blendserve/none as a ratio.

    python bench/sorter_bench.py                       # writes bench/results/sorter_cpu.json
    python bench/sorter_bench.py --scale               # bench/results/sorter_scale.json + .png
    python bench/sorter_bench.py --scale --driver-memory --scale-orders random
                                                       # adds `driver_memory` to sorter_scale.json

`--scale` (issue 17: bench/sorter_scale.py) runs the job at 1k, 4k and 16k rows and the
ordering stage alone at 1M and 10M synthetic rows, for wall time, its linear fit, and
the driver's peak memory. `--driver-memory` runs only the job at the smallest and the
largest of `--scale-rows`, each in a fresh driver process, for the driver's peak memory
per row count, and writes it into the existing JSON (`driver_memory`; other keys kept).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def skewed_rows(n: int, long_share: float = 0.2, short_len: int = 8, factor: int = 8, order: str = "long_first"):
    n_long = int(round(n * long_share))
    every = max(1, n // max(n_long, 1))
    rows = []
    for i in range(n):
        if order in ("long_first", "random"):
            is_long = i < n_long
        elif order == "front_loaded":
            is_long = i % 2 == 0 and i // 2 < n_long
        else:  # interleaved
            is_long = i % every == 0 and i // every < n_long
        length = short_len * factor if is_long else short_len
        word = "".join("abcdefghijklmnopqrstuvwxyz"[(i * 7 + j) % 26] for j in range(length))
        rows.append({"id": f"r{i:04d}", "prompt": word})
    if order == "random":
        random.Random(0).shuffle(rows)
    return rows


def _spread(x):
    """(max - min) / max over ranks."""
    return (max(x.values()) - min(x.values())) / max(x.values()) if x else None


def _summary(none, blend):
    ratio = blend["wall_s"] / none["wall_s"]
    return {
        "busy_spread_sorter": blend["busy_spread"],
        "busy_spread_none": none["busy_spread"],
        "busy_cpu_spread_sorter": blend["busy_cpu_spread"],
        "busy_cpu_spread_none": none["busy_cpu_spread"],
        "wall_ratio_blendserve_over_none": ratio,
        "padding_sorter": blend["padding_fraction"],
        "padding_none": none["padding_fraction"],
        "targets": {"wall_ratio<=1.02": ratio <= 1.02,
                    "busy_spread_sorter<=0.10": (blend["busy_spread"] or 1) <= 0.10,
                    "busy_cpu_spread_sorter<=0.10": (blend["busy_cpu_spread"] or 1) <= 0.10,
                    "padding_sorter<padding_none": blend["padding_fraction"] < none["padding_fraction"]},
    }


def run_mode(model: str, sort: str, rows, args):
    import ray

    from engine import EngineConfig, SamplingParams
    from pipeline import DLLMProcessorConfig, build_processor

    cfg = DLLMProcessorConfig(
        model=model, num_engines=2, batch_size=args.batch_size, max_concurrent_batches=2,
        engine=EngineConfig(block_length=8, steps_per_block=args.steps_per_block, cache="refresh",
                            max_batch_size=args.max_batch_size),
        sampling=SamplingParams(max_new_tokens=args.max_new_tokens, policy="fixed",
                                stop_token_ids=[]),  # no early EOS: every request uses its budget
        sort=sort, collect_engine_stats=True, enable_metrics=False)
    proc = build_processor(cfg)
    t0 = time.perf_counter()
    ds = ray.data.from_items(rows, override_num_blocks=max(1, len(rows) // cfg.batch_size))
    out = proc(ds).take_all()
    wall = time.perf_counter() - t0
    stats = proc.engine_stats()
    busy = {r: s["busy_s"] for r, s in sorted(stats.items())}
    busy_cpu = {r: s["busy_cpu_s"] for r, s in sorted(stats.items())}
    padded = sum(s["padded_cells"] for s in stats.values())
    computed = sum(s["computed_cells"] for s in stats.values())
    res = {
        "wall_s": wall,
        "rows_out": len(out),
        "ids_exactly_once": sorted(r["id"] for r in out) == sorted(r["id"] for r in rows),
        "errors": sum(1 for r in out if r["error"]),
        "busy_s": busy,
        "busy_spread": _spread(busy),
        "busy_cpu_s": busy_cpu,  # CPU time of each engine's stepping thread (1 torch thread)
        "busy_cpu_spread": _spread(busy_cpu),
        "padding_fraction": padded / computed if computed else None,
        "padding_per_rank": {r: s["padded_cells"] / s["computed_cells"] for r, s in stats.items()
                             if s["computed_cells"]},
        "rows_per_rank": {r: sum(1 for o in out if o["engine_rank"] == r) for r in busy},
    }
    return res


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-batch-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--steps-per-block", type=int, default=8)
    ap.add_argument("--short-len", type=int, default=16)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--orders", default="long_first,front_loaded,random",
                    help="input orders to run, comma list of long_first, front_loaded (both adversarial for a "
                         "contiguous split), random, interleaved")
    ap.add_argument("--out", default=None, help="default: bench/results/sorter_cpu.json (sorter_scale.json with --scale)")
    ap.add_argument("--scale", action="store_true", help="the scale bench (bench/sorter_scale.py) instead")
    ap.add_argument("--scale-rows", default="1000,4000,16000")
    ap.add_argument("--scale-orders", default="random,front_loaded")
    ap.add_argument("--sort-window-rows", type=int, default=4096, help="--scale: the ordering's window")
    ap.add_argument("--reps", type=int, default=3, help="--scale: runs per mode at the smallest row count")
    ap.add_argument("--ordering-rows", default="1000000,10000000", help="--scale: ordering-only sizes ('' for none)")
    ap.add_argument("--driver-memory", action="store_true",
                    help="--scale: only the driver's peak memory at the smallest and largest --scale-rows, each run in "
                         "a fresh driver process; merged into the JSON at --out as `driver_memory`")
    args = ap.parse_args(argv)
    if args.scale:
        return main_scale(args, argv)
    args.out = args.out or os.path.join(ROOT, "bench", "results", "sorter_cpu.json")

    import torch

    torch.set_num_threads(1)
    from bench.sorter_scale import bench_ray
    from bench.workloads import write_tiny_model

    model = write_tiny_model(tempfile.mkdtemp(prefix="tiny-dllm-"), hidden_size=args.hidden_size,
                             n_layers=args.layers, n_heads=8, n_kv_heads=8, intermediate_size=4 * args.hidden_size)
    result = {
        "command": "python bench/sorter_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "workload": {"rows": args.rows, "long_share": 0.2, "long_factor": 8, "short_prompt_tokens": args.short_len,
                     "long_prompt_tokens": 8 * args.short_len,
                     "hidden_size": args.hidden_size, "layers": args.layers, "max_new_tokens": args.max_new_tokens,
                     "block_length": 8, "steps_per_block": args.steps_per_block, "batch_size": args.batch_size,
                     "max_batch_size": args.max_batch_size, "engines": 2, "device": "cpu (2 cores, shared)",
                     "model": "random tiny LLaDA-style (bench/workloads.write_tiny_model)"},
    }
    with bench_ray():
        for order in args.orders.split(","):
            rows = skewed_rows(args.rows, short_len=args.short_len, order=order)
            none = run_mode(model, "none", rows, args)
            blend = run_mode(model, "blendserve", rows, args)
            result[order] = {"none": none, "blendserve": blend, "summary": _summary(none, blend)}
            print(order, json.dumps(result[order]["summary"], indent=2), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    return result


def _ints(text: str):
    return tuple(int(x) for x in text.split(",") if x)


def main_scale(args, argv):
    """The scale bench: a local Ray of 2 CPUs (or the one this process has), the JSON and the PNG."""
    import dataclasses

    import torch

    from bench import sorter_scale

    torch.set_num_threads(1)
    from bench.workloads import write_tiny_model

    defaults = sorter_scale.ScaleArgs()
    passed = {t.split("=")[0] for t in (sys.argv[1:] if argv is None else argv)}  # flags given explicitly
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(defaults) if f.name not in ("rows", "orders", "ordering_rows")
             if f.name == "reps" or hasattr(args, f.name) and f"--{f.name.replace('_', '-')}" in passed}
    a = dataclasses.replace(defaults, rows=_ints(args.scale_rows), orders=tuple(args.scale_orders.split(",")),
                            ordering_rows=_ints(args.ordering_rows), **given)
    out = args.out or os.path.join(ROOT, "bench", "results", "sorter_scale.json")
    model = write_tiny_model(tempfile.mkdtemp(prefix="tiny-dllm-"), hidden_size=a.hidden_size, n_layers=a.layers,
                             n_heads=4, n_kv_heads=4, intermediate_size=4 * a.hidden_size)
    command = "python bench/sorter_bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.driver_memory:
        return _driver_memory(model, a, out, command)
    t0 = time.perf_counter()
    with sorter_scale.bench_ray():
        result = sorter_scale.run_scale(model, a, log=lambda m: print(m, flush=True))
    result = {"command": command,
              "workload": dict(dataclasses.asdict(a), engines=2, device="cpu (2 cores, shared with a co-tenant)",
                               cache="refresh", canvas="full (bidirectional tiny model)",
                               model="random tiny LLaDA-style (bench/workloads.write_tiny_model)"),
              "bench_wall_s": time.perf_counter() - t0, **result}
    os.makedirs(os.path.dirname(out), exist_ok=True)
    if result["end_to_end"]:
        png = sorter_scale.plot(result["end_to_end"], result["summary"], os.path.splitext(out)[0] + ".png")
        result["plot"] = os.path.relpath(png, ROOT) if png.startswith(ROOT) else png
    with open(out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(json.dumps(result["summary"], indent=2, default=str), flush=True)
    return result


def merge_driver_memory(result: dict, mem: dict) -> dict:
    """`mem` (run_driver_memory's) into a scale result: as `driver_memory`, and its growth
    and target into `summary` beside the shared-driver figures."""
    result["driver_memory"] = mem
    summary = result.setdefault("summary", {})
    for key, value in mem.items():
        if key.startswith("driver_rss_growth_mb_"):
            summary[key + "_fresh_driver"] = value
    summary.setdefault("targets", {}).update({k + " (fresh driver per run)": v for k, v in mem["target"].items()})
    return result


def _driver_memory(model: str, a, out: str, command: str):
    """`--scale --driver-memory`: every run in a fresh driver (no Ray in this process);
    the result goes into the JSON at `out` under `driver_memory`, other keys kept."""
    from bench import sorter_scale

    t0 = time.perf_counter()
    mem = sorter_scale.run_driver_memory(model, a, log=lambda m: print(m, flush=True))
    mem = {"command": command, "bench_wall_s": time.perf_counter() - t0, **mem}
    result = merge_driver_memory(json.load(open(out)) if os.path.exists(out) else {}, mem)
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2, default=str)
    print(json.dumps({k: v for k, v in mem.items() if k != "runs"}, indent=2, default=str), flush=True)
    return result


if __name__ == "__main__":
    main()
