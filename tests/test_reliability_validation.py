"""Issue 7, A1: bad rows become error rows (the rest continues); bad jobs fail before any
engine work, with a message naming the column, path or option."""
from __future__ import annotations

import glob

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import torch

from conftest import read_parts
from engine import Engine, EngineConfig, SamplingParams, load_model
from pipeline import DLLMProcessorConfig
from pipeline.run import JobError, run_offline
from pipeline.stages import PRE_ERROR, TOKEN_IDS, tokenize_stage

ENGINE = EngineConfig(block_length=4, steps_per_block=4, cache="refresh", token_budget=2048, max_batch_size=8)
SAMPLING = SamplingParams(max_new_tokens=8, policy="threshold", threshold=0.3)
GOOD = ["copy: abc", "rev: hello", "sort: dcba", "copy: x", "rev: ab", "copy: ray"]
# id -> (prompt, per-row sampling override, words the error must contain)
BAD = {
    "null": (None, None, ["'prompt'", "null"]),
    "empty": ("", None, ["empty prompt"]),
    "blank": ("   ", None, ["empty prompt", "'prompt'", "whitespace"]),
    "toolong": ("copy: " + "a" * 1100, None, ["context"]),
    "untokenizable": ("copy: \u2603\u2603", None, ["does not tokenize", "unknown token"]),
    "bad_threshold": ("copy: abc", {"threshold": 2.0, "max_new_tokens": None, "bogus": None}, ["threshold"]),
    "bad_max_new": ("copy: abc", {"threshold": None, "max_new_tokens": 0, "bogus": None}, ["max_new_tokens"]),
    "unknown_key": ("copy: abc", {"threshold": None, "max_new_tokens": None, "bogus": 1}, ["sampling_params", "bogus"]),
}


def _config(model: str) -> DLLMProcessorConfig:
    return DLLMProcessorConfig(model=model, num_engines=1, batch_size=4, max_concurrent_batches=2,
                               engine=ENGINE, sampling=SAMPLING, dtype="float64", wait_for_engines_s=0)


def _write_input(path: str, with_bad: bool) -> None:
    ids, prompts, overrides = [], [], []
    for i, p in enumerate(GOOD):
        ids.append(f"good{i}")
        prompts.append(p)
        overrides.append(None)
    if with_bad:
        for k, (p, o, _) in BAD.items():
            ids.insert(len(ids) // 2, k)  # interleave bad rows with good ones
            prompts.insert(len(prompts) // 2, p)
            overrides.insert(len(overrides) // 2, o)
    stype = pa.struct([("threshold", pa.float64()), ("max_new_tokens", pa.int64()), ("bogus", pa.int64())])
    pq.write_table(pa.table({"id": ids, "prompt": pa.array(prompts, pa.string()),
                             "sampling_params": pa.array(overrides, stype)}), path)


def test_bad_rows_get_errors_and_good_rows_match_the_engine_alone(tmp_path, tiny_model_dir, ray_local):
    mixed = str(tmp_path / "mixed.parquet")
    _write_input(mixed, with_bad=True)
    # 8 of 14 rows fail on purpose: allow it (the default, 0, would fail the job after writing them)
    s_mixed = run_offline(mixed, str(tmp_path / "out_mixed"), _config(tiny_model_dir), rows_per_file=None,
                          max_error_fraction=1.0)

    rows = read_parts(str(tmp_path / "out_mixed")).to_pylist()
    ids = [r["id"] for r in rows]
    assert sorted(ids) == sorted([f"good{i}" for i in range(len(GOOD))] + list(BAD))  # each id exactly once
    by_id = {r["id"]: r for r in rows}
    for k, (_, _, words) in BAD.items():
        r = by_id[k]
        assert r["finish_reason"] == "error" and r["error"], r
        for w in words:
            assert w in r["error"], (k, r["error"])
        assert r["generated_token_ids"] == [] and r["generated_text"] is None
    # the clean run: the engine alone, one good prompt at a time (float64: batching changes nothing)
    model, tok = load_model(tiny_model_dir, dtype=torch.float64)
    for i, prompt in enumerate(GOOD):
        r = by_id[f"good{i}"]
        ref = Engine(model, ENGINE, tokenizer=tok).generate([prompt], SAMPLING)[0]
        assert r["error"] is None and ref.error is None
        assert r["generated_token_ids"] == ref.token_ids, r["id"]
    assert s_mixed["errors"] == len(BAD)
    assert s_mixed["rows"] == len(GOOD) + len(BAD)


def test_non_string_prompt_is_a_row_error(tiny_model_dir):
    batch = pa.table({"id": ["a", "b"], "prompt": pa.array([12, None], pa.int64())})
    out = tokenize_stage(batch, model=tiny_model_dir, prompt_column="prompt", prompt_token_ids_column="ids")
    errs = out.column(PRE_ERROR).to_pylist()
    assert "not a string" in errs[0] and "int" in errs[0] and "null" in errs[1]
    assert out.column(TOKEN_IDS).to_pylist() == [None, None]


@pytest.fixture
def no_engine(monkeypatch):
    """Fail the test if a run gets as far as building the engine stage."""
    import pipeline.run as run

    def boom(*args):
        raise AssertionError("engine work started before the job-level checks failed")

    monkeypatch.setattr(run, "build_processor_for", boom)


def test_job_level_errors_fail_fast(tmp_path, tiny_model_dir, no_engine):
    good = str(tmp_path / "in.parquet")
    _write_input(good, with_bad=False)
    cfg = _config(tiny_model_dir)

    nocol = str(tmp_path / "nocol.parquet")
    pq.write_table(pa.table({"id": ["a"], "question": ["copy: a"]}), nocol)
    with pytest.raises(JobError, match=r"no prompt column 'prompt' \(--prompt-column\)"):
        run_offline(nocol, str(tmp_path / "o1"), cfg)

    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"this is not parquet")
    with pytest.raises(JobError, match=r"not readable.*\(--input\)"):
        run_offline(str(junk), str(tmp_path / "o2"), cfg)
    with pytest.raises(JobError, match=r"not readable.*\(--input\)"):
        run_offline(str(tmp_path / "missing"), str(tmp_path / "o3"), cfg)

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(JobError, match=r"output.*\(--output\)"):
        run_offline(good, str(blocker / "out"), cfg)

    with pytest.raises(JobError, match=r"model: .*config\.json"):
        run_offline(good, str(tmp_path / "o4"), _config(str(tmp_path)))
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(JobError, match=r"model: .*not valid JSON"):
        run_offline(good, str(tmp_path / "o5"), _config(str(broken)))
    # nothing was presented as a finished run
    assert not glob.glob(str(tmp_path / "o*" / "summary.json"))


def test_job_cli_reports_job_errors(tmp_path, tiny_model_dir):
    import subprocess
    import sys

    from conftest import ROOT
    from procs import ray_temp_dir

    nocol = str(tmp_path / "nocol.parquet")
    pq.write_table(pa.table({"id": ["a"], "question": ["copy: a"]}), nocol)
    with ray_temp_dir() as ray_tmp:
        res = subprocess.run([sys.executable, "jobs/offline_eval.py", "--model", tiny_model_dir, "--input", nocol,
                              "--output", str(tmp_path / "out"), "--num-cpus", "1", "--temp-dir", ray_tmp],
                             cwd=ROOT, capture_output=True, text=True, timeout=120, start_new_session=True)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "prompt column 'prompt'" in res.stderr and "--prompt-column" in res.stderr
