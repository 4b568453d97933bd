"""Configuration dataclasses: what the engine is asked to do (EngineConfig) and how
each request is decoded (SamplingParams)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Sequence

Policy = Literal["fixed", "threshold", "factor"]
CacheMode = Literal["none", "refresh", "persistent"]
SchedulerKind = Literal["blockserve", "static", "sequential"]
AdvanceMode = Literal["block", "step"]


@dataclass
class SamplingParams:
    """Per-request decoding settings. `stop_token_ids=None` means the model's EOS
    (and EoT where the config has one)."""

    max_new_tokens: int = 64
    policy: Policy = "threshold"
    threshold: float = 0.9
    factor: float = 1.0
    temperature: float = 0.0
    stop_token_ids: Optional[Sequence[int]] = None
    seed: Optional[int] = None  # Gumbel noise seed when temperature > 0

    def validate(self) -> Optional[str]:
        """A message naming the bad field, or None; per request, so one bad row never
        fails its neighbours."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            return f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}"
        if self.policy not in ("fixed", "threshold", "factor"):
            return f"policy must be 'fixed', 'threshold' or 'factor', got {self.policy!r}"
        if not 0.0 < float(self.threshold) <= 1.0:
            return f"threshold must be in (0, 1], got {self.threshold!r}"
        if not float(self.factor) > 0.0:
            return f"factor must be > 0, got {self.factor!r}"
        if not float(self.temperature) >= 0.0:
            return f"temperature must be >= 0, got {self.temperature!r}"
        return None


@dataclass
class EngineConfig:
    """How one engine batches and caches. `token_budget` bounds the padded batch
    area |A| * max_i(p_i + (b_i+1) L) of every forward; `max_batch_size` is B for
    the static baseline and a cap on active requests for blockserve."""

    block_length: int = 32
    steps_per_block: int = 32
    cache: CacheMode = "refresh"
    token_budget: int = 65536
    scheduler: SchedulerKind = "blockserve"
    max_batch_size: int = 256
    advance: AdvanceMode = "block"

    def __post_init__(self) -> None:
        if self.block_length < 1 or self.steps_per_block < 1:
            raise ValueError("block_length and steps_per_block must be >= 1")
        if self.cache not in ("none", "refresh", "persistent"):
            raise ValueError(f"cache must be 'none', 'refresh' or 'persistent', got {self.cache!r}")
        if self.scheduler not in ("blockserve", "static", "sequential"):
            raise ValueError(f"scheduler must be 'blockserve', 'static' or 'sequential', got {self.scheduler!r}")
        if self.advance not in ("block", "step"):
            raise ValueError(f"advance must be 'block' or 'step', got {self.advance!r}")
        if self.token_budget < self.block_length + 1:
            raise ValueError("token_budget must exceed block_length")
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
