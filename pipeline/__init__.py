"""blockray's data side: Parquet I/O on any fsspec URL, the tokenize/detokenize stages,
the sorter and the processor API (`build_processor(config)(ds) -> ds`). No torch
tensors here.

Names are imported lazily so that `import pipeline.sorting` does not pull in
Ray or the engine.
"""
from __future__ import annotations

from common.lazy import lazy_exports

_EXPORTS = {
    "DLLMProcessorConfig": ".config",
    "DLLMProcessor": ".processor",
    "build_processor": ".processor",
    "OUTPUT_COLUMNS": ".processor",
    "read_prompts": ".reader",
    "write_results": ".writer",
    "run_offline": ".run",
    "RunSpec": ".run_spec",
    "StorageOptions": "common.storage",
    "get_filesystem": "common.storage",
    "block_stats": ".summary",
    "summarize": ".summary",
    "EngineConfig": "engine.config",
    "SamplingParams": "engine.config",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
