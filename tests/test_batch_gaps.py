"""Issue 53, items 2-7: hardening and the OpenAI batch gaps.

Refused through the real CLI before Ray starts (exit 2, one line naming the option): a
--tensor-parallel-size the model's heads do not divide, --allow-duplicate-ids with
OpenAI batch results, a --chat-template-kwargs key apply_chat_template takes itself, a
UTF-16 batch file. Below the engines, without Ray: byte-order marks, a body's logprobs
keys, n's bound, an integer custom_id, results lines (logprobs, refused and failed
requests) read by the `openai` package's own types. One run on the session's Ray: the
README's example batch file (jobs/data/chat_batch.jsonl, chat and completions lines,
logprobs) on the embedded model with no --chat-template.
"""
from __future__ import annotations

import codecs
import inspect
import json
import os
import subprocess
import sys

import pytest
from openai.types import Completion, ErrorObject
from openai.types.chat import ChatCompletion

from conftest import ROOT, read_parts
from test_hostile_options import refused
from test_openai_batch import chat, line, write_lines

from common.tokenizer import load_tokenizer
from pipeline.config import RESERVED_TEMPLATE_KWARGS, DLLMProcessorConfig
from pipeline.openai_batch import (CHAT, COMPLETIONS, MAX_N, UNKNOWN_LOGPROB, parse_lines, results_text,
                                   token_texts)
from pipeline.reader import InputError, PromptParquetDatasource

TINY = os.path.join(ROOT, "engine", "assets", "tiny-dllm")  # 4 attention heads, 4 K/V heads; a chat template
EXAMPLE = os.path.join(ROOT, "jobs", "data", "chat_batch.jsonl")


def batch_text(items) -> str:
    return "".join(json.dumps(i) + "\n" for i in items)


# --- refused before Ray starts (CLI) ----------------------------------------------------------

@pytest.fixture(scope="module")
def batch_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("batch")
    text = batch_text([line("a", COMPLETIONS, prompt="copy: a"), line("b", CHAT, messages=chat("rev: b"))])
    files = {"good": d / "good.jsonl", "utf16": d / "utf16.jsonl"}
    files["good"].write_text(text)
    files["utf16"].write_bytes(text.encode("utf-16"))  # with its byte-order mark, as Windows tools write it
    return {k: str(v) for k, v in files.items()}


CASES = [
    ("tensor parallel 3 over 4 heads", ["--tensor-parallel-size", "3"], "good",
     ["tensor_parallel_size=3: 4 attention heads do not divide into 3 ranks", "--tensor-parallel-size"]),
    ("tensor parallel 8 over 4 heads", ["--tensor-parallel-size", "8"], "good",
     ["tensor_parallel_size=8: 4 attention heads do not divide into 8 ranks", "--tensor-parallel-size"]),
    ("duplicate ids with batch results", ["--allow-duplicate-ids", "--output-format", "openai-batch"], "good",
     ["results.jsonl has one line per custom_id", "(--allow-duplicate-ids, --output-format)"]),
    ("a template kwarg apply_chat_template takes", ["--chat-template-kwargs", '{"tokenize": true}'], "good",
     ["chat_template_kwargs key 'tokenize' is an argument of apply_chat_template itself"]),
    ("a UTF-16 batch file", [], "utf16", ["utf16.jsonl is UTF-16 text", "re-save it as UTF-8 (--input)"]),
]


@pytest.mark.parametrize("args, which, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_before_ray_starts(tmp_path, batch_files, args, which, words):
    err = refused(TINY, batch_files[which], str(tmp_path / "out"), *args)
    for w in words:
        assert w in err, (w, err)


def test_build_processor_refuses_a_tensor_parallel_size_before_any_actor():
    from pipeline import build_processor

    with pytest.raises(ValueError, match="tensor_parallel_size=3: 4 attention heads do not divide into 3 ranks"):
        build_processor(DLLMProcessorConfig(model=TINY, tensor_parallel_size=3))


def test_sharding_refused_is_the_users_to_fix():
    from engine.models.sharding import ShardingRefused
    from pipeline.failures import users_to_fix

    assert users_to_fix(ShardingRefused("tensor_parallel_size=3: 4 attention heads do not divide into 3 ranks"))


def test_reserved_template_kwargs_cover_apply_chat_template():
    """Every named parameter of transformers' apply_chat_template is refused (a transformers
    that adds one fails here); a template's own variable is not."""
    from transformers import PreTrainedTokenizerBase

    named = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"self", "kwargs"}
    assert named - RESERVED_TEMPLATE_KWARGS == set()
    for key in ("add_generation_prompt", "messages", "chat_template"):
        with pytest.raises(ValueError, match=f"chat_template_kwargs key '{key}' is an argument"):
            DLLMProcessorConfig(model="m", chat_template_kwargs={key: True, "enable_thinking": False})
    assert DLLMProcessorConfig(model="m", chat_template_kwargs={"enable_thinking": False})


# --- byte-order marks (no Ray) ------------------------------------------------------------------

def test_a_utf8_byte_order_mark_is_read_past_and_utf16_or_32_refused_by_name(tmp_path):
    items = [line("a", COMPLETIONS, prompt="copy: a"), line("b", CHAT, messages=chat("rev: b"))]
    batch = tmp_path / "bom.jsonl"
    batch.write_bytes(codecs.BOM_UTF8 + batch_text(items).encode())
    for fmt in ("auto", "openai-batch"):
        src = PromptParquetDatasource(str(batch), input_format=fmt)
        assert src.format == "openai-batch" and src.input_ids() == ["a", "b"], fmt
    plain = tmp_path / "plain.jsonl"
    plain.write_bytes(codecs.BOM_UTF8 + b'\n{"prompt": "copy: a"}\n')  # the mark on a blank first line
    assert PromptParquetDatasource(str(plain)).schema.names == ["prompt", "id"]
    table = tmp_path / "t.csv"
    table.write_bytes(codecs.BOM_UTF8 + b"prompt,id\ncopy: a,x\n")
    assert PromptParquetDatasource(str(table)).input_ids() == ["x"]
    for encoding, name in (("utf-16", "UTF-16"), ("utf-16-be", "UTF-16"), ("utf-32", "UTF-32")):
        wide = tmp_path / f"{encoding}.jsonl"
        bom = b"" if encoding != "utf-16-be" else codecs.BOM_UTF16_BE
        wide.write_bytes(bom + batch_text(items).encode(encoding))
        for fmt in ("auto", "openai-batch", "jsonl"):
            with pytest.raises(InputError, match=f"{encoding}.jsonl is {name} text .*re-save it as UTF-8"):
                PromptParquetDatasource(str(wide), input_format=fmt)


# --- lines to rows: logprobs, n, custom_id (no Ray) ------------------------------------------

def test_logprob_keys_n_bound_and_custom_id_type():
    items = [line("c-top", CHAT, messages=chat("rev: a"), logprobs=True, top_logprobs=2),
             line("c-on", CHAT, messages=chat("rev: a"), logprobs=True),
             line("c-off", CHAT, messages=chat("rev: a"), logprobs=False),
             line("p-3", COMPLETIONS, prompt="copy: a", logprobs=3),
             line("e-top-alone", CHAT, messages=chat("rev: a"), top_logprobs=2),
             line("e-top-21", CHAT, messages=chat("rev: a"), logprobs=True, top_logprobs=21),
             line("e-chat-int", CHAT, messages=chat("rev: a"), logprobs=1),
             line("e-p-6", COMPLETIONS, prompt="copy: a", logprobs=6),
             line("e-p-top", COMPLETIONS, prompt="copy: a", top_logprobs=2),
             line("e-n", CHAT, messages=chat("rev: a"), n=MAX_N + 1),
             line("n-max", CHAT, messages=chat("rev: a"), n=MAX_N)]
    rows = {r["custom_id"]: r for r in parse_lines([json.dumps(i) for i in items], "f.jsonl").to_pylist()}
    asked = {k: (r["sampling_params"] or {}).get("logprobs") for k, r in rows.items() if not k.startswith("e-")}
    assert asked == {"c-top": 2, "c-on": 0, "c-off": None, "p-3": 3, "n-max": None}
    assert rows["n-max"]["sampling_params"]["n"] == MAX_N
    assert {k: r["__error"] for k, r in rows.items() if r["__error"]} == {
        "e-top-alone": "body.top_logprobs needs body.logprobs: true",
        "e-top-21": "body.top_logprobs must be an integer from 0 to 20, got 21",
        "e-chat-int": "body.logprobs must be true or false on /v1/chat/completions, got 1",
        "e-p-6": "body.logprobs must be an integer from 0 to 5, got 6",
        "e-p-top": ("body key 'top_logprobs' is not supported by blockray on /v1/completions (supported: logprobs, "
                    "max_completion_tokens, max_tokens, model, n, prompt, response_format, seed, stop, stream, "
                    "temperature, top_p)"),
        "e-n": f"body.n must be at most {MAX_N} (OpenAI's bound), got {MAX_N + 1}",
    }
    for cid, words in ((7, "has a custom_id of the wrong type, int 7: it must be a string"),
                       (None, "has no custom_id"), ("", "has no custom_id")):
        with pytest.raises(ValueError, match=words):
            parse_lines([json.dumps(dict(line("x", COMPLETIONS, prompt="a"), custom_id=cid))], "f.jsonl")


# --- results lines in OpenAI's shape (no Ray) ------------------------------------------------

def test_results_lines_are_openais_logprobs_refusals_and_failures():
    tok = load_tokenizer(TINY)
    texts = token_texts(lambda: tok)
    ids = tok.encode("ab", add_special_tokens=False) + [1]  # "a", "b", EOS
    top = [[{"token_id": ids[0], "logprob": -0.1}, {"token_id": 7, "logprob": -2.5}],
           [{"token_id": ids[1], "logprob": -0.2}, {"token_id": 8, "logprob": -3.0}], []]
    base = dict(sample_index=0, generated_text="ab", finish_reason="stop", error=None, num_prompt_tokens=4,
                num_generated_tokens=3, finished_at=5.0, model=None, generated_token_ids=ids,
                generated_logprobs=[-0.1, -0.2, float("nan")], top_logprobs=top)
    rows = [dict(base, custom_id="chat", url=CHAT), dict(base, custom_id="cmpl", url=COMPLETIONS),
            dict(base, custom_id="plain", url=CHAT, generated_logprobs=None, top_logprobs=None),
            dict(base, custom_id="refused", url=CHAT, error="body.n must be at most 128 (OpenAI's bound), got 129",
                 generated_text=None, finish_reason="error"),
            dict(base, custom_id="failed", url=CHAT, error="engine step failed: RuntimeError: boom",
                 generated_text=None, finish_reason="error")]
    order = ["chat", "cmpl", "plain", "refused", "failed"]
    text = results_text(rows, order, "custom_id", "tiny", ["tiny"], texts)
    assert b"NaN" not in text  # JSON has none: a token committed without being chosen is OpenAI's -9999
    out = {o["custom_id"]: o for o in map(json.loads, text.splitlines())}
    body = ChatCompletion.model_validate(out["chat"]["response"]["body"])
    content = body.choices[0].logprobs.content
    assert [(c.token, c.logprob, c.bytes) for c in content] == [
        ("a", -0.1, [97]), ("b", -0.2, [98]), ("<|eos|>", UNKNOWN_LOGPROB, list(b"<|eos|>"))]  # NaN: not chosen
    assert [[(t.token, t.logprob, t.bytes) for t in c.top_logprobs] for c in content] == [
        [("a", -0.1, [97]), ("d", -2.5, [100])], [("b", -0.2, [98]), ("e", -3.0, [101])], []]
    cmpl = Completion.model_validate(out["cmpl"]["response"]["body"]).choices[0].logprobs
    assert cmpl.tokens == ["a", "b", "<|eos|>"] and cmpl.token_logprobs == [-0.1, -0.2, UNKNOWN_LOGPROB]
    assert cmpl.top_logprobs == [{"a": -0.1, "d": -2.5}, {"b": -0.2, "e": -3.0}, {}]
    assert cmpl.text_offset == [0, 1, 2]
    assert ChatCompletion.model_validate(out["plain"]["response"]["body"]).choices[0].logprobs is None
    refused_line = out["refused"]
    assert refused_line["error"] is None and refused_line["response"]["status_code"] == 400
    error = ErrorObject.model_validate(refused_line["response"]["body"]["error"])
    assert (error.type, error.param, error.code) == ("invalid_request_error", "n", None)
    assert out["failed"]["response"] is None and out["failed"]["error"] == {
        "code": "engine_failed", "message": "engine step failed: RuntimeError: boom"}


# --- the README's example on the embedded model (session Ray) --------------------------------

def test_the_example_batch_file_runs_on_the_embedded_model(tmp_path, ray_address):
    """jobs/data/chat_batch.jsonl as the README runs it: chat lines served by the embedded
    model's own template (no --chat-template), logprobs in OpenAI's shape equal to the
    run's, every body read by the openai package's types."""
    out = str(tmp_path / "out")
    res = subprocess.run([sys.executable, "jobs/offline_eval.py", "--input", EXAMPLE, "--output", out,
                          "--output-format", "openai-batch", "--num-engines", "1", "--no-report",
                          "--no-enable-metrics", "--address", ray_address],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, start_new_session=True,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    with open(EXAMPLE) as f:
        asked = [json.loads(t) for t in f]
    with open(os.path.join(out, "results.jsonl")) as f:
        results = [json.loads(t) for t in f]
    assert [r["custom_id"] for r in results] == [a["custom_id"] for a in asked]
    parts = {(r["custom_id"], r["sample_index"]): r for r in read_parts(out).to_pylist()}
    tok = load_tokenizer(TINY)
    bodies = {}
    for r, a in zip(results, asked):
        assert r["error"] is None and r["response"]["status_code"] == 200, r
        kind = ChatCompletion if a["url"] == CHAT else Completion
        bodies[r["custom_id"]] = kind.model_validate(r["response"]["body"])
        assert len(bodies[r["custom_id"]].choices) == a["body"].get("n", 1)
    # the template renders a user's turn as its text: the chat line's prompt is the task itself
    assert parts[("rev-1", 0)]["prompt"] == "rev: blockray"
    assert bodies["rev-1"].choices[0].message.content == "yarkcolb"
    assert bodies["sort-1"].choices[0].message.content == "delo"
    rep = parts[("rep-1", 0)]
    content = bodies["rep-1"].choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([i]) for i in rep["generated_token_ids"]]
    assert [c.logprob for c in content] == rep["generated_logprobs"]
    assert [[(t.token, t.logprob) for t in c.top_logprobs] for c in content] == [
        [(tok.decode([t["token_id"]]), t["logprob"]) for t in top] for top in rep["top_logprobs"]]
    assert all(len(c.top_logprobs) == 2 for c in content)
    length = bodies["len-1"].choices[0].logprobs
    assert length.token_logprobs == parts[("len-1", 0)]["generated_logprobs"]
    assert all(len(t) == 1 for t in length.top_logprobs)
    assert all(c.logprobs is None for k in ("rev-1", "next-1", "copy-1") for c in bodies[k].choices)
