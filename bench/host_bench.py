"""Where one denoising step's host time goes (issue 41): the skewed workload served by
blockserve at a static-B budget and by static-B, with the step path's phases timed.

    python bench/host_bench.py --out bench/results/host_skewed.json
    python bench/host_bench.py --out bench/results/host_skewed.json --before bench/results/host_skewed_before.json
    python bench/host_bench.py --smoke --out /tmp/host.json        # seconds

Why line timings rather than a sampling profiler: the phases are a handful of named
functions (the engine's and the runner's), so wrapping them is exact and the same
script measures any commit that has them (`--before`: this script run against an older
checkout, whose JSON is kept as the "before"). Each phase is timed exclusive of the
phases it calls (a stack of timers), in wall time and in CPU time of the stepping thread
(time.thread_time: what co-tenants' load does not move; with one torch thread the
model's forward is that thread's work too). `forward` is the model call itself; `host`
is everything else inside Engine.step, per denoising step. On a CPU the tensor work of
the step (the float64 softmax of propose, the selection's sorts) is host time; on an
accelerator it is device work queued behind the forward.

`--op-split` answers how much of it that is: each run is repeated under a dispatch mode
(OpClock) that times every aten op's call in thread CPU and books it to the phase it ran
in, with their count; a phase's `tensor_cpu_ms_per_step` is that time (the kernels and
torch's C++ dispatch of each op), its `python_cpu_ms_per_step` the rest of its CPU time
in the plain run (the interpreter), `ops_per_step` its aten ops: next to a GPU each op
outside the forward is a kernel launch or a host op, so the host's share of a step is
about the Python time plus those ops' launch costs.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench.engine_bench import git_state, machine_info  # noqa: E402
from bench.runner import RunSpec, _widest, run, warmup  # noqa: E402
from bench.workloads import SMOKE_SKEWED, SkewedSpec, skewed  # noqa: E402

# (phase, module, owner, attribute): what is timed. An attribute a checkout lacks is skipped.
PHASES = [
    ("form batch", "engine.engine", "Engine", "_form_batch"),
    ("noise keys", "engine.engine", "Engine", "_noise_keys"),
    ("propose", "engine.engine", None, "propose"),
    ("select", "engine.engine", None, "select"),
    ("device read", "engine.engine", "Engine", "_fetch"),
    ("commit", "engine.engine", "Engine", "_commit"),
    ("forward plan", "engine.runner", "ModelRunner", "plan"),
    ("catch-up plan", "engine.runner", None, "catch_up_groups"),
    ("forward inputs", "engine.runner", "ModelRunner", "run"),
    ("step rest", "engine.engine", "Engine", "_denoise"),
    ("loop rest", "engine.core", "EngineCore", "step"),
]


class OpClock(TorchDispatchMode):
    """Thread-CPU seconds inside aten ops, booked to the phase on top of `clock`'s stack."""

    def __init__(self, clock: "PhaseClock"):
        super().__init__()
        self.clock = clock
        self.cpu: Dict[str, float] = {}
        self.ops: Dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        c = time.thread_time()
        out = func(*args, **(kwargs or {}))
        name = self.clock.stack[-1][0] if self.clock.stack else "outside the phases"
        self.cpu[name] = self.cpu.get(name, 0.0) + time.thread_time() - c
        self.ops[name] = self.ops.get(name, 0) + 1
        return out


class PhaseClock:
    """Exclusive wall and thread-CPU seconds per phase: entering a phase pauses the one it
    was called from."""

    def __init__(self):
        self.wall: Dict[str, float] = {}
        self.cpu: Dict[str, float] = {}
        self.calls: Dict[str, int] = {}
        self.stack: List[List[Any]] = []

    def enter(self, name: str) -> None:
        w, c = time.perf_counter(), time.thread_time()
        if self.stack:
            top = self.stack[-1]
            self.wall[top[0]] = self.wall.get(top[0], 0.0) + w - top[1]
            self.cpu[top[0]] = self.cpu.get(top[0], 0.0) + c - top[2]
        self.stack.append([name, w, c])
        self.calls[name] = self.calls.get(name, 0) + 1

    def leave(self) -> None:
        w, c = time.perf_counter(), time.thread_time()
        name, w0, c0 = self.stack.pop()
        self.wall[name] = self.wall.get(name, 0.0) + w - w0
        self.cpu[name] = self.cpu.get(name, 0.0) + c - c0
        if self.stack:
            self.stack[-1][1], self.stack[-1][2] = w, c

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*a, **k):
            self.enter(name)
            try:
                return fn(*a, **k)
            finally:
                self.leave()
        timed.__wrapped__ = fn
        return timed


def instrument(clock: PhaseClock, model: torch.nn.Module) -> Callable[[], None]:
    """Wrap the phases (and the model's forward, as `forward`); returns what unwraps them."""
    import importlib

    undo = []
    for name, mod, owner, attr in PHASES:
        m = importlib.import_module(mod)
        target = getattr(m, owner) if owner else m
        if not hasattr(target, attr):
            continue
        orig = target.__dict__[attr] if owner else getattr(m, attr)
        setattr(target, attr, clock.wrap(name, orig))
        undo.append((target, attr, orig))
    model.forward = clock.wrap("forward", model.forward)
    undo.append((model, "forward", None))

    def restore() -> None:
        for target, attr, orig in undo:
            if orig is None:
                delattr(target, attr)
            else:
                setattr(target, attr, orig)
    return restore


def timed_run(w, spec: RunSpec, ops: bool = False):
    """(the run's result, its PhaseClock, its OpClock or None)."""
    clock = PhaseClock()
    op_clock = OpClock(clock) if ops else None
    restore = instrument(clock, w.model)
    try:
        with op_clock or contextlib.nullcontext():
            res = run(w, spec)
    finally:
        restore()
    return res, clock, op_clock


def measure(w, spec: RunSpec, op_split: bool = False) -> Dict[str, Any]:
    res, clock, _ = timed_run(w, spec)
    steps = max(1, res.steps)
    phases = {k: {"wall_ms_per_step": 1e3 * clock.wall.get(k, 0.0) / steps,
                  "cpu_ms_per_step": 1e3 * clock.cpu.get(k, 0.0) / steps, "calls": clock.calls.get(k, 0)}
              for k in [p[0] for p in PHASES] + ["forward"] if k in clock.calls}
    host = {k: v for k, v in phases.items() if k != "forward"}
    split = {}
    if op_split:
        again, _, ops = timed_run(w, spec, ops=True)
        assert again.output_digests == res.output_digests, "the op-timed run decoded other tokens"
        for k, v in phases.items():
            v["tensor_cpu_ms_per_step"] = 1e3 * ops.cpu.get(k, 0.0) / steps
            v["python_cpu_ms_per_step"] = v["cpu_ms_per_step"] - v["tensor_cpu_ms_per_step"]
            v["ops_per_step"] = ops.ops.get(k, 0) / steps
        split = {"host_tensor_cpu_ms_per_step": sum(v["tensor_cpu_ms_per_step"] for v in host.values()),
                 "host_python_cpu_ms_per_step": sum(v["python_cpu_ms_per_step"] for v in host.values()),
                 "host_ops_per_step": sum(v["ops_per_step"] for v in host.values()),
                 "forward_ops_per_step": phases.get("forward", {}).get("ops_per_step")}
    return {"label": spec.label, "scheduler": spec.scheduler, "token_budget": spec.token_budget,
            "max_batch_size": spec.max_batch_size, "steps": res.steps, "mean_rows": res.mean_rows,
            "max_rows": res.max_rows, "peak_cost": res.peak_cost, "tokens": res.tokens, "output_digest": hash(tuple(res.output_digests)),
            "host_ms_per_step": sum(v["wall_ms_per_step"] for v in host.values()),
            "host_cpu_ms_per_step": sum(v["cpu_ms_per_step"] for v in host.values()),
            "forward_ms_per_step": phases.get("forward", {}).get("wall_ms_per_step"),
            "forward_cpu_ms_per_step": phases.get("forward", {}).get("cpu_ms_per_step"),
            "engine_host_ms_per_step": res.host_ms_per_step, "syncs_per_step": res.syncs_per_step,
            **split, "phases": phases, "loadavg": res.loadavg, "error": res.error}


def plot(path: str, report: Dict[str, Any]) -> None:
    """Stacked bars: host CPU ms per step by phase, per run, after (and before when given)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(f"{r['label']}\n(after)", r) for r in report["runs"]]
    if report.get("before"):
        bars = [(f"{r['label']}\n(before)", r) for r in report["before"]["runs"]] + bars
        bars.sort(key=lambda x: x[0].split("\n")[0])
    names = [p[0] for p in PHASES]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(bars)), 5))
    cmap = plt.get_cmap("tab20")
    bottom = [0.0] * len(bars)
    for j, ph in enumerate(names):
        vals = [r["phases"].get(ph, {}).get("cpu_ms_per_step", 0.0) for _, r in bars]
        ax.bar(range(len(bars)), vals, bottom=bottom, color=cmap(j), label=ph)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, b in enumerate(bottom):
        ax.text(i, b, f"{b:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels([b[0] for b in bars], fontsize=7)
    ax.set_ylabel("host CPU ms per denoising step (thread time)")
    ax.set_title("host time of one denoising step, by phase (skewed workload, 1 thread)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON path; the PNG goes next to it")
    ap.add_argument("--sizes", default="32", help="static B sizes; blockserve runs at each one's padded area")
    ap.add_argument("--budgets", default=None, help="comma list of blockserve budgets, one per size (skips static's "
                    "run for the budget: e.g. 34208,68416, what static-B32 and B64 used in cpu_skewed.json)")
    ap.add_argument("--no-static", action="store_true", help="blockserve runs only (needs --budgets)")
    ap.add_argument("--before", default=None, help="a JSON this script wrote on an older checkout: kept as before")
    ap.add_argument("--runs-from", default=None, help="take the runs from a JSON this script wrote (no measuring): "
                    "pair an after with a before measured at the same time")
    ap.add_argument("--n-requests", type=int, default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--op-split", action="store_true", help="repeat each run with every aten op timed: host CPU "
                    "split into tensor work and the rest (Python, dispatch)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.runs_from:
        with open(args.runs_from) as f:
            report = json.load(f)
        report["command"] += f" (runs; paired with --before {args.before} by: python {' '.join(sys.argv)})"
        return write(args, report)
    spec = SMOKE_SKEWED if args.smoke else SkewedSpec()
    if args.n_requests:
        import dataclasses
        spec = dataclasses.replace(spec, n_requests=args.n_requests)
    w = skewed(spec)
    warmup(w)
    sizes = [int(s) for s in args.sizes.split(",")]
    budgets = [int(b) for b in args.budgets.split(",")] if args.budgets else [None] * len(sizes)
    if args.no_static and None in budgets:
        ap.error("--no-static needs --budgets")
    widest = _widest(w)
    runs = []
    for b, budget in zip(sizes, budgets):
        if not args.no_static:
            r = measure(w, RunSpec(f"static-B{b}", "static", widest, max_batch_size=b), args.op_split)
            runs.append(r)
            print(f"{r['label']:20s} host {r['host_ms_per_step']:6.2f} ms/step (cpu {r['host_cpu_ms_per_step']:6.2f})"
                  f"  forward {r['forward_ms_per_step']:6.2f}", flush=True)
        if budget is None:
            budget = max(runs[-1]["peak_cost"], widest)
        r = measure(w, RunSpec(f"blockserve@B{b}", "blockserve", budget), args.op_split)
        runs.append(r)
        print(f"{r['label']:20s} host {r['host_ms_per_step']:6.2f} ms/step (cpu {r['host_cpu_ms_per_step']:6.2f})"
              f"  forward {r['forward_ms_per_step']:6.2f}  rows {r['mean_rows']:.1f}", flush=True)
    for r in runs:
        if "host_tensor_cpu_ms_per_step" in r:
            print(f"{r['label']:20s} host cpu: tensor ops {r['host_tensor_cpu_ms_per_step']:6.2f} ms/step, "
                  f"the rest {r['host_python_cpu_ms_per_step']:6.2f}; aten ops per step {r['host_ops_per_step']:.0f} "
                  f"(forward {r['forward_ops_per_step']:.0f})", flush=True)
    report = {"command": "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
              "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "git": git_state(),
              "machine": machine_info(args.threads), "workload": {"name": "skewed", "n_requests": len(w.prompts)},
              "runs": runs}
    return write(args, report)


def write(args, report: Dict[str, Any]) -> int:
    runs = report["runs"]
    if args.before:
        with open(args.before) as f:
            before = json.load(f)
        report["before"] = {k: before[k] for k in ("command", "created", "git", "runs")}
        same = {r["label"]: r["output_digest"] for r in before["runs"]}
        report["tokens_identical_to_before"] = all(same.get(r["label"], r["output_digest"]) == r["output_digest"]
                                                   for r in runs)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    plot(os.path.splitext(args.out)[0] + ".png", report)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
