"""Issue 14: hostile inputs, as a new user would try them. Every job-level problem is one
line on stderr and exit 2 before Ray starts (cases 2-6: `jobs/offline_eval.py` in a
subprocess, a few seconds each); rows that cannot be generated become error rows and
the good rows are generated exactly once, with the tokens they get alone (case 1); too
many failed rows, a dying S3 endpoint and a failure inside the run that the user must fix
end the run with a JobError (cases 7-9: `run_offline` on the session's Ray, CLI runs
joining it, for the exit code), while a bug of blockray's inside the run exits 1 with its
traceback in a log file (one CLI run on a Ray of its own, whose workers get the bug).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ROOT, S3_KEY, S3_REGION, S3_SECRET, part_files, read_parts, start_moto, write_prompts
from procs import job_ray, private_ray, ray_temp_dir

TINY = ["--block-length", "4", "--steps-per-block", "4", "--max-new-tokens", "8", "--token-budget", "1024"]


# --- helpers -----------------------------------------------------------------------------

def cli(*args: str, timeout: float = 120, address: Optional[str] = None) -> subprocess.CompletedProcess:
    """`python jobs/offline_eval.py …` on the Ray at `address`, else with a private Ray temp
    dir (should Ray start)."""
    with job_ray(address) as ray:
        return subprocess.run([sys.executable, "jobs/offline_eval.py", *args, *ray],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout, start_new_session=True,
                              stdin=subprocess.DEVNULL)


def assert_refused(res: subprocess.CompletedProcess, *words: str) -> str:
    """Exit 2 with one line on stderr holding `words`, no traceback, Ray never started."""
    err = res.stderr.strip()
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-4000:]
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert "Traceback" not in res.stdout + res.stderr
    assert "blockray offline eval:" not in res.stdout, "Ray started before the job-level checks failed"
    for w in words:
        assert w in err, (w, err)
    return err


def invalid_utf8(texts) -> pa.Array:
    """A string column holding the given bytes as they are (Arrow does not check UTF-8)."""
    return pa.array(texts, pa.binary()).view(pa.string())


def tiny_config(model: str, **kw):
    from pipeline import DLLMProcessorConfig
    from engine import EngineConfig, SamplingParams

    kw = {"dtype": "float64", "wait_for_engines_s": 0, **kw}
    return DLLMProcessorConfig(model=model, num_engines=1, batch_size=2, max_concurrent_batches=2,
                               engine=EngineConfig(block_length=4, steps_per_block=4, token_budget=1024),
                               sampling=SamplingParams(max_new_tokens=8, policy="fixed"), **kw)


# --- 1 (+2: ids unified): invalid UTF-8 prompts become error rows ------------------------

GOOD_A = ["copy: abc", "rev: hello", "copy: ray"]
GOOD_B = ["sort: dcba", "copy: x", "rev: ab"]


@pytest.fixture
def utf8_input(tmp_path):
    """Two files of 4 rows, one with string ids and one with int64 ids, each with one prompt
    whose bytes are not UTF-8."""
    d = tmp_path / "in"
    d.mkdir()
    a = [p.encode() for p in GOOD_A]
    a.insert(1, b"copy: \xff\xfeab")
    b = [p.encode() for p in GOOD_B]
    b.insert(2, b"rev: a\xc3(")
    pq.write_table(pa.table({"id": [f"a{i}" for i in range(4)], "prompt": invalid_utf8(a)}), d / "a.parquet")
    pq.write_table(pa.table({"id": pa.array(range(100, 104), pa.int64()), "prompt": invalid_utf8(b)}),
                   d / "b.parquet")
    good = dict(zip(["a0", "a2", "a3"], GOOD_A)) | dict(zip(["100", "101", "103"], GOOD_B))
    return str(d), good, ["a1", "102"]


def _engine_alone(model_dir: str, config, prompts):
    import torch

    from engine import Engine, load_model

    model, tok = load_model(model_dir, dtype=torch.float64)
    return {k: Engine(model, config.engine, tokenizer=tok).generate([p], config.sampling)[0].token_ids
            for k, p in prompts.items()}


def test_invalid_utf8_prompts_are_error_rows(tmp_path, tiny_model_dir, ray_local, utf8_input):
    from pipeline.run import ErrorFractionExceeded, run_offline

    inp, good, bad = utf8_input
    expected = _engine_alone(tiny_model_dir, tiny_config(tiny_model_dir), good)
    runs = {}
    for sort in ("blendserve", "none"):
        out = str(tmp_path / f"out-{sort}")
        cfg = tiny_config(tiny_model_dir, sort=sort)
        if sort == "blendserve":  # 2 of 8 rows failing is allowed here ...
            summary = run_offline(inp, out, cfg, rows_per_file=None, max_error_fraction=0.25)
            assert summary["status"] == "ok"
        else:  # ... and fails the default (0): after every row and summary.json are written
            with pytest.raises(ErrorFractionExceeded) as info:
                run_offline(inp, out, cfg, rows_per_file=None)
            summary = info.value.summary
            assert "2 of 8 rows failed" in str(info.value) and "not valid UTF-8" in str(info.value)
            assert json.load(open(os.path.join(out, "summary.json")))["status"] == "failed"
        table = read_parts(out)
        assert table.schema.field("id").type == pa.string()  # int64 ids of b.parquet read as strings
        rows = {r["id"]: r for r in table.to_pylist()}
        assert sorted(table.column("id").to_pylist()) == sorted([*good, *bad])  # every id exactly once
        for k in bad:
            assert rows[k]["finish_reason"] == "error" and "prompt is not valid UTF-8" in rows[k]["error"], rows[k]
            assert "\ufffd" in rows[k]["prompt"]  # the output stays readable
        for k in good:
            assert rows[k]["error"] is None and rows[k]["generated_token_ids"] == expected[k], (sort, k)
        assert summary["rows"] == 8 and summary["errors"] == 2
        assert {e["error"]: e["count"] for e in summary["top_errors"]} == {
            "prompt is not valid UTF-8 (column 'prompt': invalid start byte)": 1,
            "prompt is not valid UTF-8 (column 'prompt': invalid continuation byte)": 1}, summary["top_errors"]
        runs[sort] = rows
    assert all(runs["none"][k]["generated_token_ids"] == runs["blendserve"][k]["generated_token_ids"] for k in good)


# --- 2-6: refused in preflight, before Ray starts -------------------------------------------

def test_files_disagreeing_on_a_column_type_are_refused(tmp_path, tiny_model_dir):
    d = tmp_path / "in"
    d.mkdir()
    write_prompts(str(d / "a.parquet"), "a{}", 3, reference=["x", "y", "z"])
    write_prompts(str(d / "b.parquet"), "b{}", 3, reference=pa.array([1, 2, 3], pa.int64()))
    t0 = time.time()
    err = assert_refused(cli("--model", tiny_model_dir, "--input", str(d), "--output", str(tmp_path / "out")),
                         "'reference'", "a.parquet", "b.parquet", "string", "int64", "(--input)")
    assert time.time() - t0 < 30, err
    assert not (tmp_path / "out").exists()


def test_model_that_needs_remote_code_is_refused(tmp_path, tiny_model_dir):
    import shutil

    model = tmp_path / "remote-model"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.update(tokenizer_class="ShinyTokenizer", auto_map={"AutoTokenizer": ["tokenization_shiny.ShinyTokenizer", None]})
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    marker = tmp_path / "remote-code-ran"
    (model / "tokenization_shiny.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast\n\n\nclass ShinyTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    inp = str(tmp_path / "in.parquet")
    write_prompts(inp, "r{}", 4)
    res = cli("--model", str(model), "--input", inp, "--output", str(tmp_path / "out"))
    assert_refused(res, "needs remote code", "never runs", "auto_map", "(--model)")
    assert "[y/N]" not in res.stdout + res.stderr and "trust_remote_code" not in res.stderr
    assert not marker.exists()


def test_output_overlapping_the_input_is_refused(tmp_path, tiny_model_dir):
    d = tmp_path / "data"
    d.mkdir()
    write_prompts(str(d / "prompts.parquet"), "r{}", 4)
    before = sorted(os.listdir(d))
    for inp, out, words in ((d, d, ["is the input"]), (d, d / "results", ["inside the input"]),
                            (d / "prompts.parquet", d, ["inside the output"])):
        assert_refused(cli("--model", tiny_model_dir, "--input", str(inp), "--output", str(out)), *words, "(--output)")
    assert sorted(os.listdir(d)) == before  # nothing written among the inputs


def test_duplicate_ids_are_refused(tmp_path, tiny_model_dir):
    inp = str(tmp_path / "in.parquet")
    write_prompts(inp, "d{}", [0, 1, 2, 1, 3, 3, 3, 4])
    assert_refused(cli("--model", tiny_model_dir, "--input", inp, "--output", str(tmp_path / "out")),
                   "2 duplicated id(s)", "'d1', 'd3'", "--allow-duplicate-ids")
    assert not (tmp_path / "out").exists()


def test_overwrite_deletes_nothing_before_every_check_passed(tmp_path, tiny_model_dir):
    inp, out = str(tmp_path / "in.parquet"), tmp_path / "out"
    write_prompts(inp, "r{}", 4)
    out.mkdir()
    pq.write_table(pa.table({"id": ["r0"], "generated_text": ["abc"]}), out / "part-old-000000.parquet")
    (out / "summary.json").write_text('{"rows": 1}')
    before = sorted(os.listdir(out))
    assert_refused(cli("--overwrite", "--model", str(tmp_path / "no-such-model"), "--input", inp, "--output", str(out)),
                   "no-such-model", "(--model)")
    assert_refused(cli("--overwrite", "--model", tiny_model_dir, "--input", str(tmp_path / "typo.parquet"),
                       "--output", str(out)), "typo.parquet", "(--input)")
    assert sorted(os.listdir(out)) == before
    assert pq.read_table(out / "part-old-000000.parquet").column("id").to_pylist() == ["r0"]


# --- 7 (+5 with the flag): too many failed rows, through the CLI ----------------------------

def test_failed_rows_over_the_bound_exit_non_zero(tmp_path, tiny_model_dir, ray_address):
    """Every row fails (empty or untokenizable prompts), two ids repeat and are allowed: the
    run writes every row, exits 2 with one line naming the most frequent errors, and
    summary.json reports them with counts, and the duplicated ids."""
    inp, out = str(tmp_path / "in.parquet"), str(tmp_path / "out")
    prompts = ["", "   ", "", "copy: \u2603", "", "copy: \u2603\u2603", "", "   "]
    pq.write_table(pa.table({"id": ["e0", "e1", "e2", "e3", "e0", "e5", "e6", "e5"], "prompt": prompts}), inp)
    res = cli("--model", tiny_model_dir, "--input", inp, "--output", out, "--allow-duplicate-ids",
              "--num-engines", "1", "--batch-size", "4", *TINY, timeout=300, address=ray_address)
    err = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    assert err[-1].startswith("error: 8 of 8 rows failed (100.0%, more than --max-error-fraction 0)"), err[-1]
    assert "4 x 'empty prompt'" in err[-1] and "summary.json" in err[-1], err[-1]
    assert "=== summary ===" in res.stdout and "4 x empty prompt" in res.stdout
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["status"] == "failed" and summary["rows"] == 8 and summary["errors"] == 8
    top = {e["error"]: e["count"] for e in summary["top_errors"]}
    assert top["empty prompt"] == 4 and top["empty prompt ('prompt' is only whitespace)"] == 2, top
    assert summary["duplicate_ids"] == {"count": 2, "extra_rows": 2, "first": ["e0", "e5"]}
    assert sorted(read_parts(out).column("id").to_pylist()) == sorted(["e0", "e1", "e2", "e3", "e0", "e5", "e6", "e5"])


# --- 8: the S3 endpoint dies mid-run ---------------------------------------------------------

def _has_parts(client, key: str) -> bool:
    client.invalidate_cache()
    return client.exists(key) and bool(part_files(key, client))


def test_s3_endpoint_dying_mid_run_fails_within_a_minute(tmp_path, tiny_model_dir, ray_local):
    """One retry layer (botocore's, 5 attempts per call): once the endpoint is gone the run
    ends with the storage error in one line well within a minute (it took 230-270 s with
    botocore's 10 attempts under the writer's own 4)."""
    import s3fs

    from pipeline import StorageOptions
    from pipeline.run import JobError, run_offline

    inp = str(tmp_path / "in.parquet")
    write_prompts(inp, "r{:03d}", 400)
    proc, url = start_moto()
    try:
        client = s3fs.S3FileSystem(key=S3_KEY, secret=S3_SECRET, endpoint_url=url,
                                   client_kwargs={"region_name": S3_REGION}, skip_instance_cache=True)
        client.mkdir("dies")
        storage = StorageOptions(endpoint_url=url, key=S3_KEY, secret=S3_SECRET, region=S3_REGION)
        result: dict = {}

        def run() -> None:
            try:
                result["summary"] = run_offline(inp, "s3://dies/out", tiny_config(tiny_model_dir), storage=storage,
                                                rows_per_file=None)
            except Exception as e:  # noqa: BLE001 - inspected below
                result["error"] = e
            result["t_end"] = time.time()

        worker = threading.Thread(target=run, daemon=True)
        worker.start()
        deadline = time.time() + 240
        while not _has_parts(client, "dies/out"):
            assert worker.is_alive(), result
            assert time.time() < deadline, "no part file appeared"
            time.sleep(0.1)
        proc.kill()  # the endpoint dies: every later request is refused
        t_kill = time.time()
        worker.join(120)
    finally:
        proc.kill()
        proc.wait(10)
    assert not worker.is_alive(), "the run did not end within 120 s of the outage"
    err = result.get("error")
    assert isinstance(err, JobError), result
    msg = str(err)
    print(f"failed {result['t_end'] - t_kill:.1f} s after the outage: {msg}")
    assert result["t_end"] - t_kill < 60, msg
    assert "s3://dies/out" in msg and "rerun with the same --output" in msg, msg
    assert "EndpointConnectionError" in msg or "Could not connect" in msg, msg
    assert "\n" not in msg and "Traceback" not in msg and S3_SECRET not in msg


# --- 9: a failure while the run runs: the user's a JobError (exit 2), a bug exit 1 --------

def test_failure_inside_the_run_is_a_job_error(tmp_path, tiny_model_dir, ray_local):
    """The processor is lazy, so whatever breaks (ordering, a stage, an engine that cannot
    start: here its weights, gone after the preflight read the model, as when a shared disk
    loses them) breaks while the run executes; the user must fix it: a JobError naming the
    cause. (This test used to start the engine with a dtype torch does not have: an
    AttributeError in blockray's own code, which the config now refuses up front.)"""
    import shutil

    from pipeline.run import JobError, preflight, run_offline

    with pytest.raises(ValueError, match="dtype must be auto or one of .*got 'float17'"):
        tiny_config(tiny_model_dir, dtype="float17")
    model, inp, out = tmp_path / "model", str(tmp_path / "in.parquet"), str(tmp_path / "out")
    shutil.copytree(tiny_model_dir, model)
    write_prompts(inp, "r{}", 2)
    config = tiny_config(str(model))
    checked = preflight(inp, out, config)
    os.remove(model / "model.safetensors")
    with pytest.raises(JobError) as info:
        run_offline(inp, out, config, preflighted=checked)
    msg = str(info.value)
    print(msg)
    assert msg.startswith("run failed") and "EngineStartError" in msg, msg
    assert f"FileNotFoundError: No such file or directory: {model / 'model.safetensors'}" in msg, msg
    assert msg.count("FileNotFoundError") == 1, msg  # named once
    assert "\n" not in msg
    assert not os.path.exists(tmp_path / "out" / "summary.json")


# A bug planted in the Ray workers of one CLI run: Python imports `sitecustomize` from
# PYTHONPATH at start, and this one gives the detokenize stage a typo once
# pipeline.stages is imported (only where BLOCKRAY_TEST_PLANT_BUG is set).
PLANTED_BUG = """
import importlib.abc, importlib.machinery, os, sys


def _detokenize_with_a_typo(batch, **kwargs):
    return batch.colum("generated_token_ids")


class _PlantBug(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "pipeline.stages":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.DetokenizeUDF.stage = staticmethod(_detokenize_with_a_typo)

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("BLOCKRAY_TEST_PLANT_BUG"):
    sys.meta_path.insert(0, _PlantBug())
"""


def test_bug_inside_the_run_exits_1_with_the_traceback(tmp_path, tiny_model_dir):
    """A bug in blockray's own code inside a stage task (planted: an AttributeError in the
    detokenize stage) is not the user's mistake: exit 1, the last line on stderr names it
    and the log file whose traceback holds the original exception and its frame, no
    `error: …` line (the user's kind), no summary. A Ray of its own: its workers inherit this run's
    environment (a joined Ray's workers would not get the bug)."""
    plant = tmp_path / "plant"
    plant.mkdir()
    (plant / "sitecustomize.py").write_text(PLANTED_BUG)
    inp, out = str(tmp_path / "in.parquet"), str(tmp_path / "out")
    write_prompts(inp, "b{}", 4)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(BLOCKRAY_TEST_PLANT_BUG="1",
               PYTHONPATH=os.pathsep.join([str(plant), *filter(None, [os.environ.get("PYTHONPATH")])]))
    with ray_temp_dir() as ray_tmp:
        res = subprocess.run([sys.executable, "jobs/offline_eval.py", "--model", tiny_model_dir, "--input", inp,
                              "--output", out, "--num-engines", "1", "--batch-size", "2", *TINY,
                              *private_ray(ray_tmp)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                             start_new_session=True, stdin=subprocess.DEVNULL)
    last = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else ""
    print(last)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-5000:]
    assert last.startswith("internal error (a bug in blockray, please report it): "), last
    assert "AttributeError: 'pyarrow.lib.Table' object has no attribute 'colum'" in last, last
    assert not [line for line in res.stderr.splitlines() if line.startswith("error: ")], res.stderr[-3000:]
    log = last.rsplit("; traceback in ", 1)[1]
    try:
        text = open(log).read()
    finally:
        os.remove(log)
    assert text.startswith("Traceback (most recent call last):"), text[:500]
    assert "in _detokenize_with_a_typo" in text and 'return batch.colum("generated_token_ids")' in text, text
    assert "AttributeError: 'pyarrow.lib.Table' object has no attribute 'colum'" in text, text
    assert not os.path.exists(os.path.join(out, "summary.json"))


def test_engines_that_cannot_start_in_time_exit_2(tmp_path, tiny_model_dir, ray_address):
    """The user's problem mid-run (an engine asks for a resource no node has, so it never
    loads): once --wait-for-engines-s has passed, exit 2, the last line naming the option
    and what the engine asked for."""
    inp, out = str(tmp_path / "in.parquet"), str(tmp_path / "out")
    write_prompts(inp, "w{}", 4)
    res = cli("--model", tiny_model_dir, "--input", inp, "--output", out, "--num-engines", "1", *TINY,
              "--engine-resource", "no_such_slot=1", "--wait-for-engines-s", "3", timeout=300, address=ray_address)
    last = res.stderr.strip().splitlines()[-1]
    print(last)
    assert res.returncode == 2, res.stdout[-3000:] + res.stderr[-3000:]
    assert last.startswith("error: run failed, no summary written: "), last
    assert "EnginesNotReady: an engine did not load its model within 3 s" in last, last
    assert "--wait-for-engines-s" in last and "'no_such_slot': 1.0" in last, last
    assert "rerun with the same --output" in last and "internal error" not in res.stderr, last
    assert not os.path.exists(os.path.join(out, "summary.json"))


def test_internal_error_exits_1_with_the_traceback_in_a_log(tmp_path):
    """An unexpected exception in the job (a bug): exit 1, one line naming the error and the
    log file that holds the traceback."""
    code = ("import sys; sys.path.insert(0, 'jobs'); import offline_eval as job\n"
            "def boom(args):\n    raise KeyError('shard 3')\n"
            "job.run_job = boom\nsys.exit(job.main(['--output', sys.argv[1]]))\n")
    res = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    err = res.stderr.strip()
    assert res.returncode == 1 and len(err.splitlines()) == 1, res.stderr
    assert err.startswith("internal error") and "KeyError: 'shard 3'" in err, err
    log = err.rsplit("traceback in ", 1)[1]
    try:
        assert "Traceback" in open(log).read() and "boom" in open(log).read()
    finally:
        os.remove(log)


def test_stage_failures_name_their_cause(ray_local):
    """A stage with a bug, in its batches or in its constructor: Ray Data reports
    `UserCodeException: UDF failed to process a data block.` (its cause does not survive
    the trip to the driver) or `ActorDiedError` (the cause at the end of its text); the
    job's one line still names the real error, and pipeline/failures.py tells the bug (a
    KeyError in a stage) from the user's to fix (weights gone, the user's own preprocess)."""
    import ray.data

    from common.storage import describe_error
    from pipeline.failures import users_to_fix
    from pipeline.processor import _users

    class BrokenBatches:  # defined here: pickled by value to the workers
        def __call__(self, batch):
            raise KeyError("shard 3")

    class BrokenStart:
        def __init__(self):
            raise FileNotFoundError("weights gone")

        def __call__(self, batch):
            return batch

    def preprocess(row):  # the user's, which build_processor wraps
        return {"prompt": row["word"]}

    messages, errors = [], []
    for stage in (BrokenBatches, BrokenStart):
        with pytest.raises(Exception) as info:
            ray.data.range(4).map_batches(stage, compute=ray.data.ActorPoolStrategy(size=1),
                                          num_cpus=0.25).materialize()
        messages.append(describe_error(info.value))
        errors.append(info.value)
    with pytest.raises(Exception) as info:
        ray.data.range(4).map(_users("preprocess", preprocess), num_cpus=0.25).materialize()
    messages.append(describe_error(info.value))
    errors.append(info.value)
    assert messages[0] == "UserCodeException: UDF failed to process a data block. <- KeyError: 'shard 3'", messages
    assert messages[1].startswith("ActorDiedError: ") and messages[1].endswith(
        " <- FileNotFoundError: weights gone"), messages
    assert "UserFunctionError: your preprocess function raised KeyError: 'word'" in messages[2], messages
    assert all("\x1b" not in m and "\n" not in m for m in messages)
    # whose to fix, by the original under Ray's wrappers (whose __cause__ did not survive):
    # a KeyError in a stage is a bug; weights gone and the user's own function are the user's
    assert [users_to_fix(e) for e in errors] == [False, True, True], messages
