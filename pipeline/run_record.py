"""What wrote an output: the run record a resume is checked against.

A resume keeps the part files already in the output and generates only the missing ids,
so it must generate them the way the kept ones were: same model (the fingerprint of its
files at their source, engine.checkpoint: the same whichever copy is local, a folder or
s3://),
adapter, engine and sampling settings, chat template and blockray version. The record is
derived from the config dataclasses field by field (a field another change adds, e.g.
`adapter` or `attention`, is part of it with nothing to list here); only the fields that
cannot change a row's tokens (how many engines, batch sizes, CPU shares, the sort order,
metrics) are left out, by name, below. It is written beside the part files as
`_run_record.json` (a name Parquet readers skip) before the first part file, so every
output this version writes has one.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, Dict, List, Optional, Tuple

import fsspec

RECORD_FILE = "_run_record.json"
MISMATCH_CHOICES = ("refuse", "allow")

# Fields that cannot change a row's tokens: placement, batching, parallelism, ordering,
# metrics (a row's tokens never depend on its batch, see engine/). `model` and
# `chat_template` are where they are read from: the record holds hashes of their contents.
NOT_RESULT_FIELDS = frozenset({
    "model", "chat_template", "num_engines", "batch_size", "max_concurrent_batches", "num_gpus_per_engine",
    "num_cpus_per_engine", "resources_per_engine", "torch_threads", "cpu_stage_num_cpus",
    "wait_for_engines_s", "sort", "sort_window_rows", "sort_min_prefix", "sort_prefix_locality", "prefix_affinity", "collect_engine_stats", "enable_metrics",
    "record_batches", "engine.token_budget", "engine.gpu_memory_utilization", "engine.max_batch_size", "engine.scheduler", "engine.advance",
    "engine.profile", "engine.enable_prefix_caching", "postprocess_error_rows",
    "should_continue_on_error", "accelerator_type", "placement_group_config",
})


def settings(obj: Any, prefix: str = "") -> Dict[str, Any]:
    """Every field of a (nested) config dataclass as {"engine.block_length": 4, ...},
    JSON-normalised, less NOT_RESULT_FIELDS."""
    out: Dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        name = prefix + f.name
        if name in NOT_RESULT_FIELDS:
            continue
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.update(settings(value, name + "."))
        else:
            out[name] = json.loads(json.dumps(value, default=str))
    return out


def build_record(config: Any, checkpoint: Any, chat_template: Optional[str]) -> Dict[str, Any]:
    """The record of a run with `config` on the model of `checkpoint` (engine.checkpoint),
    rendering `chat_template` (its text, None when prompts are not rendered)."""
    from .summary import _version

    record: Dict[str, Any] = {
        "model_sha256": checkpoint.fingerprint,
        "chat_template_sha256": hashlib.sha256(chat_template.encode()).hexdigest() if chat_template else None,
        "blockray_version": _version(),
        "settings": settings(config),
    }
    if checkpoint.adapter is not None:
        record["adapter_sha256"] = checkpoint.adapter.fingerprint
    return record


def differences(old: Dict[str, Any], new: Dict[str, Any]) -> List[str]:
    """"name: old -> new" for every entry that differs (settings compared field by field)."""
    def flat(r: Dict[str, Any]) -> Dict[str, Any]:
        return {**{k: v for k, v in r.items() if k != "settings"}, **r.get("settings", {})}

    a, b = flat(old), flat(new)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def read_json(fs: fsspec.AbstractFileSystem, path: str) -> Optional[Dict[str, Any]]:
    """A JSON object at `path`, or None when there is none (or it is not JSON)."""
    try:
        with fs.open(path, "rb") as fh:
            value = json.loads(fh.read())
    except (OSError, ValueError):  # absent, or a path through a file: nothing recorded there
        return None
    return value if isinstance(value, dict) else None


def check_resume(fs: fsspec.AbstractFileSystem, out_path: str, record: Dict[str, Any], mismatch: str,
                 where: str) -> Tuple[List[str], Optional[str]]:
    """(differences, message): the differences between `record` and the one stored with
    the output's part files, and the refusal message when they differ and `mismatch` is
    "refuse" (None otherwise)."""
    old = read_json(fs, f"{out_path.rstrip('/')}/{RECORD_FILE}")
    if old is None:  # written before run records existed: nothing to compare
        return [], None
    diffs = differences(old, record)
    if not diffs or mismatch == "allow":
        return diffs, None
    shown = "; ".join(diffs[:8]) + (f"; and {len(diffs) - 8} more" if len(diffs) > 8 else "")
    return diffs, (f"output {where} was written with other settings than this run's ({shown}): resuming would mix "
                   "results of both in one output. Rerun with the settings it was written with, choose another "
                   "--output, --overwrite to start afresh, or --resume-mismatch allow to mix them on purpose "
                   "(summary.json then records both runs)")


def run_history(previous: Optional[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The runs that wrote the output so far, from its previous summary.json."""
    if not previous:
        return []
    if isinstance(previous.get("runs"), list):
        return list(previous["runs"])
    return [history_entry(previous)]  # a summary written before histories were kept


def history_entry(summary: Dict[str, Any], diffs: Optional[List[str]] = None) -> Dict[str, Any]:
    """One run of an output's history, as summary.json's `runs` lists them."""
    entry = {k: summary.get(k) for k in ("run_id", "status", "rows", "errors", "rows_processed", "rows_skipped",
                                         "wall_s", "model", "model_config_sha256", "blockray_version")}
    entry["finished_at"] = summary.get("finished_at")
    if diffs:
        entry["settings_changed"] = diffs
    return entry


__all__ = ["RECORD_FILE", "MISMATCH_CHOICES", "NOT_RESULT_FIELDS", "settings", "build_record",
           "differences", "check_resume", "run_history", "history_entry", "read_json"]
