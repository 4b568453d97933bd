"""Bytes allocated per denoising step by `engine.decoding.propose` and by the whole step
(issue 51 item 8), counted by `AllocatedBytes` (a dispatch mode: the storage bytes of
every tensor an aten op returns that none of its inputs holds; views, in-place and out=
ops allocate nothing), on LLaDA-8B's published layout shrunk in width but with its
published 126,464-token vocabulary, B rows of one block step. Prints JSON.

    python bench/propose_memory.py [--rows 8 32] [--out /tmp/propose_memory.json]"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests")]

from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model  # noqa: E402
from engine import decoding  # noqa: E402

LLADA = "GSAI-ML__LLaDA-8B-Instruct"


class AllocatedBytes(TorchDispatchMode):
    """Counts the bytes of the storages aten ops allocate inside it (`total`; `by_op`)."""

    def __init__(self):
        super().__init__()
        self.total = 0
        self.by_op: Dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        held = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t)}
        fresh = {}
        for t in tree_flatten(out)[0]:
            if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in held:
                fresh[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        n = sum(fresh.values())
        if n:
            self.total += n
            name = str(func.overloadpacket.__name__)
            self.by_op[name] = self.by_op.get(name, 0) + n
        return out


def llada_engine(rows: int, vocab: Optional[int] = None, block_length: int = 32) -> Engine:
    """LLaDA-8B's published config.json shrunk, with `vocab` tokens (None: the published
    126,464), `rows` rows of one width at a steady block step (float32)."""
    import published
    hf = published.shrink(published.config(LLADA))
    vocab = vocab or published.config(LLADA)["vocab_size"]
    hf["vocab_size"] = hf["embedding_size"] = vocab
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_hf(hf), dtype=torch.float32)
    e = Engine(model, EngineConfig(block_length=block_length, steps_per_block=block_length, cache="refresh",
                                   canvas="block", advance="step", token_budget=1 << 20, max_batch_size=rows))
    for i in range(rows):
        e.add_request([100 + i + j for j in range(24)],
                      SamplingParams(max_new_tokens=2 * block_length, policy="fixed", ignore_eos=True))
    e.step()  # the first step (prefill) apart
    return e


def measure(rows: int) -> Dict[str, Any]:
    """Bytes propose allocates at one steady step of `rows` rows, and the whole step's."""
    e = llada_engine(rows)
    seen: Dict[str, int] = {}
    inner = decoding.propose

    def counted(logits, *a, **k):
        with AllocatedBytes() as c:
            out = inner(logits, *a, **k)
        seen["propose"], seen["positions"] = c.total, int(a[2].sum()) if len(a) > 2 else -1
        seen["vocab"] = logits.shape[-1]
        return out

    import engine.engine as eng_mod
    eng_mod.propose = counted
    try:
        with AllocatedBytes() as step:
            e.step()
    finally:
        eng_mod.propose = inner
    return {"rows": rows, "propose_bytes": seen["propose"], "step_bytes": step.total,
            "masked_positions": seen["positions"], "vocab": seen["vocab"],
            "step_by_op": dict(sorted(step.by_op.items(), key=lambda kv: -kv[1])[:8])}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    res = [measure(r) for r in a.rows]
    for r in res:
        print(json.dumps(r), flush=True)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
