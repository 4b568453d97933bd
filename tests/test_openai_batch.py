"""Issue 42, part 1: input and output formats, OpenAI batch files in and out.

One real CLI run (on the session's Ray) takes an OpenAI batch file with chat and
completions lines, text-part content, max_completion_tokens, n: 2, a wrong-model line
and a line with an unsupported body key to results.jsonl, and a rerun on the same output
resumes. Everything else is checked below the engines, without Ray: lines to rows,
malformed files refused by the preflight (and once by the CLI) naming the line, JSON
Lines and CSV inputs with the same ids / limit / resume guarantees, JSON Lines part files.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ROOT, part_files, read_parts
from test_chat_and_sampling import TEMPLATE

from openai.types import Completion, ErrorObject
from openai.types.chat import ChatCompletion

from common.schema import PRE_ERROR
from pipeline.config import DLLMProcessorConfig
from pipeline.openai_batch import CHAT, COMPLETIONS, parse_lines, results_text
from pipeline.preflight import JobError, preflight
from pipeline.reader import PromptParquetDatasource
from pipeline.writer import AtomicParquetDatasink, completed_keys

TINY = ["--block-length", "4", "--steps-per-block", "4", "--max-new-tokens", "8", "--token-budget", "1024",
        "--num-engines", "1"]


def line(cid, url, **body):
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def chat(text):
    return [{"role": "user", "content": text}]


# The acceptance file: chat and completions lines, text parts, max_completion_tokens, n: 2,
# a wrong model, an unsupported key.
GOOD_FILE = [
    line("c-parts", CHAT, model="tiny", messages=[{"role": "user", "content": [{"type": "text", "text": "rev: abc"}]}],
         max_completion_tokens=8),
    line("p-copy", COMPLETIONS, model="tiny", prompt="copy: ab", max_tokens=8, temperature=0, stream=False),
    line("c-n2", CHAT, model="tiny", messages=chat("copy: abc"), n=2, temperature=0.7, top_p=0.9, seed=7),
    line("e-model", COMPLETIONS, model="gpt-4o-mini", prompt="copy: a"),
    line("e-key", CHAT, model="tiny", messages=chat("rev: ab"), logit_bias={"5": 1}),
    line("p-stop", COMPLETIONS, prompt="copy: abcd", stop="c", seed=1),
]


def write_lines(path, items, raw=()) -> str:
    """JSON Lines of `items`, then the raw texts `raw` as (line index, text) inserted."""
    texts = [json.dumps(i) for i in items]
    for at, text in raw:
        texts.insert(at, text)
    with open(path, "w") as f:
        f.write("\n".join(texts) + "\n")
    return str(path)


# --- lines to rows (no Ray) ------------------------------------------------------------------

def test_lines_become_rows_and_bodies_it_cannot_honour_are_their_lines_errors():
    items = GOOD_FILE + [
        line("e-stream", COMPLETIONS, prompt="a", stream=True),
        line("e-url", "/v1/embeddings", input="a"),
        line("e-image", CHAT, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        line("e-both", COMPLETIONS, prompt="a", max_tokens=4, max_completion_tokens=8),
        line("e-name", CHAT, messages=[{"role": "user", "content": "a", "name": "bob"}]),
        line("e-temp", COMPLETIONS, prompt="a", temperature="hot"),
        line("e-none", CHAT, model="tiny"),
    ]
    rows = {r["custom_id"]: r for r in parse_lines([json.dumps(i) for i in items] + ["  "], "f.jsonl").to_pylist()}
    assert list(rows) == [i["custom_id"] for i in items]  # in order, the blank line skipped
    assert rows["c-parts"]["messages"] == chat("rev: abc") and rows["c-parts"]["prompt"] is None
    assert rows["c-parts"]["sampling_params"] == dict(max_new_tokens=8, n=None, temperature=None, top_p=None,
                                                      stop=None, seed=None, logprobs=None, structured_outputs=None)
    assert rows["p-copy"]["prompt"] == "copy: ab" and rows["p-copy"]["messages"] is None
    assert rows["c-n2"]["sampling_params"] == dict(max_new_tokens=None, n=2, temperature=0.7, top_p=0.9, stop=None,
                                                   seed=7, logprobs=None, structured_outputs=None)
    assert rows["p-stop"]["sampling_params"]["stop"] == ["c"] and rows["p-stop"]["model"] is None
    assert rows["e-model"]["model"] == "gpt-4o-mini" and rows["e-model"][PRE_ERROR] is None  # the stage checks it
    assert {k: r[PRE_ERROR] for k, r in rows.items() if r[PRE_ERROR]} == {
        "e-key": ("body key 'logit_bias' is not supported by blockray on /v1/chat/completions (supported: "
                  "logprobs, max_completion_tokens, max_tokens, messages, model, n, response_format, seed, stop, "
                  "stream, temperature, top_logprobs, top_p)"),
        "e-stream": "body.stream True is not supported (a batch line is answered whole)",
        "e-url": "url '/v1/embeddings' is not served: /v1/chat/completions or /v1/completions",
        "e-image": ("body.messages[0].content[0] is not supported: only text parts ({\"type\": \"text\", \"text\": "
                    "...}), got {'type': 'image_url', 'image_url': {}}"),
        "e-both": "body.max_tokens and body.max_completion_tokens disagree",
        "e-name": "body.messages[0].name is not supported by blockray (a message is role and content)",
        "e-temp": "body.temperature must be a number, got 'hot' (str)",
        "e-none": "body has no 'messages'",
    }


def test_served_name_defaults_to_the_folder_name_or_hub_id(tmp_path):
    assert DLLMProcessorConfig(model=str(tmp_path / "LLaDA-8B") + "/").served_name() == "LLaDA-8B"
    assert DLLMProcessorConfig(model="s3://bucket/models/dream").served_name() == "dream"
    assert DLLMProcessorConfig(model="GSAI-ML/LLaDA-8B-Instruct").served_name() == "GSAI-ML/LLaDA-8B-Instruct"
    assert DLLMProcessorConfig(model="x/y", served_model_name="mine").served_name() == "mine"


# --- malformed files: refused in the preflight, naming the line (no Ray) --------------------

@pytest.mark.parametrize("raw,expected", [
    ([(1, '{"custom_id": "b", "url": ')], "batch.jsonl line 2 is not JSON (Expecting value: line 1 column 26 (char 25))"),
    ([(2, json.dumps(line(None, COMPLETIONS, prompt="x")))], "batch.jsonl line 3 has no custom_id"),
    ([(2, json.dumps(line("a", COMPLETIONS, prompt="y")))], "batch.jsonl line 3 repeats custom_id 'a' of "),
])
def test_a_malformed_batch_file_is_refused_naming_the_line(tmp_path, tiny_model_dir, raw, expected):
    good = [line("a", COMPLETIONS, prompt="copy: a"), line("b", COMPLETIONS, prompt="copy: b")]
    path = write_lines(tmp_path / "batch.jsonl", good, raw)
    with pytest.raises(JobError) as e:
        preflight(path, str(tmp_path / "out"), DLLMProcessorConfig(model=tiny_model_dir))
    assert expected in e.value.message and not os.path.exists(tmp_path / "out")


def test_the_cli_refuses_a_malformed_batch_file_before_ray_starts(tmp_path, tiny_model_dir):
    path = write_lines(tmp_path / "batch.jsonl", [line("a", COMPLETIONS, prompt="copy: a")] * 2)
    res = subprocess.run([sys.executable, "jobs/offline_eval.py", "--model", tiny_model_dir, "--input", path,
                          "--output", str(tmp_path / "out"), "--input-format", "openai-batch", "--no-dashboard"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert res.returncode == 2, res.stderr[-3000:]
    err = res.stderr.strip()
    where = f"file://{path}"
    assert err == f"error: input file {where} line 2 repeats custom_id 'a' of {where} line 1: each request needs its own (--input)", err
    assert "blockray offline eval:" not in res.stdout  # Ray never started


# --- JSON Lines and CSV in, JSON Lines parts out (no Ray) -----------------------------------

def read_all(src: PromptParquetDatasource) -> pa.Table:
    return pa.concat_tables([t for task in src.get_read_tasks(1) for t in task()])


def test_jsonl_and_csv_inputs_keep_ids_limit_and_resume(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    write_lines(d / "a.jsonl", [{"prompt": f"copy: {c}"} for c in "abc"])
    with open(d / "b.csv", "w", newline="") as f:
        csv.writer(f).writerows([["prompt", "reference"], ["copy: d", "d"], ["copy: e", "e"]])
    with pytest.raises(Exception, match="holds both CSV and JSON Lines files; give --input-format"):
        PromptParquetDatasource(str(d))
    src = PromptParquetDatasource(str(d / "a.jsonl"))  # auto: JSON Lines, not a batch file
    assert src.format == "jsonl" and src.input_ids() == ["a.jsonl:0", "a.jsonl:1", "a.jsonl:2"]
    src = PromptParquetDatasource(str(d), input_format="csv", exclude_ids=["b.csv:0"])  # resume past b.csv:0
    assert read_all(src).to_pylist() == [{"prompt": "copy: e", "reference": "e", "id": "b.csv:1"}]
    with pytest.raises(Exception, match="is csv and another input jsonl"):
        PromptParquetDatasource([str(d / "a.jsonl"), str(d / "b.csv")])
    src = PromptParquetDatasource(str(d / "a.jsonl"), limit=2)
    assert read_all(src).column("id").to_pylist() == ["a.jsonl:0", "a.jsonl:1"]


def test_jsonl_part_files_resume_and_do_not_mix_with_parquet_parts(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    out.mkdir()
    sink = AtomicParquetDatasink(fsspec.filesystem("file"), str(out), part_format="jsonl")
    table = pa.table({"id": ["x", "x", "y"], "sample_index": [0, 1, 0], "generated_text": ["a", "b", None],
                      "data": [b"\x00\xff", b"", b"z"]})
    assert sink.write([table], SimpleNamespace(task_idx=3)) == {"file": f"part-{sink.writer}-000003.jsonl", "rows": 3}
    with open(out / f"part-{sink.writer}-000003.jsonl") as f:
        assert [json.loads(t) for t in f] == [
            {"id": "x", "sample_index": 0, "generated_text": "a", "data": "AP8="},
            {"id": "x", "sample_index": 1, "generated_text": "b", "data": ""},
            {"id": "y", "sample_index": 0, "generated_text": None, "data": "eg=="}]
    assert completed_keys(fsspec.filesystem("file"), str(out)) == [("x", 0), ("x", 1), ("y", 0)]
    inp = write_lines(tmp_path / "p.jsonl", [{"id": i, "prompt": "copy: a"} for i in "xyz"])
    with pytest.raises(JobError, match="holds part files of another format .*output format parquet would mix"):
        preflight(inp, str(out), DLLMProcessorConfig(model=tiny_model_dir), resume=True)
    checked = preflight(inp, str(out), DLLMProcessorConfig(model=tiny_model_dir), output_format="jsonl")
    try:
        assert checked.done == ["x", "x", "y"] and checked.source.num_rows == 1  # z only
    finally:
        checked.release()


# --- results out (no Ray) ----------------------------------------------------------------------

def test_results_lines_in_input_order():
    base = dict(finish_reason="length", error=None, num_prompt_tokens=5, finished_at=1700000000.5, model=None)
    rows = [dict(base, custom_id="b", url=COMPLETIONS, sample_index=0, generated_text="xy", num_generated_tokens=2),
            dict(base, custom_id="a", url=CHAT, sample_index=1, generated_text="q", num_generated_tokens=1,
                 finish_reason="stop"),
            dict(base, custom_id="a", url=CHAT, sample_index=0, generated_text="p", num_generated_tokens=3),
            dict(base, custom_id="e", url=CHAT, sample_index=0, generated_text=None, num_generated_tokens=0,
                 finish_reason="error", error="the row asks for model 'm'", model="m")]
    out = [json.loads(t) for t in results_text(rows, ["a", "b", "e"], "custom_id", "tiny", ["tiny"]).splitlines()]
    assert [o["custom_id"] for o in out] == ["a", "b", "e"]
    a = out[0]["response"]
    assert a["status_code"] == 200 and a["body"]["object"] == "chat.completion" and a["body"]["model"] == "tiny"
    assert a["body"]["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "p"}, "logprobs": None, "finish_reason": "length"},
        {"index": 1, "message": {"role": "assistant", "content": "q"}, "logprobs": None, "finish_reason": "stop"}]
    assert a["body"]["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}
    assert a["body"]["created"] == 1700000000 and out[0]["error"] is None
    assert out[1]["response"]["body"]["object"] == "text_completion"
    assert out[1]["response"]["body"]["choices"] == [{"index": 0, "text": "xy", "logprobs": None,
                                                      "finish_reason": "length"}]
    assert out[2]["error"] is None  # refused, not failed: OpenAI's response with the error in its body
    assert out[2]["response"] == {"status_code": 404, "request_id": out[2]["id"].replace("batch_req_", "req_"),
                                  "body": {"error": {"message": "the row asks for model 'm'",
                                                     "type": "invalid_request_error", "param": "model",
                                                     "code": "model_not_found"}}}


# --- the acceptance run: the CLI, then a rerun (session Ray) ------------------------------------

def cli(*args, address):
    return subprocess.run([sys.executable, "jobs/offline_eval.py", *TINY, *args, "--address", address], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, start_new_session=True, stdin=subprocess.DEVNULL)


def test_openai_batch_file_through_the_cli_and_a_resume(tmp_path, tiny_model_dir, ray_address):
    path = write_lines(tmp_path / "batch.jsonl", GOOD_FILE)
    (tmp_path / "t.jinja").write_text(TEMPLATE)
    out = str(tmp_path / "out")
    args = ("--model", tiny_model_dir, "--served-model-name", "tiny", "--input", path, "--output", out,
            "--output-format", "openai-batch", "--max-error-fraction", "1", "--chat-template", str(tmp_path / "t.jinja"),
            "--no-report")
    res = cli(*args, address=ray_address)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    with open(os.path.join(out, "results.jsonl"), "rb") as f:
        first = f.read()
    results = [json.loads(t) for t in first.decode().splitlines()]
    assert [r["custom_id"] for r in results] == [i["custom_id"] for i in GOOD_FILE]
    parts = {(r["custom_id"], r["sample_index"]): r for r in read_parts(out).to_pylist()}
    assert sorted(parts) == sorted([(i["custom_id"], 0) for i in GOOD_FILE] + [("c-n2", 1)])  # each exactly once
    for r, asked in zip(results, GOOD_FILE):
        cid = r["custom_id"]
        assert r["id"].startswith("batch_req_") and set(r) == {"id", "custom_id", "response", "error"}
        if cid.startswith("e-"):  # refused: a response whose body is OpenAI's error
            assert r["error"] is None and r["response"]["status_code"] in (400, 404), r
            continue
        assert r["error"] is None, r
        body, is_chat = r["response"]["body"], asked["url"] == CHAT
        assert r["response"]["status_code"] == 200 and body["model"] == "tiny"
        assert body["object"] == ("chat.completion" if is_chat else "text_completion")
        samples = [parts[(cid, k)] for k in range(len(body["choices"]))]
        assert len(samples) == asked["body"].get("n", 1)
        for k, (choice, s) in enumerate(zip(body["choices"], samples)):
            text = choice["message"]["content"] if is_chat else choice["text"]
            assert choice["index"] == k and text == s["generated_text"] and isinstance(text, str)
            assert choice["finish_reason"] == s["finish_reason"] and s["finish_reason"] in ("stop", "length")
            if is_chat:
                assert choice["message"]["role"] == "assistant"
        gen = sum(s["num_generated_tokens"] for s in samples)
        assert body["usage"] == {"prompt_tokens": samples[0]["num_prompt_tokens"], "completion_tokens": gen,
                                 "total_tokens": samples[0]["num_prompt_tokens"] + gen}
        assert 0 < gen <= 8 * len(samples)
    # the chat line with text parts was rendered with the template; max_completion_tokens held
    assert parts[("c-parts", 0)]["prompt"] == "user: rev: abc. assistant: "
    assert parts[("p-stop", 0)]["generated_text"].find("c") == -1  # cut before the stop string
    errors = {r["custom_id"]: r["response"]["body"]["error"] for r in results if r["custom_id"].startswith("e-")}
    assert errors["e-model"]["code"] == "model_not_found" and errors["e-model"]["param"] == "model"
    assert errors["e-model"]["message"].startswith("the row asks for model 'gpt-4o-mini'") and (
        "(served as 'tiny')" in errors["e-model"]["message"])
    assert errors["e-key"] == {"type": "invalid_request_error", "param": "logit_bias", "code": None, "message": (
        "body key 'logit_bias' is not supported by blockray on /v1/chat/completions (supported: logprobs, "
        "max_completion_tokens, max_tokens, messages, model, n, response_format, seed, stop, stream, temperature, "
        "top_logprobs, top_p)")}
    for e in errors.values():
        assert ErrorObject.model_validate(e).type == "invalid_request_error"  # OpenAI's own type reads it
    files = part_files(out)

    res = cli(*args, address=ray_address)  # a rerun: every request is there, nothing generated again
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads(next(t for t in res.stdout.splitlines() if t.startswith("SUMMARY_JSON "))[13:])
    assert summary["rows_processed"] == 0 and summary["rows_skipped"] == len(GOOD_FILE)
    assert summary["results_file"].endswith("/out/results.jsonl")
    assert part_files(out) == files
    with open(os.path.join(out, "results.jsonl"), "rb") as f:
        assert f.read() == first


def test_a_batch_file_in_and_results_out_on_s3(s3_storage, s3fs_client):
    from common.storage import get_filesystem
    from pipeline.openai_batch import write_results_file

    s3fs_client.mkdir("formats")
    items = [line("q2", COMPLETIONS, prompt="copy: a"), line("q1", CHAT, messages=chat("rev: a"))]
    s3fs_client.pipe("formats/in/batch.jsonl", ("\n".join(json.dumps(i) for i in items) + "\n").encode())
    src = PromptParquetDatasource("s3://formats/in/", s3_storage)  # auto: a folder of one batch file
    assert src.format == "openai-batch" and src.input_ids() == ["q2", "q1"]
    rows = pa.table({"custom_id": ["q1", "q2"], "url": [CHAT, COMPLETIONS], "sample_index": [0, 0],
                     "generated_text": ["a", "a"], "finish_reason": ["stop", "length"], "error": [None, None],
                     "num_prompt_tokens": [9, 7], "num_generated_tokens": [1, 8], "finished_at": [5.0, 6.0]})
    with s3fs_client.open("formats/out/part-a.parquet", "wb") as f:
        pq.write_table(rows, f)
    fs, path = get_filesystem("s3://formats/out", s3_storage)
    assert write_results_file(fs, path, src.input_ids(), "custom_id", "tiny", ["tiny"]) == "s3://formats/out/results.jsonl"
    out = [json.loads(t) for t in s3fs_client.cat("formats/out/results.jsonl").decode().splitlines()]
    assert [(o["custom_id"], o["response"]["body"]["object"]) for o in out] == [
        ("q2", "text_completion"), ("q1", "chat.completion")]
    assert sorted(s3fs_client.ls("formats/out")) == ["formats/out/part-a.parquet", "formats/out/results.jsonl"]
