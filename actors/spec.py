"""EngineSpec: everything one engine actor is built from, as one frozen value (torch-free:
the processor builds it on the driver, the dispatchers and the group actor pass it on)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from engine.config import EngineConfig, SamplingParams  # dataclasses only: no torch


@dataclass(frozen=True)
class EngineSpec:
    """The model, the engine's and the default sampling settings, where the engine runs,
    and the input columns it reads; see actors/engine_actor.py."""

    model: str  # a local directory, s3://… or a hub id (common/model_source.py)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    dtype: str = "auto"
    device: str = "auto"
    torch_threads: Optional[int] = 1
    adapter: Optional[str] = None
    attention: str = "auto"
    model_storage: Any = None  # StorageOptions of a remote model
    rank: Optional[int] = None  # else the next rank of the run's group actor, else 0
    run_id: str = ""  # the `run` tag of its metrics
    enable_metrics: bool = True
    post_stats: bool = False  # post its engine stats to the group after each batch (tests, benches)
    record_batches: bool = False
    warmup: bool = True
    token_ids_column: str = "prompt_token_ids"
    error_column: str = "error"
    sampling_column: str = "sampling_params"
    seed_column: Optional[str] = None
    id_column: Optional[str] = "id"

    def columns(self) -> List[str]:
        """The input columns the engine reads (the dispatcher sends it only these)."""
        names = (self.token_ids_column, self.error_column, self.sampling_column, self.seed_column, self.id_column)
        return list(dict.fromkeys(c for c in names if c))
