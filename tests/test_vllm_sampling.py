"""Issue 42, vLLM's sampling names: `max_tokens` / `max_completion_tokens` (per row and in
Python), the no-op keys, and `min_tokens`, `ignore_eos`, `include_stop_str_in_output`
each changing exactly what it should (engine level, float64, the embedded model and its
tokenizer, mixed batches under blockserve)."""
from __future__ import annotations

import pytest
import torch

from actors.row_values import RowValueError, parse_sampling
from engine import Engine, SamplingParams, load_model
from test_sampling import CFG, MODEL, PROMPTS  # the embedded model, its prompts and settings


@pytest.fixture(scope="module")
def tiny():
    return load_model(MODEL, dtype=torch.float64)


def generate(tiny, params, wrap=None):
    model, tok = tiny
    eng = Engine(model, CFG, tokenizer=tok)
    if wrap is not None:
        wrap(eng)
    return eng.generate(PROMPTS, params)


def test_max_tokens_names_and_no_op_keys():
    assert SamplingParams(max_tokens=5).max_new_tokens == 5
    assert SamplingParams(max_completion_tokens=6).max_new_tokens == 6
    assert SamplingParams(max_tokens=7, detokenize=False, skip_special_tokens=True,
                          spaces_between_special_tokens=True).max_new_tokens == 7
    assert SamplingParams.from_dict({"max_completion_tokens": 9}).max_new_tokens == 9
    with pytest.raises(ValueError, match="max_completion_tokens and max_tokens name the same setting"):
        SamplingParams.from_dict({"max_tokens": 3, "max_completion_tokens": 4})
    with pytest.raises(ValueError, match="disagree"):
        SamplingParams(max_tokens=3, max_completion_tokens=4)
    base = SamplingParams(max_new_tokens=8)
    # per row (ray.data.llm's own example puts detokenize=False in sampling_params)
    row = {"temperature": 0, "max_completion_tokens": 5, "detokenize": False, "skip_special_tokens": True,
           "spaces_between_special_tokens": True, "min_tokens": 2, "ignore_eos": True,
           "include_stop_str_in_output": True, "logprobs": True}
    got = parse_sampling(row, base)
    assert (got.max_new_tokens, got.min_tokens, got.ignore_eos, got.include_stop_str_in_output, got.logprobs) == (
        5, 2, True, True, 0)
    assert parse_sampling({"logprobs": False}, base).logprobs is None
    assert parse_sampling({"logprobs": 5}, base).logprobs == 5
    # values that would change the results are refused, naming the key
    for key, value, msg in [("skip_special_tokens", False, "skip_special_tokens=False is not supported per row"),
                            ("spaces_between_special_tokens", False, "spaces_between_special_tokens=False"),
                            ("detokenize", "yes", "detokenize must be true or false"),
                            ("logprobs", 21, "logprobs must be an integer in [0, 20]"),
                            ("min_tokens", 9, "min_tokens=9 must be at most max_new_tokens=8"),
                            ("prompt_logprobs", 1, "unknown sampling parameter(s) ['prompt_logprobs']")]:
        with pytest.raises(RowValueError) as e:
            parse_sampling({key: value}, base)
        assert msg in str(e.value), (key, str(e.value))
    with pytest.raises(ValueError, match="skip_special_tokens=False is not supported per row"):
        SamplingParams(skip_special_tokens=False)


def test_ignore_eos_ignores_only_the_checkpoints_stop_ids(tiny):
    model, _ = tiny
    eos = model.config.stop_token_ids
    free = generate(tiny, SamplingParams(max_new_tokens=32))
    ignored = generate(tiny, SamplingParams(max_new_tokens=32, ignore_eos=True))
    none = generate(tiny, SamplingParams(max_new_tokens=32, stop_token_ids=[]))
    explicit = generate(tiny, SamplingParams(max_new_tokens=32, ignore_eos=True, stop_token_ids=eos))
    assert all(o.finish_reason == "stop" for o in free)
    for f, i, n, e in zip(free, ignored, none, explicit):
        # no stop id: the same tokens as an empty stop list, to max_new_tokens, EOS ids among them
        assert (i.token_ids, i.finish_reason) == (n.token_ids, "length") and len(i.token_ids) == 32
        assert i.token_ids[:len(f.token_ids)] == f.token_ids and i.token_ids[len(f.token_ids)] in eos
        # explicit stop_token_ids still end the row, even the EOS id
        assert (e.token_ids, e.finish_reason, e.text) == (f.token_ids, "stop", f.text)


def test_min_tokens_masks_the_stop_ids_before_it(tiny):
    """min_tokens = the run without it whose stop ids' logits are set to -inf (a test-side
    wrap of the engine's step logits) at the answer positions before min_tokens, from
    the batch's columns; per row, in a mixed batch."""
    model, _ = tiny
    stops = model.config.stop_token_ids
    free = generate(tiny, SamplingParams(max_new_tokens=32))
    m = max(len(o.token_ids) for o in free[2:]) + 3  # past the stop of prompts 2.. (short answers)
    params = [SamplingParams(max_new_tokens=32, min_tokens=m if k % 2 == 0 else 0) for k in range(len(PROMPTS))]
    got = generate(tiny, params)

    def mask_before_min_tokens(eng):
        step_logits = eng.runner.step_logits

        def masked(b):
            logits = step_logits(b).clone()
            for i, r in enumerate(b.rows):
                if r.request_id % 2:
                    continue
                answer = b.block_cols[i] - (b.width - int(b.lens[i])) - len(r.prompt) - len(r.lead)
                for t in stops:
                    logits[i, (answer >= 0) & (answer < m), t] = -torch.inf
            return logits
        eng.runner.step_logits = masked

    ref = generate(tiny, [SamplingParams(max_new_tokens=32)] * len(PROMPTS), wrap=mask_before_min_tokens)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in ref]
    for k, (o, f) in enumerate(zip(got, free)):
        if k % 2:
            assert (o.token_ids, o.finish_reason) == (f.token_ids, f.finish_reason)  # its neighbours change nothing
        elif len(f.token_ids) < m:
            assert len(o.token_ids) >= m and o.token_ids != f.token_ids
        alone = generate(tiny, params[k])[k]  # batch invariance: the row alone (the same prompts' batch) ...
        assert alone.token_ids == o.token_ids
    assert all(not set(o.token_ids[:m]) & set(stops) for o in got[::2])


def test_min_tokens_and_include_stop_str_in_output_with_stop_strings(tiny):
    _, tok = tiny
    free = generate(tiny, SamplingParams(max_new_tokens=32))
    text = free[1].text  # the copy task: a long answer, "pefcvilanrkarephqcrejypxibd"
    stop = text[10:12]
    cut = generate(tiny, SamplingParams(max_new_tokens=32, stop=[stop]))
    kept = generate(tiny, SamplingParams(max_new_tokens=32, stop=[stop], include_stop_str_in_output=True))
    for c, k, f in zip(cut, kept, free):  # the same tokens and finish; the text keeps the stop string
        assert (k.token_ids, k.finish_reason, k.num_blocks) == (c.token_ids, c.finish_reason, c.num_blocks)
        at = f.text.find(stop)
        assert (c.text, k.text) == ((f.text[:at], f.text[:at + len(stop)]) if at >= 0 else (f.text, f.text))
    assert (cut[1].text, kept[1].text) == (text[:10], text[:12])
    # min_tokens: a stop string ending in the first min_tokens - 1 tokens does not count
    m = len(tok(text[:12], add_special_tokens=False)["input_ids"]) + 1
    late = generate(tiny, SamplingParams(max_new_tokens=32, stop=[stop], min_tokens=m))[1]
    assert late.text == free[1].text and late.token_ids == free[1].token_ids  # it occurs only once
    both = text[11:13] + "|" + text[3:5]
    two = generate(tiny, SamplingParams(max_new_tokens=32, stop=both.split("|"), min_tokens=6,
                                        include_stop_str_in_output=True))[1]
    assert two.text == text[:13]  # text[3:5] ends within the first 5 tokens: only text[11:13] counts
