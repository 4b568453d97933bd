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

from conftest import S3_KEY, S3_REGION, part_files, read_parts, write_prompts
from engine import EngineConfig, SamplingParams
from pipeline import DLLMProcessorConfig, StorageOptions
from pipeline.run import JobError, run_offline
from common.storage import get_filesystem
from pipeline.writer import StorageWriteError, atomic_write_table
from s3_fault_proxy import ACCESS_DENIED, FaultProxy

SECRET = "zQ9-DISTINCTIVE-S3-SECRET-7f3a"  # moto accepts any secret
N = 16


def _config(model):
    return DLLMProcessorConfig(model=model, num_engines=1, batch_size=4, max_concurrent_batches=2,
                               engine=EngineConfig(block_length=4, steps_per_block=4, token_budget=1024),
                               sampling=SamplingParams(max_new_tokens=8, policy="fixed"), wait_for_engines_s=0)


def _storage(url, max_attempts=None) -> StorageOptions:
    """Options for the endpoint at `url` with SECRET; `max_attempts`: botocore's retries capped."""
    extra = {"config_kwargs": {"retries": {"max_attempts": max_attempts, "mode": "standard"}}}
    return StorageOptions(endpoint_url=url, key=S3_KEY, secret=SECRET, region=S3_REGION,
                          **({"extra": extra} if max_attempts is not None else {}))


@pytest.fixture
def s3_prompts(s3fs_client):
    if not s3fs_client.exists("faults"):
        s3fs_client.mkdir("faults")
    for f, lo in (("a.parquet", 0), ("b.parquet", N // 2)):
        with s3fs_client.open(f"faults/in/{f}", "wb") as fh:
            write_prompts(fh, "s{:02d}", range(lo, lo + N // 2), alphabet="abcdef")
    return "s3://faults/in/"


def test_transient_s3_errors_are_retried(tiny_model_dir, ray_local, s3_endpoint, s3_prompts, s3fs_client):
    with FaultProxy(s3_endpoint, fail_rate=0.3, delay_rate=0.05, delay_s=0.2, seed=7, max_consecutive=3) as proxy:
        storage = _storage(proxy.url)
        assert SECRET not in repr(storage) and SECRET not in str(storage.resolved())
        summary = run_offline(s3_prompts, "s3://faults/out", _config(tiny_model_dir), storage=storage,
                              rows_per_file=None)
    assert proxy.faults > 5, (proxy.requests, proxy.faults)  # the run really met errors
    table = read_parts("faults/out", s3fs_client)
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
        storage = _storage(proxy.url, max_attempts=2)
        with pytest.raises(JobError) as info:
            run_offline(s3_prompts, "s3://faults/never", _config(tiny_model_dir), storage=storage)
    msg = str(info.value)
    assert "output" in msg and "s3://faults/never" in msg and "--output" in msg, msg
    assert SECRET not in msg and SECRET not in repr(info.value.__cause__)
    assert not s3fs_client.exists("faults/never/summary.json")


def test_permanent_write_error_mid_run(tiny_model_dir, ray_local, s3_endpoint, s3_prompts, s3fs_client):
    """Writes to the output are refused for good (403 AccessDenied, as after a policy change)
    once a few have gone through: the run fails with a JobError naming the output, the file
    and S3's answer; it leaves complete part files only (no summary; temporaries under
    _tmp/), and a rerun once the store accepts writes again resumes from them: every id
    exactly once."""
    out, key = "s3://faults/perm", "faults/perm"
    # 2 writes for the output probe (PUT, DELETE), then 3 per part file (upload, copy, delete
    # of the temporary): about two of the four part files get through.
    with FaultProxy(s3_endpoint, fail_rate=0.0, delay_rate=0.0, write_prefix=f"/{key}/", allow_writes=8,
                    write_error=ACCESS_DENIED) as proxy:
        storage = _storage(proxy.url)
        with pytest.raises(JobError) as info:
            run_offline(s3_prompts, out, _config(tiny_model_dir), storage=storage, rows_per_file=None)
    msg = str(info.value)
    assert proxy.write_faults >= 1
    assert f"{out}/part-" in msg and "AccessDenied" in msg and "rerun with the same --output" in msg, msg
    assert "Traceback" not in msg and len(msg) < 2000, msg
    assert SECRET not in msg and SECRET not in repr(info.value.__cause__)

    s3fs_client.invalidate_cache()
    assert not s3fs_client.exists(f"{key}/summary.json")  # not presented as a finished run
    committed = []
    for p in part_files(key, s3fs_client):  # every part file is a whole Parquet file of finished rows
        t = pq.read_table(p, filesystem=s3fs_client)
        assert t.num_rows and not [e for e in t.column("error").to_pylist() if e]
        committed += t.column("id").to_pylist()
    assert len(committed) == len(set(committed)) < N, committed

    # the store accepts writes again: the rerun skips the committed ids and writes the rest
    healthy = _storage(s3_endpoint)
    summary = run_offline(s3_prompts, out, _config(tiny_model_dir), storage=healthy, rows_per_file=None)
    assert summary["rows_skipped"] == len(committed) and summary["rows_processed"] == N - len(committed)
    s3fs_client.invalidate_cache()
    table = read_parts(key, s3fs_client)
    assert sorted(table.column("id").to_pylist()) == [f"s{i:02d}" for i in range(N)]  # exactly once
    assert not s3fs_client.exists(f"{key}/_tmp")


@pytest.mark.parametrize("error", [(500, "InternalError", "We encountered an internal error. Please try again."),
                                   (404, "NoSuchBucket", "The specified bucket does not exist")],
                         ids=["500-forever", "bucket-gone"])
def test_writer_gives_up_on_permanent_errors(s3_endpoint, s3fs_client, error):
    """The part-file writer against a store that never recovers (500 after all of botocore's
    and the writer's retries) or whose bucket is gone (404 NoSuchBucket, not retried): a
    StorageWriteError naming the file and the S3 error, and nothing at the final name."""
    if not s3fs_client.exists("faults"):
        s3fs_client.mkdir("faults")
    with FaultProxy(s3_endpoint, fail_rate=0.0, delay_rate=0.0, write_prefix="/faults/gone/",
                    write_error=error) as proxy:
        storage = _storage(proxy.url, max_attempts=2)
        fs, path = get_filesystem("s3://faults/gone", storage)
        with pytest.raises(StorageWriteError) as info:
            atomic_write_table(fs, f"{path}/part-x.parquet", pa.table({"id": ["a", "b"]}))
    msg = str(info.value)
    assert "upload of s3://faults/gone/part-x.parquet failed" in msg and error[1] in msg, msg
    assert SECRET not in msg
    assert proxy.write_faults >= 1
    s3fs_client.invalidate_cache()
    assert not s3fs_client.exists("faults/gone/part-x.parquet")
