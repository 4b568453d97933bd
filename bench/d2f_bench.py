"""D2F pipelined block decoding on the CPU, measured with the engine's own counters.

    python bench/d2f_bench.py --threads 1 --out bench/results/d2f_cpu.json
    python bench/d2f_bench.py --smoke --out /tmp/d2f.json        # seconds (CI)

Reproduces the shape of the H200 characterisation of D2F-LLaDA serving (issue 25) on
the skewed workload (bench/workloads.py) with a block-causal model, all in one run:

1. steps per request: the histogram of each D2F request's denoising steps
   (RequestOutput.num_steps), next to the planted number of blocks k, and the levels it
   falls into (step counts that hold >= 3 requests and >= 5 % of them);
2. batching gain: requests/s and host fraction (1 - forward_s / wall, the engine's
   profiled forward time) of D2F requests at B = 1, 4, 16 with step-level sharing
   (blockserve, advance "step", max_batch_size B) against one request at a time
   (sequential), all on the first `--batching-requests` requests (one at a time is slow);
3. D2F against semi-AR: tokens per forward (generated tokens / the requests' denoising
   steps) and tokens/s for tau_add in TAUS against semi-autoregressive threshold
   decoding, same requests, same B, same cache; and per request whether D2F took fewer
   steps for the same tokens.

The planted model (bench/planted.py) makes the leftmost c masked columns of a row's
window confident each step (c per block), forces EOS from the planted position on, and
leaves the rest at the random model's flat probabilities. So D2F gains only what that
allows: a block's last step spills its unused confident tokens into the next block in
flight, and a complete block with nothing confident forces one token. A trained D2F
model is also confident in later blocks before their predecessor is done, which this
model never is: the gain measured here is a lower bound of D2F's.
Writes one JSON (command, machine, workload, every run, the three tables) and a PNG.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import sys
from collections import Counter
from typing import Any, Dict, List, Optional

import torch

if __package__ in (None, ""):  # `python bench/d2f_bench.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.engine_bench import git_state, machine_info  # noqa: E402
from bench.runner import RunSpec, run, warmup  # noqa: E402
from bench.workloads import SMOKE_SKEWED, SkewedSpec, Workload, skewed  # noqa: E402

TAUS = (0.1, 0.5, 0.7, 1.0)
D2F = dict(decoded_token_threshold=0.95, threshold=0.9)  # D2F-LLaDA's eval settings (engine/presets.py)
HIST_TAU = 0.7  # d2f-gsm8k's block_add_threshold


def with_d2f(w: Workload, tau_add: Optional[float]) -> Workload:
    """The workload with every request decoded by D2F at `tau_add` (None: semi-AR, as built)."""
    if tau_add is None:
        return w
    params = [dataclasses.replace(p, block_add_threshold=tau_add, **D2F) for p in w.params]
    return Workload(w.name, w.model, w.prompts, params, w.block_length, w.steps_per_block, w.tokenizer,
                    w.references, w.planted_blocks, dict(w.info))


def levels(steps: List[int], min_share: float = 0.05, min_requests: int = 3) -> Dict[str, Any]:
    """Whether the step counts fall into discrete levels: the counts that hold at least
    max(min_requests, min_share) of the requests, the share of requests on them, and the
    share on the 11 most common counts (the characterisation found 11 levels)."""
    c = Counter(steps)
    top = sorted(s for s, n in c.items() if n >= max(min_requests, min_share * len(steps)))
    top11 = sum(n for _, n in c.most_common(11))
    return {"levels": top, "n_levels": len(top), "share_on_levels": sum(c[s] for s in top) / len(steps),
            "share_on_11_most_common": top11 / len(steps), "distinct_step_counts": len(c)}


def record(r) -> Dict[str, Any]:
    d = r.summary()
    d["forwards_per_token"] = sum(r.request_steps) / max(1, r.tokens)
    return d


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    spec = dataclasses.replace(SMOKE_SKEWED if args.smoke else SkewedSpec(), dllm_attention="block_causal",
                               n_requests=args.n_requests or (12 if args.smoke else 48))
    w = skewed(spec)
    budget = 1 << 16
    sizes = [1, 4] if args.smoke else [1, 4, 16]
    big = max(sizes)
    warmup(w)
    spec_of = lambda label, scheduler, B: RunSpec(label, scheduler, budget, max_batch_size=B,  # noqa: E731
                                                  cache=args.cache, advance="step", canvas="block")
    runs: Dict[str, Any] = {}

    def go(label: str, scheduler: str, B: int, tau: Optional[float]):
        r = run(with_d2f(w, tau), spec_of(label, scheduler, B))
        if r.error:
            raise RuntimeError(f"{label}: {r.error}")
        runs[label] = r
        print(f"{label:>22}: {r.requests_per_s:7.2f} req/s {r.tokens_per_s:8.1f} tok/s "
              f"{r.tokens_per_step:5.2f} tok/step host {r.host_overhead:.3f}", flush=True)
        return r

    # 3. D2F against semi-AR at B = big (also gives 1.'s histogram at HIST_TAU and 2.'s B = big)
    semi = go(f"semi-AR@B{big}", "blockserve", big, None)
    for tau in TAUS:
        go(f"d2f-{tau}@B{big}", "blockserve", big, tau)
    # 2. batching gain: one request at a time against step-level sharing at each B, on one subset
    n_b = min(len(w.prompts), args.batching_requests or (12 if args.smoke else 24))
    full, w = w, w.subset(n_b)
    seq = go("d2f-sequential", "sequential", 1, HIST_TAU)
    for B in sizes:
        go(f"batching-d2f-{HIST_TAU}@B{B}", "blockserve", B, HIST_TAU)
    w = full
    per_cpu = lambda r: r.requests / r.cpu_s if r.cpu_s else 0.0  # noqa: E731 - robust to a shared machine
    batching = {}
    for B in sizes:
        r = runs[f"batching-d2f-{HIST_TAU}@B{B}"]
        batching[B] = {"requests_per_s": r.requests_per_s, "requests_per_cpu_s": per_cpu(r),
                       "host_fraction": r.host_overhead, "gain_over_one_at_a_time": r.requests_per_s
                       / seq.requests_per_s, "gain_over_one_at_a_time_cpu_time": per_cpu(r) / per_cpu(seq)}
    batching["one_at_a_time"] = {"requests_per_s": seq.requests_per_s, "requests_per_cpu_s": per_cpu(seq),
                                 "host_fraction": seq.host_overhead}
    batching["requests"] = n_b
    hist_run = runs[f"d2f-{HIST_TAU}@B{big}"]
    # batching never changes a request's tokens
    assert all(runs[f"batching-d2f-{HIST_TAU}@B{B}"].output_digests == seq.output_digests for B in sizes)
    assert hist_run.output_digests[:n_b] == seq.output_digests
    by_k: Dict[int, List[int]] = {}
    for k, s in zip(w.planted_blocks, hist_run.request_steps):
        by_k.setdefault(k, []).append(s)
    histogram = {"tau_add": HIST_TAU, "steps": hist_run.request_steps, "planted_blocks": w.planted_blocks,
                 "counts": dict(sorted(Counter(hist_run.request_steps).items())),
                 "steps_by_planted_blocks": {k: sorted(v) for k, v in sorted(by_k.items())},
                 **levels(hist_run.request_steps),
                 "semi_ar": levels(semi.request_steps)}
    versus = {}
    for tau in (None,) + TAUS:
        r = semi if tau is None else runs[f"d2f-{tau}@B{big}"]
        row = {"tokens_per_forward": r.tokens_per_step, "tokens_per_s": r.tokens_per_s,
               "tokens_per_cpu_s": r.tokens_per_cpu_s, "engine_forwards": r.forwards, "tokens": r.tokens}
        if tau is not None:
            fewer = [a < b for a, b in zip(r.request_steps, semi.request_steps)]
            more = [a > b for a, b in zip(r.request_steps, semi.request_steps)]
            same_tokens = r.request_tokens == semi.request_tokens
            row.update(requests_with_fewer_steps=sum(fewer), requests_with_more_steps=sum(more),
                       same_tokens_per_request=same_tokens,
                       fewer_forwards_per_token=r.tokens_per_step > semi.tokens_per_step)
        versus["semi-AR" if tau is None else f"d2f-{tau}"] = row
    claim = all(versus[f"d2f-{t}"]["fewer_forwards_per_token"] for t in TAUS if t <= 0.7)
    report = {
        "command": "python bench/d2f_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "machine": machine_info(args.threads),
        "git": git_state(), "workload": {"name": w.name, "n_requests": len(w.prompts), **w.info},
        "decoding": {"cache": args.cache, "advance": "step", "canvas": "block", "block_length": w.block_length,
                     "d2f": {"tau_add": list(TAUS), **D2F}, "semi_ar": {"policy": "threshold",
                                                                       "threshold": w.params[0].threshold}},
        "step_histogram": histogram, "batching": batching, "d2f_vs_semi_ar": versus,
        "d2f_fewer_forwards_per_token_at_tau_add_le_0.7": claim,
        "runs": {k: record(r) for k, r in runs.items()}, "smoke": args.smoke}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    plot(os.path.splitext(args.out)[0] + ".png", report)
    print(json.dumps({"batching": batching, "levels": histogram["n_levels"], "claim": claim}, indent=1))
    return report


def plot(path: str, report: Dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 5))
    h = report["step_histogram"]
    ks = sorted(set(h["planted_blocks"]))
    cmap = plt.get_cmap("viridis", max(2, len(ks)))
    data = [[s for s, k in zip(h["steps"], h["planted_blocks"]) if k == kk] for kk in ks]
    ax1.hist(data, bins=range(0, max(h["steps"]) + 2), stacked=True, color=[cmap(i) for i in range(len(ks))],
             label=[f"k={k}" for k in ks])
    ax1.set_xlabel("denoising steps per request")
    ax1.set_ylabel("requests")
    ax1.set_title(f"D2F steps per request (tau_add {h['tau_add']}): {h['distinct_step_counts']} distinct counts, "
                  f"{h['n_levels']} with >= 3 requests hold {100 * h['share_on_levels']:.0f}%", fontsize=9)
    ax1.legend(fontsize=6, title="planted blocks", title_fontsize=6)
    b = report["batching"]
    sizes = [k for k in b if k not in ("one_at_a_time", "requests")]
    x = range(len(sizes) + 1)
    rps = [b["one_at_a_time"]["requests_per_cpu_s"]] + [b[k]["requests_per_cpu_s"] for k in sizes]
    host = [b["one_at_a_time"]["host_fraction"]] + [b[k]["host_fraction"] for k in sizes]
    names = ["one at a time"] + [f"B={k}" for k in sizes]
    bars = ax2.bar(x, rps, color=["#888888"] + ["#1b9e77"] * len(sizes))
    for bar, v, hf in zip(bars, rps, host):
        ax2.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.2f}\nhost {100 * hf:.0f}%", ha="center",
                 va="bottom", fontsize=7)
    ax2.set_xticks(list(x))
    ax2.set_xticklabels(names)
    ax2.set_ylabel("requests per CPU-second (1 thread)")
    ax2.set_title(f"D2F batching gain (step-level sharing), first {b['requests']} requests", fontsize=9)
    v = report["d2f_vs_semi_ar"]
    labels = list(v)
    tpf = [v[k]["tokens_per_forward"] for k in labels]
    tps = [v[k]["tokens_per_cpu_s"] for k in labels]
    xs = range(len(labels))
    ax3.bar([i - 0.2 for i in xs], tpf, 0.4, color="#7570b3", label="tokens per forward")
    ax3b = ax3.twinx()
    ax3b.bar([i + 0.2 for i in xs], tps, 0.4, color="#d95f02", alpha=0.6, label="tokens per CPU-second")
    ax3.set_xticks(list(xs))
    ax3.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
    ax3.set_ylabel("tokens per forward")
    ax3b.set_ylabel("tokens per CPU-second")
    ax3.set_title("D2F vs semi-AR, skewed workload", fontsize=9)
    ax3.legend(loc="upper left", fontsize=7)
    ax3b.legend(loc="upper right", fontsize=7)
    m = report["machine"]
    fig.suptitle(f"{report['workload']['name']} ({report['workload']['n_requests']} requests, block-causal, "
                 f"cache {report['decoding']['cache']}); {m['processor']}, {m['cpu_count']} CPUs, torch "
                 f"{m['torch']} ({m['torch_threads']} threads)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/d2f_cpu.json", help="JSON path; the PNG goes next to it")
    ap.add_argument("--n-requests", type=int, default=None, help="default 48 (smoke 12)")
    ap.add_argument("--batching-requests", type=int, default=None,
                    help="requests of the batching table (one at a time is slow; default 24, smoke 12)")
    ap.add_argument("--cache", default="persistent", choices=["none", "refresh", "persistent"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument("--smoke", action="store_true", help="a tiny config that runs in seconds (CI)")
    return ap.parse_args(argv)


if __name__ == "__main__":
    main()
