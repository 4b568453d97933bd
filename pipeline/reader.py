"""Read prompt Parquet files (local or any fsspec URL) into a Ray Dataset.

Why a small Datasource instead of `ray.data.read_parquet`: when the input has no id
column, each row gets an id derived from its file and its row number inside that file,
which stays the same across runs, cluster sizes and block splits. `read_parquet`
cannot say which row of a file a row was. Each read task streams one file's record
batches, so memory stays bounded by a block, not by a file.
"""
from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence, Tuple, Union

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import ray.data
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from .storage import StorageOptions, get_filesystem

PathLike = Union[str, Sequence[str]]


def _is_hidden(path: str) -> bool:
    """Files that readers skip: temporaries and markers (`_tmp/…`, `.part.tmp`, `_SUCCESS`)."""
    return any(part.startswith(("_", ".")) for part in path.split("/") if part)


def list_parquet_files(fs: fsspec.AbstractFileSystem, path: str) -> List[Tuple[str, str, int]]:
    """[(path, name relative to `path`, size)] of the Parquet files at `path` (a file or a
    folder searched recursively), sorted so that the order and the derived ids are stable."""
    if fs.isfile(path):
        return [(path, posixpath.basename(path), int(fs.size(path) or 0))]
    found = fs.find(path, detail=True)
    base = path.rstrip("/") + "/"
    out = []
    for p, info in found.items():
        rel = p[len(base):] if p.startswith(base) else posixpath.basename(p)
        if info.get("type") == "file" and p.endswith(".parquet") and not _is_hidden(rel):
            out.append((p, rel, int(info.get("size") or 0)))
    if not out:
        raise FileNotFoundError(f"no .parquet files under {fs.unstrip_protocol(path)}")
    return sorted(out)


@dataclass
class _FileRef:
    path: str
    name: str  # relative name, the prefix of derived ids
    size: int
    num_rows: int  # rows to read (all, or fewer when a limit stops inside this file)


def _read_file(fs: fsspec.AbstractFileSystem, ref: _FileRef, id_column: str,
               columns: Optional[List[str]], rows_per_batch: int) -> Iterable[pa.Table]:
    """Stream one file's first `ref.num_rows` rows, adding ids when absent."""
    with fs.open(ref.path, "rb") as fh:
        pf = pq.ParquetFile(fh)
        names = pf.schema_arrow.names
        want = None if columns is None else [c for c in columns if c in names]
        if want is not None and id_column in names and id_column not in want:
            want.append(id_column)
        row = 0
        for batch in pf.iter_batches(batch_size=rows_per_batch, columns=want):
            if row + batch.num_rows > ref.num_rows:
                batch = batch.slice(0, ref.num_rows - row)
            table = pa.Table.from_batches([batch])
            if id_column not in table.column_names:
                ids = pa.array([f"{ref.name}:{row + i}" for i in range(table.num_rows)], pa.string())
                table = table.append_column(id_column, ids)
            row += table.num_rows
            yield table
            if row >= ref.num_rows:
                return


class PromptParquetDatasource(Datasource):
    """One read task per group of files; see the module docstring. Footers are read up
    front, so row counts are exact (progress bars know the total, a limit is exact, and
    the reader can cut blocks of a chosen number of rows)."""

    def __init__(self, paths: PathLike, storage: Optional[StorageOptions] = None, id_column: str = "id",
                 columns: Optional[List[str]] = None, limit: Optional[int] = None):
        super().__init__()
        self._fs = None
        self._files: List[_FileRef] = []
        left = limit
        for url in [paths] if isinstance(paths, str) else list(paths):
            fs, path = get_filesystem(url, storage)
            self._fs = self._fs or fs  # one filesystem for all paths (same scheme expected)
            for p, rel, size in list_parquet_files(fs, path):
                if left is not None and left <= 0:
                    break
                with fs.open(p, "rb") as fh:
                    n = pq.ParquetFile(fh).metadata.num_rows
                n = n if left is None else min(n, left)
                left = None if left is None else left - n
                if n:
                    self._files.append(_FileRef(p, rel, size, n))
        self._id_column = id_column
        self._columns = columns

    @property
    def num_rows(self) -> int:
        return sum(f.num_rows for f in self._files)

    def estimate_inmemory_data_size(self) -> Optional[int]:
        return sum(f.size for f in self._files) or None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: Optional[int] = None,
                       data_context=None) -> List[ReadTask]:
        if not self._files:
            return []
        n = max(1, min(parallelism if parallelism > 0 else len(self._files), len(self._files)))
        groups = [self._files[i::n] for i in range(n)]
        fs, id_column, columns = self._fs, self._id_column, self._columns
        tasks = []
        for group in groups:
            def read_fn(group=group) -> Iterable[pa.Table]:
                for ref in group:
                    yield from _read_file(fs, ref, id_column, columns, 4096)

            meta = BlockMetadata(num_rows=sum(f.num_rows for f in group), size_bytes=sum(f.size for f in group) or None,
                                 exec_stats=None, input_files=[f.path for f in group])
            tasks.append(ReadTask(read_fn, meta, per_task_row_limit=per_task_row_limit))
        return tasks


MAX_BLOCKS = 10_000


def read_prompts(paths: PathLike, *, storage: Optional[StorageOptions] = None, id_column: str = "id",
                 columns: Optional[List[str]] = None, limit: Optional[int] = None,
                 rows_per_block: Optional[int] = None, num_cpus: float = 0.25) -> ray.data.Dataset:
    """A Dataset of the rows of the Parquet files at `paths` (file or folder URLs), every
    row carrying `id_column` (from the data, or '<file>:<row>'). `limit` keeps the first
    rows in file order.

    `rows_per_block`: cut the data into blocks of about this many rows (at most
    MAX_BLOCKS blocks). Give the processor's batch_size: a block is what Ray Data hands
    to one engine at a time, so batch-sized blocks spread rows over every engine and let
    results reach storage batch by batch. (Ray's `repartition(target_num_rows_per_block=)`
    would do it too, but as 1-CPU tasks that starve next to engine actors on small nodes.)
    """
    source = PromptParquetDatasource(paths, storage, id_column=id_column, columns=columns, limit=limit)
    blocks = None
    if rows_per_block:
        blocks = max(1, min(MAX_BLOCKS, -(-source.num_rows // rows_per_block)))
    return ray.data.read_datasource(source, num_cpus=num_cpus, override_num_blocks=blocks)
