"""A request's lifetime state (Request) and what the engine hands back (RequestOutput)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional

from .config import SamplingParams


@dataclass
class RequestOutput:
    request_id: Any
    prompt_token_ids: List[int]
    token_ids: List[int]
    finish_reason: str  # "stop" | "length" | "error"
    text: Optional[str] = None
    error: Optional[str] = None
    num_blocks: int = 0
    num_steps: int = 0
    latency_s: float = 0.0
    prompt_tokens_forwarded: int = 0  # how often the prompt was computed (cache accounting)


@dataclass(eq=False)
class Request:
    """Identity semantics (eq=False): the engine keys sets and dicts on the request itself."""

    request_id: Any
    prompt: List[int]
    params: SamplingParams
    block_length: int
    stop_ids: List[int]
    arrival: float = field(default_factory=time.perf_counter)
    generated: List[int] = field(default_factory=list)  # committed blocks
    num_steps: int = 0
    seq: int = 0  # admission order, for LIFO preemption
    error: Optional[str] = None
    noise_seed: Optional[int] = None  # Gumbel seed when temperature > 0
    prompt_forwarded: int = 0  # prompt tokens forwarded over the request's life (cache accounting)
    full_canvas: bool = False  # the row holds all its blocks from admission (EngineConfig.canvas)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def block_index(self) -> int:
        return len(self.generated) // self.block_length

    @property
    def num_blocks_needed(self) -> int:
        return math.ceil(self.params.max_new_tokens / self.block_length)

    @property
    def width(self) -> int:
        """Columns the row occupies: prompt + committed + current block, and under the
        full canvas the still-masked later blocks too (then fixed from admission)."""
        return self.final_width if self.full_canvas else self.prompt_len + len(self.generated) + self.block_length

    @property
    def tail(self) -> int:
        """Columns after the current block (the masked suffix of the full canvas)."""
        return self.width - self.prompt_len - len(self.generated) - self.block_length

    @property
    def final_width(self) -> int:
        return self.prompt_len + self.num_blocks_needed * self.block_length
