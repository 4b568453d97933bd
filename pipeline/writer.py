"""Stream result blocks to Parquet files (local or any fsspec URL), each file complete or absent.

Why a Datasink of our own: Ray's Parquet writer opens the final name and fills it, so
a reader listing the folder mid-run (or after a crash) can see a truncated file. Here
every write task writes its file under `<output>/_tmp/` (a prefix Parquet readers skip)
and then moves it to `<output>/part-<run>-<task>.parquet`: a rename on local disks, a
server-side copy of a fully uploaded object on S3. Write tasks run as blocks arrive,
so results land while the engines are still generating.
"""
from __future__ import annotations

import json
import logging
import uuid
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from ray.data.block import Block, BlockAccessor
from ray.data.datasource import Datasink
from ray.data.datasource.datasink import WriteResult

from common.storage import StorageOptions, describe_error, get_filesystem, join

logger = logging.getLogger(__name__)

TMP_DIR = "_tmp"
StatsFn = Callable[[pa.Table], Dict[str, Any]]
Output = Union[str, Tuple[fsspec.AbstractFileSystem, str]]  # a URL, or a resolved (filesystem, path)


class OutputExistsError(FileExistsError):
    """The output location already holds result files and overwrite was not asked for."""


class StorageWriteError(OSError):
    """A write to the output failed for good (after the storage client's retries, or at
    once for a permission or missing-bucket error): the message names the step, the file
    and the store's answer."""


def atomic_write_bytes(fs: fsspec.AbstractFileSystem, path: str, data: bytes) -> None:
    """Write `data` to `path` so that readers see all of it or nothing: upload to a
    temporary name under `_tmp/`, then commit with a rename (server-side copy on S3).
    Each storage call is retried by the storage client only (botocore, see
    storage.S3_RETRIES): a second layer here would multiply the attempts and the time a
    dead endpoint takes to fail. A commit whose copy landed but whose cleanup failed
    counts as done (the target is complete)."""
    parent = path.rsplit("/", 1)[0]
    tmp_dir = join(parent, TMP_DIR)
    if has_folders(fs):  # object stores have none (and s3fs's makedirs would ask for the bucket)
        fs.makedirs(tmp_dir, exist_ok=True)
    tmp = join(tmp_dir, f"{uuid.uuid4().hex}-{path.rsplit('/', 1)[-1]}")

    def upload() -> None:
        with fs.open(tmp, "wb") as fh:
            fh.write(data)

    def commit() -> None:
        try:
            fs.mv(tmp, path)
        except Exception:
            fs.invalidate_cache()
            if fs.exists(path) and fs.size(path) == len(data):
                try:
                    if fs.exists(tmp):
                        fs.rm(tmp)
                except Exception as e:  # noqa: BLE001 - the target is complete; a stray temp is harmless
                    logger.debug("could not remove %s: %s", tmp, e)
                return
            raise

    for step, fn in (("upload", upload), ("commit", commit)):
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            where = fs.unstrip_protocol(path)
            raise StorageWriteError(f"{step} of {where} failed: {describe_error(e)}") from e


def atomic_write_table(fs: fsspec.AbstractFileSystem, path: str, table: pa.Table,
                       compression: str = "zstd") -> None:
    """Write `table` as one Parquet file at `path`, via a temporary name."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression=compression)
    atomic_write_bytes(fs, path, sink.getvalue().to_pybytes())


class OutputNotWritableError(PermissionError):
    """The output location does not accept writes: the job fails before any engine work."""


def prepare_output(fs: fsspec.AbstractFileSystem, path: str, overwrite: bool = False, resume: bool = False) -> None:
    """Create the output location and make sure it accepts writes. Result files of an
    earlier run (`*.parquet` and summary.json directly in it, and `_tmp/`) are refused,
    or removed with `overwrite`, so that a folder never mixes two runs; with `resume`
    they are kept (the caller skips their ids: see `completed_ids`) and only the earlier
    run's temporaries and summary are dropped. Nothing else in it is touched, and nothing
    is removed before the write probe has passed (the job calls this last in its
    preflight, once every other check has passed)."""
    old = check_output(fs, path, overwrite=overwrite, resume=resume)
    try:
        fs.makedirs(path, exist_ok=True)  # on S3 this creates the bucket when it is missing
    except Exception as e:  # noqa: BLE001 - a bucket we may not create may still accept writes
        logger.debug("makedirs(%s) failed: %s", path, e)
    probe = join(path, TMP_DIR, f"write-probe-{uuid.uuid4().hex}")
    try:
        fs.makedirs(join(path, TMP_DIR), exist_ok=True)
        with fs.open(probe, "wb") as fh:
            fh.write(b"ok")
        fs.rm(probe)
    except Exception as e:  # noqa: BLE001
        raise OutputNotWritableError(f"output {fs.unstrip_protocol(path)} is not writable: "
                                     f"{type(e).__name__}: {e}") from e
    for p in old:
        if overwrite or p.rstrip("/").endswith("/summary.json"):
            fs.rm(p)
    tmp = join(path, TMP_DIR)
    if (overwrite or resume) and fs.exists(tmp):
        fs.rm(tmp, recursive=True)  # partial uploads of a run that died
    remove_empty_tmp(fs, path)


def check_output(fs: fsspec.AbstractFileSystem, path: str, overwrite: bool = False, resume: bool = False) -> List[str]:
    """Without changing anything: the result files (`*.parquet`, summary.json) directly in
    `path`, or OutputExistsError when there are some and neither `overwrite` nor `resume`
    is given. Raises whatever the store raises when it cannot be listed."""
    fs.invalidate_cache()
    if not fs.exists(path):
        return []
    old = [p for p in fs.ls(path, detail=False) if p.rstrip("/").endswith((".parquet", "/summary.json"))]
    if old and not (overwrite or resume):
        raise OutputExistsError(f"{fs.unstrip_protocol(path)} already holds {len(old)} result file(s); "
                                "pass overwrite=True (--overwrite), resume=True (--resume) "
                                "or choose another output")
    return old


def completed_ids(fs: fsspec.AbstractFileSystem, path: str, id_column: str = "id") -> List[str]:
    """Ids in the complete result files at `path` (`part-*.parquet` directly in it;
    temporaries under `_tmp/` are never complete), once per output row (a row generated
    with n samples is n output rows). Empty when nothing is there."""
    return [i for i, _ in completed_keys(fs, path, id_column)]


def completed_keys(fs: fsspec.AbstractFileSystem, path: str, id_column: str = "id") -> List[Tuple[str, int]]:
    """(id, sample_index) of every output row in the complete result files at `path`;
    sample_index is 0 in files written before it existed."""
    fs.invalidate_cache()
    if not fs.exists(path):
        return []
    keys: List[Tuple[str, int]] = []
    for p in sorted(fs.ls(path, detail=False)):
        name = p.rstrip("/").rsplit("/", 1)[-1]
        if not (name.startswith("part-") and name.endswith(".parquet")):
            continue
        with fs.open(p, "rb") as fh:
            f = pq.ParquetFile(fh)
            cols = [id_column] + (["sample_index"] if "sample_index" in f.schema_arrow.names else [])
            table = f.read(columns=cols)
        ids = table.column(id_column).to_pylist()
        samples = table.column("sample_index").to_pylist() if len(cols) > 1 else [0] * len(ids)
        keys.extend((str(i), int(k or 0)) for i, k in zip(ids, samples))
    return keys


class AtomicParquetDatasink(Datasink[Dict[str, Any]]):
    """One Parquet file per write task; each task returns `stats_fn(table)` plus its file
    name and row count, so the driver can summarise a run without reading outputs back."""

    def __init__(self, fs: fsspec.AbstractFileSystem, path: str, *, stats_fn: Optional[StatsFn] = None,
                 rows_per_file: Optional[int] = None, compression: str = "zstd"):
        self.fs = fs
        self.path = path.rstrip("/")
        self.stats_fn = stats_fn
        self.rows_per_file = rows_per_file
        self.compression = compression
        self.run_id = uuid.uuid4().hex[:8]
        self.result: Optional[WriteResult] = None

    def write(self, blocks: Iterable[Block], ctx) -> Dict[str, Any]:
        tables = [BlockAccessor.for_block(b).to_arrow() for b in blocks]
        tables = [t for t in tables if t.num_rows]
        if not tables:
            return {"file": None, "rows": 0}
        table = pa.concat_tables(tables, promote_options="permissive")
        name = f"part-{self.run_id}-{ctx.task_idx:06d}.parquet"
        atomic_write_table(self.fs, join(self.path, name), table, self.compression)
        out = {"file": name, "rows": table.num_rows}
        if self.stats_fn is not None:
            out.update(self.stats_fn(table))
        return out

    def on_write_complete(self, write_result: WriteResult) -> None:
        self.result = write_result
        remove_empty_tmp(self.fs, self.path)

    def on_write_failed(self, error: Exception) -> None:
        remove_empty_tmp(self.fs, self.path)

    @property
    def write_returns(self) -> List[Dict[str, Any]]:
        return [r for r in (self.result.write_returns if self.result else []) if r.get("rows")]

    @property
    def min_rows_per_write(self) -> Optional[int]:
        return self.rows_per_file


def _output(output: Output, storage: Optional[StorageOptions]) -> Tuple[fsspec.AbstractFileSystem, str]:
    return output if isinstance(output, tuple) else get_filesystem(output, storage)


def write_results(ds, output: Output, *, storage: Optional[StorageOptions] = None,
                  stats_fn: Optional[StatsFn] = None, rows_per_file: Optional[int] = None, overwrite: bool = False,
                  num_cpus: float = 0.25) -> AtomicParquetDatasink:
    """Execute `ds` and stream its rows to Parquet under `output`; returns the sink, whose
    `write_returns` hold one stats dict per file written. `output` is a URL (prepared
    here: see `prepare_output`) or the (filesystem, path) that the caller already
    prepared (the job's preflight)."""
    fs, path = _output(output, storage)
    if not isinstance(output, tuple):
        prepare_output(fs, path, overwrite=overwrite)
    sink = AtomicParquetDatasink(fs, path, stats_fn=stats_fn, rows_per_file=rows_per_file)
    ds.write_datasink(sink, ray_remote_args={"num_cpus": num_cpus})
    return sink


def has_folders(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether folders exist on their own (local disks), not only as key prefixes (object stores)."""
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else fs.protocol
    return "file" in protocols


def remove_empty_tmp(fs: fsspec.AbstractFileSystem, path: str) -> None:
    """Drop `<path>/_tmp` once nothing writes there (local disks; object stores have no
    folders, and nothing to drop: skipping them spares a failing store more requests)."""
    if not has_folders(fs):
        return
    tmp = join(path, TMP_DIR)
    try:
        if fs.isdir(tmp) and not fs.find(tmp):
            fs.rm(tmp, recursive=True)
    except Exception as e:  # noqa: BLE001 - cleanup only
        logger.debug("could not remove %s: %s", tmp, e)


def _json_default(value: Any) -> Any:
    """numpy scalars (Ray's counts) as plain numbers."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def write_json(output: Output, name: str, obj: Any, storage: Optional[StorageOptions] = None) -> str:
    """Atomically write `obj` as JSON to `<output>/<name>` (`output`: a URL or a
    (filesystem, path)); returns its URL. Call it after the run's writes have finished
    (it removes the shared `_tmp` folder)."""
    fs, path = _output(output, storage)
    target = join(path, name)
    text = json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n"
    atomic_write_bytes(fs, target, text.encode())
    remove_empty_tmp(fs, path)
    return fs.unstrip_protocol(target)
