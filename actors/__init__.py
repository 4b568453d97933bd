"""blockray's Ray side: the engine actor (a Ray Data callable class owning one engine),
its background engine loop and its metrics, and the engine stage's dispatcher that sends
a lost engine's batches to a live one. Knows nothing of Parquet or S3.

Names are imported lazily: the dispatcher (actors/engine_router.py) runs in processes
that must not import torch.
"""
from __future__ import annotations

from common.lazy import lazy_exports

_EXPORTS = {
    "DLLMEngineActor": ".engine_actor",
    "EngineDispatcher": ".engine_router",
    "OUTPUT_SCHEMA": ".schema",
    "EngineMetrics": ".metrics",
    "METRICS": ".metrics",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
