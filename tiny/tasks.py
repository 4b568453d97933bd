"""Synthetic task family for the embedded tiny diffusion LM.

Why: the default model must be trainable on a CPU in ~30 minutes and still exercise
what the engine is about, i.e. requests that stop after *different* numbers of
8-token blocks. Every task here is a per-character rule a 1-4M-parameter model can
learn (copy / reverse / map / repeat / pick / count / sort); answers run from 1 to 48
characters, so ceil((len(answer) + 1) / 8) (answer + EOS) covers 1..7 blocks. The
long answers (33..48 chars) come only from the easiest rules: `copy` and `rep`.

Prompt format: "<keyword>: <argument>" ("rep <n>: <unit>" for repeats). Arguments use
only lowercase letters (plus digits for `next`), never ':' or spaces, so a prompt
parses unambiguously. Pure Python: no torch, no ray.
"""
from __future__ import annotations

import random
import string
from typing import Callable, Mapping, Optional

LETTERS: str = string.ascii_lowercase
DIGITS: str = string.digits
PUNCT: str = " :.,-=?"
# The model's character vocabulary (order fixes the tokenizer ids after the specials).
CHARS: str = LETTERS + DIGITS + PUNCT

TASKS: tuple[str, ...] = ("copy", "rev", "rep", "next", "len", "first", "last", "sort")

# Training/eval mix: more weight on the tasks that produce long answers (copy, rep)
# so every block count is well represented; single-char answers are cheap to learn.
TASK_WEIGHTS: Mapping[str, float] = {
    "copy": 2.0, "rev": 1.5, "rep": 2.0, "next": 1.0,
    "len": 1.0, "first": 0.5, "last": 0.5, "sort": 1.0,
}

MAX_ANSWER_CHARS: int = 48
MAX_PROMPT_CHARS: int = 64  # longest is "copy: " + 40 chars = 46

# Argument length ranges per task (inclusive); kept where the feasibility probe
# reached high exact match (copy/reverse up to 24 chars; copy is the easiest rule).
COPY_LEN = (1, 40)
REV_LEN = (1, 16)
NEXT_LEN = (1, 16)
LEN_LEN = (1, 30)
PICK_LEN = (1, 12)
SORT_LEN = (2, 8)
REP_TIMES = (2, 9)  # single digit, so the count is one token
REP_UNIT = (1, 6)
# Every (unit length, times) pair whose answer fits; sampled uniformly so that
# answers of 33..48 chars (u=4..6 with large n) are common.
REP_COMBOS: tuple[tuple[int, int], ...] = tuple(
    (u, n)
    for u in range(REP_UNIT[0], REP_UNIT[1] + 1)
    for n in range(REP_TIMES[0], REP_TIMES[1] + 1)
    if u * n <= MAX_ANSWER_CHARS
)


def _word(rng: random.Random, lo: int, hi: int, alphabet: str = LETTERS) -> str:
    """A random string with a length uniform in [lo, hi]."""
    return "".join(rng.choices(alphabet, k=rng.randint(lo, hi)))


def _shift(c: str) -> str:
    """Next character in its own cycle: a->b ... z->a, 0->1 ... 9->0."""
    alphabet = DIGITS if c in DIGITS else LETTERS
    return alphabet[(alphabet.index(c) + 1) % len(alphabet)]


def _copy(rng: random.Random) -> tuple[str, str]:
    s = _word(rng, *COPY_LEN)
    return f"copy: {s}", s


def _rev(rng: random.Random) -> tuple[str, str]:
    s = _word(rng, *REV_LEN)
    return f"rev: {s}", s[::-1]


def _rep(rng: random.Random) -> tuple[str, str]:
    u, n = rng.choice(REP_COMBOS)
    unit = _word(rng, u, u)
    return f"rep {n}: {unit}", unit * n


def _next(rng: random.Random) -> tuple[str, str]:
    s = _word(rng, *NEXT_LEN, alphabet=LETTERS + DIGITS)
    return f"next: {s}", "".join(_shift(c) for c in s)


def _len(rng: random.Random) -> tuple[str, str]:
    s = _word(rng, *LEN_LEN)
    return f"len: {s}", str(len(s))


def _first(rng: random.Random) -> tuple[str, str]:
    s = _word(rng, *PICK_LEN)
    return f"first: {s}", s[0]


def _last(rng: random.Random) -> tuple[str, str]:
    s = _word(rng, *PICK_LEN)
    return f"last: {s}", s[-1]


def _sort(rng: random.Random) -> tuple[str, str]:
    s = _word(rng, *SORT_LEN)
    return f"sort: {s}", "".join(sorted(s))


_MAKERS: dict[str, Callable[[random.Random], tuple[str, str]]] = {
    "copy": _copy, "rev": _rev, "rep": _rep, "next": _next,
    "len": _len, "first": _first, "last": _last, "sort": _sort,
}
assert tuple(_MAKERS) == TASKS


def make_example(task: str, rng: random.Random) -> tuple[str, str]:
    """One (prompt, answer) pair of `task`; deterministic given the rng state."""
    try:
        maker = _MAKERS[task]
    except KeyError:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}") from None
    return maker(rng)


def sample(
    rng: random.Random, weights: Optional[Mapping[str, float]] = None
) -> tuple[str, str, str]:
    """(task, prompt, answer) with the task drawn from `weights` (default TASK_WEIGHTS)."""
    w = TASK_WEIGHTS if weights is None else weights
    tasks = [t for t in TASKS if w.get(t, 0.0) > 0]
    task = rng.choices(tasks, weights=[w[t] for t in tasks], k=1)[0]
    prompt, answer = make_example(task, rng)
    return task, prompt, answer


def answer_length_range(task: str) -> tuple[int, int]:
    """(min, max) answer length in chars of `task`, by construction (docs and tests)."""
    return {
        "copy": COPY_LEN, "rev": REV_LEN, "next": NEXT_LEN, "sort": SORT_LEN,
        "rep": (min(u * n for u, n in REP_COMBOS), max(u * n for u, n in REP_COMBOS)),
        "len": (len(str(LEN_LEN[0])), len(str(LEN_LEN[1]))),
        "first": (1, 1), "last": (1, 1),
    }[task]


def blocks_needed(answer: str, block_length: int = 8) -> int:
    """Blocks a request needs to emit `answer` followed by EOS."""
    return -(-(len(answer) + 1) // block_length)
