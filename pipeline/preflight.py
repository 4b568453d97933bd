"""The job-level checks, before any engine (or Ray) work: every refusal of a job that
cannot run, each a `JobError` naming what was wrong and the options it concerns.
(pipeline/errors.py): a library caller reads `message` and `options`, the CLI prints the
message with the options' flags."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import fsspec
import pyarrow as pa

from common.storage import StorageOptions, describe_error, get_filesystem, protocol_of

from .config import DLLMProcessorConfig
from .errors import CheckpointRefused, JobError
from .output_lock import OutputLock, OutputLocked
from . import openai_batch
from .reader import DEFAULT_ID_COLUMN, DuplicateIds, InputError, PromptParquetDatasource
from .resources import Cluster, check_gpu_memory, check_resources
from .run_record import RECORD_FILE, build_record, check_resume, read_json, run_history
from .run_spec import RunSpec, as_spec
from .stages import template_of
from .writer import OUTPUT_FORMATS, PART_SUFFIX, accepted_parts, check_output, completed_keys, prepare_output, write_json

SUMMARY_FILE = "summary.json"


@dataclass
class Preflight:
    """What the job-level checks found: the input (ids already in the output left out),
    those ids, the output location, the input's duplicated ids when allowed, and the
    model's Checkpoint."""

    source: PromptParquetDatasource
    done: List[str]
    out_fs: fsspec.AbstractFileSystem
    out_path: str
    duplicates: Optional[DuplicateIds] = None
    checkpoint: Any = None  # the model, read once (engine.checkpoint.Checkpoint): the run passes it on
    lock: Optional[OutputLock] = None  # this run's lease on the output, held until the run ends
    record: Optional[Dict[str, Any]] = None  # what writes the output (pipeline/run_record.py)
    history: List[Dict[str, Any]] = dataclasses.field(default_factory=list)  # earlier runs on it
    settings_changed: List[str] = dataclasses.field(default_factory=list)  # vs the record kept (allowed)
    id_column: str = DEFAULT_ID_COLUMN  # the column holding the ids (derived ones included)
    ids_note: Optional[str] = None  # when the ids are derived, <file>:<row>: what that means (the summary says it)
    output_format: str = "parquet"  # pipeline/writer.py OUTPUT_FORMATS
    spec: Optional[RunSpec] = None  # what was checked: the run goes on with this one
    chat_template: Optional[str] = None  # the template prompts are rendered with (None: none), read once here

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()


def check_tokenizer(checkpoint: Any) -> None:
    """Load the tokenizer once, as the stages will (never with remote code): a model that
    needs its own code, or whose tokenizer does not load, is refused here, not in a stage.
    Checkpoint.load_tokenizer: with the files the Checkpoint already parsed, so that only
    transformers' load reads them again (and a remote model's are not fetched again)."""
    from common.tokenizer import NeedsRemoteCode

    model = checkpoint.model
    if not checkpoint.tokenizer.present:
        raise JobError(f"model: {model} has no tokenizer files, needed for text prompts", "model")
    try:
        checkpoint.load_tokenizer()
    except NeedsRemoteCode as e:
        raise JobError(f"model: {e}", "model") from e
    except Exception as e:  # noqa: BLE001
        raise JobError(f"model: the tokenizer in {model} does not load: {describe_error(e)}", "model") from e


def check_model(model: str, needs_tokenizer: bool, storage: Optional[StorageOptions] = None,
                adapter: Optional[str] = None, attention: str = "auto", sampling: Any = None,
                engine: Any = None, revision: Optional[str] = None) -> Any:
    """The model's Checkpoint (engine.checkpoint), read once from its source and checked:
    config.json of a supported family (parsed by the engine's own parser, never by a
    checkpoint's remote code), every shard header (a remote model's by byte range: no
    weights are downloaded), the adapter; `sampling` / `engine`: the run's settings,
    refused where the model's engine would ignore them; a tokenizer that loads when prompts
    are text."""
    from .checkpoint_check import check_settings, open_checkpoint

    storage = (storage or StorageOptions()).resolved()  # once: every stage and engine reads it the same way
    try:
        checkpoint = open_checkpoint(model, adapter=adapter, attention=attention, storage=storage, revision=revision)
        check_settings(checkpoint, sampling, engine)
    except CheckpointRefused as e:
        raise JobError(f"model: {e.message}", *e.options) from e
    if needs_tokenizer:
        check_tokenizer(checkpoint)
    return checkpoint


def check_columns(source: PromptParquetDatasource, config: DLLMProcessorConfig) -> bool:
    """The input has a column prompts can come from, in every file; returns whether they
    are text."""
    names = source.schema.names if source.schema is not None else []
    auto_chat = (config.apply_chat_template is None and config.messages_column in names
                 and config.prompt_column not in names and config.prompt_token_ids_column not in names)
    if config.apply_chat_template or auto_chat:
        if config.messages_column not in names:
            raise JobError(f"input has no {config.messages_column!r} column (--messages-column) for "
                           f"apply_chat_template; columns: {names}", "messages_column")
        column, text = config.messages_column, True
    elif config.prompt_token_ids_column in names:
        column, text = config.prompt_token_ids_column, False
    elif config.prompt_column not in names:
        raise JobError(f"input has no prompt column {config.prompt_column!r} (--prompt-column) nor "
                       f"{config.prompt_token_ids_column!r}; columns: {names}", "prompt_column")
    else:
        column, text = config.prompt_column, True
    missing = source.files_without(column)
    if missing:
        raise JobError(f"input file {missing[0]} has no {column!r} column, which the other input files have "
                       f"({len(missing)} file(s) lack it)", "input")
    option = next(k for k in ("messages_column", "prompt_token_ids_column", "prompt_column")
                  if getattr(config, k) == column)
    check_prompt_type(source, column, option)
    return text


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t) or (
        pa.types.is_list_view(t) or pa.types.is_large_list_view(t))


def _is_text(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


# The Arrow types a prompt column may have, by the option naming it: text; chat turns (a
# list of {role, content}, or their JSON text); token ids (a list of integers)
PROMPT_TYPES = {"prompt_column": ("text (string)", _is_text),
                "messages_column": ("a list of {role, content} turns or their JSON text",
                                    lambda t: _is_list(t) or _is_text(t)),
                "prompt_token_ids_column": ("a list of token ids", _is_list)}


def check_prompt_type(source: PromptParquetDatasource, column: str, option: str) -> None:
    """The prompt column is of a type its rows can be read as, in every file: a binary or
    integer `prompt` would make every row an error row after the engines start. A file
    whose column holds only nulls (Arrow type null) passes while another file has prompts."""
    want, ok = PROMPT_TYPES[option]
    types = source.column_types(column)
    for url, t in types:
        if not pa.types.is_null(t) and not ok(t):
            raise JobError(f"input file {url}: column {column!r} is {t}, not {want}; convert it, or name another "
                           "column", option, "input")
    if types and all(pa.types.is_null(t) for _, t in types):
        raise JobError(f"input column {column!r} holds only nulls (in {types[0][0]}"
                       + (f" and {len(types) - 1} more file(s)" if len(types) > 1 else "") + "): no row has a "
                       "prompt", option, "input")


def check_chat_template(config: DLLMProcessorConfig, given: Optional[str], names: List[str],
                        checkpoint: Any) -> Optional[str]:
    """The chat template the run will render with (`given`: the --chat-template text, as
    RunSpec read it; else the tokenizer's), or None when it renders none. Raises JobError
    when one is asked for (apply_chat_template=True, or auto with only a messages column)
    and there is none."""
    wanted = config.apply_chat_template is True or (
        config.apply_chat_template is None and config.messages_column in names)
    if not wanted:
        return None
    template = template_of(checkpoint.metadata_dir(), given, checkpoint.hf)
    if template:
        return template
    if config.apply_chat_template is None and (config.prompt_column in names
                                               or config.prompt_token_ids_column in names):
        return None  # auto: the text or token-id prompts are used as they are
    raise JobError(f"the input's {config.messages_column!r} column needs a chat template, and the tokenizer of "
                   f"{config.model} has none: give one with --chat-template PATH", "chat_template")


def _comparable(fs: fsspec.AbstractFileSystem, path: str) -> Tuple[str, str]:
    """(kind of store, normalised path) of a location, so that two URLs naming the same
    place compare equal (local paths through symlinks too)."""
    if protocol_of(fs.unstrip_protocol(path)) == "file":
        return "file", os.path.realpath(path)
    return type(fs).__name__, path.rstrip("/")


def check_separate(input: Union[str, List[str]], output: str, out_fs: fsspec.AbstractFileSystem, out_path: str,
                   storage: Optional[StorageOptions]) -> None:
    """The output is neither an input nor inside one, and no input is inside the output:
    results written among the inputs would be read as inputs by the next run."""
    kind, out = _comparable(out_fs, out_path)
    for url in [input] if isinstance(input, str) else list(input):
        try:
            fs, path = get_filesystem(url, storage)
        except Exception:  # noqa: BLE001 - the input check names it
            continue
        k, inp = _comparable(fs, path)
        if k != kind:
            continue
        if out == inp or out.startswith(inp.rstrip("/") + "/"):
            raise JobError(f"output {output} is {'the input' if out == inp else 'inside the input'} {url}: results "
                           "would be read back as prompts by the next run; choose an output outside the input",
                           "output")
        if inp.startswith(out.rstrip("/") + "/"):
            raise JobError(f"input {url} is inside the output {output}; choose an output outside the input",
                           "output")


def check_ids(source: PromptParquetDatasource, id_column: Optional[str]) -> Optional[str]:
    """The id column is in every input file, or in none; in none only when it was not
    named (`id_column` None: the default's): then each row's id is derived, <file>:<row>,
    and the returned note says so (the summary, summary.json and the run log state it)."""
    name = id_column or DEFAULT_ID_COLUMN
    having = source.files_with_ids()
    lacking = [f.url for f in source.files_read if f.url not in having]
    if not lacking:
        return None
    if having:
        raise JobError(f"input file {lacking[0]} has no id column {name!r}, which {having[0]} has ({len(lacking)} "
                       f"of {len(having) + len(lacking)} file(s) lack it): its rows would get derived ids "
                       "(<file>:<row>) among real ones; give every file the column", "id_column", "input")
    if id_column is not None:
        names = [n for n in (source.schema.names if source.schema is not None else []) if n != name]
        raise JobError(f"no input file has the id column {name!r} (in {lacking[0]}"
                       + (f" and {len(lacking) - 1} more file(s)" if len(lacking) > 1 else "")
                       + f"); columns: {names}. Name the column that holds the ids, or leave --id-column out "
                       "to number the rows <file>:<row>", "id_column")
    return (f"the input has no {name!r} column: each row's id is <file>:<row> (the file's path under its input, "
            "the row's number in it); a resume matches rows by these, so keep the files' names and row order, "
            "or give the input an id column")


def check_batch_input(config: DLLMProcessorConfig, id_column: Optional[str]) -> str:
    """An OpenAI batch input lands in the processor's default columns, its ids are its
    custom_ids: a config or --id-column naming other columns is refused (else ignored)."""
    if id_column not in (None, openai_batch.ID_COLUMN):
        raise JobError(f"an OpenAI batch input's ids are its {openai_batch.ID_COLUMN!r}s; --id-column {id_column!r} "
                       "does not apply to it: leave it out", "id_column")
    wanted = {"prompt_column": "prompt", "messages_column": "messages",
              "sampling_column": openai_batch.SAMPLING_COLUMN}
    for option, name in wanted.items():
        if getattr(config, option) != name:
            raise JobError(f"an OpenAI batch input's requests are read into column {name!r}; --"
                           f"{option.replace('_', '-')} {getattr(config, option)!r} does not apply to it: leave it "
                           "out", option)
    return openai_batch.ID_COLUMN


def check_output_format(output_format: str, parts: List[str], where: str) -> None:
    """A known output format, whose part files would not mix with the ones kept (resume)."""
    if output_format not in OUTPUT_FORMATS:
        raise JobError(f"output format {output_format!r} is not one of {', '.join(OUTPUT_FORMATS)}", "output_format")
    other = [p for p in parts if not p.endswith(PART_SUFFIX[output_format])]
    if other:
        raise JobError(f"output {where} holds part files of another format ({other[0]}); output format "
                       f"{output_format} would mix them: give the format it was written with, or another output "
                       "(or --overwrite)", "output_format")


def check_duplicates_output(allow_duplicate_ids: bool, output_format: str) -> None:
    """--allow-duplicate-ids with OpenAI batch results is refused: results.jsonl answers
    each custom_id once (OpenAI itself requires them unique), so rows sharing an id
    would have no line of their own."""
    if allow_duplicate_ids and output_format == "openai-batch":
        raise JobError("allow_duplicate_ids with output format openai-batch: results.jsonl has one line per "
                       "custom_id (OpenAI requires them unique), so rows sharing an id could not each be answered; "
                       "make the ids unique, or choose another output format", "allow_duplicate_ids",
                       "output_format")


def check_tensor_parallel(config: DLLMProcessorConfig, checkpoint: Any) -> None:
    """The model splits over tensor_parallel_size ranks, by the rule its shards are cut by
    (engine.models.sharding.ShardPlan: query and K/V heads, MLP widths), read from its
    config.json alone: no weights loaded, before Ray. DiffusionGemma's canvas engine cuts
    its own shards (engine/canvas/sharding.py) and refuses at load, also as the user's."""
    size = config.engine.tensor_parallel_size
    if size == 1 or not checkpoint.serving.own_weights:
        return
    from engine.models.sharding import ShardingRefused, ShardPlan  # imports torch: tensor-parallel jobs only

    try:
        ShardPlan(checkpoint.config, 0, size)
    except ShardingRefused as e:
        raise JobError(f"model {config.model}: {e}; tensor_parallel_size must divide its attention heads, K/V heads "
                       "(or be a multiple of them) and MLP widths", "tensor_parallel_size") from e


def preflight(spec: Union[RunSpec, str, List[str]], output: Optional[str] = None,
              config: Optional[DLLMProcessorConfig] = None, *, cluster: Optional[Cluster] = None,
              **settings: Any) -> Preflight:
    """The job-level checks of `spec` (pipeline/run_spec.py; or input, output, config and
    its other fields as keywords), before any engine (or Ray) work: output apart from the
    input, input readable with a prompt column of a usable type in every file, agreeing
    column types and unique ids (`id_column`, else "id" when the input has it, else
    <file>:<row>), model and tokenizer loadable, settings the model's engine serves, the
    engine pool and the model's memory within `cluster` (what the run's Ray has or will
    have: pipeline/resources.py), output writable. `input_format` (reader.INPUT_FORMATS,
    auto by the files) and `output_format` (writer.OUTPUT_FORMATS): an OpenAI batch file is
    refused here when a line is no request (not JSON, no custom_id, a repeated one), naming
    the line. Raises JobError naming the option to fix. Nothing in the output is removed
    (overwrite) or created until every other check has passed: the output is prepared
    last, under this run's lease on it (`Preflight.lock`, released by run_offline), with
    the run record a resume is checked against (`resume_mismatch="allow"` mixes settings
    on purpose)."""
    spec = as_spec(spec, output, config, settings)
    out_fs, out_path, lock = _check_output(spec)
    source, id_column, ids_note, needs_tokenizer = _check_input(spec)
    names = source.schema.names if source.schema is not None else []
    checkpoint, template = _check_model_for(spec, cluster, source.format, names, needs_tokenizer)
    record = build_record(spec.config, checkpoint, template)
    parts, done, changed = _check_resume(spec, out_fs, out_path, id_column, record)
    try:
        duplicates = source.scan_ids(exclude_ids=done)
    except Exception as e:  # noqa: BLE001
        raise JobError(f"input ids cannot be read: {describe_error(e)}", "input", "id_column") from e
    if duplicates and not spec.allow_duplicate_ids:
        raise JobError(f"input has {duplicates.count} duplicated id(s) in column {id_column!r} "
                       f"({duplicates.extra_rows} extra rows), first: {', '.join(map(repr, duplicates.first))}; "
                       "make ids unique, or pass --allow-duplicate-ids to generate every row and report them",
                       "input", "id_column")
    history = run_history(read_json(out_fs, f"{out_path.rstrip('/')}/{SUMMARY_FILE}")) if spec.resumes else []
    _take_output(spec, lock, out_fs, out_path, parts, record)
    return Preflight(source, done, out_fs, out_path, duplicates, checkpoint, lock, record, history, changed,
                     id_column, ids_note, spec.output_format, spec, template)


def _check_output(spec: RunSpec) -> Tuple[fsspec.AbstractFileSystem, str, OutputLock]:
    """The output's filesystem and path, apart from the input and reachable, and its lease
    (not taken yet: once every check has passed); nothing changed there."""
    output = spec.output
    try:
        out_fs, out_path = get_filesystem(output, spec.storage)
    except Exception as e:  # noqa: BLE001
        raise JobError(f"output {output} cannot be used: {type(e).__name__}: {e}", "output") from e
    check_separate(spec.input, output, out_fs, out_path, spec.storage)
    try:
        check_output(out_fs, out_path, overwrite=spec.overwrite, resume=spec.resumes)  # reachable; changes nothing
    except Exception as e:  # noqa: BLE001
        raise JobError(f"output {output} cannot be used: {type(e).__name__}: {e}", "output") from e
    lock = OutputLock(out_fs, out_path, spec.run_id)
    try:
        lock.check()  # changes nothing: taken once every check has passed
    except OutputLocked as e:
        raise JobError(f"{e}", "output") from e
    except Exception:  # noqa: BLE001 - an output that cannot be read: the write probe below names why
        pass
    check_output_format(spec.output_format, [], output)
    check_duplicates_output(spec.allow_duplicate_ids, spec.output_format)
    return out_fs, out_path, lock


def _check_input(spec: RunSpec) -> Tuple[PromptParquetDatasource, str, Optional[str], bool]:
    """(the input, its id column, the note on derived ids, whether prompts are text)."""
    config = spec.config
    named, id_column = spec.id_column, spec.id_column or DEFAULT_ID_COLUMN
    try:
        source = PromptParquetDatasource(spec.input, spec.storage, id_column=id_column, limit=spec.limit,
                                         input_format=spec.input_format)
    except InputError as e:
        raise JobError(f"{e}", "input") from e
    if source.format == "openai-batch":  # its ids are its custom_ids; every line has a prompt, or its own error
        return source, check_batch_input(config, named), None, True
    needs_tokenizer = check_columns(source, config)
    return source, id_column, check_ids(source, named), needs_tokenizer


def _check_model_for(spec: RunSpec, cluster: Optional[Cluster], input_format: str, names: List[str],
                     needs_tokenizer: bool) -> Tuple[Any, Optional[str]]:
    """(the model's Checkpoint, the chat template prompts are rendered with): the model,
    its settings and tensor-parallel split, the template, the pool and its memory."""
    config = spec.config
    engine = config.engine
    if cluster is not None and engine.token_budget is None and config.engine_resources(cluster.gpus)["device"] == "cpu":
        engine = dataclasses.replace(engine, token_budget=engine.fixed_token_budget())  # CPU engines plan none
    checkpoint = check_model(config.model, needs_tokenizer, spec.storage, config.adapter, config.attention,
                             config.sampling, engine, config.revision)
    check_tensor_parallel(config, checkpoint)
    template = check_chat_template(config, spec.chat_template, names, checkpoint)
    if (input_format == "openai-batch" and template is None and config.messages_column in names
            and config.apply_chat_template is not False):
        raise JobError(f"the input's {openai_batch.CHAT} lines need a chat template, and the tokenizer of "
                       f"{config.model} has none: give one with --chat-template PATH", "chat_template")
    if cluster is not None:
        check_resources(config, cluster)
        check_gpu_memory(config, checkpoint, cluster)
    return checkpoint, template


def _check_resume(spec: RunSpec, out_fs: fsspec.AbstractFileSystem, out_path: str, id_column: str,
                  record: Dict[str, Any]) -> Tuple[List[str], List[str], List[str]]:
    """(the part files kept, the ids they hold, the settings changed since they were
    written): refused when they hold an id twice, or were written with other settings."""
    where = out_fs.unstrip_protocol(out_path)
    try:
        parts = accepted_parts(out_fs, out_path) if spec.resumes else []  # late parts left out (pipeline/writer.py)
        keys = completed_keys(out_fs, out_path, id_column, parts)
    except Exception as e:  # noqa: BLE001
        raise JobError(f"output {spec.output}: its part files cannot be read to resume: {describe_error(e)}; "
                       "--overwrite starts afresh", "output") from e
    check_output_format(spec.output_format, parts, where)
    if len(keys) != len(set(keys)) and not spec.allow_duplicate_ids:  # (id, sample_index) written twice
        raise JobError(f"output {where} already holds duplicate ids; rerun with --overwrite", "output")
    changed: List[str] = []
    if keys:
        changed, refusal = check_resume(out_fs, out_path, record, spec.resume_mismatch, where)
        if refusal:
            raise JobError(f"{refusal}", "output", "resume_mismatch")
    return parts, [i for i, _ in keys], changed  # one id per output row: a row of n samples is n rows


def _take_output(spec: RunSpec, lock: OutputLock, out_fs: fsspec.AbstractFileSystem, out_path: str,
                 parts: List[str], record: Dict[str, Any]) -> None:
    """Take the output's lease, then prepare it (overwrite, resume) and write the record."""
    try:
        lock.acquire()
    except OutputLocked as e:
        raise JobError(f"{e}", "output") from e
    except Exception as e:  # noqa: BLE001
        raise JobError(f"output {spec.output} is not writable: {describe_error(e)}", "output") from e
    try:
        prepare_output(out_fs, out_path, overwrite=spec.overwrite, resume=spec.resumes, writer=lock.writer_id,
                       parts=parts)
        write_json((out_fs, out_path), RECORD_FILE, record)
    except Exception as e:  # noqa: BLE001
        lock.release()
        raise JobError(f"output {spec.output} cannot be used: {type(e).__name__}: {e}", "output") from e
