"""The CPU stages and the summary, without Ray: chat template → tokenize → detokenize on
pyarrow batches (user columns untouched, per-row errors), processor config checks, and
exact-match scoring."""
from __future__ import annotations

import pyarrow as pa
import pytest

from engine.config import SamplingParams
from pipeline.config import DLLMProcessorConfig, model_settings, split_settings
from pipeline.stages import (PRE_ERROR, TOKEN_IDS, chat_template_stage, detokenize_stage, load_tokenizer,
                             tokenize_stage)
from pipeline.summary import block_stats, summarize

TEMPLATE = "{% for m in messages %}{{ m['role'][0] }}= {{ m['content'] }}. {% endfor %}a= "  # tiny-vocab chars only


def test_tokenize_text_ids_and_errors(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    batch = pa.table({"prompt": ["copy: ab", None, "rev: x"], "meta": [{"k": 1}, {"k": 2}, {"k": 3}]})
    out = tokenize_stage(batch, model=tiny_model_dir, prompt_column="prompt",
                         prompt_token_ids_column="prompt_token_ids")
    assert out.column("meta").to_pylist() == [{"k": 1}, {"k": 2}, {"k": 3}]
    ids = out.column(TOKEN_IDS).to_pylist()
    assert ids[0] == tok("copy: ab", add_special_tokens=False)["input_ids"] and ids[1] is None
    assert out.column(PRE_ERROR).to_pylist() == [None, "'prompt' is null", None]
    # pre-tokenized input wins over text
    pre = pa.table({"prompt_token_ids": [[5, 6], None], "prompt": ["zzz", "zzz"]})
    out = tokenize_stage(pre, model=tiny_model_dir, prompt_column="prompt", prompt_token_ids_column="prompt_token_ids")
    assert out.column(TOKEN_IDS).to_pylist() == [[5, 6], None]
    assert out.column(PRE_ERROR).to_pylist()[1] == "'prompt_token_ids' is null"
    with pytest.raises(ValueError, match="need a 'prompt'"):
        tokenize_stage(pa.table({"x": [1]}), model=tiny_model_dir, prompt_column="prompt",
                       prompt_token_ids_column="prompt_token_ids")


def test_chat_template_then_tokenize_then_detokenize(tiny_model_dir):
    msgs = [[{"role": "user", "content": "copy: ab"}], [], [{"role": "system", "content": "hi"},
                                                          {"role": "user", "content": "rev: x"}]]
    batch = pa.table({"messages": msgs, "id": ["a", "b", "c"]})
    out = chat_template_stage(batch, model=tiny_model_dir, messages_column="messages", chat_template=TEMPLATE)
    out = tokenize_stage(out, model=tiny_model_dir, prompt_column="prompt", prompt_token_ids_column="prompt_token_ids")
    tok = load_tokenizer(tiny_model_dir)
    ids = out.column(TOKEN_IDS).to_pylist()
    assert tok.decode(ids[0]) == "u= copy: ab. a= "
    assert tok.decode(ids[2]) == "s= hi. u= rev: x. a= "
    assert "empty" in out.column(PRE_ERROR).to_pylist()[1]
    # what the engine would append, then detokenize drops the internal columns
    gen = out.append_column("generated_token_ids", pa.array([tok("ba")["input_ids"], [], [5]], pa.list_(pa.int64())))
    gen = gen.append_column("error", pa.array([None, "chat template failed", None], pa.string()))
    final = detokenize_stage(gen, model=tiny_model_dir)
    assert final.column("generated_text").to_pylist() == ["ba", None, tok.decode([5])]
    assert not [c for c in final.column_names if c.startswith("__")]
    assert final.column("id").to_pylist() == ["a", "b", "c"]


def test_config_validation_and_model_settings(tmp_path):
    with pytest.raises(ValueError):
        DLLMProcessorConfig(model="m", num_engines=0)
    with pytest.raises(ValueError, match="sort"):
        DLLMProcessorConfig(model="m", sort="random")
    with pytest.raises(ValueError, match="sampling"):
        DLLMProcessorConfig(model="m", sampling=SamplingParams(max_new_tokens=0))
    (tmp_path / "blockray.json").write_text('{"block_length": 8, "steps_per_block": 8, "threshold": 0.9, '
                                            '"max_new_tokens": 56, "other": 1}')
    eng, smp = split_settings(model_settings(str(tmp_path)))
    assert eng == {"block_length": 8, "steps_per_block": 8}
    assert smp == {"threshold": 0.9, "max_new_tokens": 56}
    assert model_settings(str(tmp_path / "missing")) == {}


def test_summary_exact_match():
    t = pa.table({"reference": ["ab", "c", None, "d"], "generated_text": [" ab\n", "x", "y", None],
                  "error": [None, None, None, "boom"], "num_generated_tokens": [3, 1, 1, 0],
                  "latency_s": [1.0, 1.0, 1.0, 0.0], "finish_reason": ["stop", "length", "stop", "error"]})
    s = summarize([block_stats(t), block_stats(t.slice(0, 2))], wall_s=2.0)
    assert (s["rows"], s["errors"], s["generated_tokens"], s["scored_rows"], s["exact_matches"]) == (6, 1, 9, 5, 2)
    assert s["exact_match"] == pytest.approx(2 / 5) and s["tokens_per_s"] == 4.5
    assert s["finish_reasons"] == {"error": 1, "length": 2, "stop": 3}
    no_ref = summarize([block_stats(t.drop_columns(["reference"]))], wall_s=1.0)
    assert no_ref["exact_match"] is None
