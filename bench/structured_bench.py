"""Structured outputs (engine.structured, issue 43) against unconstrained decoding on the
embedded tiny model at B = 32, and the compile time of each constraint.

    python bench/structured_bench.py --out bench/results/structured_cpu.json
    python bench/structured_bench.py --smoke --out /tmp/structured.json     # seconds

The same prompts and settings decoded twice by one engine configuration (blockserve,
max_batch_size 32, the block canvas): every row unconstrained, then every row under a
constraint (regexes and choices over the tiny model's characters, cycled over the rows).
Throughput is generated tokens per CPU-second of this process (time.process_time, one
torch thread), so other load on the machine does not move it; the ratio constrained /
unconstrained is the overhead figure (issue 43 asks >= 0.7). Policy `fixed` (the schedule
decides how many tokens a step commits, so both runs do the same work per step: the ratio
is the guide's own overhead) is the headline; under `threshold` the constraint also changes
how confident the model is, so how many tokens a step commits (`tokens_per_step`): both
are reported, with CPU-s per step. Compile times are CPU-seconds
of outlines-core's index plus the automaton's tables, per constraint, first compile (later
rows hit the engine's cache); the JSON schema one is over a byte-level BPE vocabulary of
151,643 tokens (the Dream layout of tests/published). Writes JSON and a PNG."""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any, Dict, List

import torch

if __package__ in (None, ""):  # `python bench/structured_bench.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.engine_bench import git_state, machine_info  # noqa: E402
from engine import Engine, EngineConfig, SamplingParams, load_model  # noqa: E402
from engine.structured.params import parse  # noqa: E402

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


def decode(model, tok, prompts: List[str], params: List[SamplingParams], batch: int) -> Dict[str, Any]:
    cfg = EngineConfig(block_length=8, steps_per_block=4, max_batch_size=batch, canvas="block", token_budget=65536)
    eng = Engine(model, cfg, tokenizer=tok)
    t0, w0 = time.process_time(), time.perf_counter()
    outs = eng.generate(prompts, params)
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    assert not [o.error for o in outs if o.error], [o.error for o in outs if o.error][:3]
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tokens": tokens, "cpu_s": cpu, "wall_s": wall, "tokens_per_cpu_s": tokens / cpu,
            "steps": eng.stats.steps, "compiles": eng.structured.compiler.compiles if eng.structured.compiler else 0}


def compile_times(model_tok) -> Dict[str, float]:
    from engine.structured.automaton import Compiler

    model, tok = model_tok
    comp = Compiler(tok, model.config.vocab_size)
    out = {json.dumps(c): comp.get(parse(c), [model.config.eos_token_id]).compile_s for c in CONSTRAINTS}
    sys.path.insert(0, os.path.join(HERE, "tests"))
    import published

    with tempfile.TemporaryDirectory() as d:
        root = published.build("Dream-org__Dream-v0-Instruct-7B", os.path.join(d, "dream"))
        dm, dt = load_model(root, dtype=torch.float32, device="cpu")
        dc = Compiler(dt, dm.config.vocab_size)
        t0 = time.process_time()
        dc.vocabulary()
        out["dream vocabulary (151,643 byte-level BPE tokens)"] = time.process_time() - t0
        a = dc.get(parse({"json": SCHEMA}), dm.config.stop_token_ids)
        out["json schema over the dream vocabulary"] = a.compile_s
        out["json schema states, token classes"] = [a.n_states, int(a.table.shape[1])]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "bench", "results", "structured_cpu.json"))
    ap.add_argument("--smoke", action="store_true", help="a few rows, seconds")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rows", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = 8 if args.smoke else args.rows
    model, tok = load_model(TINY, dtype=torch.float32, device="cpu")
    prompts = [f"q{i}: {'abcdefgh'[i % 8] * (1 + i % 5)}" for i in range(rows)]
    runs: Dict[str, Any] = {}
    for policy in ("fixed", "threshold"):
        free = [SamplingParams(max_new_tokens=args.max_new_tokens, seed=i, policy=policy) for i in range(rows)]
        constrained = [SamplingParams(max_new_tokens=args.max_new_tokens, seed=i, policy=policy,
                                      structured_outputs=CONSTRAINTS[i % len(CONSTRAINTS)]) for i in range(rows)]
        decode(model, tok, prompts[:4], free[:4], args.batch)  # warm up
        runs[policy] = {"unconstrained": decode(model, tok, prompts, free, args.batch),
                        "constrained": decode(model, tok, prompts, constrained, args.batch)}
        for r in runs[policy].values():
            r["tokens_per_step"] = r["tokens"] / r["steps"]
            r["cpu_s_per_step"] = r["cpu_s"] / r["steps"]
    ratios = {p: r["constrained"]["tokens_per_cpu_s"] / r["unconstrained"]["tokens_per_cpu_s"] for p, r in runs.items()}
    step_cost = {p: r["constrained"]["cpu_s_per_step"] / r["unconstrained"]["cpu_s_per_step"] for p, r in runs.items()}
    ratio = ratios["fixed"]
    result = {"command": "python bench/structured_bench.py" + (" --smoke" if args.smoke else ""),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine_info(1),
              "git": git_state(), "batch": args.batch, "rows": rows, "max_new_tokens": args.max_new_tokens,
              "constraints": CONSTRAINTS, "runs": runs,
              "summary": {"constrained_over_unconstrained_tokens_per_cpu_s": ratios,
                          "constrained_over_unconstrained_cpu_s_per_step": step_cost,
                          "tokens_per_step": {p: {k: v["tokens_per_step"] for k, v in r.items()}
                                              for p, r in runs.items()}},
              "compile_cpu_s": {} if args.smoke else compile_times((model, tok))}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = [f"{p}\n{k}" for p in runs for k in runs[p]]
        ax.bar(names, [runs[p][k]["tokens_per_cpu_s"] for p in runs for k in runs[p]],
               color=["#888", "#2a7"] * len(runs))
        ax.set_ylabel("generated tokens / CPU-s")
        ax.set_title(f"tiny model, B={args.batch}: constrained / unconstrained: "
                     + ", ".join(f"{p} {r:.2f}" for p, r in ratios.items()), fontsize=9)
        fig.tight_layout()
        fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=100)
    except ImportError:
        print("matplotlib missing: no PNG (pip install .[bench])", file=sys.stderr)
    print(json.dumps(result["summary"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
