"""EngineSpec: everything one engine actor is built from, as one frozen value (torch-free:
the processor builds it on the driver, the dispatchers and the group actor pass it on)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Union

from engine.config import EngineConfig, SamplingParams  # dataclasses only: no torch


@dataclass(frozen=True)
class EngineSpec:
    """The model, the engine's and the default sampling settings, where the engine runs,
    and the input columns it reads; see actors/engine_actor.py."""

    # the run's Checkpoint (engine.checkpoint: the processor passes the one its preflight
    # opened), or a local directory, s3://… or hub id that the actor opens itself
    model: Union[str, Any]
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingParams = field(default_factory=SamplingParams)
    dtype: str = "auto"
    device: str = "auto"
    torch_threads: Optional[int] = 1
    rank: Optional[int] = None  # else the next rank of the run's group actor, else 0
    run_id: str = ""  # the `run` tag of its metrics
    enable_metrics: bool = True
    prefix_affinity: bool = True  # with prefix caching (`prefix_caching`): route batches by prefix (engine_router)
    post_stats: bool = False  # post its engine stats to the group after each batch (tests, benches)
    record_batches: bool = False
    warmup: bool = True
    token_ids_column: str = "prompt_token_ids"
    error_column: str = "error"
    sampling_column: str = "sampling_params"
    seed_column: Optional[str] = None
    id_column: Optional[str] = "id"

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks of this engine (EngineConfig's, one value for both): > 1, the engine actor is
        rank 0 of a placement group and starts the others (actors/tensor_parallel.py)."""
        return int(getattr(self.engine, "tensor_parallel_size", 1))

    def checkpoint(self) -> Any:
        """The model's Checkpoint: as given, or opened from its path or URL."""
        from engine.checkpoint import Checkpoint

        return self.model if isinstance(self.model, Checkpoint) else Checkpoint.open(self.model)

    def prefix_caching(self) -> bool:
        """Whether the engine caches prompt prefixes (engine.enable_prefix_caching, auto
        resolved for the model): the dispatcher's prefix affinity reads it."""
        on = self.engine.enable_prefix_caching
        return on if on is not None else self.checkpoint().prefix_caching(self.engine)

    def columns(self) -> List[str]:
        """The input columns the engine reads (the dispatcher sends it only these)."""
        names = (self.token_ids_column, self.error_column, self.sampling_column, self.seed_column, self.id_column)
        return list(dict.fromkeys(c for c in names if c))
