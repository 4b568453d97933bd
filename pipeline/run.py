"""Parquet in, Parquet out: the offline evaluation run behind jobs/offline_eval.py.

Kept here (not in the job script) so tests can call it and the job stays a thin
argument parser.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Dict, List, Optional, Union

from .config import DLLMProcessorConfig
from .processor import build_processor
from .reader import read_prompts
from .storage import StorageOptions, get_filesystem
from .summary import block_stats, summarize
from .writer import write_json, write_results

SUMMARY_FILE = "summary.json"


def run_offline(input: Union[str, List[str]], output: str, config: DLLMProcessorConfig, *,
                storage: Optional[StorageOptions] = None, limit: Optional[int] = None, id_column: str = "id",
                reference_column: Optional[str] = "reference", overwrite: bool = False,
                rows_per_file: Optional[int] = 256) -> Dict[str, Any]:
    """Read prompts, generate, stream results to `output`, write `summary.json` beside
    them and return the summary."""
    storage = (storage or StorageOptions()).resolved()
    t0 = time.perf_counter()
    ds = read_prompts(input, storage=storage, id_column=id_column, limit=limit, rows_per_block=config.batch_size)
    ds = build_processor(config)(ds)
    sink = write_results(ds, output, storage=storage, overwrite=overwrite, rows_per_file=rows_per_file,
                         stats_fn=functools.partial(block_stats, reference_column=reference_column))
    wall_s = time.perf_counter() - t0
    fs, path = get_filesystem(output, storage)
    summary = summarize(
        sink.write_returns, wall_s,
        output=fs.unstrip_protocol(path),
        input=input,
        model=config.model,
        num_engines=config.num_engines,
        batch_size=config.batch_size,
        output_files=sorted(r["file"] for r in sink.write_returns),
    )
    summary["summary_file"] = write_json(output, SUMMARY_FILE, summary, storage)
    return summary


__all__ = ["run_offline", "SUMMARY_FILE"]
