"""The per-row features on the denoising step's path, as logits processors (vLLM keeps
them so): min_tokens, structured outputs, logprob recording. The step applies one list;
each processor declares the SamplingParams fields it reads (engine.reads: the engine's
refusals are derived from those declarations), finds its rows once per batch layout, and
wraps the step's proposal and selection like a context manager: `before` in list order
(it may change the logits the step proposes from), `after` in reverse (it may change the
step's selection and tokens, and undo what its `before` did). A batch in which no row asks
for a feature pays nothing for it. Also here, in one place: whether a row draws noise."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Tuple

from .noise import draws_noise  # noqa: F401 - the engine asks here
from .reads import LOGPROB_SAMPLING, MIN_TOKENS_SAMPLING, NOISE_SAMPLING, STRUCTURED_SAMPLING

if TYPE_CHECKING:
    import torch


@dataclass
class StepLogits:
    """What the processors see of one step: the batch (read only), the window's tokens [B,
    NB L] and masks, the logits [B, NB L, V] they may change, the rows not frozen, the
    engine's counted device read; `kept` holds what a processor carries from `before` to
    `after`."""

    batch: Any
    window: "torch.Tensor"
    is_mask: "torch.Tensor"
    logits: "torch.Tensor"
    live: Sequence[Tuple[Any, List[int]]]  # (decoding rule, its rows not frozen)
    fetch: Callable[["torch.Tensor"], "torch.Tensor"]
    conf: Optional["torch.Tensor"] = None  # the proposals' confidence [B NB, L], once proposed
    kept: Dict[str, Any] = field(default_factory=dict)


class LogitsProcessor:
    name = ""
    reads: FrozenSet[str] = frozenset()

    def rows(self, b: Any) -> List[int]:
        """The batch's rows that ask for this feature (found once per layout)."""
        return []

    def before(self, s: StepLogits, rows: List[int]) -> None:
        """Before the step proposes; `rows`: the live rows that ask."""

    def after(self, s: StepLogits, rows: List[int], sel: "torch.Tensor", x0: "torch.Tensor"
              ) -> Tuple["torch.Tensor", "torch.Tensor"]:
        """Once the step chose `sel` [B NB, L] and its tokens `x0`: the selection and tokens to write."""
        return sel, x0


class MinTokens(LogitsProcessor):
    """The row's stop ids get -inf logits at answer positions before min_tokens
    (engine.logprobs.mask_stop_ids), put back once the step chose (its logprobs are the
    model's own)."""

    name, reads = "min_tokens", MIN_TOKENS_SAMPLING

    def rows(self, b: Any) -> List[int]:
        return [i for i, r in enumerate(b.rows) if r.params.min_tokens]

    def before(self, s: StepLogits, rows: List[int]) -> None:
        from .logprobs import mask_stop_ids

        s.kept[self.name] = mask_stop_ids(s.batch, rows, s.logits)

    def after(self, s, rows, sel, x0):
        restore = s.kept.get(self.name)
        if restore is not None:
            restore()
        return sel, x0


class Structured(LogitsProcessor):
    """Structured outputs (engine.structured): only allowed tokens are proposed, and the
    step's commits of a constrained row are jointly completable."""

    name, reads = "structured_outputs", STRUCTURED_SAMPLING

    def __init__(self, outputs: Any):
        self.outputs = outputs  # engine.structured.guide.StructuredOutputs

    def rows(self, b: Any) -> List[int]:
        return [i for i, r in enumerate(b.rows) if r.params.structured_outputs is not None]

    def before(self, s: StepLogits, rows: List[int]) -> None:
        guide = self.outputs.guide(s.batch, s.window, s.is_mask)
        if guide is not None:
            guide.mask_logits(s.logits)
        s.kept[self.name] = guide

    def after(self, s, rows, sel, x0):
        guide = s.kept.get(self.name)
        if guide is None:
            return sel, x0
        B, shape = s.window.shape[0], sel.shape
        sel, x0 = guide.settle(sel.reshape(B, -1), x0.reshape(B, -1), s.conf.reshape(B, -1), s.logits)
        return sel.reshape(shape), x0.reshape(shape)


class Logprobs(LogitsProcessor):
    """The log-probability (and top N) of every token the step writes (engine.logprobs.record)."""

    name, reads = "logprobs", LOGPROB_SAMPLING

    def rows(self, b: Any) -> List[int]:
        return [i for i, r in enumerate(b.rows) if r.params.logprobs is not None]

    def after(self, s, rows, sel, x0):
        from .logprobs import record

        record(s.batch, rows, sel, x0, s.logits, s.fetch)
        return sel, x0


def default_processors(structured: Any) -> List[LogitsProcessor]:
    """The masked-diffusion engine's list: logprobs outermost (it records what the others
    settled), min_tokens' mask put back before it, the structured-outputs guide innermost."""
    return [Logprobs(), MinTokens(), Structured(structured)]


def reads_of(processors: Sequence[LogitsProcessor]) -> FrozenSet[str]:
    return frozenset(NOISE_SAMPLING).union(*(p.reads for p in processors))


class Processing:
    """The step's processors over one batch layout: the rows each asks for, found once."""

    def __init__(self, processors: Sequence[LogitsProcessor], b: Any):
        self.active = [(p, p.rows(b)) for p in processors]
        self.active = [(p, rows) for p, rows in self.active if rows]

    def before(self, s: StepLogits) -> None:
        live = {i for _, rows in s.live for i in rows}
        self.live = [(p, [i for i in rows if i in live]) for p, rows in self.active]
        for p, rows in self.live:
            p.before(s, rows)

    def after(self, s: StepLogits, sel: "torch.Tensor", x0: "torch.Tensor") -> Tuple["torch.Tensor", "torch.Tensor"]:
        for p, rows in reversed(self.live):
            sel, x0 = p.after(s, rows, sel, x0)
        return sel, x0
