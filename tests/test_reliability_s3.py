"""Issue 7, A4 + A5 (credentials): a processor run reading from and writing to s3://
through FaultProxy (a share of requests answered 500 InternalError / 503 SlowDown)
completes with every id exactly once, thanks to botocore's retries (StorageOptions
default) and the writer's retried commit; a permanent error fails the run with a clear
message and no summary. A distinctive secret never shows in logs, summary, outputs or
error messages."""
from __future__ import annotations

import glob
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import S3_KEY, S3_REGION
from engine import EngineConfig, SamplingParams
from pipeline import DLLMProcessorConfig, StorageOptions
from pipeline.run import JobError, run_offline
from s3_fault_proxy import FaultProxy

SECRET = "zQ9-DISTINCTIVE-S3-SECRET-7f3a"  # moto accepts any secret
N = 16


def _config(model):
    return DLLMProcessorConfig(model=model, num_engines=1, batch_size=4, max_concurrent_batches=2,
                               engine=EngineConfig(block_length=4, steps_per_block=4, token_budget=1024),
                               sampling=SamplingParams(max_new_tokens=8, policy="fixed"), wait_for_engines_s=0)


@pytest.fixture
def s3_prompts(s3fs_client):
    if not s3fs_client.exists("faults"):
        s3fs_client.mkdir("faults")
    for f, lo in (("a.parquet", 0), ("b.parquet", N // 2)):
        t = pa.table({"id": [f"s{i:02d}" for i in range(lo, lo + N // 2)],
                      "prompt": [f"copy: {'abcdef'[: i % 6 + 1]}" for i in range(lo, lo + N // 2)]})
        with s3fs_client.open(f"faults/in/{f}", "wb") as fh:
            pq.write_table(t, fh)
    return "s3://faults/in/"


def test_transient_s3_errors_are_retried(tiny_model_dir, ray_local, s3_endpoint, s3_prompts, s3fs_client):
    with FaultProxy(s3_endpoint, fail_rate=0.3, delay_rate=0.05, delay_s=0.2, seed=7, max_consecutive=3) as proxy:
        storage = StorageOptions(endpoint_url=proxy.url, key=S3_KEY, secret=SECRET, region=S3_REGION)
        assert SECRET not in repr(storage) and SECRET not in str(storage.resolved())
        summary = run_offline(s3_prompts, "s3://faults/out", _config(tiny_model_dir), storage=storage,
                              rows_per_file=None)
    assert proxy.faults > 5, (proxy.requests, proxy.faults)  # the run really met errors
    files = [p for p in s3fs_client.ls("faults/out") if p.endswith(".parquet")]
    table = pa.concat_tables([pq.read_table(p, filesystem=s3fs_client) for p in files])
    assert sorted(table.column("id").to_pylist()) == [f"s{i:02d}" for i in range(N)]  # exactly once
    assert summary["rows"] == N and summary["errors"] == 0

    # A5: the secret is nowhere the user or an operator can read it
    session_dir = ray_local.address_info["session_dir"]
    texts = [repr(summary), s3fs_client.cat("faults/out/summary.json").decode()]
    texts += [str(r) for r in table.to_pylist()]
    for path in glob.glob(os.path.join(session_dir, "logs", "*")):
        if os.path.isfile(path):
            texts.append(open(path, errors="replace").read())
    assert not [t[:200] for t in texts if SECRET in t]


def test_permanent_s3_error_fails_clearly(tiny_model_dir, s3_endpoint, s3_prompts, s3fs_client):
    with FaultProxy(s3_endpoint, fail_rate=1.0, delay_rate=0.0, max_consecutive=10 ** 9) as proxy:
        storage = StorageOptions(endpoint_url=proxy.url, key=S3_KEY, secret=SECRET, region=S3_REGION,
                                 extra={"config_kwargs": {"retries": {"max_attempts": 2, "mode": "standard"}}})
        with pytest.raises(JobError) as info:
            run_offline(s3_prompts, "s3://faults/never", _config(tiny_model_dir), storage=storage)
    msg = str(info.value)
    assert "output" in msg and "s3://faults/never" in msg and "--output" in msg, msg
    assert SECRET not in msg and SECRET not in repr(info.value.__cause__)
    assert not s3fs_client.exists("faults/never/summary.json")
