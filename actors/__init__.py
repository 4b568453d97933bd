"""blockray's Ray side: the engine actor (one engine, built from an EngineSpec), its
background engine loop and its metrics, the run's group actor, and the engine stage's
dispatcher that sends a lost engine's batches to a live one. Knows nothing of Parquet
or S3. No module here imports torch at import time: the engine actor loads it when built.
"""
from __future__ import annotations

from common.lazy import lazy_exports

_EXPORTS = {
    "DLLMEngineActor": ".engine_actor",
    "EngineSpec": ".spec",
    "EngineDispatcher": ".engine_router",
    "OUTPUT_SCHEMA": "common.schema",
    "EngineMetrics": ".metrics",
    "METRICS": ".metrics",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_exports(__name__, _EXPORTS)
