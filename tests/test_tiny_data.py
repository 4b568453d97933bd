"""The tiny model's data side: task family, char tokenizer and the shipped eval set.

Why: the embedded model, its eval and the benchmarks all rely on one id per char,
exact round trips, fixed special ids and answers spanning several 8-token blocks.
"""
from __future__ import annotations

import os
import random

import pyarrow.parquet as pq
import pytest

from tiny import tasks as tiny_tasks
from tiny.tasks import TASKS, blocks_needed, make_example, sample
from tiny.tokenizer import build_tokenizer, save_tokenizer
from jobs.data import make_prompts

EVAL = pq.read_table(make_prompts.EVAL_PATH).to_pydict()


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    ids = save_tokenizer(d)
    assert ids == {"pad": 0, "eos": 1, "mask": 2, "unk": 3,
                   "vocab_size": 4 + len(tiny_tasks.CHARS)}
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert os.path.exists(d / name)
    return AutoTokenizer.from_pretrained(str(d))


def test_specials_have_fixed_ids(hf_tok):
    assert hf_tok.is_fast
    assert (hf_tok.pad_token_id, hf_tok.eos_token_id, hf_tok.mask_token_id,
            hf_tok.unk_token_id) == (0, 1, 2, 3)
    assert hf_tok.convert_tokens_to_ids(["<|pad|>", "<|eos|>", "<|mask|>", "<|unk|>"]) == [0, 1, 2, 3]
    assert len(hf_tok) == 4 + len(tiny_tasks.CHARS)


def test_round_trip_every_eval_string(hf_tok):
    raw = build_tokenizer()
    for text in EVAL["prompt"] + EVAL["reference"]:
        ids = hf_tok(text)["input_ids"]
        assert len(ids) == len(text)  # one id per char, no BOS/EOS added
        assert min(ids) > 3  # no unk, no specials
        assert ids == raw.encode(text).ids
        assert hf_tok.decode(ids, skip_special_tokens=True) == text
        assert hf_tok.decode(ids + [1, 0, 2], skip_special_tokens=True) == text


def test_round_trip_spaces_and_punctuation(hf_tok):
    # Decoders that join with spaces or clean up " ." would break these.
    text = " a . b , c ?  -=: 09 "
    ids = hf_tok(text)["input_ids"]
    assert len(ids) == len(text)
    assert hf_tok.decode(ids, skip_special_tokens=True) == text
    assert hf_tok(tiny_tasks.CHARS)["input_ids"] == list(range(4, 4 + len(tiny_tasks.CHARS)))


def test_eval_set_shape():
    assert os.path.getsize(make_prompts.EVAL_PATH) < 200_000
    assert set(EVAL) >= {"id", "prompt", "reference", "task"}
    n = len(EVAL["id"])
    assert n >= 1000 and len(set(EVAL["id"])) == n
    assert set(EVAL["task"]) == set(TASKS)
    assert max(len(p) for p in EVAL["prompt"]) <= 64
    lengths = [len(a) for a in EVAL["reference"]]
    assert min(lengths) == 1 and max(lengths) >= 48
    assert len({blocks_needed(a) for a in EVAL["reference"]}) >= 4
    assert {blocks_needed(a) for a in EVAL["reference"]} >= {1, 2, 3, 4, 5, 6}


def test_eval_file_matches_generator():
    # The shipped file is exactly what make_prompts writes (stale files fail here).
    fresh = make_prompts.tiny_rows(make_prompts.EVAL_ROWS, make_prompts.EVAL_SEED, "eval")
    assert fresh == {k: EVAL[k] for k in fresh}


def test_references_are_correct():
    for task, prompt, ref in zip(EVAL["task"], EVAL["prompt"], EVAL["reference"]):
        head, arg = prompt.split(": ")
        assert head.split(" ")[0] == task
        expected = {
            "copy": lambda: arg, "rev": lambda: arg[::-1],
            "rep": lambda: arg * int(head.split(" ")[1]),
            "len": lambda: str(len(arg)), "first": lambda: arg[0], "last": lambda: arg[-1],
            "sort": lambda: "".join(sorted(arg)),
            "next": lambda: "".join(tiny_tasks._shift(c) for c in arg),
        }[task]()
        assert ref == expected
        lo, hi = tiny_tasks.answer_length_range(task)
        assert lo <= len(ref) <= hi


def test_generators_are_deterministic():
    a, b = random.Random(7), random.Random(7)
    assert [sample(a) for _ in range(200)] == [sample(b) for _ in range(200)]
    for task in TASKS:
        assert make_example(task, random.Random(3)) == make_example(task, random.Random(3))
    assert make_prompts.tiny_rows(50, 0) == make_prompts.tiny_rows(50, 0)
    assert make_prompts.tiny_rows(50, 0) != make_prompts.tiny_rows(50, 12345)
    for dist in make_prompts.LENGTH_DISTS:
        assert make_prompts.synthetic_rows(dist, 30, 5) == make_prompts.synthetic_rows(dist, 30, 5)
    with pytest.raises(ValueError):
        make_example("add", random.Random(0))


def test_benchmark_sets(tmp_path):
    for dist in ("uniform", "lognormal", "skewed"):
        path = str(tmp_path / f"{dist}.parquet")
        make_prompts.main(["--rows", "2000", "--length-dist", dist, "--out", path])
        t = pq.read_table(path).to_pydict()
        assert set(t) == {"id", "prompt"} and len(set(t["id"])) == 2000
        assert all(p and set(p) <= set(tiny_tasks.CHARS) for p in t["prompt"])
    lengths = [len(p) for p in pq.read_table(str(tmp_path / "skewed.parquet"))["prompt"].to_pylist()]
    long_share = sum(n > 48 for n in lengths) / len(lengths)  # base 32: short <= 48, long >= 128
    assert 0.15 < long_share < 0.25
