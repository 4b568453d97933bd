"""Structured outputs (engine.structured, issue 43) against unconstrained decoding on the
embedded tiny model at B = 32, and the compile time of each constraint.

    python bench/structured_bench.py --out bench/results/structured_cpu.json
    python bench/structured_bench.py --smoke --out /tmp/structured.json     # seconds

The same prompts and settings decoded by one engine configuration (blockserve,
max_batch_size 32, the block canvas), every row unconstrained and every row under a
constraint, in interleaved rounds (A B B A ...; the ratio is the median of the rounds').
Throughput is generated tokens per CPU-second of this process (time.process_time, one
torch thread), so other load on the machine moves it little; the ratio constrained /
unconstrained is the overhead figure (issue 43 asks >= 0.7). Two workloads:

- `tasks` (the headline): the tiny model's own tasks (tiny/tasks.py, as `make run` asks
  them) under the model's own settings (blockray.json: threshold 0.9, 8 steps per 8-token
  block, refresh cache, 56 new tokens), each row constrained to its answer's format, as a
  user constrains a model to the format its prompt asks for: `len` to `[0-9]{1,2}`,
  `first`/`last` to a `choice` of the argument's letters, `next` to `[a-z0-9]+`, the rest to
  `[a-z]+`. Exact match is reported both ways (the constraint must not cost accuracy).
- `off_task`: prompts outside the model's tasks with constraints it was never trained to
  produce (regexes and a choice, cycled). Under `fixed` (the schedule decides how many
  tokens a step commits, so both runs do the same work per step) the ratio is again the
  guide's own cost; under `threshold` the constraint also lowers the model's confidence,
  so a step commits fewer tokens (`tokens_per_step`): a cost of the model, reported apart.

Compile times are wall seconds of the caps' checks, outlines-core's index (built in the
compiler's child process, engine.structured.worker) and the automaton's tables, per
constraint, first compile (later rows hit the engine's cache); the JSON schema one is over
a byte-level BPE vocabulary of 151,643 tokens (the Dream layout of tests/published).
Writes JSON and a PNG."""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import torch

if __package__ in (None, ""):  # `python bench/structured_bench.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.engine_bench import git_state, machine_info  # noqa: E402
from engine import Engine, EngineConfig, SamplingParams, load_model  # noqa: E402
from engine.structured.params import parse  # noqa: E402
from tiny.tasks import sample  # noqa: E402

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(HERE, "engine", "assets", "tiny-dllm")
CONSTRAINTS = [{"regex": "[a-z]{3,12}"}, {"regex": "[0-9]+ (plus|minus) [0-9]+"}, {"choice": ["yes", "no", "maybe"]},
               {"regex": "(ab|cd)*e?[0-9]{2,4}"}, {"regex": "[a-z ]{8,30}\\."}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city"],
                                     "properties": {"city": {"type": "string", "maxLength": 5}}}}}


def task_constraint(task: str, prompt: str) -> Dict[str, Any]:
    """The format a `task` row's answer takes (tiny/tasks.py), as a user would constrain it."""
    arg = prompt.split(": ", 1)[1]
    if task in ("first", "last"):
        return {"choice": sorted(set(arg))}
    return {"regex": {"len": "[0-9]{1,2}", "next": "[a-z0-9]+"}.get(task, "[a-z]+")}


def workloads(rows: int, max_new_tokens: int) -> Dict[str, Dict[str, Any]]:
    """Each workload: prompts, engine settings, per-policy sampling settings, answers if known."""
    rng = random.Random(0)
    tasks = [sample(rng) for _ in range(rows)]
    return {
        "tasks": {"prompts": [p for _, p, _ in tasks], "answers": [a for _, _, a in tasks],
                  "constraints": [task_constraint(t, p) for t, p, _ in tasks],
                  "engine": dict(block_length=8, steps_per_block=8, cache="refresh"),
                  "sampling": dict(max_new_tokens=56, threshold=0.9), "policies": ("threshold", "fixed")},
        "off_task": {"prompts": [f"q{i}: {'abcdefgh'[i % 8] * (1 + i % 5)}" for i in range(rows)], "answers": None,
                     "constraints": [CONSTRAINTS[i % len(CONSTRAINTS)] for i in range(rows)],
                     "engine": dict(block_length=8, steps_per_block=4),
                     "sampling": dict(max_new_tokens=max_new_tokens), "policies": ("fixed", "threshold")},
    }


def decode(model, tok, w: Dict[str, Any], policy: str, constrained: bool, batch: int,
           rows: Optional[int] = None) -> Dict[str, Any]:
    """One engine decodes the workload's first `rows` rows; tokens, CPU-s, steps, exact match."""
    prompts = w["prompts"][:rows]
    params = [SamplingParams(seed=i, policy=policy, **w["sampling"],
                             **({"structured_outputs": w["constraints"][i]} if constrained else {}))
              for i in range(len(prompts))]
    cfg = EngineConfig(**w["engine"], max_batch_size=batch, canvas="block", token_budget=65536)
    eng = Engine(model, cfg, tokenizer=tok)
    t0, w0 = time.process_time(), time.perf_counter()
    outs = eng.generate(prompts, params)
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    assert not [o.error for o in outs if o.error], [o.error for o in outs if o.error][:3]
    tokens = sum(len(o.token_ids) for o in outs)
    out = {"tokens": tokens, "cpu_s": cpu, "wall_s": wall, "tokens_per_cpu_s": tokens / cpu,
           "steps": eng.stats.steps, "tokens_per_step": tokens / eng.stats.steps, "cpu_s_per_step": cpu / eng.stats.steps,
           "compiles": eng.structured.compiler.compiles if eng.structured.compiler else 0,
           "token_ids": [list(o.token_ids) for o in outs]}
    if w["answers"] is not None:
        out["exact_match"] = sum(o.text.strip() == a for o, a in zip(outs, w["answers"])) / len(outs)
    return out


def compare(model, tok, w: Dict[str, Any], policy: str, batch: int, rounds: int) -> Dict[str, Any]:
    """Interleaved rounds (free, constrained; then constrained, free; ...): the median ratio."""
    decode(model, tok, w, policy, False, batch, rows=4)  # warm up
    runs: Dict[str, List[Dict[str, Any]]] = {"unconstrained": [], "constrained": []}
    for r in range(rounds):
        for constrained in ((False, True) if r % 2 == 0 else (True, False)):
            runs["constrained" if constrained else "unconstrained"].append(decode(model, tok, w, policy, constrained, batch))
    ratios = [c["tokens_per_cpu_s"] / f["tokens_per_cpu_s"] for f, c in zip(runs["unconstrained"], runs["constrained"])]
    free, cons = runs["unconstrained"][0], runs["constrained"][0]
    same = sum(a == b for a, b in zip(free.pop("token_ids"), cons.pop("token_ids")))
    for k in runs:
        for r in runs[k][1:]:
            r.pop("token_ids")
    return {"ratio_median": statistics.median(ratios), "round_ratios": ratios,
            "step_cost_ratio": statistics.median(c["cpu_s_per_step"] / f["cpu_s_per_step"]
                                                 for f, c in zip(runs["unconstrained"], runs["constrained"])),
            "rows_with_identical_tokens": same, "unconstrained": free, "constrained": cons,
            "rounds": {k: [r["tokens_per_cpu_s"] for r in v] for k, v in runs.items()}}


def compile_times(model_tok) -> Dict[str, float]:
    from engine import EngineConfig
    from engine.structured.automaton import Compiler

    model, tok = model_tok
    comp = Compiler(tok, model.config.vocab_size, EngineConfig())
    out = {json.dumps(c): comp.get(parse(c), [model.config.eos_token_id]).compile_s for c in CONSTRAINTS}
    sys.path.insert(0, os.path.join(HERE, "tests"))
    import published

    with tempfile.TemporaryDirectory() as d:
        root = published.build("Dream-org__Dream-v0-Instruct-7B", os.path.join(d, "dream"))
        dm, dt = load_model(root, dtype=torch.float32, device="cpu")
        dc = Compiler(dt, dm.config.vocab_size, EngineConfig())
        t0 = time.process_time()
        dc.vocabulary()
        out["dream vocabulary (151,643 byte-level BPE tokens)"] = time.process_time() - t0
        a = dc.get(parse({"json": SCHEMA}), dm.config.stop_token_ids)
        out["json schema over the dream vocabulary"] = a.compile_s
        out["json schema states, token classes"] = [a.n_states, a.n_classes]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "bench", "results", "structured_cpu.json"))
    ap.add_argument("--smoke", action="store_true", help="a few rows, one round, seconds")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32, help="the off-task workload's")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows, rounds = (8, 1) if args.smoke else (args.rows, args.rounds)
    model, tok = load_model(TINY, dtype=torch.float32, device="cpu")
    runs = {name: {policy: compare(model, tok, w, policy, args.batch, rounds) for policy in w["policies"]}
            for name, w in workloads(rows, args.max_new_tokens).items()}
    summary: Dict[str, Any] = {"constrained_over_unconstrained_tokens_per_cpu_s": {
        f"{n}.{p}": r["ratio_median"] for n, pr in runs.items() for p, r in pr.items()}}
    summary["constrained_over_unconstrained_cpu_s_per_step"] = {
        f"{n}.{p}": r["step_cost_ratio"] for n, pr in runs.items() for p, r in pr.items()}
    summary["tokens_per_step"] = {f"{n}.{p}": [r["unconstrained"]["tokens_per_step"], r["constrained"]["tokens_per_step"]]
                                  for n, pr in runs.items() for p, r in pr.items()}
    summary["tasks_exact_match"] = {p: [r["unconstrained"]["exact_match"], r["constrained"]["exact_match"]]
                                    for p, r in runs["tasks"].items()}
    summary["tasks_rows_with_identical_tokens"] = {p: r["rows_with_identical_tokens"] for p, r in runs["tasks"].items()}
    result = {"command": "python bench/structured_bench.py" + (" --smoke" if args.smoke else ""),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine_info(1),
              "git": git_state(), "batch": args.batch, "rows": rows, "rounds": rounds,
              "off_task_constraints": CONSTRAINTS, "runs": runs, "summary": summary,
              "compile_cpu_s": {} if args.smoke else compile_times((model, tok))}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4))
        cells = [(n, p, k) for n in runs for p in runs[n] for k in ("unconstrained", "constrained")]
        ax.bar([f"{n}\n{p}\n{k[:4]}" for n, p, k in cells],
               [statistics.median(runs[n][p]["rounds"][k]) for n, p, k in cells], color=["#888", "#2a7"] * len(cells))
        ax.tick_params(axis="x", labelsize=7)
        ax.set_ylabel("generated tokens / CPU-s (median round)")
        ax.set_title(f"tiny model, B={args.batch}: constrained / unconstrained: " + ", ".join(
            f"{k} {v:.2f}" for k, v in summary["constrained_over_unconstrained_tokens_per_cpu_s"].items()), fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=100)
    except ImportError:
        print("matplotlib missing: no PNG (pip install .[bench])", file=sys.stderr)
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
