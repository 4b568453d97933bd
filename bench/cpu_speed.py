"""Issue 51 acceptance 6 on the CPU: the skewed bench and the full-canvas peer bench, this
tree against another checkout (the pre-issue commit 9fab8d8), in tokens per CPU-second.

Each tree runs in a worker process of its own with the tree's `engine` first on its path
(bench/runner.py, bench/workloads.py and bench/fastdllm_loop.py are the same in both),
one torch thread, the same requests and a fixed catch-up overhead (the plan, hence the
tokens, do not depend on timings); the two alternate run by run, ABBA, so a shared
machine's drift hits both trees. The ratio is new / base per round (median and range)
and of the best runs, with the tokens' digests checked equal. CPU time is the process's
(time.process_time), not wall time.

    python bench/cpu_speed.py --base /work/wt-base --rounds 8 --out /tmp/cpu_speed.json"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from statistics import median
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = ("skewed", "full-dual", "peer")  # blockserve on the skewed bench; full canvas + dual: blockserve, the peer


def _run(w, case: str, batch: int) -> Dict[str, Any]:
    """One run of `case` over workload `w` with this process's engine."""
    from bench.engine_bench import _widest
    from bench.fastdllm_loop import run_peer
    from bench.runner import RunSpec, run

    if case == "peer":
        r = run_peer(w)
    else:
        full = case == "full-dual"
        spec = RunSpec(case, "blockserve", batch * _widest(w), max_batch_size=batch, forward_overhead_cells=100,
                       cache="dual" if full else "refresh", canvas="full" if full else "auto",
                       advance="step" if full else "block")
        r = run(w, spec)
    return {"tokens": r.tokens, "cpu_s": r.cpu_s, "tokens_per_cpu_s": r.tokens_per_cpu_s,
            "digest": hash(tuple(r.output_digests))}


def worker(n: int, batch: int) -> None:
    """Serves runs for the driver: a case name per stdin line, a JSON line back (the
    workload built once, its tree's engine first on sys.path)."""
    import torch

    from bench.workloads import SkewedSpec, skewed

    torch.set_num_threads(1)
    w = skewed(SkewedSpec(n_requests=n))
    print("ready", flush=True)
    for line in sys.stdin:
        print(json.dumps(_run(w, line.strip(), batch)), flush=True)


class _Tree:
    """A worker process over one checkout."""

    def __init__(self, tree: str, n: int, batch: int):
        env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--n-requests", str(n), "--batch", str(batch)]
        self.p = subprocess.Popen(cmd, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.p.stdout.readline().strip() == "ready"

    def run(self, case: str) -> Dict[str, Any]:
        self.p.stdin.write(case + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait()


def compare(base: str, new: str, rounds: int, n: int, batch: int, cases=CASES) -> Dict[str, Any]:
    runs: Dict[str, Dict[str, List[Dict[str, Any]]]] = {c: {"base": [], "new": []} for c in cases}
    trees = {"base": _Tree(base, n, batch), "new": _Tree(new, n, batch)}
    try:
        for r in range(rounds):
            order = ["base", "new"] if r % 2 == 0 else ["new", "base"]
            for case in cases:
                for name in order:
                    got = trees[name].run(case)
                    runs[case][name].append(got)
                    print(f"[round {r}] {case:9s} {name:4s} {got['tokens_per_cpu_s']:8.1f} tok/cpu-s "
                          f"({got['tokens']} tokens, {got['cpu_s']:.2f} cpu-s)", flush=True)
    finally:
        for t in trees.values():
            t.close()
    summary = {}
    for case, by in runs.items():
        ratios = [b["tokens_per_cpu_s"] / a["tokens_per_cpu_s"] for a, b in zip(by["base"], by["new"])]
        best = max(x["tokens_per_cpu_s"] for x in by["new"]) / max(x["tokens_per_cpu_s"] for x in by["base"])
        summary[case] = {"ratio_median": median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                         "ratio_of_best": best, "ratios": ratios,
                         "same_tokens": len({x["digest"] for x in by["base"] + by["new"]}) == 1,
                         "base_cpu_s": [x["cpu_s"] for x in by["base"]], "new_cpu_s": [x["cpu_s"] for x in by["new"]]}
    return {"summary": summary, "runs": runs}


def plot(res: Dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for i, (case, s) in enumerate(res["summary"].items()):
        ax.scatter([i] * len(s["ratios"]), s["ratios"], color="C0")
        ax.plot([i - 0.2, i + 0.2], [s["ratio_median"]] * 2, color="C1")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(res["summary"])), list(res["summary"]))
    ax.set_ylabel("tokens per CPU-s, new / base")
    ax.set_title("issue 51: CPU speed against 9fab8d8 (per ABBA round)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="the other checkout (e.g. `git worktree add /work/wt-base 9fab8d8`)")
    ap.add_argument("--new", default=os.path.dirname(HERE))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--n-requests", type=int, default=8, help="the skewed workload's first N requests")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default=None, help="JSON path; the PNG goes next to it")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.n_requests, a.batch)
        return 0
    t0 = time.time()
    res = compare(a.base, a.new, a.rounds, a.n_requests, a.batch, a.cases.split(","))
    res["command"] = "python " + " ".join([os.path.relpath(__file__, a.new)] + (argv or sys.argv[1:]))
    res["wall_s"] = time.time() - t0
    for case, s in res["summary"].items():
        print(f"{case}: new/base tokens per CPU-s median {s['ratio_median']:.3f} "
              f"[{s['ratio_min']:.3f}, {s['ratio_max']:.3f}], best over best {s['ratio_of_best']:.3f}, "
              f"same tokens {s['same_tokens']}")
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
        plot(res, os.path.splitext(a.out)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
