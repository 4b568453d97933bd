"""The engine's K/V memory, K/V copies and host loop against a baseline commit, in one run.

    python bench/kv_bench.py --baseline 7d10492 --out bench/results/kv_slots.json   # ~8 min
    python bench/kv_bench.py --smoke --out /tmp/kv.json                             # seconds, no baseline

engine_bench's skewed workload served by blockserve with the refresh cache (and
persistent at B16), advance="step", canvas="block", at the token budgets of
engine_bench's static-B runs (B x the widest row: B = 8, 16, 32, 64). Each
configuration runs in this tree and in a git worktree of `--baseline` (this file, run
there in a subprocess: same workload, budgets and machine, minutes apart). Per run:
peak_kv_over_budget, kv_bytes_copied_per_token (and by cause where the engine counts
them), host_ms_per_step, syncs_per_step, host_overhead (wall time outside forwards);
`ratios` holds baseline / new for copies and peak, and both host fractions. Only
ratios and counters mean anything on a shared machine; the counters are exact.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = ("wall_s", "tokens", "tokens_per_s", "host_overhead", "peak_kv_over_budget", "kv_bytes_copied_per_token",
        "kv_copied_by_per_token", "host_ms_per_step", "syncs_per_step", "steps", "forwards", "padding_fraction")


def measure(root: str, smoke: bool) -> dict:
    """Every configuration in the tree at `root` (its engine and bench modules)."""
    sys.path.insert(0, root)
    import torch

    from bench.runner import RunSpec, _widest, run
    from bench.workloads import SMOKE_SKEWED, SkewedSpec, skewed

    torch.set_num_threads(1)
    w = skewed(SMOKE_SKEWED if smoke else SkewedSpec())
    widest = _widest(w)
    configs = [(f"refresh@B{b}", "refresh", b) for b in ((2, 4) if smoke else (8, 16, 32, 64))]
    configs.append((f"persistent@B{configs[1][2]}", "persistent", configs[1][2]))
    out = {}
    for label, cache, b in configs:
        res = run(w, RunSpec(label, "blockserve", b * widest, cache=cache, advance="step", canvas="block")).summary()
        d = {k: res.get(k) for k in KEYS}  # a baseline without a figure gives None
        out[label] = d
        print(label, json.dumps(d), file=sys.stderr, flush=True)
    return {"token_budgets": {label: b * widest for label, _, b in configs}, "runs": out}


def baseline(ref: str, smoke: bool) -> dict:
    tree = os.path.join("/tmp", f"blockray-baseline-{ref}")
    if not os.path.isdir(tree):
        subprocess.run(["git", "worktree", "add", "--detach", "-f", tree, ref], cwd=HERE, check=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--tree", tree] + (["--smoke"] if smoke else [])
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=tree).stdout)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", default=None, help="git ref to compare with (run in a worktree)")
    ap.add_argument("--out", default="bench/results/kv_slots.json")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--tree", default=None, help=argparse.SUPPRESS)  # internal: measure that tree, JSON to stdout
    args = ap.parse_args(argv)
    if args.tree:
        print(json.dumps(measure(args.tree, args.smoke)))
        return {}
    t0 = time.time()
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout
    data = {"command": " ".join(["python", "bench/kv_bench.py"] + (argv or sys.argv[1:])),
            "commit": sha.strip(), "new": measure(HERE, args.smoke)}
    if args.baseline:
        data["baseline_ref"] = args.baseline
        data["baseline"] = baseline(args.baseline, args.smoke)
        ratios = {}
        for label, new in data["new"]["runs"].items():
            old = data["baseline"]["runs"].get(label)
            if not old:
                continue
            ratios[label] = {
                "kv_bytes_copied_per_token_baseline_over_new":
                    old["kv_bytes_copied_per_token"] / new["kv_bytes_copied_per_token"]
                    if new["kv_bytes_copied_per_token"] else None,
                "peak_kv_over_budget": [old["peak_kv_over_budget"], new["peak_kv_over_budget"]],
                "host_overhead": [old["host_overhead"], new["host_overhead"]],
                "tokens_per_s_new_over_baseline": new["tokens_per_s"] / old["tokens_per_s"]}
        data["ratios"] = ratios
    data["seconds"] = time.time() - t0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=2)
    print(json.dumps(data.get("ratios", data["new"]["runs"]), indent=2))
    return data


if __name__ == "__main__":
    main()
