"""Nemotron-Labs-Diffusion's three modes of one checkpoint on the CPU: LinearSpec
self-speculation and AR (engine.linear_spec) against the diffusion mode (engine.engine),
on the same tiny model, the same prompts, measured with the engines' own counters.

    python bench/linear_spec.py --threads 1 --out bench/results/linear_spec_cpu.json
    python bench/linear_spec.py --smoke --out /tmp/linear_spec.json        # seconds (CI)

Two models of one tiny Nemotron-Labs-Diffusion shape (the located 8B config, sizes shrunk):

- `random`: seeded weights. Its bidirectional drafts rarely agree with its causal verify,
  so LinearSpec keeps about one token a block for two forwards: its worst case.
- `trained`: the same weights trained here for `--train-steps` steps (transformers'
  Ministral3Model, float32, Adam) with the published model's two objectives, a causal
  next-token loss and a masked-block loss (the block bidirectional against a causal
  prefix, its first token kept as the seed), on a copy task: each sequence repeats a
  random 4-token motif, 5 % of tokens replaced at random. Its drafts then agree with its
  verify as a trained model's do on predictable text: how far depends on the training.

Modes, greedy, every row max_new_tokens tokens (ignore_eos), blockserve, every request in
one batch: `ar` (decoding "ar"), `linear_spec` (block_length L, one draft pass),
`diffusion_fixed` (the published generate() default: steps = L, one mask a step) and
`diffusion_threshold` (policy threshold 0.9), both advancing by steps (a row starts its
next block at the step after its last, as LinearSpec's rows do). Per mode: tokens per forward per request
(the published loops' nfe: a request's forwards, RequestOutput.num_steps; for the
diffusion mode its denoising steps), tokens per batched forward (the engine's forwards,
EngineStats.forwards) and tokens per CPU-second (EngineStats.busy_cpu_s, one torch
thread; the median of --repeats runs); LinearSpec's accepted lengths. No thresholds: ratios of one run.
Writes one JSON (command, machine, settings, every run) and a PNG beside it."""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from typing import Any, Dict, List

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # `python bench/linear_spec.py`
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.engine_bench import git_state, machine_info  # noqa: E402
from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model  # noqa: E402
from engine.linear_spec import LinearSpecEngine  # noqa: E402

MASK, MOTIF, NOISE, MAX_PROMPT = 100, 4, 0.05, 16
# the located 8B config.json's keys (tests/test_nemotron_labs_diffusion.py CONFIG), sizes shrunk
TINY = {
    "architectures": ["NemotronLabsDiffusionModel"], "attention_bias": False, "attention_dropout": 0.0,
    "block_size": 32, "bos_token_id": 1, "dlm_paradigm": "bidirectional", "eos_token_id": 11, "head_dim": 16,
    "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 128, "mask_token_id": MASK,
    "max_position_embeddings": 4096, "mlp_bias": False, "model_type": "nemotron_labs_diffusion",
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-05,
    "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 16.0, "llama_4_scaling_beta": 0.1,
                        "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 16384,
                        "rope_theta": 1000000.0, "rope_type": "yarn"},
    "sliding_window": None, "tie_word_embeddings": False, "vocab_size": 128}


def copy_task(g: torch.Generator, batch: int, length: int) -> torch.Tensor:
    """Sequences repeating a random MOTIF-token motif (tokens below the mask id), NOISE of
    the tokens replaced at random."""
    motif = torch.randint(0, MASK, (batch, MOTIF), generator=g)
    x = motif.repeat(1, length // MOTIF + 1)[:, :length].clone()
    noise = torch.rand(batch, length, generator=g) < NOISE
    x[noise] = torch.randint(0, MASK, (int(noise.sum()),), generator=g)
    return x


def train(model, steps: int, block_length: int, length: int, seed: int = 0) -> Dict[str, Any]:
    """Train `model` (float32) in place through transformers' Ministral3Model with the
    causal and the masked-block loss on sequences of `length` tokens (the prompts' and
    answers' longest: a tiny model does not carry the task past the lengths it saw);
    returns the last losses."""
    from transformers import Ministral3Config
    from transformers.models.ministral3.modeling_ministral3 import Ministral3Model

    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
            "tie_word_embeddings", "hidden_act")
    enc = Ministral3Model(Ministral3Config(**{k: TINY[k] for k in keys}, pad_token_id=None,
                                           attn_implementation="eager")).float().train()
    fam = model.config.family
    w = {fam.checkpoint_name(n): p.detach().float() for n, p in model.named_parameters()}
    enc.load_state_dict({k[len("encoder."):]: v for k, v in w.items() if k.startswith("encoder.")}, strict=True)
    head = torch.nn.Parameter(w["diffusion_head.weight"].clone())
    opt = torch.optim.Adam(list(enc.parameters()) + [head], lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    B, N, L, V = 32, length, block_length, TINY["vocab_size"]
    causal = torch.zeros(N, N).masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), float("-inf"))[None, None]
    pos = torch.arange(N)[None].expand(B, -1)
    losses = {}
    for _ in range(steps):
        x = copy_task(g, B, N)
        h = enc(input_ids=x, attention_mask=causal, position_ids=pos).last_hidden_state
        ar_loss = F.cross_entropy(F.linear(h[:, :-1], head).reshape(-1, V), x[:, 1:].reshape(-1))
        s = int(torch.randint(1, N - L, (1,), generator=g))  # a block after a causal prefix of s tokens
        masked = torch.rand(B, L, generator=g) < torch.rand(B, 1, generator=g)
        masked[:, 0] = False  # the seed
        xin = x[:, :s + L].clone()
        xin[:, s:][masked] = MASK
        keep = torch.ones(s + L, s + L, dtype=torch.bool).tril()
        keep[s:, s:] = True
        bm = torch.zeros(s + L, s + L).masked_fill(~keep, float("-inf"))[None, None]
        hb = enc(input_ids=xin, attention_mask=bm, position_ids=pos[:, :s + L]).last_hidden_state[:, s:]
        d_loss = F.cross_entropy(F.linear(hb, head)[masked], x[:, s:s + L][masked]) if masked.any() else 0 * ar_loss
        opt.zero_grad()
        (ar_loss + d_loss).backward()
        opt.step()
        losses = dict(causal=float(ar_loss.detach()), masked_block=float(d_loss.detach()))
    trained = {"encoder." + k: v.detach() for k, v in enc.state_dict().items()}
    trained["diffusion_head.weight"] = head.detach()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(trained[fam.checkpoint_name(n)])
    model.fuse_()
    return losses


def run_mode(model, mode: str, prompts: List[List[int]], max_new: int, L: int) -> Dict[str, Any]:
    """One engine over every prompt, in one blockserve batch."""
    B = len(prompts)
    if mode in ("ar", "linear_spec"):
        eng = LinearSpecEngine(model, EngineConfig(block_length=L, token_budget=65536, max_batch_size=B))
        sp = SamplingParams(decoding=mode, max_new_tokens=max_new, ignore_eos=True)
    else:
        eng = Engine(model, EngineConfig(block_length=L, steps_per_block=L, token_budget=65536, max_batch_size=B,
                                         advance="step"))
        sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True, policy="fixed" if mode == "diffusion_fixed"
                            else "threshold", threshold=0.9)
    outs = eng.generate(prompts, sp)
    tokens = sum(len(o.token_ids) for o in outs)
    row_forwards = sum(o.num_steps for o in outs)
    st = eng.stats
    rec = dict(mode=mode, requests=B, tokens=tokens, row_forwards=row_forwards, forwards=st.forwards,
               tokens_per_row_forward=tokens / row_forwards, tokens_per_forward=tokens / max(st.forwards, 1),
               cpu_s=st.busy_cpu_s, tokens_per_cpu_s=tokens / st.busy_cpu_s if st.busy_cpu_s else None)
    if mode == "linear_spec":
        blocks = sum(eng.accepted.values())
        rec["blocks"] = blocks
        rec["accepted_per_block"] = sum(n * c for n, c in eng.accepted.items()) / blocks if blocks else None
        rec["accepted_histogram"] = {str(n): c for n, c in sorted(eng.accepted.items())}
    return rec


def main(argv=None) -> Dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    L, max_new = args.block_length, args.max_new_tokens
    g = torch.Generator().manual_seed(1)
    prompts = [copy_task(g, 1, int(torch.randint(9, MAX_PROMPT + 1, (1,), generator=g)))[0].tolist()
               for _ in range(args.requests)]
    cfg = ModelConfig.from_hf(TINY)
    report: Dict[str, Any] = dict(
        command="python bench/linear_spec.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), machine=machine_info(args.threads),
        git=git_state(), settings=dict(block_length=L, max_new_tokens=max_new, requests=args.requests,
                                       train_steps=args.train_steps, dtype="float32", config=TINY),
        models={})
    modes = ("ar", "linear_spec", "diffusion_fixed", "diffusion_threshold")
    for name in ("random", "trained"):
        model = build_model(cfg, torch.float32, seed=0)
        losses = train(model, args.train_steps, L, MAX_PROMPT + max_new) if name == "trained" else None
        model.eval()
        with torch.no_grad():
            for mode in modes:  # warm-up: the first forwards of a process are slow
                run_mode(model, mode, prompts[:2], L, L)
            runs = {}
            for mode in modes:  # the median CPU time of `repeats` runs (the tokens are the same every time)
                reps = [run_mode(model, mode, prompts, max_new, L) for _ in range(args.repeats)]
                rec = sorted(reps, key=lambda r: r["cpu_s"])[len(reps) // 2]
                rec["cpu_s_runs"] = [r["cpu_s"] for r in reps]
                runs[mode] = rec
        ar = runs["ar"]
        ratios = {mode: dict(tokens_per_row_forward=r["tokens_per_row_forward"] / ar["tokens_per_row_forward"],
                             tokens_per_cpu_s=(r["tokens_per_cpu_s"] / ar["tokens_per_cpu_s"])
                             if r["tokens_per_cpu_s"] and ar["tokens_per_cpu_s"] else None)
                  for mode, r in runs.items()}
        report["models"][name] = dict(losses=losses, runs=runs, vs_ar=ratios)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    plot(os.path.splitext(args.out)[0] + ".png", report)
    print(json.dumps({m: {k: {x: round(v["tokens_per_row_forward"], 3) for x, v in d["runs"].items()}
                          for k in ("runs",)} for m, d in report["models"].items()}, indent=1))
    return report


def plot(path: str, report: Dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(report["models"])
    modes = list(report["models"][models[0]]["runs"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = ["#888888", "#1b9e77", "#7570b3", "#d95f02"]
    for ax, key, label in ((axes[0], "tokens_per_row_forward", "tokens per forward (per request: its nfe)"),
                           (axes[1], "tokens_per_cpu_s", "tokens per CPU-second (1 thread)")):
        for j, mode in enumerate(modes):
            xs = [i + (j - 1.5) * 0.2 for i in range(len(models))]
            vals = [report["models"][m]["runs"][mode][key] or 0 for m in models]
            bars = ax.bar(xs, vals, 0.2, color=colors[j], label=mode)
            for bar, v in zip(bars, vals):
                ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.2f}" if v < 100 else f"{v:.0f}", ha="center",
                        va="bottom", fontsize=7)
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels([f"{m} model" for m in models])
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    s, m = report["settings"], report["machine"]
    fig.suptitle(f"Nemotron-Labs-Diffusion (tiny, float32): LinearSpec vs AR vs diffusion mode; {s['requests']} "
                 f"requests x {s['max_new_tokens']} tokens, L={s['block_length']}, trained {s['train_steps']} steps; "
                 f"{m['processor']}, torch {m['torch']} ({m['torch_threads']} threads)", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/linear_spec_cpu.json", help="JSON path; the PNG goes next to it")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--block-length", type=int, default=8)
    ap.add_argument("--train-steps", type=int, default=600)
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode; the median CPU time is reported")
    ap.add_argument("--smoke", action="store_true", help="a few requests, a few training steps (seconds)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.requests, args.max_new_tokens, args.train_steps, args.repeats = 3, 16, 3, 1
    return args


if __name__ == "__main__":
    main()
