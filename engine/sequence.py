"""A request's lifetime state (Request), how a prompt becomes one (tokenize, validate),
and what the engine hands back (RequestOutput)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple, Union

from .config import EngineConfig, SamplingParams
from .d2f import D2FState
from .models import ModelConfig

Prompt = Union[str, Sequence[int]]


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
    noise_seed: Optional[int] = None  # Gumbel seed when temperature > 0
    prompt_forwarded: int = 0  # prompt tokens forwarded over the request's life (cache accounting)
    d2f: Optional[D2FState] = None  # D2F rows: the blocks in flight (SamplingParams.block_add_threshold)
    # LLaDA2 (blocks at absolute positions, engine.llada2): the prompt's tail after its last
    # whole block, which opens the first decoded block; `prompt` is then the whole blocks only
    lead: List[int] = field(default_factory=list)
    edit: Any = None  # LLaDA2.1 token editing: the current block's editing state (engine.llada2)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def output_ids(self) -> List[int]:
        """The generated tokens (the committed blocks without the prompt's tail, `lead`)."""
        return self.generated[len(self.lead):] if self.lead else self.generated

    @property
    def n_active(self) -> int:
        """Blocks in flight: 1, or a D2F row's."""
        return self.d2f.n_active if self.d2f is not None else 1


@dataclass(frozen=True)
class RowShape:
    """The engine-wide settings that say what a request's row holds: blocks of
    `block_length`, and (`full_canvas`) every masked later block from admission."""

    block_length: int
    full_canvas: bool = False

    def blocks_needed(self, r: Request) -> int:
        if r.params.d2f:  # D2F's count: whole blocks only
            return r.params.max_new_tokens // self.block_length
        return math.ceil((len(r.lead) + r.params.max_new_tokens) / self.block_length)

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


def validate(req: Request, shape: RowShape, mcfg: ModelConfig, cfg: EngineConfig, has_tokenizer: bool
             ) -> Optional[str]:
    """What makes `req` impossible to serve on this engine, or None."""
    err = req.params.validate()
    if err:
        return err
    if req.params.stop and not has_tokenizer:
        return "stop strings need a tokenizer (the engine has none); use stop_token_ids"
    if not req.prompt:
        return "empty prompt"
    bad = [t for t in req.prompt if not 0 <= t < mcfg.vocab_size]
    if bad:
        return f"token id {bad[0]} outside the vocabulary [0, {mcfg.vocab_size})"
    if req.params.d2f:
        err = d2f_unsupported(req, shape, mcfg, cfg)
        if err:
            return err
    width, blocks = shape.final_width(req), shape.blocks_needed(req)
    if width > mcfg.max_seq_len:
        return (f"prompt of {req.prompt_len} tokens + {blocks} blocks of "
                f"{cfg.block_length} exceeds the model context of {mcfg.max_seq_len} tokens")
    if width > cfg.token_budget:
        return (f"request needs {width} tokens of batch budget alone "
                f"(prompt {req.prompt_len} + {blocks} blocks of {cfg.block_length}), "
                f"more than token_budget={cfg.token_budget}")
    return None


def d2f_unsupported(req: Request, shape: RowShape, mcfg: ModelConfig, cfg: EngineConfig) -> Optional[str]:
    """Why this engine cannot serve `req` with D2F decoding, or None."""
    why = None
    if not mcfg.block_causal:
        why = ("needs block-causal attention (its blocks are decoded against unfinished predecessors); this "
               "model is bidirectional (config.json dllm_attention)")
    elif mcfg.shift_logits:
        why = f"is implemented for unshifted logits (LLaDA); {mcfg.model_type} reads each position from the one before"
    elif shape.full_canvas:
        why = "needs the block canvas (EngineConfig.canvas 'block' or 'auto')"
    elif cfg.mode.caches_suffix:
        why = "forwards every block in flight; cache 'dual' forwards one: use none, refresh or persistent"
    elif req.params.max_new_tokens < shape.block_length:
        why = (f"decodes max_new_tokens // block_length whole blocks: max_new_tokens={req.params.max_new_tokens} "
               f"< block_length={shape.block_length}")
    return f"block_add_threshold (D2F decoding) {why}" if why else None
