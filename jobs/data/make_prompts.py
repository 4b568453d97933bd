"""Prompt sets for the tiny model: the shipped evaluation set and benchmark inputs.

Why: evaluation and benchmarks must be reproducible offline, so every set is a pure
function of (distribution, rows, seed). The eval set uses seed 12345 while training
streams use seed 0 (TRAIN_SEED), so eval prompts are fresh draws, not a slice of the
training data (rare collisions are harmless).

    python jobs/data/make_prompts.py                       # rewrite jobs/data/tiny_eval.parquet
    python jobs/data/make_prompts.py --rows 100000 --length-dist lognormal --out p.parquet

Distributions: `tiny` = the tiny task family (with `reference` and `task` columns);
`uniform`, `lognormal`, `skewed` = random-char prompts whose token lengths (one token
per char) follow that distribution; `skewed` makes 20% of prompts 8x longer.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

if __package__ in (None, ""):  # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tiny.tasks import CHARS, sample  # noqa: E402

TRAIN_SEED = 0
EVAL_SEED = 12345
BENCH_SEED = 1  # benchmark sets: neither the training nor the eval stream
EVAL_ROWS = 1200
EVAL_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_eval.parquet")
LENGTH_DISTS: tuple[str, ...] = ("tiny", "uniform", "lognormal", "skewed")


def tiny_rows(rows: int, seed: int, id_prefix: str = "tiny") -> dict[str, list[str]]:
    """`rows` task examples as columns id, prompt, reference, task."""
    rng = random.Random(seed)
    cols: dict[str, list[str]] = {"id": [], "prompt": [], "reference": [], "task": []}
    for i in range(rows):
        task, prompt, answer = sample(rng)
        cols["id"].append(f"{id_prefix}-{i:06d}")
        cols["prompt"].append(prompt)
        cols["reference"].append(answer)
        cols["task"].append(task)
    return cols


def prompt_lengths(dist: str, rows: int, rng: random.Random, base_len: int = 32) -> list[int]:
    """Token lengths (>= 1) of `rows` prompts; `base_len` is the typical length.

    uniform: U[1, 2*base_len]; lognormal: median base_len, sigma 0.75, capped at
    16*base_len; skewed: U[base_len/2, 3*base_len/2] with 20% of rows 8x longer."""
    if dist == "uniform":
        return [rng.randint(1, 2 * base_len) for _ in range(rows)]
    if dist == "lognormal":
        mu, cap = math.log(base_len), 16 * base_len
        return [min(cap, max(1, round(rng.lognormvariate(mu, 0.75)))) for _ in range(rows)]
    if dist == "skewed":
        lo, hi = max(1, base_len // 2), max(1, 3 * base_len // 2)
        return [rng.randint(lo, hi) * (8 if rng.random() < 0.2 else 1) for _ in range(rows)]
    raise ValueError(f"unknown length distribution {dist!r}; expected one of {LENGTH_DISTS}")


def synthetic_rows(
    dist: str, rows: int, seed: int, base_len: int = 32, id_prefix: Optional[str] = None
) -> dict[str, list[str]]:
    """Columns for a benchmark prompt set: `tiny` gives task examples (id, prompt,
    reference, task); the other distributions give random-char prompts (id, prompt)."""
    prefix = id_prefix or dist
    if dist == "tiny":
        return tiny_rows(rows, seed, prefix)
    rng = random.Random(seed)
    lengths = prompt_lengths(dist, rows, rng, base_len)
    return {
        "id": [f"{prefix}-{i:07d}" for i in range(rows)],
        "prompt": ["".join(rng.choices(CHARS, k=n)) for n in lengths],
    }


def write_parquet(cols: dict[str, list[str]], path: str) -> str:
    """Write string columns as one zstd-compressed Parquet file; return the path."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    table = pa.table({k: pa.array(v, type=pa.string()) for k, v in cols.items()})
    pq.write_table(table, path, compression="zstd")
    return path


def make_eval_set(path: str = EVAL_PATH, rows: int = EVAL_ROWS, seed: int = EVAL_SEED) -> str:
    """The shipped evaluation set (deterministic; ids `eval-NNNNNN`)."""
    return write_parquet(tiny_rows(rows, seed, "eval"), path)


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length-dist", choices=LENGTH_DISTS, default=None,
                   help="build a benchmark set; omit to rewrite the eval set")
    p.add_argument("--rows", type=int, default=None, help=f"rows (eval default {EVAL_ROWS})")
    p.add_argument("--seed", type=int, default=None, help=f"seed (default {EVAL_SEED} for eval, {BENCH_SEED} otherwise)")
    p.add_argument("--base-len", type=int, default=32, help="typical prompt tokens (non-tiny)")
    p.add_argument("--out", default=None, help=f"output path (eval default {EVAL_PATH})")
    a = p.parse_args(argv)
    if a.length_dist is None:
        path = make_eval_set(a.out or EVAL_PATH, a.rows or EVAL_ROWS,
                             EVAL_SEED if a.seed is None else a.seed)
    else:
        if a.out is None:
            p.error("--out is required with --length-dist")
        cols = synthetic_rows(a.length_dist, a.rows or 100_000, BENCH_SEED if a.seed is None else a.seed,
                              a.base_len)
        path = write_parquet(cols, a.out)
    n = pq.read_metadata(path).num_rows
    print(f"wrote {n} rows to {path} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
