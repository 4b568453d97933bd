"""blockray's Ray side: the engine actor (a Ray Data callable class owning one engine),
its background engine loop and its metrics. Knows nothing of Parquet or S3."""
from .engine_actor import OUTPUT_SCHEMA, DLLMEngineActor
from .metrics import METRICS, EngineMetrics

__all__ = ["DLLMEngineActor", "OUTPUT_SCHEMA", "EngineMetrics", "METRICS"]
