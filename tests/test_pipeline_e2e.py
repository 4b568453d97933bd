"""A1: Parquet prompts on a real S3 endpoint (moto_server on loopback) → read → processor
with 2 engine actors → results streamed back to S3 → read back with pyarrow. Every input
id comes back exactly once, with the tokens the engine gives that prompt alone; rows
that cannot be served carry an error and do not fail their batch."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from conftest import blocking_gets, part_files, read_parts
from engine import Engine, EngineConfig, SamplingParams, load_model
from pipeline import OUTPUT_COLUMNS, DLLMProcessorConfig, build_processor, read_prompts, write_results

ENGINE = EngineConfig(block_length=4, steps_per_block=4, cache="refresh", token_budget=512, max_batch_size=8)
SAMPLING = SamplingParams(max_new_tokens=24, policy="threshold", threshold=0.3)
WORDS = ["a", "bc", "def", "ghij", "klmno", "pqrstu", "vwxyzab", "cdefghij"]


def _prompts(n: int, start: int):
    return [f"{['copy', 'rev', 'sort'][i % 3]}: {WORDS[i % len(WORDS)]}" for i in range(start, start + n)]


@pytest.fixture
def s3_input(s3fs_client):
    """Two input files with ids, user columns, one empty prompt and one null prompt."""
    s3fs_client.mkdir("e2e")
    rows = 0
    for f, n in (("part-a.parquet", 11), ("part-b.parquet", 9)):
        prompts = _prompts(n, rows)
        if f == "part-b.parquet":
            prompts[3], prompts[5] = "", None
        table = pa.table({"id": [f"q{rows + i:03d}" for i in range(n)], "prompt": prompts,
                          "task": ["t"] * n, "weight": [float(rows + i) for i in range(n)]})
        with s3fs_client.open(f"e2e/prompts/{f}", "wb") as fh:
            pq.write_table(table, fh)
        rows += n
    return "s3://e2e/prompts/", rows


def test_s3_to_s3_with_two_engines(tiny_model_dir, ray_local, s3_input, s3_storage, s3fs_client):
    url, n_rows = s3_input
    config = DLLMProcessorConfig(model=tiny_model_dir, num_engines=2, batch_size=3, max_concurrent_batches=2,
                                 engine=ENGINE, sampling=SAMPLING, dtype="float64", should_continue_on_error=True)
    # Blocks of one batch: Ray Data hands engines work block by block.
    ds = build_processor(config)(read_prompts(url, storage=s3_storage, rows_per_block=config.batch_size))
    sink = write_results(ds, "s3://e2e/results", storage=s3_storage)
    assert sink.result.num_rows == n_rows

    assert len(part_files("e2e/results", s3fs_client)) > 1  # streamed block by block, not one file collected at the end
    table = read_parts("e2e/results", s3fs_client)
    assert set(OUTPUT_COLUMNS) <= set(table.column_names)
    assert not [c for c in table.column_names if c.startswith("__")]
    rows = table.to_pylist()
    ids = [r["id"] for r in rows]
    assert sorted(ids) == [f"q{i:03d}" for i in range(n_rows)]  # each id exactly once
    assert {r["engine_rank"] for r in rows} == {0, 1}

    # Reference: the engine alone, one prompt at a time, same model and settings.
    model, tok = load_model(tiny_model_dir, dtype=torch.float64)
    by_id = {r["id"]: r for r in rows}
    for r in rows:
        assert r["task"] == "t" and r["weight"] == float(int(r["id"][1:]))  # user columns untouched
        if r["prompt"] in ("", None):
            assert r["finish_reason"] == "error" and r["error"], r
            assert r["generated_token_ids"] == [] and r["generated_text"] is None
            continue
        ref = Engine(model, ENGINE, tokenizer=tok).generate([r["prompt"]], SAMPLING)[0]
        assert r["error"] is None
        assert r["generated_token_ids"] == ref.token_ids, r["id"]
        assert (r["finish_reason"], r["num_blocks"], r["num_steps"]) == (
            ref.finish_reason, ref.num_blocks, ref.num_steps)
        assert r["generated_text"] == ref.text
        assert r["num_prompt_tokens"] == len(ref.prompt_token_ids)
        assert r["num_generated_tokens"] == len(ref.token_ids) and r["latency_s"] > 0
    assert by_id["q014"]["error"] == "empty prompt"
    # no actor of the run (dispatchers, engines) blocked its event loop on ray.get
    assert not blocking_gets(ray_local.address_info["session_dir"])
