"""What a decoding rule (engine.rules) sees of a denoising step, and what it hands back:
the rules read a narrow view, never the batch, and return decisions that the engine
applies to the batch. Torch-free at import (the preflight imports the rules)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class StepView:
    """The batch's rows and their host bookkeeping at one point of a step ([B] each, [B, NB
    L] for `masked`: host values, read only), their parameters by name (`params`: per row,
    engine.decoding.RowParams; `unit_params`: per decoding unit, B x NB), and during `select`
    the step's device tensors ([B NB, L] units: conf, is_mask, x0; [B, NB L]: window; the
    logits). Built by the engine from its batch (StepView.of)."""

    rows: Sequence[Any]  # the rows' Requests (a rule keeps its per-row state on them: Request.state)
    block_length: int
    n_window: int  # NB: the most blocks any row has in flight
    step: "torch.Tensor"  # steps spent on each row's current block
    masked: "torch.Tensor"  # which window positions still hold the mask
    busy_steps: "torch.Tensor"  # steps of the current block in which the row still had masks
    prompt_fwd: "torch.Tensor"  # prompt tokens forwarded so far
    params: Any
    unit_params: Any
    conf: Optional["torch.Tensor"] = None
    is_mask: Optional["torch.Tensor"] = None
    x0: Optional["torch.Tensor"] = None
    window: Optional["torch.Tensor"] = None
    logits: Optional["torch.Tensor"] = None

    @classmethod
    def of(cls, b: Any, **step: "torch.Tensor") -> "StepView":
        """The view of batch `b` (engine.batch.Batch), with the step's device tensors."""
        return cls(rows=b.rows, block_length=b.block_length, n_window=b.n_window, step=b.step, masked=b.masked,
                   busy_steps=b.busy_steps, prompt_fwd=b.prompt_fwd, params=b.row_params,
                   unit_params=b.unit_params, **step)

    def caps(self, steps: int) -> "torch.Tensor":
        """[B] host: the step after which each row's block is committed whatever it holds
        (its rule's cap, else its policy's)."""
        return self.params.caps(self.block_length, steps)


@dataclass(frozen=True)
class Verdict:
    """A rule's decision once a step's tokens are on the host: `done` [B] whose current
    block is complete; `busy` [B] steps to add to the rows' busy_steps (a step the request
    took although its block held no mask: LLaDA2.1's editing-only steps), or None."""

    done: "torch.Tensor"
    busy: Optional["torch.Tensor"] = None
