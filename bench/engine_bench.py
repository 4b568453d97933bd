"""BlockServe vs Fast-dLLM-style static batching vs one-at-a-time, in one run.

    python bench/engine_bench.py --workload skewed --out bench/results/cpu_skewed.json
    python bench/engine_bench.py --workload tiny-eval --out bench/results/cpu_tiny_eval.json
    python bench/engine_bench.py --workload skewed --smoke --out /tmp/smoke.json   # seconds
    python bench/engine_bench.py --workload sdar --cache persistent --static-batch-sizes 8,16 \
        --repeats 2 --threads 1 --out bench/results/cpu_sdar.json

Why this shape: a speedup claim is only meaningful against the baselines the papers
beat (static batches of B run in lock step until the slowest finishes; sequential),
on the same model, requests and decoding, in the same process, at equal memory. So:
every scheduler serves the same `Workload`; blockserve's token budget is the peak
padded area |B| x width that static-B actually used (equal K/V and activation
memory); runs alternate (round r runs the list forwards when r is even, backwards
when odd, ABBA style) so that drift in a shared machine's load hits all schedulers;
the headline numbers are same-run ratios. Writes one JSON (the exact command, the
machine, the workload, every run, medians, ratios, targets) and a PNG next to it.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import dataclasses
from dataclasses import dataclass
from statistics import median
from typing import Dict, List, Optional

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.fastdllm_loop import run_peer  # noqa: E402
from bench.runner import RunResult, RunSpec, _widest, fit_overhead, run, warmup  # noqa: E402
from bench.workloads import (SMOKE_SDAR, SMOKE_SKEWED, SDARSpec, SkewedSpec, TinyEvalSpec, Workload,  # noqa: E402
                             skewed, tiny_eval)

TARGETS = {
    "skewed": {"blockserve_over_static": 2.0, "blockserve_over_sequential": 8.0,
               "blockserve_padding_max": 0.15, "blockserve_host_overhead_max": 0.15},
    "tiny-eval": {"blockserve_over_static": 1.5},
    "sdar": {},  # measured, no target set yet
}


PEER = "fastdllm-bs1-dual"  # bench/fastdllm_loop.py's label
# issue 28, acceptance 1 (full canvas + dual cache): blockserve with step advance against the peer and sequential
PEER_TARGETS = {"over_peer": 2.5, "over_sequential": 1.8}


@dataclass
class Plan:
    """Which runs a benchmark makes; `static_sizes` pairs each static-B with a blockserve
    run at the budget static-B used; `variants` adds blockserve runs at the middle budget
    with another advance/cache mode (e.g. "step", "persistent"). Every run serves every
request of the workload: ratios are between runs of the same requests."""

    static_sizes: List[int]
    sequential: bool
    variants: List[str]
    cache: str = "refresh"
    repeats: int = 1
    advance: str = "block"  # blockserve's advance mode (the baselines run in lock step either way)
    canvas: str = "auto"  # every run's canvas, baselines included (variants may override)
    forward_overhead_cells: Optional[float] = None  # every run's catch-up overhead (None: each fits online)
    peer: bool = False  # the Fast-dLLM-style batch-size-1 dual-cache loop (bench/fastdllm_loop.py)


def machine_info(threads: int) -> Dict[str, object]:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count(),
            "torch_threads": threads, "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def git_state() -> Dict[str, object]:
    """Which engine made the numbers: HEAD, whether tracked engine files differ from it,
    and a hash of engine/*.py as they were read (the engine changes often)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "engine"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
        h = hashlib.sha256()
        for dirpath, _, files in sorted(os.walk(os.path.join(root, "engine"))):
            for f in sorted(files):
                if f.endswith(".py"):
                    with open(os.path.join(dirpath, f), "rb") as fh:
                        h.update(f.encode() + fh.read())
        return {"commit": sha or None, "engine_dirty": bool(dirty), "engine_py_sha256": h.hexdigest()[:16]}
    except OSError:
        return {"commit": None, "engine_dirty": None}


def build_workload(args) -> Workload:
    if args.workload in ("skewed", "sdar"):
        sdar = args.workload == "sdar"
        spec = (SMOKE_SDAR if sdar else SMOKE_SKEWED) if args.smoke else (SDARSpec() if sdar else SkewedSpec())
        if args.n_requests:
            spec = dataclasses.replace(spec, n_requests=args.n_requests)
        return skewed(spec)
    spec = TinyEvalSpec(n_requests=args.n_requests or (16 if args.smoke else None))
    if args.model_dir:
        spec.model_dir = args.model_dir
    return tiny_eval(spec)


VARIANT_PARTS = {"none": "cache", "refresh": "cache", "persistent": "cache", "dual": "cache",
                 "block": "advance", "step": "advance", "canvas-block": "canvas", "canvas-full": "canvas",
                 "compile": "compile"}


def variant_spec(kind: str, budget: int, cache: str, label_budget: str, canvas: str = "auto",
                 forward_overhead_cells: Optional[float] = None) -> RunSpec:
    """`kind` is "+"-joined: a cache mode (none, refresh, persistent, dual), an advance
    mode (block, step), a canvas (canvas-block, canvas-full) and/or `compile` (the dual
    cache's block-only step through torch.compile: CUDA graphs on CUDA)."""
    parts = kind.split("+")
    bad = [p for p in parts if p not in VARIANT_PARTS]
    if bad or not parts:
        raise ValueError(f"unknown variant {kind!r}: join a cache mode (none, refresh, persistent, dual), an advance "
                         "mode (block, step), a canvas (canvas-block, canvas-full) and/or compile with +")
    pick = {VARIANT_PARTS[p]: p for p in parts}
    return RunSpec(f"blockserve+{kind}@{label_budget}", "blockserve", budget, cache=pick.get("cache", cache),
                   advance=pick.get("advance", "block"),
                   canvas=pick["canvas"].split("-")[1] if "canvas" in pick else canvas,
                   forward_overhead_cells=forward_overhead_cells, compile_decode="compile" in pick)


def planner_overhead(how: str, w: Workload, plan: Plan) -> Optional[float]:
    """`--overhead`: None (online), a given number, or one fit on blockserve at static-B's widest-row budget."""
    if how == "online":
        return None
    if how != "fit":
        return float(how)
    b = plan.static_sizes[len(plan.static_sizes) // 2]
    return round(fit_overhead(w, RunSpec("fit", "blockserve", b * _widest(w), cache=plan.cache, advance=plan.advance,
                                         canvas=plan.canvas)), 1)


def run_plan(w: Workload, plan: Plan, log=print) -> List[RunResult]:
    """Every run of the plan, `plan.repeats` rounds, alternating direction."""
    widest = _widest(w)
    budgets: Dict[int, int] = {}  # static B -> peak padded area static-B used
    results: List[RunResult] = []

    def order() -> List[tuple]:
        items: List[tuple] = []
        if plan.sequential:
            items.append(("sequential", None))
        if plan.peer:
            items.append(("peer", None))
        for b in plan.static_sizes:
            items += [("static", b), ("blockserve", b)]
        mid = plan.static_sizes[len(plan.static_sizes) // 2]
        items += [("variant", (v, mid)) for v in plan.variants]
        return items

    for r in range(plan.repeats):
        items = order() if r % 2 == 0 else order()[::-1]
        if r % 2 == 1:  # blockserve first needs the budgets of round 0
            assert all(b in budgets for b in plan.static_sizes)
        for kind, arg in items:
            same = dict(cache=plan.cache, canvas=plan.canvas, forward_overhead_cells=plan.forward_overhead_cells)
            if kind == "peer":
                results.append(run_peer(w))
                log(f"[round {r}] {results[-1].label:30s} {results[-1].tokens_per_cpu_s:8.1f} tok/cpu-s")
                continue
            if kind == "sequential":
                spec = RunSpec("sequential", "sequential", widest, max_batch_size=1, **same)
            elif kind == "static":
                spec = RunSpec(f"static-B{arg}", "static", widest, max_batch_size=arg, **same)
            elif kind == "blockserve":
                spec = RunSpec(f"blockserve@B{arg}", "blockserve", budgets[arg], advance=plan.advance, **same)
            else:
                v, b = arg
                spec = variant_spec(v, budgets[b], plan.cache, f"B{b}", plan.canvas, plan.forward_overhead_cells)
            res = run(w, spec)
            if kind == "static":
                budgets.setdefault(arg, max(res.peak_cost, widest))
            results.append(res)
            log(f"[round {r}] {res.label:30s} {res.tokens_per_s:8.1f} tok/s {res.tokens_per_cpu_s:8.1f} tok/cpu-s  "
                f"wall {res.wall_s:6.1f}s  "
                f"pad {res.padding_fraction:5.1%}  host {res.host_overhead:5.1%}  rows {res.mean_rows:5.1f}  "
                + (f"host/step {res.host_ms_per_step:.2f} ms (cpu {res.host_cpu_ms_per_step:.2f})  "
                   if res.host_ms_per_step is not None and res.host_cpu_ms_per_step is not None else "") +
                f"p50 {res.latency_p50_s:6.2f}s" + (f"  acc {res.accuracy:.3f}" if res.accuracy is not None else "")
                + (f"  ERROR {res.error}" if res.error else ""))
    return results


def summarize(results: List[RunResult]) -> Dict[str, Dict[str, object]]:
    """Per label: the median run by tokens/s (its fields), plus every round's tokens/s."""
    by: Dict[str, List[RunResult]] = {}
    for r in results:
        by.setdefault(r.label, []).append(r)
    out = {}
    for label, rs in by.items():
        med = median([r.tokens_per_s for r in rs])
        pick = min(rs, key=lambda r: abs(r.tokens_per_s - med))
        out[label] = {**pick.summary(), "tokens_per_s": med, "tokens_per_s_rounds": [r.tokens_per_s for r in rs],
                      "tokens_per_cpu_s_rounds": [r.tokens_per_cpu_s for r in rs],
                      "requests_per_s_rounds": [r.requests_per_s for r in rs],
                      "latencies_s_sorted": [round(t, 4) for t in sorted(pick.latencies_s)]}
    return out


def ratios(summary: Dict[str, Dict[str, object]], sizes: List[int], key: str = "tokens_per_s_rounds"
           ) -> Dict[str, float]:
    """Same-run throughput ratios: blockserve@B / static-B and blockserve@B / sequential
    (median over rounds of the per-round ratio); `key` picks wall-clock or CPU-time rates."""
    def r(a, b):
        return median([x / y for x, y in zip(a[key], b[key])])

    out: Dict[str, float] = {}
    seq = summary.get("sequential")
    for b in sizes:
        bs, st = summary.get(f"blockserve@B{b}"), summary.get(f"static-B{b}")
        if bs and st:
            out[f"blockserve/static@B{b}"] = r(bs, st)
        if bs and seq:
            out[f"blockserve@B{b}/sequential"] = r(bs, seq)
    for label, s in summary.items():
        if label.startswith("blockserve+"):
            b = label.split("@B")[-1]
            if seq:
                out[f"{label}/sequential"] = r(s, seq)
            st = summary.get(f"static-B{b}")
            if st:
                out[f"{label}/static"] = r(s, st)
            main = summary.get(f"blockserve@B{b}")
            if main:  # e.g. the cost of the full canvas: blockserve@B16 / blockserve+canvas-block@B16
                out[f"blockserve@B{b}/{label}"] = r(main, s)
    peer = summary.get(PEER)
    for label, s in summary.items():  # every engine run against the Fast-dLLM-style batch-1 loop
        if peer and label != PEER and s["scheduler"] in ("blockserve", "sequential"):
            out[f"{label}/{PEER}"] = r(s, peer)
    return out


def check_targets(workload: str, summary, rat, sizes) -> Dict[str, object]:
    t = TARGETS[workload]
    out: Dict[str, object] = {"targets": t}
    over_static = {b: rat.get(f"blockserve/static@B{b}") for b in sizes}
    if "blockserve_over_static" in t:
        out["blockserve_over_static_met"] = {f"B{b}": (v is not None and v >= t["blockserve_over_static"])
                                             for b, v in over_static.items()}
    if "blockserve_over_sequential" in t:
        out["blockserve_over_sequential_met"] = {
            f"B{b}": (rat.get(f"blockserve@B{b}/sequential") or 0) >= t["blockserve_over_sequential"] for b in sizes}
    bs = [summary[f"blockserve@B{b}"] for b in sizes if f"blockserve@B{b}" in summary]
    if "blockserve_padding_max" in t:
        out["blockserve_padding_met"] = {s["label"]: s["padding_fraction"] <= t["blockserve_padding_max"] for s in bs}
    if "blockserve_host_overhead_max" in t:
        out["blockserve_host_overhead_met"] = {s["label"]: s["host_overhead"] <= t["blockserve_host_overhead_max"]
                                               for s in bs}
    step = next((k for k in summary if k.startswith("blockserve+step@")), None)
    if step and PEER in summary:
        key = "tokens_per_cpu_s_rounds"
        s = summary[step]
        # the share of the run's time in catch-up forwards: each row's whole-row recompute at its block start,
        # which the reference requires and batching cannot share; ratio / share is the ratio if all else were free
        share = ((s["catch_up"] or {}).get("forward_share") or 0) * s["forward_s"] / s["wall_s"] if s["wall_s"] else 0
        for name, base in (("over_peer", PEER), ("over_sequential", "sequential")):
            if base in summary:
                v = median([x / y for x, y in zip(s[key], summary[base][key])])
                out[f"{step}_{name}_cpu"] = {"ratio": v, "target": PEER_TARGETS[name], "met": v >= PEER_TARGETS[name],
                                             "catch_up_time_share": share, "ceiling": v / share if share else None}
    accs = {label: s["accuracy"] for label, s in summary.items() if s.get("accuracy") is not None}
    if accs:
        full = {label: a for label, a in accs.items() if summary[label]["requests"] == max(
            summary[x]["requests"] for x in accs)}
        out["accuracy"] = accs
        out["same_accuracy"] = len(set(round(a, 9) for a in full.values())) == 1
    return out


def outputs_agree(results: List[RunResult]) -> bool:
    """Every run generated exactly the same tokens for every request it served (a
    scheduler must not change what is generated)."""
    ref = max(results, key=lambda r: len(r.output_digests)).output_digests
    return all(r.output_digests == ref[: len(r.output_digests)] for r in results if r.error is None)


def plot(path: str, report: Dict[str, object]) -> None:
    """Throughput bars, where the compute went (padding and idle rows), latency CDFs;
    drawn from the report alone, so `--replot` redraws a committed JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["schedulers"]
    labels = list(summary)
    n_all = report["workload"]["n_requests"]
    names = [f"{x}\n(first {summary[x]['requests']})" if summary[x]["requests"] < n_all else x for x in labels]
    colors = {"sequential": "#888888", "static": "#d95f02", "blockserve": "#1b9e77"}
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 5.2), gridspec_kw={"width_ratios": [1.2, 1.2, 1]})
    x = range(len(labels))
    tps = [summary[k]["tokens_per_s"] for k in labels]
    cps = [summary[k].get("tokens_per_cpu_s", 0.0) for k in labels]
    w = 0.4
    cols = [colors.get(summary[k]["scheduler"], "#7570b3") for k in labels]
    bars = ax1.bar([i - w / 2 for i in x], tps, w, color=cols, label="per wall-clock second")
    bars2 = ax1.bar([i + w / 2 for i in x], cps, w, color=cols, alpha=0.45, hatch="//",
                    label="per CPU-second of this process")
    for b, v in list(zip(bars, tps)) + list(zip(bars2, cps)):
        ax1.text(b.get_x() + b.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom", fontsize=6)
    ax1.set_ylabel("generated tokens / s")
    ax1.set_title("throughput")
    ax1.legend(fontsize=7)
    pad = [summary[k]["padding_fraction"] for k in labels]
    idle = [summary[k].get("idle_row_fraction") for k in labels]  # None: not measured (no planted wrapper)
    ax2.bar([i - w / 2 for i in x], pad, w, label="padding (pad cells / computed cells)", color="#e7298a")
    if any(v is not None for v in idle):
        ax2.bar([i + w / 2 for i in x], [v or 0.0 for v in idle], w, label="idle rows (row had nothing left to unmask)",
                color="#66a61e")
    ax2.axhline(0.15, color="k", lw=0.8, ls=":")
    ax2.set_ylim(0, 1)
    ax2.set_title("wasted forward columns")
    ax2.legend(fontsize=7, loc="upper left")
    for ax in (ax1, ax2):
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=35, ha="right", fontsize=7)
    for k, name in zip(labels, names):
        xs = summary[k].get("latencies_s_sorted") or []
        if xs:
            ax3.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name.replace("\n", " "),
                     linestyle="--" if summary[k]["scheduler"] == "static" else "-")
    ax3.set_xscale("log")
    ax3.set_xlabel("request latency, s (all requests arrive at t=0)")
    ax3.set_ylabel("fraction of requests done")
    ax3.set_title("latency CDF")
    ax3.legend(fontsize=6)
    m, rat = report["machine"], report["ratios"]
    head = "wall: " + ", ".join(f"{k} {v:.2f}x" for k, v in rat.items() if "+" not in k)
    if report.get("ratios_cpu_time"):
        head += "\nCPU time: " + ", ".join(f"{k} {v:.2f}x" for k, v in report["ratios_cpu_time"].items()
                                            if "+" not in k)
    fig.suptitle(f"{report['workload']['name']}: {n_all} requests; {m['processor']}, {m['cpu_count']} CPUs, "
                 f"torch {m['torch']} ({m['torch_threads']} threads); cache {report['decoding']['cache']}, "
                 f"canvas {'/'.join(report['decoding'].get('canvas', ['block']))}; "
                 f"blockserve advance {report['decoding'].get('blockserve_advance', 'block')}\n{head}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=["skewed", "tiny-eval", "sdar"])
    ap.add_argument("--out", help="JSON path; the PNG goes next to it")
    ap.add_argument("--replot", default=None, help="redraw the PNG of an existing results JSON and exit")
    ap.add_argument("--static-batch-sizes", default=None, help="comma list, default 8,16,32 (smoke: 2,4)")
    ap.add_argument("--sequential", action=argparse.BooleanOptionalAction, default=True,
                    help="run the sequential baseline (on every request, as every run; it is slow: pick --n-requests)")
    ap.add_argument("--n-requests", type=int, default=None, help="the workload's first N requests, for every run")
    ap.add_argument("--overhead", default="fit",
                    help="the catch-up planner's cost of one more forward, in cells, for every run: 'fit' (fitted "
                         "once before the runs on the first requests and recorded; the runs' plans are then "
                         "reproducible), a number, or 'online' (each engine fits its own as it runs)")
    ap.add_argument("--variants", default="",
                    help="extra blockserve runs at the middle budget, e.g. step,persistent,persistent+step,"
                         "canvas-block (the same cache and advance on the other canvas)")
    ap.add_argument("--cache", default="refresh", choices=["none", "refresh", "persistent", "dual"],
                    help="every run's cache (the static baseline's too)")
    ap.add_argument("--canvas", default="auto", choices=["auto", "block", "full"],
                    help="every run's canvas (auto: full for bidirectional models, block for block-causal ones)")
    ap.add_argument("--advance", default="block", choices=["block", "step"], help="blockserve's advance mode")
    ap.add_argument("--repeats", type=int, default=1, help="rounds; odd rounds run the list backwards")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--model-dir", default=None, help="tiny-eval: model directory (default engine/assets/tiny-dllm)")
    ap.add_argument("--smoke", action="store_true", help="a tiny config that runs in seconds (CI)")
    args = ap.parse_args(argv)
    if not args.replot and not (args.workload and args.out):
        ap.error("--workload and --out are required (or --replot JSON)")
    return args


def main(argv=None) -> Dict[str, object]:
    args = parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            report = json.load(f)
        plot(os.path.splitext(args.replot)[0] + ".png", report)
        return report
    argv_used = sys.argv[1:] if argv is None else list(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = [int(x) for x in (args.static_batch_sizes or ("2,4" if args.smoke else "8,16,32")).split(",")]
    plan = Plan(sizes, args.sequential, [v for v in args.variants.split(",") if v], cache=args.cache,
                repeats=args.repeats, advance=args.advance, canvas=args.canvas,
                peer=args.cache == "dual" and args.canvas == "full")
    git = git_state()  # before the runs: the engine files may change on disk while they go
    w = build_workload(args)
    warmup(w)
    plan.forward_overhead_cells = planner_overhead(args.overhead, w, plan)
    print(f"workload {w.name}: {len(w.prompts)} requests; plan {plan}", flush=True)
    results = run_plan(w, plan, log=lambda s: print(s, flush=True))
    summary = summarize(results)
    rat = ratios(summary, sizes)
    report = {
        "command": "python bench/engine_bench.py " + " ".join(shlex.quote(a) for a in argv_used),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git": git,
        "machine": machine_info(torch.get_num_threads()),
        "workload": {"name": w.name, "n_requests": len(w.prompts), **w.info},
        "decoding": {"block_length": w.block_length, "steps_per_block": w.steps_per_block,
                     "policy": w.params[0].policy, "threshold": w.params[0].threshold,
                     "max_new_tokens": w.params[0].max_new_tokens, "cache": plan.cache,
                     "canvas": sorted({r.canvas for r in results if r.label.count("+") == 0}),
                     "blockserve_advance": plan.advance},
        "plan": plan.__dict__,
        "planner": {"overhead": args.overhead, "forward_overhead_cells": plan.forward_overhead_cells},
        "schedulers": summary,
        "ratios": rat,
        "ratios_cpu_time": ratios(summary, sizes, key="tokens_per_cpu_s_rounds"),
        "targets": check_targets(w.name, summary, rat, sizes),
        "outputs_agree": outputs_agree(results),
        "runs": [r.summary() for r in results],
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    png = os.path.splitext(args.out)[0] + ".png"
    plot(png, report)
    print(json.dumps({"ratios": rat, "ratios_cpu_time": report["ratios_cpu_time"], "targets": report["targets"],
                      "outputs_agree": report["outputs_agree"]}, indent=2))
    print(f"wrote {args.out} and {png}")
    return report


if __name__ == "__main__":
    main()
