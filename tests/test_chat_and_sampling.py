"""Issue 15, for users coming from ray.data.llm and vLLM: chat templates applied by default
(a prefill continued, the rendered prompt kept), vLLM's sampling names per row with `n`
samples and stop strings, per-row seeds, and the run record in summary.json.

Cheap on purpose: stage and actor tests run in process; the two pipeline runs share the
session's Ray and use 1 engine, blocks of 4 and at most 8 new tokens."""
from __future__ import annotations

import asyncio
import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.engine_actor import STOP_TEXT, DLLMEngineActor, row_seed, sample_seeds
from actors.spec import EngineSpec
from conftest import ROOT, read_parts
from engine import EngineConfig, SamplingParams
from pipeline import stages
from pipeline.config import DLLMProcessorConfig
from actors.row_values import parse_sampling
from pipeline.run import SUMMARY_FILE, JobError, preflight, run_offline
from pipeline.stages import (PRE_ERROR, TEXT_PROMPT, chat_template_stage, detokenize_stage, load_tokenizer,
                             resolve_chat_template, tokenize_stage)
from pipeline.summary import block_stats, latency_bucket, percentiles, summarize

TINY = os.path.join(ROOT, "engine", "assets", "tiny-dllm")  # trained: "rev: abc" gives "cba"
# Only characters of the tiny vocabulary; no newline (the tiny tokenizer has none).
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}. {% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
ENGINE = EngineConfig(block_length=4, steps_per_block=4, token_budget=2048)
SAMPLING = SamplingParams(max_new_tokens=8)
ACCEPTANCE = {"max_tokens": 8, "top_p": 0.9, "top_k": 5, "stop": ["x"], "n": 3, "temperature": 0.7, "seed": 1}


def with_template(src: str, dst: str) -> str:
    """A copy of the model directory `src` whose tokenizer_config.json has TEMPLATE."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "tokenizer_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["chat_template"] = TEMPLATE
    with open(path, "w") as f:
        json.dump(cfg, f)
    return dst


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> str:
    return with_template(TINY, str(tmp_path_factory.mktemp("chat") / "tiny-chat"))


# --- chat template stage (no Ray) --------------------------------------------------------------

def test_chat_stage_auto_renders_continues_prefill_and_keeps_prompt(chat_model_dir):
    msgs = [[{"role": "user", "content": "rev: abc"}],
            [{"role": "user", "content": "copy: ab"}, {"role": "assistant", "content": "a"}],
            None]
    batch = pa.table({"messages": msgs, "prompt": [None, None, "copy: z"]})
    out = chat_template_stage(batch, model=chat_model_dir, messages_column="messages", mode=None)
    assert out.column("prompt").to_pylist() == [
        "user: rev: abc. assistant: ",   # last turn the user's: a new assistant turn is opened
        "user: copy: ab. assistant: a",  # a prefill: continued, no ". assistant: " after it
        "copy: z"]                       # auto: a row without messages keeps its text prompt
    out = tokenize_stage(out, model=chat_model_dir, prompt_column="prompt", prompt_token_ids_column="x")
    tok = load_tokenizer(chat_model_dir)
    assert [tok.decode(i) for i in out.column(stages.TOKEN_IDS).to_pylist()] == out.column("prompt").to_pylist()
    # keep_prompt=False: the engine gets the same text, the prompt column is left as it was
    out = chat_template_stage(batch, model=chat_model_dir, messages_column="messages", mode=None, keep_prompt=False)
    assert out.column("prompt").to_pylist() == [None, None, "copy: z"]
    assert out.column(TEXT_PROMPT).to_pylist()[1] == "user: copy: ab. assistant: a"


def test_chat_stage_auto_passes_through_and_forced_needs_a_template(chat_model_dir, tiny_model_dir):
    plain = pa.table({"prompt": ["rev: ab"]})
    assert chat_template_stage(plain, model=chat_model_dir, messages_column="messages", mode=None) is plain
    chats = pa.table({"messages": [[{"role": "user", "content": "rev: ab"}]]})
    # the random tiny model's tokenizer has no template: auto leaves the batch alone, forced makes a per-row error
    assert chat_template_stage(chats, model=tiny_model_dir, messages_column="messages", mode=None) is chats
    forced = chat_template_stage(chats, model=tiny_model_dir, messages_column="messages", mode=True)
    assert "no chat template" in forced.column(PRE_ERROR).to_pylist()[0]
    # a template given as text (ray.data.llm) or as a file (vLLM's --chat-template)
    ok = chat_template_stage(chats, model=TINY, messages_column="messages", chat_template=TEMPLATE)
    assert ok.column("prompt").to_pylist() == ["user: rev: ab. assistant: "]


def test_resolve_chat_template(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert resolve_chat_template(str(path)) == TEMPLATE == resolve_chat_template(TEMPLATE)
    assert resolve_chat_template(None) is None
    with pytest.raises(ValueError, match="neither a file"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))


# --- sampling: per-row params, seeds, n, stop strings (in process) --------------------------------

def _row_params(base, override):  # the engine actor's per-row parse: actors/row_values.py's
    return parse_sampling(override, base)


def test_row_params_take_vllm_names_and_name_unknown_keys():
    p = _row_params(SAMPLING, {**ACCEPTANCE, "policy": None})
    assert (p.max_new_tokens, p.top_p, p.top_k, list(p.stop), p.n, p.temperature, p.seed) == (
        8, 0.9, 5, ["x"], 3, 0.7, 1)
    assert _row_params(SAMPLING, None) is SAMPLING
    # an Arrow struct gives every row every key: null entries are not "unknown"
    assert _row_params(SAMPLING, {"max_tokens": 4, "bogus": None}).max_new_tokens == 4
    with pytest.raises(ValueError, match=r"\['bogus'\]"):
        _row_params(SAMPLING, {"max_tokens": 4, "bogus": 1})


def test_row_and_sample_seeds():
    assert row_seed(7, 3, 0, "a") == 7  # the row's own sampling_params seed first
    assert row_seed(None, 3, 0, "a") == 3  # then the seed column
    derived = row_seed(None, None, 0, "a")
    assert derived == row_seed(None, None, 0, "a") != row_seed(None, None, 0, "b")  # stable, per id
    assert row_seed(None, None, 0, "a") != row_seed(None, None, 1, "a")
    assert row_seed(None, None, 5, None) == 5 and row_seed(None, None, None, "a") is None
    seeds = sample_seeds(1, 3)
    assert seeds[0] == 1 and len(set(seeds)) == 3 and seeds == sample_seeds(1, 3)
    assert sample_seeds(None, 2) == [None, None]


def _run(actor, table):
    return asyncio.run(actor.run_batch(table))


def test_actor_stop_strings_cut_the_text_and_n_expands_rows():
    """The trained tiny model reverses "abcxef" into "fexcba": the stop string "x" ends the
    request at that block and the text is cut before it; n=3 gives three rows."""
    tok = load_tokenizer(TINY)
    actor = DLLMEngineActor(EngineSpec(TINY, EngineConfig(block_length=8, steps_per_block=8, token_budget=2048),
                                       SamplingParams(max_new_tokens=16), rank=0, enable_metrics=False, warmup=False))
    ids = tok("rev: abcxef", add_special_tokens=False)["input_ids"]
    table = pa.table({"prompt_token_ids": [ids, ids, ids], "id": ["s", "n", "bad"],
                      "sampling_params": [{"stop": ["x"]}, {"n": 3, "temperature": 0.7, "seed": 1},
                                          {"n": 0}]})
    out = _run(actor, table)
    actor.loop.shutdown()
    rows = out.to_pylist()
    assert [(r["id"], r["sample_index"]) for r in rows] == [("s", 0), ("n", 0), ("n", 1), ("n", 2), ("bad", 0)]
    stop = rows[0]
    assert stop["finish_reason"] == "stop" and stop[STOP_TEXT] == "fe"
    assert tok.decode(stop["generated_token_ids"]).startswith("fex")  # the fewest tokens holding "x"
    assert "n must be" in rows[4]["error"]
    final = detokenize_stage(out, model=TINY)
    assert final.column("generated_text").to_pylist()[0] == "fe"
    assert STOP_TEXT not in final.column_names


def test_duplicated_prompts_are_distinct_samples(tiny_model_dir):
    """Job seed 0, temperature 1: two rows with the same prompt and different ids get
    different seeds (so different tokens), the same id gets the same tokens again."""
    actor = DLLMEngineActor(EngineSpec(tiny_model_dir, ENGINE, SamplingParams(max_new_tokens=8, temperature=1.0, seed=0),
                                       rank=0, enable_metrics=False, warmup=False))
    table = pa.table({"prompt_token_ids": [[5, 6, 7]] * 3, "id": ["a", "b", "a"]})
    toks = _run(actor, table).column("generated_token_ids").to_pylist()
    actor.loop.shutdown()
    assert toks[0] == toks[2] != toks[1]


# --- summary pieces ------------------------------------------------------------------------------

def test_latency_percentiles_and_blocks_histogram():
    lat = [0.01 * (i + 1) for i in range(100)]  # 0.01 .. 1.0 s
    t = pa.table({"error": [None] * 100, "num_generated_tokens": [4] * 100, "latency_s": lat,
                  "finish_reason": ["stop"] * 100, "num_blocks": [1 + i % 3 for i in range(100)],
                  "sample_index": [i % 2 for i in range(100)],
                  "finished_at": [1000.0 + x for x in lat]})
    s = summarize([block_stats(t.slice(0, 50)), block_stats(t.slice(50))], wall_s=10.0)
    for q, exact in (("p50", 0.50), ("p90", 0.90), ("p99", 0.99)):
        assert s["latency_s"][q] == pytest.approx(exact, rel=0.07)
    assert s["blocks_to_finish"] == {"1": 34, "2": 33, "3": 33}
    assert s["input_rows"] == 50 and s["rows"] == 100
    assert s["generation_s"] == pytest.approx(1.0 - 0.0) and s["generation_tokens_per_s"] == pytest.approx(400.0)
    assert percentiles({}) == {"p50": None, "p90": None, "p99": None} and latency_bucket(0.0) == 0


# --- preflight: a template asked for and missing fails the job early -------------------------------

def _write(path, **cols) -> str:
    pq.write_table(pa.table(cols), path)
    return str(path)


def test_preflight_refuses_a_missing_template(tmp_path, tiny_model_dir):
    chats = _write(tmp_path / "chats.parquet", id=["a"], messages=[[{"role": "user", "content": "rev: ab"}]])
    texts = _write(tmp_path / "texts.parquet", id=["a"], prompt=["rev: ab"])
    both = _write(tmp_path / "both.parquet", id=["a"], prompt=["rev: ab"],
                  messages=[[{"role": "user", "content": "rev: ab"}]])
    out = str(tmp_path / "out")
    cfg = DLLMProcessorConfig(model=tiny_model_dir)  # its tokenizer has no chat template
    with pytest.raises(JobError, match="--chat-template"):  # auto, and only messages to go on
        preflight(chats, out, cfg)
    with pytest.raises(JobError, match="--chat-template"):  # forced
        preflight(both, out, DLLMProcessorConfig(model=tiny_model_dir, apply_chat_template=True))
    with pytest.raises(JobError, match="neither a file"):
        preflight(texts, out, DLLMProcessorConfig(model=tiny_model_dir, chat_template=str(tmp_path / "no.jinja")))
    assert not os.path.exists(out)  # nothing created before the checks passed
    tmpl = tmp_path / "t.jinja"
    tmpl.write_text(TEMPLATE)
    preflight(chats, out, DLLMProcessorConfig(model=tiny_model_dir, chat_template=str(tmpl)))
    preflight(both, out, cfg, resume=True)  # auto without a template: the text prompts are used


def test_job_exits_2_when_the_template_is_missing(tmp_path, tiny_model_dir, capsys):
    from jobs.offline_eval import main

    chats = _write(tmp_path / "chats.parquet", id=["a"], messages=[[{"role": "user", "content": "rev: ab"}]])
    base = ["--input", chats, "--output", str(tmp_path / "out"), "--model", tiny_model_dir]
    assert main(base) == 2  # no flag: auto, and the model has no template for the messages
    assert "--chat-template PATH" in capsys.readouterr().err
    assert main(base + ["--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "neither a file" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out")


# --- the job end to end (run_offline on the session's Ray) ----------------------------------------

def test_messages_get_the_template_by_default(tmp_path, chat_model_dir, ray_local):
    """Acceptance 1, and the run record of summary.json (issue 15 item 6)."""
    msgs = [[{"role": "user", "content": "rev: abc"}],
            [{"role": "user", "content": "copy: ab"}, {"role": "assistant", "content": "a"}],
            [{"role": "system", "content": "be short"}, {"role": "user", "content": "copy: b"}],
            []]  # an error row, for top_errors
    src = _write(tmp_path / "in.parquet", id=["u", "prefill", "sys", "empty"], messages=msgs)
    cfg = DLLMProcessorConfig(model=chat_model_dir, num_engines=1, batch_size=4, engine=ENGINE, sampling=SAMPLING,
                              sort="none", num_cpus_per_engine=0.5)
    summary = run_offline(src, str(tmp_path / "out"), cfg, max_error_fraction=1.0)
    rows = {r["id"]: r for r in read_parts(str(tmp_path / "out")).to_pylist()}
    assert rows["u"]["prompt"] == "user: rev: abc. assistant: "
    assert rows["prefill"]["prompt"] == "user: copy: ab. assistant: a"  # continued, not re-opened
    assert rows["sys"]["prompt"] == "system: be short. user: copy: b. assistant: "
    tok = load_tokenizer(chat_model_dir)
    for rid in ("u", "prefill", "sys"):  # what the engine saw: the rendered prompt's tokens
        assert rows[rid]["num_prompt_tokens"] == len(tok(rows[rid]["prompt"], add_special_tokens=False)["input_ids"])
        assert rows[rid]["error"] is None and rows[rid]["sample_index"] == 0
    assert "empty" in rows["empty"]["error"]

    with open(os.path.join(str(tmp_path / "out"), SUMMARY_FILE)) as f:
        record = json.load(f)
    assert record["config"]["engine"]["block_length"] == 4 and record["config"]["sampling"]["max_new_tokens"] == 8
    assert record["config"]["apply_chat_template"] is None and record["config"]["sort"] == "none"
    assert record["model"] == chat_model_dir and len(record["model_config_sha256"]) == 64
    assert "blockray_version" in record and "git_commit" in record
    assert record["top_errors"][0]["count"] == 1 and "empty" in record["top_errors"][0]["error"]
    assert record["generation_tokens_per_s"] >= record["tokens_per_s"] > 0
    assert 0 < record["generation_s"] <= record["wall_s"]
    assert set(record["latency_s"]) == {"p50", "p90", "p99"} and record["latency_s"]["p50"] > 0
    assert sum(record["blocks_to_finish"].values()) == 3
    assert record == json.loads(json.dumps({k: v for k, v in summary.items() if k != "summary_file"}))


def test_vllm_sampling_params_per_row_with_n_samples(tmp_path, tiny_model_dir, ray_local):
    """Acceptance 2: vLLM's sampling dict per row runs without error, n=3 gives three
    distinct samples per row (sample_index 0..2), stop strings never survive in the text;
    rows without a seed get one derived from the job seed and their id; a resume sees
    every (id, sample) once."""
    params = [ACCEPTANCE, ACCEPTANCE, None, None]
    src = _write(tmp_path / "in.parquet", id=["p0", "p1", "d0", "d1"],
                 prompt=["rev: abcd", "copy: xyz", "sort: dcba", "sort: dcba"], sampling_params=params)
    cfg = DLLMProcessorConfig(model=tiny_model_dir, num_engines=1, batch_size=4, engine=ENGINE, sort="none",
                              sampling=SamplingParams(max_new_tokens=8, temperature=1.0, seed=0),
                              num_cpus_per_engine=0.5)
    out = str(tmp_path / "out")
    summary = run_offline(src, out, cfg)
    assert summary["errors"] == 0 and summary["rows"] == 8 and summary["input_rows"] == 4
    rows = read_parts(out).to_pylist()
    keys = sorted((r["id"], r["sample_index"]) for r in rows)
    assert keys == [("d0", 0), ("d1", 0)] + [(p, k) for p in ("p0", "p1") for k in range(3)]
    tok = load_tokenizer(tiny_model_dir)
    for p in ("p0", "p1"):
        samples = [r for r in rows if r["id"] == p]
        assert len({tuple(r["generated_token_ids"]) for r in samples}) == 3  # distinct seeds, distinct samples
        for r in samples:
            assert r["num_generated_tokens"] <= 8 and "x" not in r["generated_text"]
            full = tok.decode(r["generated_token_ids"], skip_special_tokens=True)
            if "x" in full:  # the stop string ended it: the text is cut before it
                assert r["finish_reason"] == "stop" and r["generated_text"] == full[:full.index("x")]
    dup = {r["id"]: r["generated_token_ids"] for r in rows if r["id"].startswith("d")}
    assert dup["d0"] != dup["d1"]  # same prompt, different ids: different samples
    checked = preflight(src, out, cfg)  # resume: every (id, sample) once, nothing left to do
    assert sorted(checked.done) == sorted(r["id"] for r in rows) and checked.source.num_rows == 0
