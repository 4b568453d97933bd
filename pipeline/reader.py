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
import pyarrow.compute as pc
import pyarrow.parquet as pq
import ray.data
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from .storage import StorageOptions, get_filesystem

PathLike = Union[str, Sequence[str]]


class InputError(ValueError):
    """The input cannot be read (missing, not Parquet, no access): the job fails before any engine work."""


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
    rows_out: int  # rows it yields: num_rows less the excluded ids


def _derived_ids(name: str, start: int, n: int) -> pa.Array:
    """Ids of rows `start`..`start + n` of a file without an id column: '<name>:<row>'."""
    return pa.array([f"{name}:{start + i}" for i in range(n)], pa.string())


def _is_excluded(ids: Union[pa.Array, pa.ChunkedArray], exclude: pa.Array) -> pa.Array:
    """Per row, whether its id (as a string) is one of `exclude`."""
    return pc.is_in(pc.cast(ids, pa.string()), value_set=exclude)


def _read_file(fs: fsspec.AbstractFileSystem, ref: _FileRef, id_column: str,
               columns: Optional[List[str]], rows_per_batch: int,
               exclude_ids: Optional[pa.Array] = None) -> Iterable[pa.Table]:
    """Stream one file's first `ref.num_rows` rows, adding ids when absent and dropping
    rows whose id is in `exclude_ids` (resume: already in the output)."""
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
                table = table.append_column(id_column, _derived_ids(ref.name, row, table.num_rows))
            row += table.num_rows
            if exclude_ids is not None:
                table = table.filter(pc.invert(_is_excluded(table.column(id_column), exclude_ids)))
            yield table
            if row >= ref.num_rows:
                return


class PromptParquetDatasource(Datasource):
    """One read task per group of files; see the module docstring. Footers are read up
    front, so row counts are exact (progress bars know the total, a limit is exact, and
    the reader can cut blocks of a chosen number of rows)."""

    def __init__(self, paths: PathLike, storage: Optional[StorageOptions] = None, id_column: str = "id",
                 columns: Optional[List[str]] = None, limit: Optional[int] = None,
                 exclude_ids: Optional[Iterable[str]] = None):
        super().__init__()
        self._fs = None
        self._files: List[_FileRef] = []
        self.schema: Optional[pa.Schema] = None  # of the first file (job-level column checks)
        self._exclude = pa.array(sorted({str(i) for i in exclude_ids}), pa.string()) if exclude_ids else None
        self.num_excluded = 0
        left = limit
        for url in [paths] if isinstance(paths, str) else list(paths):
            try:
                fs, path = get_filesystem(url, storage)
                found = list_parquet_files(fs, path)
            except Exception as e:  # noqa: BLE001 - one clear message for any unreadable input
                raise InputError(f"input {url} is not readable: {type(e).__name__}: {e}") from e
            self._fs = self._fs or fs  # one filesystem for all paths (same scheme expected)
            for p, rel, size in found:
                if left is not None and left <= 0:
                    break
                try:
                    with fs.open(p, "rb") as fh:
                        pf = pq.ParquetFile(fh)
                        n = pf.metadata.num_rows
                        self.schema = self.schema or pf.schema_arrow
                        n = n if left is None else min(n, left)
                        skipped = self._count_excluded(pf, rel, n, id_column) if self._exclude is not None else 0
                except Exception as e:  # noqa: BLE001
                    raise InputError(f"input file {fs.unstrip_protocol(p)} is not readable Parquet: "
                                     f"{type(e).__name__}: {e}") from e
                left = None if left is None else left - n
                self.num_excluded += skipped
                if n - skipped:
                    self._files.append(_FileRef(p, rel, size, n, n - skipped))
        self._id_column = id_column
        self._columns = columns

    def _count_excluded(self, pf: pq.ParquetFile, rel: str, n: int, id_column: str) -> int:
        """How many of the first `n` rows of this file have an excluded id."""
        ids = (pf.read(columns=[id_column]).column(id_column).slice(0, n) if id_column in pf.schema_arrow.names
               else _derived_ids(rel, 0, n))
        return pc.sum(_is_excluded(ids, self._exclude)).as_py() or 0

    @property
    def num_rows(self) -> int:
        """Rows this source yields (after exclusions)."""
        return sum(f.rows_out for f in self._files)

    def estimate_inmemory_data_size(self) -> Optional[int]:
        return sum(f.size for f in self._files) or None

    def get_read_tasks(self, parallelism: int, per_task_row_limit: Optional[int] = None,
                       data_context=None) -> List[ReadTask]:
        if not self._files:
            return []
        n = max(1, min(parallelism if parallelism > 0 else len(self._files), len(self._files)))
        groups = [self._files[i::n] for i in range(n)]
        fs, id_column, columns, exclude = self._fs, self._id_column, self._columns, self._exclude
        tasks = []
        for group in groups:
            def read_fn(group=group) -> Iterable[pa.Table]:
                for ref in group:
                    yield from _read_file(fs, ref, id_column, columns, 4096, exclude)

            meta = BlockMetadata(num_rows=sum(f.rows_out for f in group), size_bytes=sum(f.size for f in group) or None,
                                 exec_stats=None, input_files=[f.path for f in group])
            tasks.append(ReadTask(read_fn, meta, per_task_row_limit=per_task_row_limit))
        return tasks


MAX_BLOCKS = 10_000


def read_prompts(paths: PathLike, *, storage: Optional[StorageOptions] = None, id_column: str = "id",
                 columns: Optional[List[str]] = None, limit: Optional[int] = None,
                 rows_per_block: Optional[int] = None, num_cpus: float = 0.25,
                 source: Optional[PromptParquetDatasource] = None) -> ray.data.Dataset:
    """A Dataset of the rows of the Parquet files at `paths` (file or folder URLs), every
    row carrying `id_column` (from the data, or '<file>:<row>'). `limit` keeps the first
    rows in file order.

    `rows_per_block`: cut the data into blocks of about this many rows (at most
    MAX_BLOCKS blocks). Give the processor's batch_size: a block is what Ray Data hands
    to one engine at a time, so batch-sized blocks spread rows over every engine and let
    results reach storage batch by batch. (Ray's `repartition(target_num_rows_per_block=)`
    would do it too, but as 1-CPU tasks that starve next to engine actors on small nodes.)

    `source`: a datasource already opened with PromptParquetDatasource (its checks done,
    ids to resume past left out); `paths` and the options above are then ignored.
    """
    if source is None:
        source = PromptParquetDatasource(paths, storage, id_column=id_column, columns=columns, limit=limit)
    blocks = None
    if rows_per_block:
        blocks = max(1, min(MAX_BLOCKS, -(-source.num_rows // rows_per_block)))
    return ray.data.read_datasource(source, num_cpus=num_cpus, override_num_blocks=blocks)
