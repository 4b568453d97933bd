"""Issue 37, rows 1-4 and acceptance 2: a bad row never fails the user's dataset, and a
prompt far longer than the context is refused before it is tokenized whole.

Through `build_processor` on the session's Ray, three runs in all: one with a chat template
and the default postprocess handling (rows 1-3: error rows skip postprocess, a `model`
column naming another model, null message content), one without a template, with
`postprocess_error_rows=True`, over a Parquet file holding a 5 MiB and a 50 MiB prompt
(row 1's option, row 4, the long prompts), and one whose postprocess raises on a good row.
The tokenize stage's memory is measured without Ray, in subprocesses (see
test_long_prompts_keep_the_tokenize_stage_flat).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # (not conftest's: the subprocess below
# imports this module, and conftest imports torch)

# Only characters of the tiny vocabulary (the tiny tokenizer has no newline).
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}. {% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
MIB = 1 << 20
MSG = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


def tiny_config(model: str, **kw):
    from engine import EngineConfig, SamplingParams
    from pipeline import DLLMProcessorConfig

    return DLLMProcessorConfig(model=model, num_engines=1, batch_size=4, max_concurrent_batches=2, dtype="float64",
                               wait_for_engines_s=0, sort="none", should_continue_on_error=True,
                               engine=EngineConfig(block_length=4, steps_per_block=4, token_budget=1024),
                               sampling=SamplingParams(max_new_tokens=8, policy="fixed"), **kw)


def by_key(rows) -> dict:
    """{(id, sample_index): row}; asserts that no key comes twice."""
    keys = [(r["id"], r["sample_index"]) for r in rows]
    assert len(keys) == len(set(keys)), keys
    return dict(zip(keys, rows))


def assert_error_rows(rows: dict, expected: dict) -> None:
    for rid, words in expected.items():
        err = rows[(rid, 0)]["error"]
        assert err and all(w in err for w in words), (rid, words, err)


# --- rows 1-3: error rows skip postprocess; `model` naming another; null message content --------

def test_error_rows_skip_postprocess_and_name_their_problem(ray_local, tiny_model_dir):
    import ray

    from pipeline import build_processor

    def row(rid, prompt=None, messages=None, model=None, sampling_params=None):
        return dict(id=rid, prompt=prompt, messages=messages, model=model, sampling_params=sampling_params)

    items = [
        row("g-text", prompt="copy: ab"),
        row("g-chat", messages=[{"role": "user", "content": "rev: ab"}]),
        row("g-model", prompt="copy: abc", model=tiny_model_dir),  # the served model by its path ...
        row("g-model-slash", prompt="rev: abc", model=tiny_model_dir + "/"),  # ... with a trailing slash
        row("e-null", prompt=None),  # neither prompt nor messages
        row("e-top-p", prompt="copy: ab", sampling_params={"top_p": "abc"}),
        row("e-other-model", prompt="copy: ab", model="other-org/other-model"),
        row("e-lora", prompt="copy: ab", model="my-lora-adapter"),
        row("e-content-null", messages=[{"role": "user", "content": None}]),
        row("e-content-missing", messages=[{"role": "system", "content": "be short"}, {"role": "user"}]),
    ]
    good = [r["id"] for r in items if r["id"].startswith("g-")]
    cfg = tiny_config(tiny_model_dir, chat_template=TEMPLATE)
    # ray.data.llm's example postprocess: it would raise AttributeError on an error row's null text
    processor = build_processor(cfg, postprocess=lambda r: {
        "id": r["id"], "sample_index": r["sample_index"], "text": r["generated_text"].strip(),
        "generated": r["num_generated_tokens"]})
    rows = by_key(processor(ray.data.from_items(items)).take_all())
    assert sorted(rows) == sorted((r["id"], 0) for r in items)
    for rid in good:  # postprocess's rows
        r = rows[(rid, 0)]
        assert r["generated"] == 8 and isinstance(r["text"], str) and r.get("error") is None, r
    served = repr(tiny_model_dir)
    assert_error_rows(rows, {
        "e-null": ["'messages' is null, and so is 'prompt'"],
        "e-top-p": ["bad sampling_params: top_p must be a number, got 'abc' (str)"],
        "e-other-model": ["asks for model 'other-org/other-model'", f"this run serves {served}"],
        "e-lora": ["asks for model 'my-lora-adapter'", f"this run serves {served}", "LoRA"],
        "e-content-null": ["messages[0].content is null (a user turn without text)"],
        "e-content-missing": ["messages[1].content is null (a user turn without text)"],
    })
    for rid in (r["id"] for r in items if r["id"].startswith("e-")):  # whole, as the processor made them
        r = rows[(rid, 0)]
        assert r["generated_text"] is None and r["finish_reason"] == "error" and r.get("text") is None, r
        assert r["generated_token_ids"] == [] or r["generated_token_ids"] is None, r


# --- a postprocess that raises on a good row: the user's, naming the row --------------------------

def test_postprocess_raising_on_a_good_row_is_the_users(ray_local, tiny_model_dir):
    import ray

    from common.storage import describe_error
    from pipeline import build_processor
    from pipeline.failures import users_to_fix

    items = [{"id": "e0", "prompt": None}, {"id": "g0", "prompt": "copy: ab"}]  # e0 skips postprocess
    processor = build_processor(tiny_config(tiny_model_dir), postprocess=lambda r: {"x": r["missing_column"]})
    with pytest.raises(Exception) as info:
        processor(ray.data.from_items(items)).take_all()
    message = describe_error(info.value)
    assert ("UserFunctionError: your postprocess function raised KeyError: 'missing_column' on the row with id "
            "'g0'") in message, message
    assert users_to_fix(info.value), message


# --- row 1's option, row 4, acceptance 2: long prompts ------------------------------------------

NORMAL = {"n0": "copy: ab", "n1": "rev: abc", "n2": "copy: x", "n3": "rev: ab"}
LONG = {"long5": 5 * MIB, "long50": 50 * MIB}


def write_input(path: str, long: bool) -> str:
    """The normal prompts, a row with only messages and one with neither, and with `long`
    a 5 MiB and a 50 MiB prompt of the tiny vocabulary's characters among them."""
    ids, prompts = list(NORMAL), list(NORMAL.values())
    if long:
        ids[2:2] = list(LONG)
        prompts[2:2] = ["copy: " + "ab" * ((size - 6) // 2) for size in LONG.values()]
    ids += ["msgs-only", "nothing"]
    prompts += [None, None]
    messages = [None] * (len(ids) - 2) + [[{"role": "user", "content": "rev: ab"}], None]
    pq.write_table(pa.table({"id": ids, "prompt": pa.array(prompts, pa.large_string()),
                             "messages": pa.array(messages, MSG)}), path)
    return path


LONG_ERROR = ("prompt too long for the model's context (or token_budget): its first 65,536 of {:,} characters "
              "are already 65,536 tokens, over the 1,024 a request can hold; the rest not tokenized")
UNUSED = ("'messages' not used: the model has no chat template (give one: chat_template, --chat-template PATH), "
          "and the row has no 'prompt'")


def test_postprocess_on_error_rows_when_asked_messages_without_template_and_long_prompts(
        tmp_path, ray_local, tiny_model_dir):
    import ray

    from pipeline import build_processor

    src = write_input(str(tmp_path / "in.parquet"), long=True)
    cfg = tiny_config(tiny_model_dir, postprocess_error_rows=True)  # the tiny model has no chat template
    processor = build_processor(cfg, postprocess=lambda r: {
        "id": r["id"], "sample_index": r["sample_index"], "error": r["error"],
        "text": r["generated_text"], "generated": r["num_generated_tokens"]})
    rows = by_key(processor(ray.data.read_parquet(src)).take_all())
    assert sorted(rows) == sorted((rid, 0) for rid in [*NORMAL, *LONG, "msgs-only", "nothing"])
    assert all(set(r) == {"id", "sample_index", "error", "text", "generated"} for r in rows.values()), rows
    for rid in NORMAL:
        assert rows[(rid, 0)]["generated"] == 8 and rows[(rid, 0)]["error"] is None, rows[(rid, 0)]
    errors = {rid: r["error"] for (rid, _), r in rows.items() if rid not in NORMAL}
    assert errors == {"long5": LONG_ERROR.format(LONG["long5"]), "long50": LONG_ERROR.format(LONG["long50"]),
                      "msgs-only": UNUSED, "nothing": "'prompt' is null"}, errors
    assert all(rows[(rid, 0)]["text"] is None for rid in errors)


# The tokenize stage as a run builds it (DLLMProcessor.tokenize_udf), over an input file read
# whole and cut into batches of the config's batch_size, as Ray Data's fused read -> tokenize
# task does; prints the stage's peak above the memory the process held once the input was
# read (the kernel's high-water mark of its RSS, VmHWM, reset to the current RSS through
# /proc/self/clear_refs when the read is done), and each row's error.
TOKENIZE_ONLY = r"""
import json, sys
import pyarrow.parquet as pq
sys.path.insert(0, sys.argv[3])
from test_hostile_rows import tiny_config
from pipeline import build_processor

def status(key):
    return next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith(key + ":")) / 1024

cfg = tiny_config(sys.argv[1])
udf = build_processor(cfg).tokenize_udf()
table = pq.read_table(sys.argv[2])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
read_mb, errors = status("VmRSS"), {}
for start in range(0, table.num_rows, cfg.batch_size):
    out = udf(table.slice(start, cfg.batch_size))
    errors.update(zip(out.column("id").to_pylist(), out.column("__error").to_pylist()))
print(json.dumps({"read_mb": read_mb, "stage_mb": status("VmHWM") - read_mb, "errors": errors}))
"""


def test_long_prompts_keep_the_tokenize_stage_flat(tmp_path, tiny_model_dir):
    """Acceptance 2's memory. What is measured: a fresh process, the test's child with
    nothing else in it, runs the tokenize stage exactly as a run builds it (the processor's
    TokenizeUDF: its checkpoint, limits and tokenizer) over the input as Ray's fused read ->
    tokenize task gets it (the Parquet file read whole, cut into batches), once with the 5 MiB
    and 50 MiB prompts among the rows and once without. The stage's peak is the highest RSS
    while it runs (VmHWM, reset when the read is done) above the RSS the process held with
    its input read: what the stage adds (the prompts as Python strings, the tokenizer's
    buffers, its output columns). The read itself is not the stage: decoding 55 MiB of
    Parquet leaves ~180 MB in Arrow's allocator whatever is done with the rows (printed).
    Under Ray the stage runs in pooled workers shared with other tasks, whose peaks could not
    be told apart. Tokenized whole, the 5 MiB prompt alone took 1.9 GB more."""
    runs = {}
    for long in (False, True):
        src = write_input(str(tmp_path / f"in-{long}.parquet"), long)
        res = subprocess.run([sys.executable, "-c", TOKENIZE_ONLY, tiny_model_dir, src, os.path.dirname(__file__)],
                             cwd=ROOT, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": ROOT})
        assert res.returncode == 0, res.stderr[-3000:]
        runs[long] = json.loads(res.stdout.strip().splitlines()[-1])
    assert runs[False]["errors"] == {**{rid: None for rid in NORMAL}, "msgs-only": UNUSED, "nothing": "'prompt' is null"}
    assert runs[True]["errors"] == {**runs[False]["errors"], "long5": LONG_ERROR.format(LONG["long5"]),
                                    "long50": LONG_ERROR.format(LONG["long50"])}
    print("tokenize stage: " + ", ".join(f"{'with' if k else 'without'} the long prompts {r['stage_mb']:.0f} MB over "
                                         f"the {r['read_mb']:.0f} MB read" for k, r in runs.items()))
    assert runs[True]["stage_mb"] - runs[False]["stage_mb"] <= 200, runs
