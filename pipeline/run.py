"""Prompts in (Parquet, JSON Lines, CSV, OpenAI batch), results out (Parquet or JSON Lines
part files, and an OpenAI batch results.jsonl): the offline evaluation run behind
jobs/offline_eval.py.

Kept here (not in the job script) so tests can call it and the job stays a thin
argument parser.

Reliability contract: every input row ends up in the output exactly once, with its
generation or with an error saying why.
- Problems of the whole job (no prompt column, unreadable input, files disagreeing on a
  column type, duplicated ids, output inside the input, output not writable, no model,
  a model that needs remote code) fail fast, before any engine starts, with a
  `JobError` naming the column, path or option (`preflight`); nothing in the output is
  removed before every check has passed.
- What stops the run later is a `JobError` too when the user must fix it (storage, the
  model's source, the input, an engine that cannot be placed or started for such a
  reason: pipeline/failures.py decides, by the root cause under Ray's wrappers); anything
  else is a bug in blockray and propagates as raised (the CLI then exits 1 and writes its
  traceback to a log file).
- More failed rows than `max_error_fraction` (default 0): `ErrorFractionExceeded`, after
  every row and summary.json are written.
- Problems of one row become that row's `error` (pipeline/stages.py, the engine).
- Resume (default): part files are complete or absent (pipeline/writer.py), so a rerun
  with the same output reads the ids of the part files already there and leaves those
  rows out before the engines; `summary.json` (written last) marks a finished run and
  reports `rows_skipped` / `rows_processed`. A resume into an output written with other
  settings is refused, naming them (pipeline/run_record.py; `resume_mismatch="allow"`), and
  `summary.json` lists every run that wrote the output (`runs`).
- One writer per output: the run holds a lease in it (pipeline/output_lock.py) from the
  preflight to its end; a second run on the output is refused naming the holder. A run
  that loses it (taken over, or not refreshed in time) stops writing there and fails
  (`LeaseLost`, a JobError naming the run that took it or the cause); parts a dying run
  commits after a takeover are kept out of the output (the part manifest, pipeline/writer.py).
- Storage failing after every part file (the lease, report.html, summary.json) is a
  JobError too, saying what is written and what a rerun does.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Callable, Dict, List, Optional, Union

import ray

from common.storage import StorageOptions, StorageWriteError, describe_error

from .checkpoint_check import stop_sources
from .config import DLLMProcessorConfig
from .failures import users_to_fix
from .output_lock import LOCK_FILE, LeaseLost
from .preflight import (SUMMARY_FILE, JobError, Preflight, check_columns, check_model,  # noqa: F401 - re-exported
                        check_separate, preflight)
from .run_spec import MAX_ERROR_FRACTION, UNREAD, RunSpec, as_spec
from .reader import read_prompts
from .resources import connected_cluster
from .run_record import history_entry
from .summary import block_stats, run_record, summarize
from .writer import remove_late_parts, write_json, write_results


class ErrorFractionExceeded(JobError):
    """The run finished and wrote every row, but more of them failed than allowed
    (`max_error_fraction`); `summary` is the run's summary (also in summary.json)."""

    def __init__(self, message: str, summary: Dict[str, Any]):
        super().__init__(message)
        self.summary = summary


def error_fraction_message(summary: Dict[str, Any], max_error_fraction: float) -> str:
    """One line: how many rows failed, the bound, the most frequent messages."""
    top = "; ".join(f"{e['count']} x {e['error']!r}" for e in summary.get("top_errors", [])[:3])
    return (f"{summary['errors']} of {summary['rows']} rows failed ({summary['error_fraction']:.1%}, more than "
            f"--max-error-fraction {max_error_fraction:g}); most frequent: {top}. Every row was written, with "
            f"its error: see {summary.get('summary_file')}")


def run_offline(spec: Union[RunSpec, str, List[str]], output: Optional[str] = None,
                config: Optional[DLLMProcessorConfig] = None, *, preflighted: Optional[Preflight] = None,
                **settings: Any) -> Dict[str, Any]:
    """Read prompts, generate, stream results to the output, write `summary.json` beside
    them and return the summary. `spec`: the run (pipeline/run_spec.py RunSpec), or its
    input, output and config with its other fields as keywords (`storage`, `limit`,
    `id_column`, `reference_column`, `overwrite`, `resume`, `rows_per_file`,
    `allow_duplicate_ids`, `max_error_fraction`, `resume_mismatch`, `run_id`, `report`,
    `input_format`, `output_format`). With `resume` (default) ids already in the output's
    part files are skipped; `overwrite` starts from scratch instead. `preflighted`: what
    `preflight` returned for this same run, when the caller already ran it (the run then
    goes on with its spec, run id included). `report`: also write report.html
    (pipeline/report.py), with the engines' own stats (the job, pipeline/cli.py, does
    unless --no-report). `id_column`: the input's ids (default: "id" when the input has
    it, else each row's <file>:<row>, which the summary states); a column named must be in
    every input file. `input_format`: auto (by the files: pipeline/reader.py
    detect_format), parquet, jsonl, csv or openai-batch (ids: custom_id); `output_format`:
    parquet or jsonl part files, or openai-batch (Parquet parts, then results.jsonl in
    input order when the run ends: pipeline/openai_batch.py).

    Raises JobError for what stops the run and the user must fix (pipeline/failures.py),
    ErrorFractionExceeded (a JobError, after summary.json is written) when more than
    `max_error_fraction` of the rows failed; any other exception is a bug in blockray and
    propagates as raised (Ray's wrapper included, its text holding the remote traceback)."""
    t0 = time.perf_counter()
    spec = as_spec(spec, output, config, settings)
    if preflighted is not None and preflighted.spec is not None:
        if not same_run(spec, preflighted.spec):
            raise ValueError("preflighted: preflight's result for other settings than this run's")
        spec = preflighted.spec  # its run id holds the output's lease
    checked = preflighted or preflight(  # the engine pool against the Ray connected to, if any yet
        spec, cluster=connected_cluster() if ray.is_initialized() else None)
    try:
        return _run(checked, spec, t0)
    finally:
        checked.release()


def same_run(a: RunSpec, b: RunSpec) -> bool:
    """The two specs ask for the same run, whatever their run ids."""
    return a is b or all(getattr(a, f.name) == getattr(b, f.name) for f in dataclasses.fields(RunSpec)
                         if f.name != "run_id")


def _run(checked: Preflight, spec: RunSpec, t0: float) -> Dict[str, Any]:
    source, done, out_fs, out_path = checked.source, checked.done, checked.out_fs, checked.out_path
    id_column, max_error_fraction, run_id = checked.id_column, spec.max_error_fraction, spec.run_id
    config = spec.config
    if config.id_column != id_column:  # per-row seeds derive from the job's ids
        config = dataclasses.replace(config, id_column=id_column)
    if not config.collect_engine_stats:  # per-engine token budget (summary.json), busy time and padding (report)
        config = dataclasses.replace(config, collect_engine_stats=True)

    # --- run ------------------------------------------------------------------------------
    stats_fn = functools.partial(block_stats, reference_column=spec.reference_column)
    write_returns: List[Dict[str, Any]] = []
    engines: Dict[Any, Any] = {}
    if source.num_rows:
        try:  # building the processor checks the model: inside, too
            processor = build_processor_for(config, spec.storage, run_id, checked.checkpoint,
                                            chat_template=checked.chat_template)
            ds = processor(read_prompts(spec.input, rows_per_block=config.batch_size, source=source))
            sink = write_results(ds, (out_fs, out_path), rows_per_file=spec.rows_per_file, stats_fn=stats_fn,
                                 writer=checked.lock.writer_id, guard=checked.lock.guard(),
                                 part_format=checked.output_format)
            engines = engine_figures(processor)
        except Exception as e:  # noqa: BLE001 - the user's to fix: one line; a bug: as raised
            checked.lock.after_failure()
            if not users_to_fix(e):
                raise
            lost = lease_lost(checked.lock)
            if lost:  # a write task found it first: the driver's own words for it
                raise JobError(lost) from e
            raise JobError(f"run failed, no summary written: {describe_error(e)}. Part files already in "
                           f"{out_fs.unstrip_protocol(out_path)} are complete (temporaries stay under _tmp/): "
                           f"once the cause is fixed, rerun with the same --output to resume") from e
        write_returns = sink.write_returns
    wall_s = time.perf_counter() - t0
    processed = sum(r["rows"] for r in write_returns)
    summary = summarize(
        write_returns, wall_s,
        output=out_fs.unstrip_protocol(out_path),
        input=spec.input,
        model=config.model,
        run_id=run_id,
        num_engines=config.num_engines,
        tensor_parallel_size=config.tensor_parallel_size,  # devices (ranks) per engine
        batch_size=config.batch_size,
        output_files=sorted(r["file"] for r in write_returns),
        resumed=bool(done),
        rows_skipped=source.num_excluded,
        rows_processed=processed,
        rows_total=len(done) + processed,
        max_error_fraction=max_error_fraction,
        duplicate_ids=checked.duplicates.to_dict() if checked.duplicates else None,
    )
    summary.update(run_record(config, checked.checkpoint))
    summary["stop_token_ids"] = stop_sources(checked.checkpoint, config.sampling.stop_token_ids)
    summary["model_token_ids"] = checked.checkpoint.token_ids()
    summary["status"] = "failed" if summary["error_fraction"] > max_error_fraction else "ok"
    summary["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    summary["run_record"] = checked.record
    summary["ids_note"] = checked.ids_note
    summary["runs"] = [*checked.history, history_entry(summary, checked.settings_changed)]
    summary["engines"] = engines
    results = None
    if checked.output_format == "openai-batch":
        from .openai_batch import token_texts, write_results_file
        from .processor import served_names

        cp = checked.checkpoint
        results = functools.partial(write_results_file, out_fs, out_path, source.input_ids(), id_column,
                                    config.served_name(), served_names(config)["served"], checked.lock.verify,
                                    token_texts(cp.load_tokenizer))
    finish(checked, summary, spec.report, results)
    if summary["status"] == "failed":
        raise ErrorFractionExceeded(error_fraction_message(summary, max_error_fraction), summary)
    return summary


def finish(checked: Preflight, summary: Dict[str, Any], report: bool,
           results: Optional[Callable[[], str]] = None) -> None:
    """After every part file: check the lease is still this run's, remove late parts
    (pipeline/writer.py), write `results` (OpenAI batch's results.jsonl), report.html (with
    `report`) and summary.json, remove the lease. A failure there the user must fix (storage, the lease lost) is a JobError that
    says what is written and what to do; a bug propagates."""
    out_fs, out_path = checked.out_fs, checked.out_path
    try:
        checked.lock.verify()  # a run that lost the output's lease writes nothing more there
        remove_late_parts(out_fs, out_path)
        if results is not None:
            summary["results_file"] = results()
        if report:
            from .report import write_report

            summary["report_file"] = write_report((out_fs, out_path), summary)
        summary["summary_file"] = write_json((out_fs, out_path), SUMMARY_FILE, summary)
        checked.lock.release(check=True)
    except LeaseLost as e:
        raise JobError(str(e)) from e
    except Exception as e:  # noqa: BLE001 - the user's to fix: one line; a bug: as raised
        if not users_to_fix(e):
            raise
        where = out_fs.unstrip_protocol(out_path)
        if "summary_file" in summary:
            advice = (f"Every row and summary.json are written in {where}; remove {LOCK_FILE} there (a run on it "
                      f"from another host would otherwise wait {checked.lock.ttl_s:g} s for the lease to expire)")
        else:
            advice = (f"Every row is written, in the part files in {where}, but not the run's summary: rerun with the "
                      "same --output to write it (no row is generated again)")
        cause = str(e) if isinstance(e, StorageWriteError) else describe_error(e)  # which holds its cause
        raise JobError(f"{cause}. {advice}") from e


def lease_lost(lock: Any) -> Optional[str]:
    """Why this run no longer holds its output's lease; None when it does, or when the
    lease cannot be read now (the run's own error then says more)."""
    try:
        lock.verify()
    except LeaseLost as e:
        return str(e)
    except Exception:  # noqa: BLE001 - see above
        pass
    return None


def engine_figures(processor: Any) -> Dict[str, Dict[str, Any]]:
    """{engine rank: busy_s, forward_s, steps, generated tokens, padding fraction, token
    budget and how it was resolved (`budget`: engine.budget.Budget, the memory plan of a
    planned one)} as the engines last posted them (config.collect_engine_stats); {} when
    none did."""
    keep = ("busy_s", "forward_s", "cycles", "steps", "generated_tokens", "padded_cells", "computed_cells",
            "token_budget", "kv_peak_bytes", "budget", "prefix_query_blocks", "prefix_hit_blocks",
            "prefix_query_tokens", "prefix_hit_tokens", "prefix_cached_blocks", "prefix_evictions")
    try:
        posted = getattr(processor, "engine_stats", dict)()
    except Exception as e:  # noqa: BLE001 - the report then says "no engine stats"; the run stands
        logging.getLogger(__name__).warning("engine stats not read: %s", describe_error(e))
        return {}
    return {str(rank): {**{k: st.get(k) for k in keep}, "padding_fraction": (
        st["padded_cells"] / st["computed_cells"] if st.get("computed_cells") else 0.0)}
        for rank, st in sorted(posted.items())}


def build_processor_for(config: DLLMProcessorConfig, storage: Optional[StorageOptions] = None,
                        run_id: Optional[str] = None, checkpoint: Any = None, chat_template: Any = UNREAD):
    """The job's processor: error rows always pass (should_continue_on_error=True), every row
    is written, and max_error_fraction judges the run once it has finished. `chat_template`:
    the template the preflight resolved (processor.build_processor)."""
    from .processor import build_processor

    if not config.should_continue_on_error:
        config = dataclasses.replace(config, should_continue_on_error=True)
    return build_processor(config, storage=storage, run_id=run_id, checkpoint=checkpoint, chat_template=chat_template)


__all__ = ["run_offline", "RunSpec", "preflight", "Preflight", "SUMMARY_FILE", "JobError", "ErrorFractionExceeded",
           "MAX_ERROR_FRACTION", "check_model", "check_columns", "check_separate", "describe_error"]
