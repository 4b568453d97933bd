"""Read prompt files (local or any fsspec URL) into a Ray Dataset: Parquet, JSON Lines,
CSV or OpenAI batch files (pipeline/openai_batch.py), each format a `FileFormat`.

Why a small Datasource instead of `ray.data.read_parquet`: when the input has no id
column, each row gets an id derived from its file and its row number inside that file,
which stays the same across runs, cluster sizes and block splits. `read_parquet`
cannot say which row of a file a row was. Each read task streams one Parquet file's
record batches, so memory stays bounded by a block, not by a file; a JSON Lines, CSV or
OpenAI batch file is read whole (by the preflight, to count and check its rows, then by
its read task), so memory is bounded by the largest such file. Every format has the same
guarantees: ids, limit, resume, schemas unified or refused.
"""
from __future__ import annotations

import codecs
import io
import posixpath
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv
import pyarrow.json as pjson
import pyarrow.parquet as pq
import ray.data
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from common.storage import StorageOptions, get_filesystem

from . import openai_batch

PathLike = Union[str, Sequence[str]]
DEFAULT_ID_COLUMN = "id"  # the id column when none is named: used when the input has it


class InputError(ValueError):
    """The input cannot be read (missing, not Parquet, no access): the job fails before any engine work."""


class SchemaMismatchError(InputError):
    """Two input files disagree on a column's type (and no lossless unification exists)."""


@dataclass
class DuplicateIds:
    """Ids that occur more than once in the input (see PromptParquetDatasource.scan_ids)."""

    count: int  # distinct ids seen more than once
    extra_rows: int  # rows beyond the first of each such id
    first: List[str]  # the first few of them, in input order

    def to_dict(self) -> dict:
        return {"count": self.count, "extra_rows": self.extra_rows, "first": self.first}


def _is_hidden(path: str) -> bool:
    """Files that readers skip: temporaries and markers (`_tmp/…`, `.part.tmp`, `_SUCCESS`)."""
    return any(part.startswith(("_", ".")) for part in path.split("/") if part)


class FileFormat:
    """How one input format is read: the suffixes of its files in a folder, a file's rows
    (as Arrow tables, in order) and its row count and schema. Parquet streams; the
    others read a file whole (`table`)."""

    name = ""
    suffixes: Tuple[str, ...] = ()
    id_column: Optional[str] = None  # a format whose rows carry their ids in a column of its own

    def table(self, fh: Any, where: str, seen: Optional[Dict[str, str]] = None) -> pa.Table:
        raise NotImplementedError

    def inspect(self, fh: Any, where: str, seen: Dict[str, str]) -> Tuple[int, pa.Schema]:
        """(rows, schema) of an open file; `seen`: what the files read before hold, for a
        format whose checks span files (OpenAI batch: custom_id)."""
        t = self.table(fh, where, seen)
        return t.num_rows, t.schema

    def batches(self, fh: Any, where: str, rows: int, columns: Optional[List[str]]) -> Iterable[pa.Table]:
        """The file's rows in order, in tables of at most `rows` rows (`columns`: those
        needed, when the format can read fewer)."""
        for b in self.table(fh, where).to_batches(max_chunksize=rows):
            yield pa.Table.from_batches([b])


class ParquetFormat(FileFormat):
    name, suffixes = "parquet", (".parquet",)

    def inspect(self, fh: Any, where: str, seen: Dict[str, str]) -> Tuple[int, pa.Schema]:
        pf = pq.ParquetFile(fh)
        return pf.metadata.num_rows, pf.schema_arrow

    def batches(self, fh: Any, where: str, rows: int, columns: Optional[List[str]]) -> Iterable[pa.Table]:
        pf = pq.ParquetFile(fh)
        want = None if columns is None else [c for c in columns if c in pf.schema_arrow.names]
        for batch in pf.iter_batches(batch_size=rows, columns=want):
            yield pa.Table.from_batches([batch])


# Byte-order marks of the encodings a text input may not be in, UTF-32's first (UTF-32 LE's
# starts with UTF-16 LE's). UTF-8's own mark is read past (utf-8-sig), as Excel and
# Notepad write it.
OTHER_BOMS = ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
              (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"))


def check_utf8(fh: Any, where: str) -> None:
    """Refuse a text input that starts with a UTF-16 or UTF-32 byte-order mark, naming the
    encoding (its bytes would otherwise read as a JSON or CSV syntax error); `fh` is left
    at its start."""
    head = fh.read(4)
    fh.seek(0)
    for bom, encoding in OTHER_BOMS:
        if head.startswith(bom):
            raise InputError(f"input file {where} is {encoding} text (it starts with a {encoding} byte-order mark); "
                             "re-save it as UTF-8")


class TextFormat(FileFormat):
    """A format of UTF-8 text (a byte-order mark allowed), read whole by `parse`."""

    def table(self, fh: Any, where: str, seen: Optional[Dict[str, str]] = None) -> pa.Table:
        check_utf8(fh, where)
        return self.parse(fh, where, seen)

    def parse(self, fh: Any, where: str, seen: Optional[Dict[str, str]]) -> pa.Table:
        raise NotImplementedError


class JsonLinesFormat(TextFormat):
    name, suffixes = "jsonl", (".jsonl", ".ndjson", ".json")

    def parse(self, fh: Any, where: str, seen: Optional[Dict[str, str]]) -> pa.Table:
        return pjson.read_json(fh)  # reads past a UTF-8 byte-order mark


class CsvFormat(TextFormat):
    name, suffixes = "csv", (".csv",)

    def parse(self, fh: Any, where: str, seen: Optional[Dict[str, str]]) -> pa.Table:
        return pcsv.read_csv(fh)  # reads past a UTF-8 byte-order mark


class OpenAIBatchFormat(TextFormat):
    name, suffixes, id_column = "openai-batch", JsonLinesFormat.suffixes, openai_batch.ID_COLUMN

    def parse(self, fh: Any, where: str, seen: Optional[Dict[str, str]]) -> pa.Table:
        try:
            return openai_batch.parse_lines(io.TextIOWrapper(fh, encoding="utf-8-sig"), where, seen)
        except UnicodeDecodeError as e:
            raise openai_batch.BatchFileError(f"{where} is not UTF-8 text: {e}") from None


FORMATS: Dict[str, FileFormat] = {f.name: f for f in (ParquetFormat(), JsonLinesFormat(), CsvFormat(),
                                                      OpenAIBatchFormat())}
INPUT_FORMATS = ("auto", *FORMATS)


def _first_line(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """The first line of text of a file (past a UTF-8 byte-order mark); refuses another encoding's."""
    with fs.open(path, "rb") as fh:
        check_utf8(fh, fs.unstrip_protocol(path))
        for line in fh:
            line = line.removeprefix(codecs.BOM_UTF8)  # the mark opens the file, so the first line
            if line.strip():
                return line.decode("utf-8", "replace")
    return ""


def detect_format(fs: fsspec.AbstractFileSystem, path: str) -> str:
    """The format of the input at `path` (input format auto): by its files' suffix (a
    folder: Parquet when it holds any, else the one kind it holds); JSON Lines whose
    first line is an object with custom_id and body is an OpenAI batch file. A file of
    another name is read as Parquet."""
    if fs.isfile(path):
        files = [path]
    else:
        files = sorted(p for p, info in fs.find(path, detail=True).items() if info.get("type") == "file"
                       and not _is_hidden(p[len(path.rstrip("/")) + 1:]))
    kinds = {name for name in ("parquet", "csv", "jsonl") for p in files if p.endswith(FORMATS[name].suffixes)}
    if "parquet" in kinds or not kinds:
        return "parquet"
    if len(kinds) > 1:
        raise InputError(f"input {fs.unstrip_protocol(path)} holds both CSV and JSON Lines files; give "
                         "--input-format (input_format) to read one kind")
    kind = kinds.pop()
    first = next(p for p in files if p.endswith(FORMATS[kind].suffixes))
    return "openai-batch" if kind == "jsonl" and openai_batch.is_batch_line(_first_line(fs, first)) else kind


def list_input_files(fs: fsspec.AbstractFileSystem, path: str, suffixes: Tuple[str, ...] = (".parquet",)
                     ) -> List[Tuple[str, str, int]]:
    """[(path, name relative to `path`, size)] of the input files at `path` (a file, or a
    folder searched recursively for names ending in `suffixes`), sorted so that the order
    and the derived ids are stable."""
    if fs.isfile(path):
        return [(path, posixpath.basename(path), int(fs.size(path) or 0))]
    found = fs.find(path, detail=True)
    base = path.rstrip("/") + "/"
    out = []
    for p, info in found.items():
        rel = p[len(base):] if p.startswith(base) else posixpath.basename(p)
        if info.get("type") == "file" and p.endswith(suffixes) and not _is_hidden(rel):
            out.append((p, rel, int(info.get("size") or 0)))
    if not out:
        raise FileNotFoundError(f"no {' / '.join(suffixes)} files under {fs.unstrip_protocol(path)}")
    return sorted(out)


list_parquet_files = list_input_files


@dataclass
class _FileRef:
    path: str
    name: str  # relative name, the prefix of derived ids
    size: int
    num_rows: int  # rows to read (all, or fewer when a limit stops inside this file)
    rows_out: int  # rows it yields: num_rows less the excluded ids
    url: str = ""  # full URL, for messages
    columns: Tuple[str, ...] = ()  # the file's columns (with the id column, derived or not)
    has_ids: bool = True  # the file has the id column itself (else ids are derived)
    schema: Optional[pa.Schema] = None  # the file's own, as read from its footer


def repeated_columns(schema: pa.Schema) -> List[str]:
    """Column names a schema holds more than once (Parquet allows it; no reader by name can
    tell them apart)."""
    names = schema.names
    return sorted({n for n in names if names.count(n) > 1})


def _is_int_or_str(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)


def _merge_type(name: str, a: pa.DataType, b: pa.DataType, id_column: str) -> Optional[pa.DataType]:
    """The type two files' `name` columns are read as, or None when they cannot agree
    without loss. A column of nulls only (type null) takes the other file's type; an id
    column of integers in one file and strings in another is read as strings (ids are
    compared as strings everywhere: resume, duplicates)."""
    if a.equals(b):
        return a
    if pa.types.is_null(a) or pa.types.is_null(b):
        return b if pa.types.is_null(a) else a
    if name == id_column and _is_int_or_str(a) and _is_int_or_str(b):
        return pa.string()
    return None


def unify_schemas(files: Sequence[Tuple[str, pa.Schema]], id_column: str) -> pa.Schema:
    """One schema for files [(url, schema)], columns in order of first appearance (a column
    missing from a file reads as nulls there); raises SchemaMismatchError naming the
    column and the two files that disagree."""
    fields: dict = {}  # name -> (type, url of the file that set it)
    for url, schema in files:
        for f in schema:
            if f.name not in fields:
                fields[f.name] = (f.type, url)
                continue
            have, where = fields[f.name]
            merged = _merge_type(f.name, have, f.type, id_column)
            if merged is None:
                raise SchemaMismatchError(
                    f"input files disagree on column {f.name!r}: {have} in {where} but {f.type} in {url}; "
                    "rewrite one so that the types agree (only an id column mixing integers and strings "
                    "is unified, as strings)")
            if not merged.equals(have):
                fields[f.name] = (merged, where if not pa.types.is_null(have) else url)
    return pa.schema([pa.field(n, t) for n, (t, _) in fields.items()])


def _conform(table: pa.Table, target: pa.Schema, keep: Optional[Sequence[str]]) -> pa.Table:
    """`table` with the columns of `target` (those in `keep`, when given) in its order and
    types: cast where a file's type differs losslessly, nulls where a file lacks one."""
    cols, fields = [], []
    for f in target:
        if keep is not None and f.name not in keep:
            continue
        if f.name in table.column_names:
            col = table.column(f.name)
            cols.append(col if col.type.equals(f.type) else col.cast(f.type))
        else:
            cols.append(pa.nulls(table.num_rows, f.type))
        fields.append(f)
    return pa.Table.from_arrays(cols, schema=pa.schema(fields))


def _derived_ids(name: str, start: int, n: int) -> pa.Array:
    """Ids of rows `start`..`start + n` of a file without an id column: '<name>:<row>'."""
    return pa.array([f"{name}:{start + i}" for i in range(n)], pa.string())


def _is_excluded(ids: Union[pa.Array, pa.ChunkedArray], exclude: pa.Array) -> pa.Array:
    """Per row, whether its id (as a string) is one of `exclude`."""
    return pc.is_in(pc.cast(ids, pa.string()), value_set=exclude)


def _read_file(fs: fsspec.AbstractFileSystem, ref: _FileRef, id_column: str,
               columns: Optional[List[str]], rows_per_batch: int,
               exclude_ids: Optional[pa.Array] = None, target: Optional[pa.Schema] = None,
               fmt: FileFormat = FORMATS["parquet"]) -> Iterable[pa.Table]:
    """Stream one file's first `ref.num_rows` rows, adding ids when absent, in the
    input's unified schema `target`, and dropping rows whose id is in `exclude_ids`
    (resume: already in the output)."""
    keep = None if columns is None else [*columns, id_column]
    with fs.open(ref.path, "rb") as fh:
        row = 0
        for table in fmt.batches(fh, ref.url or ref.path, rows_per_batch, keep):
            if row + table.num_rows > ref.num_rows:
                table = table.slice(0, ref.num_rows - row)
            if id_column not in table.column_names:
                table = table.append_column(id_column, _derived_ids(ref.name, row, table.num_rows))
            row += table.num_rows
            if target is not None:
                table = _conform(table, target, keep)
            if exclude_ids is not None:
                table = table.filter(pc.invert(_is_excluded(table.column(id_column), exclude_ids)))
            yield table
            if row >= ref.num_rows:
                return


class PromptParquetDatasource(Datasource):
    """One read task per group of files; see the module docstring. Footers (or a whole
    file, for formats without one) are read up front, so row counts are exact (progress
    bars know the total, a limit is exact, and the reader can cut blocks of a chosen
    number of rows), and the files' schemas are unified (or refused) before any read task
    runs. A `limit` stops reading files once it is reached, but the first file is always
    read (limit 0: no rows, its columns still checked). `input_format`: one of
    INPUT_FORMATS, auto by the files (`detect_format`); the one read is `format`."""

    def __init__(self, paths: PathLike, storage: Optional[StorageOptions] = None, id_column: str = "id",
                 columns: Optional[List[str]] = None, limit: Optional[int] = None,
                 exclude_ids: Optional[Iterable[str]] = None, input_format: str = "auto"):
        super().__init__()
        if input_format not in INPUT_FORMATS:
            raise InputError(f"input format {input_format!r} is not one of {', '.join(INPUT_FORMATS)}")
        self.format = None if input_format == "auto" else input_format
        seen: Dict[str, str] = {}  # across files: OpenAI batch custom_ids
        self._fs = None
        self._files: List[_FileRef] = []
        self.files_read: List[_FileRef] = []  # every file whose footer was read, rows or not
        self._exclude: Optional[pa.Array] = None
        self.num_excluded = 0
        self._id_column = id_column
        self._columns = columns
        schemas: List[Tuple[str, pa.Schema]] = []
        left = limit
        for url in [paths] if isinstance(paths, str) else list(paths):
            try:
                fs, path = get_filesystem(url, storage)
                kind = detect_format(fs, path) if input_format == "auto" else input_format
                if self.format not in (None, kind):
                    raise InputError(f"input {url} is {kind} and another input {self.format} (input format auto); "
                                     "give --input-format (input_format), or one kind of input")
                self.format = kind
                id_column = self._id_column = FORMATS[kind].id_column or id_column
                found = list_input_files(fs, path, FORMATS[kind].suffixes)
            except InputError:
                raise
            except Exception as e:  # noqa: BLE001 - one clear message for any unreadable input
                raise InputError(f"input {url} is not readable: {type(e).__name__}: {e}") from e
            self._fs = self._fs or fs  # one filesystem for all paths (same scheme expected)
            for p, rel, size in found:
                if left is not None and left <= 0 and self.files_read:
                    break
                full = fs.unstrip_protocol(p)
                try:
                    with fs.open(p, "rb") as fh:
                        n, schema = FORMATS[kind].inspect(fh, full, seen)
                except openai_batch.BatchFileError as e:
                    raise InputError(f"input file {e}") from e
                except InputError:
                    raise
                except Exception as e:  # noqa: BLE001
                    raise InputError(f"input file {full} is not readable {kind}: {type(e).__name__}: {e} "
                                     "(--input-format names the format)") from e
                repeated = repeated_columns(schema)
                if repeated:
                    raise InputError(f"input file {full} has more than one column named {repeated[0]!r}; rename or "
                                     "drop the repeated column(s): " + ", ".join(map(repr, repeated)))
                n = n if left is None else min(n, left)
                left = None if left is None else left - n
                has_ids = id_column in schema.names
                if not has_ids:  # derived ids are strings
                    schema = schema.append(pa.field(id_column, pa.string()))
                schemas.append((full, schema))
                self.files_read.append(_FileRef(p, rel, size, n, n, full, tuple(schema.names), has_ids, schema))
        # the unified schema of every file (job-level column checks, and what read tasks yield)
        self.schema: Optional[pa.Schema] = unify_schemas(schemas, id_column) if schemas else None
        self._files = [f for f in self.files_read if f.num_rows]
        if exclude_ids:
            self.scan_ids(exclude_ids)

    def files_without(self, column: str) -> List[str]:
        """URLs of the input files read that lack `column`."""
        return [f.url for f in self.files_read if column not in f.columns]

    def column_types(self, column: str) -> List[Tuple[str, pa.DataType]]:
        """[(URL, type)] of `column` in each input file read that has it."""
        return [(f.url, f.schema.field(column).type) for f in self.files_read
                if f.schema is not None and column in f.schema.names]

    def files_with_ids(self) -> List[str]:
        """URLs of the input files read that hold the id column themselves."""
        return [f.url for f in self.files_read if f.has_ids]

    def _file_ids(self, ref: _FileRef) -> pa.Array:
        """The ids (as strings) of the first `ref.num_rows` rows of one file."""
        if not ref.has_ids:
            return _derived_ids(ref.name, 0, ref.num_rows)
        with self._fs.open(ref.path, "rb") as fh:
            chunks = [t.column(self._id_column) for t in FORMATS[self.format].batches(
                fh, ref.url, 1 << 20, [self._id_column])]
        col = pa.chunked_array([c for ch in chunks for c in ch.chunks], chunks[0].type) if chunks else pa.array([])
        return pc.cast(col.slice(0, ref.num_rows), pa.string()).combine_chunks()

    def input_ids(self) -> List[str]:
        """The ids of every row read (resumed ones too), in input order."""
        return [i for ref in self.files_read if ref.num_rows for i in self._file_ids(ref).to_pylist()]

    def scan_ids(self, exclude_ids: Optional[Iterable[str]] = None, max_named: int = 5) -> Optional[DuplicateIds]:
        """Read every file's ids once: leave out the rows whose id is in `exclude_ids`
        (resume) and return the ids that occur more than once in the input (None when
        all are unique). Holds all ids on the driver while it runs."""
        self._exclude = pa.array(sorted({str(i) for i in exclude_ids}), pa.string()) if exclude_ids else None
        self.num_excluded = 0
        chunks = []
        for ref in self._files:
            ids = self._file_ids(ref)
            chunks.append(ids)
            skipped = 0 if self._exclude is None else (pc.sum(_is_excluded(ids, self._exclude)).as_py() or 0)
            ref.rows_out = ref.num_rows - skipped
            self.num_excluded += skipped
        self._files = [f for f in self._files if f.rows_out]
        if not chunks:
            return None
        ids = pa.chunked_array(chunks, pa.string())
        counts = pc.value_counts(ids)
        dup = pc.filter(counts, pc.greater(counts.field("counts"), 1))
        if not len(dup):
            return None
        values = dup.field("values")
        first = pc.unique(pc.filter(ids, pc.is_in(ids, value_set=values))).slice(0, max_named).to_pylist()
        extra = int(pc.sum(dup.field("counts")).as_py()) - len(dup)
        return DuplicateIds(count=len(dup), extra_rows=extra, first=first)

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
        target, fmt = self.schema, FORMATS[self.format]
        tasks = []
        for group in groups:
            def read_fn(group=group) -> Iterable[pa.Table]:
                for ref in group:
                    yield from _read_file(fs, ref, id_column, columns, 4096, exclude, target, fmt)

            meta = BlockMetadata(num_rows=sum(f.rows_out for f in group), size_bytes=sum(f.size for f in group) or None,
                                 exec_stats=None, input_files=[f.path for f in group])
            tasks.append(ReadTask(read_fn, meta, per_task_row_limit=per_task_row_limit))
        return tasks


MAX_BLOCKS = 10_000


def read_prompts(paths: PathLike, *, storage: Optional[StorageOptions] = None, id_column: str = "id",
                 columns: Optional[List[str]] = None, limit: Optional[int] = None,
                 rows_per_block: Optional[int] = None, num_cpus: float = 0.25,
                 source: Optional[PromptParquetDatasource] = None) -> ray.data.Dataset:
    """A Dataset of the rows of the prompt files at `paths` (file or folder URLs), every
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
