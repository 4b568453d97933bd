"""Train (and evaluate) the embedded tiny block-diffusion LM on the synthetic tasks.

Why: every command of the project must run offline on a CPU, so the default model is
a ~0.9M-parameter block-causal dLLM (d=128, 4 layers) trained here from a seed, in
about half an hour on one core of a busy 2-core box, on tiny.tasks (answers
that end after 1..7 blocks of 8 tokens).

Objective (masked diffusion over blocks, as the engine decodes): an answer is followed
by EOS up to the end of its last block (always at least one EOS). Every block of an
answer trains in ONE forward (the block-diffusion trick): a sample is

    prompt | clean blocks 0..n-2 | noised blocks 0..n-1

with the noised copy at the same position ids as the clean one; the prompt attends the
prompt, clean block j the prompt + clean blocks <= j, noised block j the prompt + clean
blocks < j + itself. (The last clean block is never attended by a noised block, so it
is left out.) Each noised block masks k ~ U{1..L} of its L tokens; the loss is the
unweighted cross-entropy on masked positions, averaged over them.

Samples are packed first-fit into rows of 160 tokens (positions restart at 0 and the
attention mask is block-diagonal per sample; the tail of a row is pad, masked out of
attention and loss). Packing i.i.d. samples matters: in a probe, length-bucketed
batches (one task and length per batch) were at loss 1.35 and copy 0% after ~6M
training tokens, packed mixed batches at loss 0.21 and 47% exact match overall.

    python -m tiny.train --out engine/assets/tiny-dllm            # train (fixed steps, seed 0)
    python -m tiny.train --eval engine/assets/tiny-dllm           # per-task accuracy via the Engine
    python -m tiny.train --eval engine/assets/tiny-dllm --schedulers blockserve static sequential

Training is a fixed number of optimizer steps (the LR schedule depends on it), so the
same seed gives the same data, masks and initial weights; with the default --threads 1
a rerun on the same machine and torch build is expected to be bit-exact (more threads
may change float reduction order, not the accuracy). `--minutes` is only a safety cap:
when hit, training stops early and saves what it has (and says so).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections import Counter, defaultdict
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from engine.models import DLLM, ModelConfig
from tiny.tasks import TASKS, sample
from tiny.tokenizer import EOS_ID, MASK_ID, PAD_ID, save_tokenizer, vocab

BLOCK = 8
MAX_NEW_TOKENS = 56  # 7 blocks: the longest answer (48 chars) + EOS
ENGINE_SETTINGS = {"block_length": BLOCK, "steps_per_block": 8, "cache": "refresh",
                   "policy": "threshold", "threshold": 0.9, "max_new_tokens": MAX_NEW_TOKENS}
ENGINE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ENGINE_DIR, "assets", "tiny-dllm")
EVAL_PATH = os.path.join(os.path.dirname(ENGINE_DIR), "jobs", "data", "tiny_eval.parquet")

# kinds of row positions
_PROMPT, _CLEAN, _NOISED, _PAD = 0, 1, 2, 3


# --- model -------------------------------------------------------------------------
def model_config(d_model: int, n_layers: int, n_heads: int, ffn: int) -> ModelConfig:
    ids = {"pad": PAD_ID, "eos": EOS_ID, "mask": MASK_ID}
    return ModelConfig(model_type="llada", vocab_size=len(vocab()), hidden_size=d_model, n_layers=n_layers,
                       n_heads=n_heads, n_kv_heads=n_heads, intermediate_size=ffn,
                       mask_token_id=ids["mask"], eos_token_id=ids["eos"], pad_token_id=ids["pad"],
                       rope_theta=10000.0, max_seq_len=256, dllm_attention="block_causal",
                       tie_word_embeddings=False)


def init_model(cfg: ModelConfig, seed: int) -> DLLM:
    """GPT-2 style init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 n_layers)."""
    torch.manual_seed(seed)
    model = DLLM(cfg)
    out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            elif name.endswith(("o.weight", "down.weight")):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, 0.02)
    return model


# --- data --------------------------------------------------------------------------
_VOCAB = vocab()


def encode(text: str) -> List[int]:
    return [_VOCAB[c] for c in text]


def answer_blocks(answer: str) -> List[int]:
    """Answer ids + EOS up to the end of its last block (at least one EOS)."""
    ids = encode(answer) + [EOS_ID]
    return ids + [EOS_ID] * (-len(ids) % BLOCK)


ROW = 160  # packed row length; the longest sample ("copy: " + 40 chars, 6 blocks + 5 clean) is 150


def sample_length(prompt: str, answer: str) -> int:
    """Tokens one sample takes in a training row: prompt + clean blocks but the last + noised blocks."""
    n = len(answer_blocks(answer)) // BLOCK
    return len(prompt) + BLOCK * (2 * n - 1)


def batches(seed: int, rows: int, row_len: int = ROW) -> Iterator[List[List[Tuple[str, str, str]]]]:
    """Endless deterministic stream of batches: `rows` rows of `row_len` tokens, each
    packed first-fit with i.i.d. samples of the task mix (so every batch mixes tasks and
    lengths and has little padding). A sample that fits nowhere opens the next batch."""
    rng = random.Random(seed)
    carry: List[Tuple[str, str, str]] = []
    while True:
        batch: List[List[Tuple[str, str, str]]] = [[] for _ in range(rows)]
        free = [row_len] * rows
        misses = 0
        pending, carry = carry, []
        while misses < 8:
            it = pending.pop(0) if pending else sample(rng)
            n = sample_length(it[1], it[2])
            i = next((i for i in range(rows) if free[i] >= n), None)
            if i is None:
                carry.append(it)
                misses += 1
                continue
            batch[i].append(it)
            free[i] -= n
        carry = pending + carry
        yield batch


def make_batch(batch: Sequence[Sequence[Tuple[str, str, str]]], gen: np.random.Generator):
    """Tensors for one training forward over packed rows: ids, pos [B, T]; mask
    [B, 1, T, T] (samples never see each other; positions restart at 0 per sample);
    targets [B, T] (-100 where there is no loss)."""
    rows = []
    sid = 0
    for packed in batch:
        ids, pos, kind, seg, tgt, who = [], [], [], [], [], []
        for _, prompt, answer in packed:
            p, a = encode(prompt), answer_blocks(answer)
            n = len(a) // BLOCK
            noised = list(a)
            loss_at = np.zeros(len(a), dtype=bool)
            for j in range(n):
                k = int(gen.integers(1, BLOCK + 1))
                loss_at[j * BLOCK + gen.choice(BLOCK, size=k, replace=False)] = True
            for i in np.flatnonzero(loss_at):
                noised[i] = MASK_ID
            clean = a[: BLOCK * (n - 1)]
            ids += p + clean + noised
            pos += list(range(len(p) + len(clean))) + list(range(len(p), len(p) + len(a)))
            kind += [_PROMPT] * len(p) + [_CLEAN] * len(clean) + [_NOISED] * len(a)
            seg += [0] * len(p) + [1 + i // BLOCK for i in range(len(clean))] + [1 + i // BLOCK for i in range(len(a))]
            tgt += [-100] * (len(p) + len(clean)) + [t if m else -100 for t, m in zip(a, loss_at)]
            sid += 1
            who += [sid] * (len(p) + len(clean) + len(a))
        rows.append((ids, pos, kind, seg, tgt, who))
    T = max(len(r[0]) for r in rows)
    B = len(rows)
    out = [torch.full((B, T), fill, dtype=torch.long) for fill in (PAD_ID, 0, _PAD, 0, -100, 0)]
    for i, r in enumerate(rows):
        for t, vals in zip(out, r):
            t[i, :len(vals)] = torch.tensor(vals, dtype=torch.long)
    ids, pos, kind, seg, tgt, who = out
    qk, kk = kind[:, :, None], kind[:, None, :]
    qs, ks = seg[:, :, None], seg[:, None, :]
    allow = (kk == _PROMPT) & (qk != _PAD)
    allow |= (kk == _CLEAN) & (qk == _CLEAN) & (ks <= qs)
    allow |= (kk == _CLEAN) & (qk == _NOISED) & (ks < qs)
    allow |= (kk == _NOISED) & (qk == _NOISED) & (ks == qs)
    allow &= who[:, :, None] == who[:, None, :]
    allow |= torch.eye(T, dtype=torch.bool)[None] & (qk == _PAD)  # pad rows attend themselves (no NaN)
    return ids, pos, allow[:, None], tgt


# --- training ----------------------------------------------------------------------
def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def save_dir(model: DLLM, out: str) -> None:
    from engine.loader import save_model

    os.makedirs(out, exist_ok=True)
    ids = save_tokenizer(out)
    cfg = model.config
    assert (ids["vocab_size"], ids["mask"], ids["eos"], ids["pad"]) == (
        cfg.vocab_size, cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id)
    save_model(model, out)
    with open(os.path.join(out, "blockray.json"), "w") as f:
        json.dump(ENGINE_SETTINGS, f, indent=2)


def train(out: str, steps: int = 3000, seed: int = 0, minutes: Optional[float] = None, d_model: int = 128,
          n_layers: int = 4, n_heads: int = 4, ffn: int = 384, tokens_per_batch: int = 4000,
          lr: float = 3e-3, warmup: int = 200, weight_decay: float = 0.01, threads: int = 1,
          log_every: int = 50, eval_every: int = 0) -> DLLM:
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    cfg = model_config(d_model, n_layers, n_heads, ffn)
    model = init_model(cfg, seed)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: d={d_model} layers={n_layers} heads={n_heads} ffn={ffn} params={n_params / 1e6:.2f}M; "
          f"steps={steps} tokens/batch={tokens_per_batch} lr={lr} seed={seed}", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.98), eps=1e-8)
    stream = batches(seed, max(1, tokens_per_batch // ROW))
    gen = np.random.default_rng(seed)
    t0 = time.perf_counter()
    tok_count, loss_sum, loss_n, last_t, last_step = 0, 0.0, 0, t0, 0
    stopped_early = False
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, lr, warmup)
        ids, pos, mask, tgt = make_batch(next(stream), gen)
        logits = model(ids, pos, mask)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tok_count += ids.numel()
        loss_sum += loss.item()
        loss_n += 1
        if (step + 1) % log_every == 0 or step + 1 == steps:
            now = time.perf_counter()
            sps = (step + 1 - last_step) / (now - last_t)
            eta = (steps - step - 1) / sps if sps > 0 else float("nan")
            print(f"step {step + 1}/{steps} loss {loss_sum / loss_n:.4f} lr {opt.param_groups[0]['lr']:.2e} "
                  f"{sps:.2f} steps/s {tok_count / (now - t0):.0f} tok/s elapsed {(now - t0) / 60:.1f}m "
                  f"eta {eta / 60:.1f}m", flush=True)
            loss_sum, loss_n, last_t, last_step = 0.0, 0, now, step + 1
        if eval_every and (step + 1) % eval_every == 0 and step + 1 < steps:
            model.eval()
            quick_eval(model, limit=240)
            model.train()
        if minutes is not None and time.perf_counter() - t0 > minutes * 60 and step + 1 < steps:
            print(f"WARNING: --minutes {minutes} reached at step {step + 1}/{steps}; saving a partially "
                  f"trained model (not reproducible across machines)", flush=True)
            stopped_early = True
            break
    model.eval()
    save_dir(model, out)
    took = time.perf_counter() - t0
    meta = {"seed": seed, "steps": steps, "steps_done": step + 1, "stopped_early": stopped_early,
            "train_minutes": round(took / 60, 1), "params": n_params, "d_model": d_model, "n_layers": n_layers,
            "n_heads": n_heads, "ffn": ffn, "tokens_per_batch": tokens_per_batch, "lr": lr, "warmup": warmup, "threads": threads}
    print(f"trained in {took / 60:.1f} min; wrote {out}: {json.dumps(meta)}", flush=True)
    with open(os.path.join(out, "train_meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return model


# --- evaluation (through the Engine) ----------------------------------------------
def load_eval(path: str = EVAL_PATH, limit: Optional[int] = None) -> Dict[str, List[str]]:
    import pyarrow.parquet as pq

    cols = pq.read_table(path).to_pydict()
    if limit is not None:
        cols = {k: v[:limit] for k, v in cols.items()}
    return cols


def engine_settings(model_dir: Optional[str]) -> Dict:
    s = dict(ENGINE_SETTINGS)
    if model_dir and os.path.exists(os.path.join(model_dir, "blockray.json")):
        with open(os.path.join(model_dir, "blockray.json")) as f:
            s.update(json.load(f))
    return s


def run_engine(model, tok, prompts: Sequence[str], scheduler: str = "blockserve",
               settings: Optional[Dict] = None, **engine_kw):
    from engine import Engine, EngineConfig, SamplingParams

    s = settings or ENGINE_SETTINGS
    eng = Engine(model, EngineConfig(block_length=s["block_length"], steps_per_block=s["steps_per_block"],
                                     cache=s.get("cache", "refresh"), scheduler=scheduler, **engine_kw),
                 tokenizer=tok)
    sp = SamplingParams(max_new_tokens=s["max_new_tokens"], policy=s["policy"], threshold=s["threshold"])
    return eng.generate(list(prompts), sp)


def score(outs, cols) -> Dict:
    per_task: Dict[str, List[int]] = defaultdict(lambda: [0, 0])
    hist: Counter = Counter()
    for o, ref, task in zip(outs, cols["reference"], cols["task"]):
        per_task[task][0] += int(o.text == ref)
        per_task[task][1] += 1
        hist[o.num_blocks] += 1
    correct = sum(v[0] for v in per_task.values())
    return {"accuracy": correct / len(outs), "n": len(outs),
            "per_task": {t: per_task[t][0] / per_task[t][1] for t in TASKS if t in per_task},
            "per_task_n": {t: per_task[t][1] for t in TASKS if t in per_task},
            "num_blocks_hist": dict(sorted(hist.items())), "texts": [o.text for o in outs]}


def print_report(name: str, r: Dict) -> None:
    tasks = "  ".join(f"{t} {100 * a:.1f}% (n={r['per_task_n'][t]})" for t, a in r["per_task"].items())
    print(f"[{name}] exact match {100 * r['accuracy']:.2f}% of {r['n']}  |  {tasks}", flush=True)
    print(f"[{name}] blocks-to-finish histogram: {r['num_blocks_hist']}", flush=True)


def quick_eval(model, limit: int = 240) -> Dict:
    from tiny.tokenizer import build_tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), clean_up_tokenization_spaces=False)
    cols = load_eval(limit=limit)
    t0 = time.perf_counter()
    r = score(run_engine(model, tok, cols["prompt"]), cols)
    print_report(f"quick eval {time.perf_counter() - t0:.0f}s", r)
    return r


def evaluate(model_dir: str, schedulers: Sequence[str] = ("blockserve",), limit: Optional[int] = None,
             sequential_limit: Optional[int] = None, dtype: torch.dtype = torch.float32,
             threads: int = 2) -> Dict[str, Dict]:
    from engine.loader import load_model

    torch.set_num_threads(threads)
    model, tok = load_model(model_dir, dtype=dtype)
    settings = engine_settings(model_dir)
    cols = load_eval(limit=limit)
    results = {}
    for sched in schedulers:
        c = cols
        if sched == "sequential" and sequential_limit is not None:
            c = {k: v[:sequential_limit] for k, v in cols.items()}
        t0 = time.perf_counter()
        r = score(run_engine(model, tok, c["prompt"], sched, settings), c)
        r["seconds"] = time.perf_counter() - t0
        print_report(f"{sched} {r['seconds']:.0f}s", r)
        results[sched] = r
    if len(results) > 1:  # the same rows decoded by every scheduler should agree
        base_name = schedulers[0]
        base = results[base_name]
        for name, r in results.items():
            if name == base_name:
                continue
            n = r["n"]
            same = sum(a == b for a, b in zip(base["texts"][:n], r["texts"]))
            base_acc = sum(t == ref for t, ref in zip(base["texts"][:n], cols["reference"][:n])) / n
            print(f"[{name} vs {base_name}] on the first {n} rows: {base_name} {100 * base_acc:.2f}% "
                  f"{name} {100 * r['accuracy']:.2f}%; identical texts {same}/{n}", flush=True)
    return results


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help=f"train and write the model here (default {DEFAULT_OUT})")
    p.add_argument("--eval", default=None, metavar="DIR", help="evaluate the model in DIR through the Engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--minutes", type=float, default=None, help="safety cap on training time (stops early)")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=384)
    p.add_argument("--tokens-per-batch", type=int, default=4000, help=f"rows of {ROW} tokens = this // {ROW}")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads; 1 is the default because on a shared 2-core box 2 threads run up to "
                        "10x slower whenever another process is busy (OpenMP spin barriers)")
    p.add_argument("--eval-every", type=int, default=0, help="quick engine eval every N steps (0: never)")
    p.add_argument("--schedulers", nargs="+", default=["blockserve"], choices=["blockserve", "static", "sequential"])
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N eval rows")
    p.add_argument("--sequential-limit", type=int, default=None, help="rows for the sequential scheduler")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    a = p.parse_args(argv)
    if a.eval is None and a.out is None:
        a.out = DEFAULT_OUT
    if a.out is not None:
        train(a.out, a.steps, a.seed, a.minutes, a.d_model, a.layers, a.heads, a.ffn, a.tokens_per_batch,
              a.lr, a.warmup, threads=a.threads, eval_every=a.eval_every)
    if a.eval is not None:
        evaluate(a.eval, a.schedulers, a.limit, a.sequential_limit, getattr(torch, a.dtype), a.threads)


if __name__ == "__main__":
    sys.exit(main())
