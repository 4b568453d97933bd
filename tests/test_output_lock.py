"""Issue 23, case 7: one writer per output. The lease (pipeline/output_lock.py) on a local
disk and on S3 (moto on loopback, through s3fs): a second holder is refused naming the
first, a lease whose holder is gone expires, and the job's preflight checks it."""
from __future__ import annotations

import json
import os
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.output_lock import LOCK_FILE, OutputLock, OutputLocked


def _foreign(lock_path_fs, path: str, heartbeat_at: float, ttl_s: float = 60, host: str = "other-host",
             pid: int = 4242) -> None:
    """A lease written by a run on another host (or a dead process on this one)."""
    lock_path_fs.pipe_file(path, json.dumps({"token": "t-other", "host": host, "pid": pid, "run_id": "r-other",
                                             "acquired_at": heartbeat_at, "heartbeat_at": heartbeat_at,
                                             "ttl_s": ttl_s}).encode())


def _check_store(fs, out: str) -> None:
    path = f"{out}/{LOCK_FILE}"
    first = OutputLock(fs, out, run_id="r1", settle_s=0.05).acquire()
    assert json.loads(fs.cat_file(path))["run_id"] == "r1"
    # a live run elsewhere: refused, naming it
    _foreign(fs, path, time.time())
    with pytest.raises(OutputLocked, match=r"being written by run r-other \(pid 4242 on other-host"):
        OutputLock(fs, out, run_id="r2", settle_s=0.05).acquire()
    first.release()  # not its lease any more: left alone
    assert fs.exists(path)
    # its holder stopped refreshing more than ttl_s ago: expired, taken over
    _foreign(fs, path, time.time() - 120, ttl_s=60)
    second = OutputLock(fs, out, run_id="r2", settle_s=0.05).acquire()
    assert json.loads(fs.cat_file(path))["run_id"] == "r2"
    second.release()
    fs.invalidate_cache()
    assert not fs.exists(path)


def test_lease_on_local_disk(tmp_path):
    import fsspec

    fs = fsspec.filesystem("file")
    out = str(tmp_path / "out")
    os.makedirs(out)
    _check_store(fs, out)
    # a holder on this host whose process is gone: stale at once
    _foreign(fs, f"{out}/{LOCK_FILE}", time.time(), host=os.uname().nodename, pid=2**22 + 12345)
    OutputLock(fs, out, settle_s=0.05).acquire().release()


def test_lease_on_s3(s3fs_client):
    s3fs_client.mkdir("lease-bucket")
    _check_store(s3fs_client, "lease-bucket/out")


def test_preflight_refuses_an_output_held_by_a_live_run(tmp_path, tiny_model_dir, s3_storage, s3fs_client):
    from pipeline import DLLMProcessorConfig
    from pipeline.run import JobError, preflight

    inp = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({"id": ["a"], "prompt": ["copy: a"]}), inp)
    s3fs_client.mkdir("held-bucket")
    _foreign(s3fs_client, f"held-bucket/out/{LOCK_FILE}", time.time())
    with pytest.raises(JobError, match=r"s3://held-bucket/out is being written by run r-other"):
        preflight(inp, "s3://held-bucket/out", DLLMProcessorConfig(model=tiny_model_dir), storage=s3_storage)
    checked = preflight(inp, "s3://held-bucket/out2", DLLMProcessorConfig(model=tiny_model_dir), storage=s3_storage,
                        run_id="mine")
    try:
        assert json.loads(s3fs_client.cat_file(f"held-bucket/out2/{LOCK_FILE}"))["run_id"] == "mine"
        assert s3fs_client.exists("held-bucket/out2/_run_record.json")
    finally:
        checked.release()
    s3fs_client.invalidate_cache()
    assert not s3fs_client.exists(f"held-bucket/out2/{LOCK_FILE}")
