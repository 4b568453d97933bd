"""Pipeline I/O: storage options (arguments, then AWS_* variables), stable ids from file
and row, deterministic limits, atomic result files, and writes that stream while the
dataset is still running — on local disk and on a real S3 endpoint (moto_server)."""
from __future__ import annotations

import threading
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import read_parts
from pipeline.reader import PromptParquetDatasource, list_parquet_files, read_prompts
from common.storage import StorageOptions, get_filesystem
from pipeline.writer import (OutputExistsError, TMP_DIR, atomic_write_table, prepare_output, write_json,
                             write_results)


def _table(n: int, start: int = 0, ids: bool = False) -> pa.Table:
    cols = {"prompt": [f"copy: {'abc'[: i % 3 + 1]}" for i in range(start, start + n)],
            "extra": list(range(start, start + n))}
    if ids:
        cols["id"] = [f"x{i}" for i in range(start, start + n)]
    return pa.table(cols)


def test_storage_options_fall_back_to_environment(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    kw = StorageOptions().fsspec_kwargs("s3")
    assert kw == {"key": "k", "secret": "s", "endpoint_url": "http://127.0.0.1:9",
                  "client_kwargs": {"region_name": "eu-west-1"},
                  "config_kwargs": {"retries": {"max_attempts": 5, "mode": "standard"}}}
    # explicit arguments win; local paths get no S3 options
    assert StorageOptions(endpoint_url="http://h:1").fsspec_kwargs("s3")["endpoint_url"] == "http://h:1"
    assert StorageOptions().fsspec_kwargs("file") == {}


def test_ids_derived_from_file_and_row(tmp_path):
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    pq.write_table(_table(3), d / "a.parquet")
    pq.write_table(_table(2, 3), d / "sub" / "b.parquet")
    pq.write_table(_table(5), d / "_tmp.parquet")  # hidden: a writer's temporary
    fs, path = get_filesystem(str(d))
    assert [rel for _, rel, _ in list_parquet_files(fs, path)] == ["a.parquet", "sub/b.parquet"]
    src = PromptParquetDatasource(str(d))
    assert src.num_rows == 5
    rows = [r for t in src.get_read_tasks(4) for block in t() for r in block.to_pylist()]
    assert sorted(r["id"] for r in rows) == ["a.parquet:0", "a.parquet:1", "a.parquet:2",
                                             "sub/b.parquet:0", "sub/b.parquet:1"]
    assert {r["id"]: r["extra"] for r in rows}["sub/b.parquet:1"] == 4
    # an existing id column is kept as is; a limit keeps the first rows in file order
    pq.write_table(_table(4, ids=True), tmp_path / "ids.parquet")
    src = PromptParquetDatasource(str(tmp_path / "ids.parquet"), limit=3)
    assert [r["id"] for t in src.get_read_tasks(2) for b in t() for r in b.to_pylist()] == ["x0", "x1", "x2"]


def test_atomic_write_leaves_nothing_visible_on_failure(tmp_path, monkeypatch):
    fs, path = get_filesystem(str(tmp_path / "out"))
    prepare_output(fs, path)
    atomic_write_table(fs, f"{path}/part-0.parquet", _table(3))
    assert pq.read_table(tmp_path / "out" / "part-0.parquet").num_rows == 3

    def broken_mv(*a, **k):
        raise OSError("connection lost before commit")

    monkeypatch.setattr(fs, "mv", broken_mv)
    with pytest.raises(OSError):
        atomic_write_table(fs, f"{path}/part-1.parquet", _table(3))
    visible = sorted(p.name for p in (tmp_path / "out").iterdir() if not p.name.startswith(("_", ".")))
    assert visible == ["part-0.parquet"]  # the half-done file sits only under _tmp/, which readers skip
    assert list((tmp_path / "out" / TMP_DIR).iterdir())
    with pytest.raises(OutputExistsError):
        prepare_output(fs, path)
    prepare_output(fs, path, overwrite=True)
    assert not list((tmp_path / "out").glob("*.parquet"))


def test_results_stream_to_storage_while_running(tmp_path, ray_local):
    """The first result file is committed while later blocks are still being computed."""
    import ray

    def slow(batch):
        time.sleep(1.0)
        return batch

    ds = ray.data.range(5, override_num_blocks=5).map_batches(
        slow, batch_size=1, compute=ray.data.TaskPoolStrategy(size=1), num_cpus=0.25)
    out = tmp_path / "out"
    done = threading.Event()
    seen_before_done = []

    def run():
        write_results(ds, str(out), num_cpus=0.25)
        done.set()

    t = threading.Thread(target=run)
    t.start()
    while not done.is_set():
        files = list(out.glob("part-*.parquet")) if out.exists() else []
        if files and not done.is_set():
            seen_before_done = files
            for f in files:  # every visible file is complete
                assert pq.read_table(f).num_rows >= 1
            break
        time.sleep(0.1)
    t.join(120)
    assert seen_before_done, "no output file appeared before the dataset finished"
    assert sum(pq.read_table(f).num_rows for f in out.glob("part-*.parquet")) == 5
    assert not (out / TMP_DIR).exists()


def test_s3_round_trip_with_environment_credentials(tmp_path, ray_local, s3_endpoint, s3fs_client, monkeypatch):
    """Reading s3:// with nothing but AWS_* variables, writing results and summary back."""
    s3fs_client.mkdir("io-bucket")
    with s3fs_client.open("io-bucket/in/p.parquet", "wb") as f:
        pq.write_table(_table(6), f)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    storage = StorageOptions().resolved()  # resolved on the driver, carried to the tasks
    ds = read_prompts("s3://io-bucket/in/", storage=storage, limit=5)
    sink = write_results(ds, "s3://io-bucket/out", storage=storage, num_cpus=0.25)
    write_json("s3://io-bucket/out", "summary.json", {"rows": sink.result.num_rows}, storage)
    table = read_parts("io-bucket/out", s3fs_client)
    assert sorted(table.column("id").to_pylist()) == [f"p.parquet:{i}" for i in range(5)]
    assert s3fs_client.cat("io-bucket/out/summary.json") == b'{\n  "rows": 5\n}\n'
    assert not s3fs_client.find(f"io-bucket/out/{TMP_DIR}")
