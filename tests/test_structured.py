"""Issue 43: structured outputs for diffusion decoding. Every constrained answer is a string
of its row's language whatever order the positions were unmasked in (regexes drawn by
Hypothesis over the embedded tiny model's alphabet, in mixed batches under every scheduler
and both canvases), the rows without a constraint keep their tokens exactly (float64),
`choice` answers one of its choices on every row (D2F rows among them), and a JSON schema
on a byte-level BPE vocabulary (Dream's published tokenizer layout, tiny random weights)
gives answers that parse and validate, 50 rows."""
from __future__ import annotations

import json
import os
import re
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from engine import Engine, EngineConfig, SamplingParams, load_model
from engine.structured.params import from_response_format, parse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkpoints  # noqa: E402
import published  # noqa: E402

torch.set_num_threads(1)
TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine", "assets", "tiny-dllm")
PROMPTS = ["copy: abc", "rev: cab", "what is 2+3?", "q: hello", "count to 5", "spell dog"]


@pytest.fixture(scope="module")
def tiny():
    return load_model(TINY, dtype=torch.float64, device="cpu")


def atoms():
    chars = st.sampled_from(list("abcde0123 :"))
    cls = st.sampled_from(["[a-c]", "[0-9]", "[a-z]", "[x-z0-2]"])
    return st.one_of(chars.map(re.escape), cls)


def regexes():
    """Regular expressions over the tiny model's characters, whose shortest answer fits."""
    return st.recursive(atoms(), lambda inner: st.one_of(
        st.lists(inner, min_size=2, max_size=3).map("".join),
        st.lists(inner, min_size=2, max_size=3).map(lambda xs: "(" + "|".join(xs) + ")"),
        st.tuples(inner, st.integers(0, 2), st.integers(0, 2)).map(lambda t: f"({t[0]}){{{t[1]},{t[1] + t[2]}}}"),
        inner.map(lambda x: f"({x})?"), inner.map(lambda x: f"({x})*")), max_leaves=6)


def run(model, tok, prompts, params, **cfg):
    return Engine(model, EngineConfig(**cfg), tokenizer=tok).generate(prompts, params)


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.lists(regexes(), min_size=2, max_size=3))
def test_every_constrained_answer_matches_its_regex_and_other_rows_keep_their_tokens(tiny, patterns):
    model, tok = tiny
    free = [SamplingParams(max_new_tokens=20, policy="fixed"), SamplingParams(max_new_tokens=12, temperature=0.7, seed=3)]
    constrained = [SamplingParams(max_new_tokens=20, policy=pol, temperature=t, seed=5,
                                  structured_outputs={"regex": r})
                   for r, (pol, t) in zip(patterns, [("threshold", 0.0), ("fixed", 0.8), ("factor", 0.0)])]
    prompts = PROMPTS[:len(constrained) + len(free)]
    for canvas in ("block", "full"):
        base = dict(block_length=4, steps_per_block=4, canvas=canvas, max_batch_size=8, token_budget=1024)
        alone = run(model, tok, prompts[len(constrained):], free, **base)
        for sched in ("blockserve", "static", "sequential"):
            outs = run(model, tok, prompts, constrained + free, scheduler=sched, **base)
            for o, r in zip(outs, patterns):
                assert o.error is None and re.fullmatch(r, o.text), (canvas, sched, r, o.text, o.error)
            assert [o.token_ids for o in outs[len(constrained):]] == [o.token_ids for o in alone], (canvas, sched)


def test_choice_answers_one_of_the_choices_on_every_row(tiny):
    model, tok = tiny
    choices = ["yes", "no", "maybe 2", "n0"]
    params = [SamplingParams(max_new_tokens=8, policy=p, structured_outputs={"choice": choices}, **kw)
              for p, kw in [("threshold", {}), ("fixed", {}), ("timestep", {}), ("threshold", {"block_add_threshold": 0.5,
                                                                                             "threshold": 0.5})] * 3]
    outs = run(model, tok, PROMPTS * 2, params, block_length=4, steps_per_block=4, canvas="block")
    assert all(o.error is None and o.text in choices for o in outs), [(o.text, o.error) for o in outs]


def test_refusals_name_what_is_wrong(tiny):
    model, tok = tiny
    bad = {"grammar": ("root ::= 'a'", "context-free grammar is not supported"),
           "two": ({"regex": "a", "choice": ["a"]}, "exactly one of"),
           "re": ({"regex": "("}, "is not a regular expression"),
           "fits": ({"regex": "a{30}"}, "no answer of the language fits in max_new_tokens=8"),
           "json": ({"json": "{nope"}, "structured_outputs.json is not JSON")}
    bad["grammar"] = ({"grammar": bad["grammar"][0]}, bad["grammar"][1])
    params = [SamplingParams(max_new_tokens=8, structured_outputs=v) for v, _ in bad.values()]
    outs = run(model, tok, ["a"] * len(params) + ["b"], params + [SamplingParams(max_new_tokens=8)], block_length=4,
               steps_per_block=4)
    for o, (_, why) in zip(outs, bad.values()):
        assert o.finish_reason == "error" and why in o.error, (why, o.error)
    assert outs[-1].finish_reason != "error"
    assert from_response_format({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}) == {
        "json": '{"type": "object"}'}
    with pytest.raises(ValueError, match="min_tokens"):
        raise ValueError(SamplingParams(max_new_tokens=8, min_tokens=2, structured_outputs={"regex": "a"}).validate())
    assert parse({"choice": ["a"], "regex": None, "json_object": False}).kind == "choice"  # an Arrow struct's nulls


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "a", "d", "t", "ok"],
          "properties": {
              "n": {"type": "string", "maxLength": 4},
              "a": {"type": "integer", "minimum": 0, "maximum": 99},
              "ok": {"type": "boolean"},
              "t": {"type": "array", "items": {"type": "string", "maxLength": 2}, "maxItems": 2},
              "d": {"type": "object", "additionalProperties": False, "required": ["c", "z"],
                    "properties": {"c": {"type": "string", "maxLength": 3},
                                   "z": {"type": "integer", "minimum": 0, "maximum": 9}}}}}


def test_json_schema_on_a_byte_level_bpe_vocabulary_parses_and_validates(tmp_path):
    import jsonschema

    root = published.build("Dream-org__Dream-v0-Instruct-7B", str(tmp_path / "dream"))
    model, tok = load_model(root, dtype=torch.float32, device="cpu")
    params = [SamplingParams(max_new_tokens=64, policy="fixed", structured_outputs={"json": SCHEMA},
                             temperature=1.0 if i % 10 == 0 else 0.0, seed=i) for i in range(50)]
    prompts = [f"person {i}:" for i in range(50)]
    outs = run(model, tok, prompts, params, block_length=32, steps_per_block=2, max_batch_size=25)
    for o in outs:
        assert o.error is None, o.error
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_through_the_cli_parquet_rows_and_openai_response_format(tmp_path, tiny_model_dir, ray_address):
    """Per-row sampling_params.structured_outputs in Parquet (the tiny model), and an OpenAI
    batch file's response_format json_schema (the Dream layout: its byte-level BPE has
    the braces and quotes JSON needs), as those users send them."""
    import jsonschema
    import pyarrow as pa
    import pyarrow.parquet as pq

    from conftest import read_parts
    from test_openai_batch import COMPLETIONS, cli, line, write_lines

    choices, regex = ["yes", "no"], "[a-c]{2,5}"
    asked = [{"structured_outputs": {"choice": choices, "regex": None}}, {"structured_outputs": {"regex": regex,
                                                                                                 "choice": None}},
             None, {"structured_outputs": {"choice": choices, "regex": None}}]
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(4)], "prompt": [f"copy: {'abc'[:i + 1]}" for i in range(4)],
                             "sampling_params": asked}), tmp_path / "in.parquet")
    res = cli("--model", tiny_model_dir, "--input", str(tmp_path / "in.parquet"), "--output", str(tmp_path / "out"),
              "--no-report", address=ray_address)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = {r["id"]: r for r in read_parts(str(tmp_path / "out")).to_pylist()}
    assert rows["r0"]["generated_text"] in choices and rows["r3"]["generated_text"] in choices
    assert re.fullmatch(regex, rows["r1"]["generated_text"]) and rows["r2"]["finish_reason"] in ("stop", "length")

    root = published.build("Dream-org__Dream-v0-Instruct-7B", str(tmp_path / "dream"))
    schema = {"type": "object", "additionalProperties": False, "required": ["k", "v"],
              "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 9}, "v": {"type": "boolean"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "kv", "schema": schema}}
    path = write_lines(tmp_path / "batch.jsonl", [line(f"j{i}", COMPLETIONS, prompt=f"item {i}", max_tokens=24,
                                                       response_format=fmt) for i in range(3)])
    out = str(tmp_path / "out-batch")
    res = cli("--model", root, "--input", path, "--output", out, "--output-format", "openai-batch", "--no-report",
              address=ray_address)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    with open(os.path.join(out, "results.jsonl")) as f:
        results = [json.loads(t) for t in f]
    assert [r["custom_id"] for r in results] == ["j0", "j1", "j2"]
    for r in results:
        assert r["error"] is None, r
        jsonschema.validate(json.loads(r["response"]["body"]["choices"][0]["text"]), schema)


@pytest.mark.parametrize("folder", ["inclusionAI__LLaDA2.0-mini", "JetLM__SDAR-1.7B-Chat"])
def test_families_with_blocks_at_absolute_positions(tmp_path, folder):
    """LLaDA2 and SDAR (the prompt's tail opens the first block: not part of the answer),
    on their published tokenizer layouts with tiny random weights."""
    model, tok = load_model(published.build(folder, str(tmp_path / "m")), dtype=torch.float32, device="cpu")
    params = [SamplingParams(max_new_tokens=12, structured_outputs={"choice": ["yes", "no way"]}),
              SamplingParams(max_new_tokens=12, structured_outputs={"regex": "[a-c]{3}x"})]
    outs = run(model, tok, ["hello there", "abc de"], params, block_length=4, steps_per_block=4)
    assert outs[0].text in ("yes", "no way") and re.fullmatch("[a-c]{3}x", outs[1].text), [o.text for o in outs]


@pytest.mark.parametrize("folder", ["GSAI-ML__LLaDA-8B-Instruct", "LLaDA-MoE"])
def test_bidirectional_prompt_families_on_their_published_layouts(tmp_path, folder):
    """LLaDA and LLaDA-MoE (the prompt bidirectional), with tiny random weights: LLaDA on
    its published file set, LLaDA-MoE on tests/checkpoints.py's (none is published in any
    store): choice and regex hold on every row, a sampled row's too."""
    root = str(tmp_path / "m")
    model, tok = load_model(checkpoints.write_llada_moe(root) if folder == "LLaDA-MoE" else published.build(folder, root),
                            dtype=torch.float32, device="cpu")
    params = [SamplingParams(max_new_tokens=12, structured_outputs={"choice": ["yes", "no way"]}),
              SamplingParams(max_new_tokens=12, structured_outputs={"regex": "[a-c]{3}x"}),
              SamplingParams(max_new_tokens=12, seed=3, temperature=1.0, structured_outputs={"regex": "(ab|ba)+"})]
    outs = run(model, tok, ["hello there", "abc de", "x"], params, block_length=4, steps_per_block=4)
    assert [o.error for o in outs] == [None] * 3
    assert outs[0].text in ("yes", "no way"), outs[0].text
    assert re.fullmatch("[a-c]{3}x", outs[1].text) and re.fullmatch("(ab|ba)+", outs[2].text), [o.text for o in outs]
