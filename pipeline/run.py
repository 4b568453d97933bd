"""Parquet in, Parquet out: the offline evaluation run behind jobs/offline_eval.py.

Kept here (not in the job script) so tests can call it and the job stays a thin
argument parser.

Reliability contract: every input row ends up in the output exactly once, with its
generation or with an error saying why.
- Problems of the whole job (no prompt column, unreadable input, output not writable,
  no model) fail fast, before any engine starts, with a `JobError` naming the column,
  path or option (`preflight`).
- Problems of one row become that row's `error` (pipeline/stages.py, the engine).
- Resume (default): part files are complete or absent (pipeline/writer.py), so a rerun
  with the same output reads the ids of the part files already there and leaves those
  rows out before the engines; `summary.json` (written last) marks a finished run and
  reports `rows_skipped` / `rows_processed`.
"""
from __future__ import annotations

import functools
import json
import os
import time
from typing import Any, Dict, List, Optional, Union

from .config import DLLMProcessorConfig
from .reader import InputError, PromptParquetDatasource, read_prompts
from .storage import StorageOptions, describe_error, get_filesystem
from .stages import has_tokenizer
from .summary import block_stats, summarize
from .writer import completed_ids, prepare_output, write_json, write_results

SUMMARY_FILE = "summary.json"


class JobError(RuntimeError):
    """The job cannot run (or did not finish); the message says why and what to change."""


def check_model(model: str, needs_tokenizer: bool) -> None:
    """A model directory the engines can load: config.json (valid JSON) and weights;
    a tokenizer when prompts are text."""
    cfg = os.path.join(model, "config.json")
    if not os.path.isdir(model):
        raise JobError(f"model: {model} is not a directory (--model)")
    if not os.path.isfile(cfg):
        raise JobError(f"model: {model} has no config.json (--model)")
    try:
        with open(cfg) as f:
            json.load(f)
    except Exception as e:  # noqa: BLE001
        raise JobError(f"model: {cfg} is not valid JSON: {e}") from e
    if not any(n.endswith(".safetensors") for n in os.listdir(model)):  # all engine.loader reads
        raise JobError(f"model: {model} holds no weights (*.safetensors) (--model)")
    if needs_tokenizer and not has_tokenizer(model):
        raise JobError(f"model: {model} has no tokenizer files, needed for text prompts (--model)")


def check_columns(source: PromptParquetDatasource, config: DLLMProcessorConfig) -> bool:
    """The input has a column prompts can come from; returns whether they are text."""
    names = source.schema.names if source.schema is not None else []
    if config.apply_chat_template:
        if config.messages_column not in names:
            raise JobError(f"input has no {config.messages_column!r} column (--messages-column) for "
                           f"apply_chat_template; columns: {names}")
        return True
    if config.prompt_token_ids_column in names:
        return False
    if config.prompt_column not in names:
        raise JobError(f"input has no prompt column {config.prompt_column!r} (--prompt-column) nor "
                       f"{config.prompt_token_ids_column!r}; columns: {names}")
    return True


def preflight(input: Union[str, List[str]], output: str, config: DLLMProcessorConfig, *,
              storage: Optional[StorageOptions] = None, limit: Optional[int] = None, id_column: str = "id",
              overwrite: bool = False, resume: bool = True):
    """The job-level checks, before any engine (or Ray) work: output usable and writable,
    input readable with a prompt column, model loadable. Returns (input datasource with
    the ids already in the output left out, those ids, output fs, output path); raises
    JobError naming the option to fix."""
    resume = resume and not overwrite
    try:
        out_fs, out_path = get_filesystem(output, storage)
        prepare_output(out_fs, out_path, overwrite=overwrite, resume=resume)
    except Exception as e:  # noqa: BLE001
        raise JobError(f"output {output} cannot be used: {type(e).__name__}: {e} (--output)") from e
    done = completed_ids(out_fs, out_path, id_column) if resume else []
    if len(done) != len(set(done)):
        raise JobError(f"output {out_fs.unstrip_protocol(out_path)} already holds duplicate ids; "
                       "rerun with --overwrite")
    try:
        source = PromptParquetDatasource(input, storage, id_column=id_column, limit=limit, exclude_ids=done)
    except InputError as e:
        raise JobError(f"{e} (--input)") from e
    needs_tokenizer = check_columns(source, config)
    check_model(config.model, needs_tokenizer)
    return source, done, out_fs, out_path


def run_offline(input: Union[str, List[str]], output: str, config: DLLMProcessorConfig, *,
                storage: Optional[StorageOptions] = None, limit: Optional[int] = None, id_column: str = "id",
                reference_column: Optional[str] = "reference", overwrite: bool = False, resume: bool = True,
                rows_per_file: Optional[int] = 256, preflighted: Optional[tuple] = None) -> Dict[str, Any]:
    """Read prompts, generate, stream results to `output`, write `summary.json` beside
    them and return the summary. With `resume` (default) ids already in `output`'s part
    files are skipped; `overwrite` starts from scratch instead. `preflighted`: what
    `preflight` returned for these same arguments, when the caller already ran it."""
    t0 = time.perf_counter()
    source, done, out_fs, out_path = preflighted or preflight(
        input, output, config, storage=storage, limit=limit, id_column=id_column, overwrite=overwrite, resume=resume)

    # --- run ------------------------------------------------------------------------------
    stats_fn = functools.partial(block_stats, reference_column=reference_column)
    write_returns: List[Dict[str, Any]] = []
    if source.num_rows:
        ds = build_processor_for(config)(read_prompts(input, rows_per_block=config.batch_size, source=source))
        try:
            sink = write_results(ds, (out_fs, out_path), rows_per_file=rows_per_file, stats_fn=stats_fn)
        except Exception as e:  # noqa: BLE001
            raise JobError(f"run failed, no summary written: {describe_error(e)}. Part files already in "
                           f"{out_fs.unstrip_protocol(out_path)} are complete (temporaries stay under _tmp/): "
                           f"once the cause is fixed, rerun with the same --output to resume") from e
        write_returns = sink.write_returns
    wall_s = time.perf_counter() - t0
    processed = sum(r["rows"] for r in write_returns)
    summary = summarize(
        write_returns, wall_s,
        output=out_fs.unstrip_protocol(out_path),
        input=input,
        model=config.model,
        num_engines=config.num_engines,
        batch_size=config.batch_size,
        output_files=sorted(r["file"] for r in write_returns),
        resumed=bool(done),
        rows_skipped=source.num_excluded,
        rows_processed=processed,
        rows_total=len(done) + processed,
    )
    summary["summary_file"] = write_json((out_fs, out_path), SUMMARY_FILE, summary)
    return summary


def build_processor_for(config: DLLMProcessorConfig):
    from .processor import build_processor

    return build_processor(config)


__all__ = ["run_offline", "preflight", "SUMMARY_FILE", "JobError", "check_model", "check_columns", "describe_error"]
