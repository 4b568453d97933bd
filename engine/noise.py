"""Whether a row draws noise, in one place: the engine gives a row that does a seed
(engine.engine.Engine.check), and propose draws each kind for the rows that ask
(engine.decoding.propose); a row that draws none takes no generator at any step. Reads
engine.reads.NOISE_SAMPLING. Torch-free."""
from __future__ import annotations

from typing import Any


def draws_tokens(p: Any) -> bool:
    """The row draws its proposals (Gumbel noise on the logits)."""
    return p.temperature is not None and p.temperature > 0


def draws_confidence(p: Any) -> bool:
    """The row draws its confidence: a uniform per position (random remasking, Dream's origin)."""
    return p.remasking == "random" or p.policy == "origin"


def perturbs_confidence(p: Any) -> bool:
    """The row perturbs its confidence (Gumbel top-k: Dream's alg_temp)."""
    return p.alg_temp > 0


def draws_noise(p: Any) -> bool:
    """Whether a row with SamplingParams `p` draws noise at all (then it needs a seed: its
    own, or one the engine draws); the rows that do not take no generator at any step.
    Reads NOISE_SAMPLING."""
    return draws_tokens(p) or draws_confidence(p) or perturbs_confidence(p) or draws_escape(p)


def draws_escape(p: Any) -> bool:
    """The row draws its anti-loop positions (LLaDA2.2's edit loop, engine.indel; HF's variant)."""
    return getattr(p, "edit_ops", False) is True and getattr(p, "edit_ops_variant", "hf") == "hf"
