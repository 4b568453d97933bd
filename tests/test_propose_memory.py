"""propose's memory per step (issue 51 item 8): with LLaDA's 126,464-token vocabulary, the
bytes its aten ops allocate (bench.propose_memory.AllocatedBytes) are its chunk buffers
plus a few bytes per masked position, the same at B=1 and B=3: never a [positions,
vocabulary] float64 tensor (before: the float64 copy and its softmax, 0.6 GB at B=8).
Dream's restricted sampling, which draws from the whole distribution, keeps its [positions,
vocabulary] logits and is not bounded here. Its tokens: tests/test_reference_decoding.py
and the families' float64 equality tests; chunked passes give one pass's bits:
test_chunked_passes_are_one_pass."""
from __future__ import annotations

import pytest
import torch

from bench.propose_memory import AllocatedBytes
from engine import SamplingParams
from engine.decoding import RowParams, chunk_rows, propose

V = 126464  # LLaDA-8B's vocabulary
L = 8  # positions per row: several chunk passes per row
PER_POSITION = 256  # bytes: indices, confidences, proposals at each masked position
RULES = {"low_confidence": {}, "threshold": dict(policy="threshold", threshold=0.9),
         "entropy": dict(remasking="entropy"), "margin": dict(remasking="margin"),
         "entropy_bound": dict(policy="entropy_bound")}


def _bytes(B: int, params: dict, full_x0: bool) -> tuple:
    g = torch.Generator().manual_seed(B)
    logits = torch.randn(B, L, V, generator=g)
    need = torch.ones(B, L, dtype=torch.bool)
    need[:, 0] = False
    rp = RowParams.build([SamplingParams(**params)] * B, [None] * B, "cpu")
    with AllocatedBytes() as c:
        propose(logits, rp, None, need, full_x0=full_x0)
    return c.total, int(need.sum())


@pytest.mark.parametrize("rule,full_x0", [(r, True) for r in sorted(RULES)] + [("low_confidence", False)])
def test_propose_allocates_its_chunk_buffers_whatever_the_batch(rule, full_x0):
    C = chunk_rows(V, torch.device("cpu"))
    spare = rule in ("entropy", "entropy_bound")  # a second float64 buffer for p log p
    buffers = C * V * (8 + 4 + (8 if spare else 0))  # float64 rows, their float32 stage
    for B in (1, 3):
        got, n = _bytes(B, RULES[rule], full_x0)
        assert buffers <= got <= buffers + PER_POSITION * n, (B, got, buffers)
    assert 20 * buffers < 8 * 32 * V * 8  # one float64 [positions, vocabulary] tensor at B=8, L=32


def test_chunked_passes_are_one_pass(monkeypatch):
    """Every rule propose computes, with one position per pass and with all in one pass:
    the same proposals and confidences, bit for bit (float64 and float32 logits; drawn
    tokens, Dream's restricted sampling, ties)."""
    import random

    from engine import decoding
    from engine.models.families.base import Confidence

    cases = [{}, dict(policy="threshold", threshold=0.5), dict(remasking="entropy"), dict(remasking="margin"),
             dict(remasking="sequential"), dict(remasking="random"), dict(policy="origin"), dict(temperature=0.7),
             dict(temperature=0.8, top_p=0.9, top_k=7), dict(top_k=5), dict(top_p=0.8), dict(alg_temp=0.5),
             dict(policy="entropy_bound"), dict(policy="entropy_bound", temperature=0.6)]
    g = torch.Generator().manual_seed(0)
    B, Lw, Vs = 6, 5, 97
    for trial in range(12):
        rng = random.Random(trial)
        dtype = (torch.float64, torch.float32)[trial % 2]
        params = [SamplingParams(**rng.choice(cases)) for _ in range(B)]
        seeds = [rng.randrange(1000) if rng.random() < 0.8 else None for _ in range(B)]
        keys = [None if s is None else 7 * s + 1 for s in seeds]
        logits = (3 * torch.randn(B, Lw, Vs, generator=g)).to(dtype)
        logits[0, 1, 3] = logits[0, 1, 5] = logits[0, 1].max() + 1  # a tie for the argmax
        need = torch.rand(B, Lw, generator=g) < 0.7
        for sampled in (False, True):
            for full_x0 in (True, False):
                got = []
                for rows in (1, 10**6):
                    monkeypatch.setitem(decoding.PROPOSE_CHUNK_BYTES, "cpu", rows * 8 * Vs)
                    rp = RowParams.build(params, seeds, "cpu",
                                         confidence=Confidence.SAMPLED if sampled else Confidence.MODEL)
                    got.append(propose(logits, rp, keys, need, full_x0=full_x0))
                (xa, ca), (xb, cb) = got
                assert torch.equal(xa[need], xb[need]) and torch.equal(ca, cb), (trial, sampled, full_x0)
                assert not full_x0 or torch.equal(xa, xb)
