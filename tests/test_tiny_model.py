"""The shipped tiny dLLM (engine/assets/tiny-dllm): it loads offline, is small,
block-causal, and answers eval prompts exactly through the Engine.

Why: every offline command and CPU benchmark defaults to this model; a broken or
retrained-for-worse checkpoint must fail here, not in a Ray job.
"""
from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams, load_model
from tiny.tasks import TASKS, blocks_needed
from jobs.data import make_prompts

MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine", "assets", "tiny-dllm")


@pytest.fixture(scope="module")
def model_and_tok():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return load_model(MODEL_DIR, dtype=torch.float32)


def _settings():
    with open(os.path.join(MODEL_DIR, "blockray.json")) as f:
        return json.load(f)


def test_files_small_and_config_block_causal():
    names = set(os.listdir(MODEL_DIR))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "blockray.json"} <= names
    total = sum(os.path.getsize(os.path.join(MODEL_DIR, n)) for n in names)
    assert total < 20 * 2**20, f"tiny model directory is {total / 2**20:.1f} MiB"
    cfg = json.load(open(os.path.join(MODEL_DIR, "config.json")))
    assert cfg["model_type"] == "llada" and cfg["dllm_attention"] == "block_causal"
    assert (cfg["pad_token_id"], cfg["eos_token_id"], cfg["mask_token_id"]) == (0, 1, 2)
    s = _settings()
    assert (s["block_length"], s["steps_per_block"], s["policy"], s["threshold"], s["max_new_tokens"]) == (
        8, 8, "threshold", 0.9, 56)


def test_loaded_model_matches_tokenizer(model_and_tok):
    model, tok = model_and_tok
    assert tok is not None and model.config.block_causal
    assert model.config.vocab_size == len(tok)
    assert (tok.mask_token_id, tok.eos_token_id, tok.pad_token_id) == (
        model.config.mask_token_id, model.config.eos_token_id, model.config.pad_token_id)


def _pick_rows():
    """The first eval row of every task, plus the first rows needing 5, 6 and 7 blocks."""
    ev = pq.read_table(make_prompts.EVAL_PATH).to_pydict()
    picked, seen_tasks, seen_blocks = [], set(), set()
    for i, (task, ref) in enumerate(zip(ev["task"], ev["reference"])):
        nb = blocks_needed(ref)
        if task not in seen_tasks or (nb >= 5 and nb not in seen_blocks):
            picked.append(i)
            seen_tasks.add(task)
            seen_blocks.add(nb)
    return [(ev["prompt"][i], ev["reference"][i], ev["task"][i]) for i in picked]


def test_engine_answers_eval_prompts_exactly(model_and_tok):
    model, tok = model_and_tok
    rows = _pick_rows()
    assert {t for _, _, t in rows} == set(TASKS) and len(rows) <= 12
    s = _settings()
    eng = Engine(model, EngineConfig(block_length=s["block_length"], steps_per_block=s["steps_per_block"],
                                     cache="refresh", scheduler="blockserve"), tokenizer=tok)
    outs = eng.generate([p for p, _, _ in rows], SamplingParams(
        max_new_tokens=s["max_new_tokens"], policy=s["policy"], threshold=s["threshold"]))
    wrong = [(p, ref, o.text) for (p, ref, _), o in zip(rows, outs) if o.text != ref]
    assert not wrong, f"wrong answers (prompt, reference, got): {wrong}"
    for (_, ref, _), o in zip(rows, outs):
        assert o.finish_reason == "stop"
        assert o.num_blocks == blocks_needed(ref)  # stops in the block holding the first EOS
    assert len({o.num_blocks for o in outs}) >= 4


def test_training_rows_match_engine_layout():
    """The block-diffusion training row (packed, clean + noised copies) gives every
    noised block exactly the logits the engine computes for prompt + committed blocks +
    that block under its own block-causal mask."""
    import numpy as np

    from engine.batch import attention_mask
    from engine.models import build_model
    from tiny.train import BLOCK, answer_blocks, encode, make_batch, model_config, sample_length

    model = build_model(model_config(32, 2, 4, 64), dtype=torch.float64, seed=1)
    rows = [[("copy", "copy: abcdefghijklmnopqrst", "abcdefghijklmnopqrst"), ("first", "first: ab", "a")],
            [("rev", "rev: abcdefghij", "jihgfedcba")]]
    ids, pos, mask, _ = make_batch(rows, np.random.default_rng(0))
    with torch.no_grad():
        logits = model(ids, pos, mask)
        for r, packed in enumerate(rows):
            off = 0
            for _, prompt, answer in packed:
                p, a = encode(prompt), answer_blocks(answer)
                n = len(a) // BLOCK
                for j in range(n):
                    start = off + len(p) + BLOCK * (n - 1) + BLOCK * j
                    row = torch.cat([torch.tensor(p + a[:BLOCK * j]), ids[r, start:start + BLOCK]])[None]
                    W = row.shape[1]
                    m = attention_mask(torch.tensor([W]), torch.tensor([len(p)]), W, BLOCK, True)
                    ref = model(row, torch.arange(W)[None], m)[0, -BLOCK:]
                    torch.testing.assert_close(logits[r, start:start + BLOCK], ref)
                off += sample_length(prompt, answer)
