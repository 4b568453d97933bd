"""A request's lifetime state (Request), how a prompt becomes one (tokenize), and what
the engine hands back (RequestOutput, FinishReason)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from .config import SamplingParams

Prompt = Union[str, Sequence[int]]


class FinishReason(enum.StrEnum):
    """Why a request ended: a stop token or string (`stop`), its token budget or its last
    block (`length`), or a message saying why it could not run (`error`)."""

    STOP = "stop"
    LENGTH = "length"
    ERROR = "error"


@dataclass
class RequestOutput:
    request_id: Any
    prompt_token_ids: List[int]
    token_ids: List[int]
    finish_reason: FinishReason
    text: Optional[str] = None
    error: Optional[str] = None
    num_blocks: int = 0
    num_steps: int = 0
    latency_s: float = 0.0
    prompt_tokens_forwarded: int = 0  # how often the prompt was computed (cache accounting)
    # SamplingParams.logprobs (engine.logprobs): per token of token_ids, its log-probability at
    # the step that wrote it, and (logprobs > 0) the most likely (token id, logprob) there
    logprobs: Optional[List[float]] = None
    top_logprobs: Optional[List[List[Tuple[int, float]]]] = None


@dataclass(eq=False)
class Request:
    """One request's state over its life. Identity semantics (eq=False): the engine keys
    sets and dicts on the request itself. What its row looks like (its width, its masked
    suffix) depends on engine-wide settings: RowShape answers that."""

    request_id: Any
    prompt: List[int]
    params: SamplingParams
    stop_ids: List[int]
    arrival: float = field(default_factory=time.perf_counter)
    generated: List[int] = field(default_factory=list)  # committed blocks
    num_steps: int = 0
    seq: int = 0  # admission order, for LIFO preemption
    error: Optional[str] = None
    noise_seed: Optional[int] = None  # seed of its noise: temperature > 0, random remasking, origin
    prompt_forwarded: int = 0  # prompt tokens forwarded over the request's life (cache accounting)
    rule: Any = None  # its decoding rule (engine.rules): how its blocks are decoded and committed
    state: Any = None  # the rule's state of the row (D2F's blocks in flight, the editing state)
    constraint: Any = None  # its structured_outputs (engine.structured.guide.RowConstraint)
    # blocks at absolute positions (BlockLayout.ABSOLUTE, engine.rules.split_prompt): the
    # prompt's tail after its last whole block, which opens the first decoded block;
    # `prompt` is then the whole blocks only
    lead: List[int] = field(default_factory=list)
    # answer position -> (logprob, top logprobs) of its last write (SamplingParams.logprobs)
    token_logprobs: Dict[int, Tuple[float, Optional[List[Tuple[int, float]]]]] = field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def output_ids(self) -> List[int]:
        """The generated tokens (the committed blocks without the prompt's tail, `lead`)."""
        return self.generated[len(self.lead):] if self.lead else self.generated

    @property
    def n_active(self) -> int:
        """Blocks in flight: 1, or as its rule says (D2F)."""
        return self.rule.n_active(self)


@dataclass(frozen=True)
class RowShape:
    """The engine-wide settings that say what a request's row holds: blocks of
    `block_length`, and (`full_canvas`) every masked later block from admission."""

    block_length: int
    full_canvas: bool = False

    def blocks_needed(self, r: Request) -> int:
        return r.rule.blocks_needed(r, self.block_length)

    def block_index(self, r: Request) -> int:
        return len(r.generated) // self.block_length

    def final_width(self, r: Request) -> int:
        return r.prompt_len + self.blocks_needed(r) * self.block_length

    def width(self, r: Request) -> int:
        """Columns the row occupies: prompt + committed + current block (a D2F row: every
        block in flight), and under the full canvas the still-masked later blocks too
        (then fixed from admission)."""
        if self.full_canvas:
            return self.final_width(r)
        return r.prompt_len + len(r.generated) + r.n_active * self.block_length

    def tail(self, r: Request) -> int:
        """Columns after the current block (the masked suffix of the full canvas)."""
        return self.width(r) - r.prompt_len - len(r.generated) - r.n_active * self.block_length

    def block_tokens(self, r: Request, mask_id: int) -> List[int]:
        """The current block (and under the full canvas the masked suffix) as a row is
        (re)built: masks, after the prompt's tail (LLaDA2's `lead`) in the first block."""
        lead = [] if r.generated else r.lead
        return lead + [mask_id] * (self.block_length + self.tail(r) - len(lead))


def tokenize(prompt: Prompt, tokenizer) -> Tuple[Optional[List[int]], Optional[str]]:
    """(token ids, None), or (None, the message naming why the prompt cannot be used)."""
    try:
        if isinstance(prompt, str):
            if tokenizer is None:
                return None, "prompt is text but the engine has no tokenizer; pass token ids"
            return list(tokenizer(prompt, add_special_tokens=False)["input_ids"]), None
        ids = [int(t) for t in prompt]
        if any(isinstance(t, bool) or t != int(t) for t in prompt):
            raise TypeError
        return ids, None
    except Exception as e:  # noqa: BLE001 - any tokenizer failure is a per-row error
        return None, f"prompt could not be tokenized: {type(e).__name__}: {e}"
