"""Decoding rules as objects: how a row's blocks are decoded and committed, one class per
variant behind one interface (as engine.modes does for cache modes, and SGLang's
dllm algorithms for its decoders). The engine calls every hook, for the rows of each
rule in its batch, at the same points of every step; it names no rule itself.

- `BlockRule`: one block at a time, the positions of a step chosen by the row's policy
  (engine.decoding), the block committed once it holds no mask (or its step cap).
- `EditingRule` (engine.editing): LLaDA2.1's token editing on top of it.
- `D2FRule` (engine.d2f): several blocks in flight, committed at any step.
- `MultiBlockRule` (engine.multi_block): d3LLM's multi-block decoding, every block in flight.
- `IndelRule` (engine.indel): LLaDA2.2's Levenshtein edit loop, whose steps delete and
  insert positions of the block (its `rewrite` replaces the block whole).

A row's rule comes from its SamplingParams (engine.decoders.rule_for: the first rule that
`applies`); what the model's family allows (its decoding layout) each rule checks in
`unsupported`."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, FrozenSet, List, Optional

from .layout import Layout
from .reads import MASKED_SAMPLING
from .step_view import StepView, Verdict

if TYPE_CHECKING:  # torch-free at import: the preflight checks a job's settings with these rules
    import torch

    from .sequence import Request, RowShape

NOISE_MASK = 2**62 - 1


class BlockRule:
    """One block at a time (LLaDA's generate(), Fast-dLLM, Dream's block decoding, LLaDA2's
    loop): the step's positions are chosen by engine.decoding.select, the block is
    committed when it holds no mask or reached its step cap, and the row grows by a block."""

    name = "block"
    reads: FrozenSet[str] = MASKED_SAMPLING
    stepwise = False  # commits at any step (the batch then advances by steps)
    floor_one = False  # the schedule floor's k is 1 (ThresholdRule.SCHEDULE_FLOOR)
    reads_all_proposals = False  # `select` reads x0 at decoded positions too (then every position is proposed)

    def applies(self, params: Any) -> bool:
        """Whether SamplingParams `params` ask for this rule."""
        return True

    def unsupported(self, req: "Request", layout: Layout) -> Optional[str]:
        """Why the engine cannot serve `req` with this rule, or None."""
        return None

    def start(self, req: "Request", layout: Layout) -> Any:
        """The row's state for this rule (Request.state), once its request is valid."""
        return None

    def blocks_needed(self, req: "Request", block_length: int) -> int:
        return -(-(len(req.lead) + req.params.max_new_tokens) // block_length)

    def n_active(self, req: "Request") -> int:
        """Blocks in flight."""
        return 1

    def in_flight(self, req: "Request", shape: "RowShape", mask_id: int) -> List[int]:
        """The tokens of the row's blocks in flight (and under the full canvas the masked
        suffix), as a row is (re)built."""
        return shape.block_tokens(req, mask_id)

    def step_cap(self, req: "Request", block_length: int, steps: int) -> Optional[int]:
        """Steps after which the row's block is committed whatever it holds; None: its
        policy's (engine.decoding.step_cap: S, or max(S, L) for threshold and factor)."""
        return None

    def noise_keys(self, req: "Request", seed: int, step: int) -> List[int]:
        """Per block in flight, the seed of its noise at this step: (seed, tokens before
        it, step in the block)."""
        return [hash((seed, len(req.generated), step)) & NOISE_MASK]

    def candidates(self, view: StepView, rows: List[int], is_mask: torch.Tensor) -> torch.Tensor:
        """The masked positions [B NB, L] the step's policy may choose among; this rule's
        `rows` may narrow theirs (a sub-block of the block). All of them by default."""
        return is_mask

    def select(self, view: StepView, rows: List[int], sel: torch.Tensor) -> torch.Tensor:
        """The step's selection [B NB, L] after the policies chose it; this rule's `rows`
        (not frozen) may change theirs. The view holds the step's conf, is_mask, x0, window
        and logits."""
        return sel

    def rewrite(self, view: StepView, rows: List[int], window: torch.Tensor) -> torch.Tensor:
        """The step's window [B, NB L] (device) once the selection is written; this rule's
        `rows` may replace their blocks (engine.indel: positions deleted and inserted). As
        it stands by default."""
        return window

    def after_step(self, view: StepView, rows: List[int], blocks: torch.Tensor, done: torch.Tensor) -> Verdict:
        """Given `done` [B] (whose current block is complete) once the step's tokens are on
        the host (`blocks`), this rule's verdict: a rule may keep a block open, and count
        more busy steps. The engine applies it to the batch."""
        return Verdict(done)

    def commit(self, engine: Any, view: StepView, rows: List[int], blocks: torch.Tensor, done: torch.Tensor) -> None:
        """Commit this rule's completed blocks (engine.commit), growing the rows that go on
        to their next block (engine.grow)."""
        L, finished, busy = view.block_length, done.tolist(), view.busy_steps.tolist()
        for i in rows:
            if finished[i]:
                r = view.rows[i]
                r.num_steps += busy[i]
                if not engine.commit(i, blocks[i, -L:].tolist()):
                    engine.grow(r)


class InFlightRule(BlockRule):
    """A rule with several blocks in flight at once, committed at any step (engine.d2f,
    engine.multi_block). Its per-request state (Request.state) holds them: `n_active`,
    `first_active` (generated blocks before the first in flight), `tokens()`, `steps`,
    `block_length`."""

    stepwise = True

    def n_active(self, req: "Request") -> int:
        return req.state.n_active

    def in_flight(self, req: "Request", shape: "RowShape", mask_id: int) -> List[int]:
        return req.state.tokens()

    def noise_keys(self, req: "Request", seed: int, step: int) -> List[int]:
        """Per block in flight: (seed, tokens before it, the request's step)."""
        st, L = req.state, req.state.block_length
        return [hash((seed, (st.first_active + j) * L, st.steps)) & NOISE_MASK for j in range(st.n_active)]


BLOCK = BlockRule()


def split_prompt(req: "Request", layout: Layout) -> None:
    """Under BlockLayout.ABSOLUTE (LLaDA2), move the prompt's tail after its last whole
    block into `req.lead`: it opens the first decoded block, and is never unmasked."""
    L = layout.shape.block_length
    r = len(req.prompt) % L
    if layout.absolute and r:
        req.prompt, req.lead = req.prompt[:-r], req.prompt[-r:]


def row_refusal(req: "Request", layout: Layout) -> Optional[str]:
    """Why a masked-diffusion engine with `layout` cannot serve `req` (its rule chosen),
    or None: the prompt placed as the family lays out blocks, the rule's checks, the row's
    width against the model's context and the token budget. The engine's own check
    (Engine.check), and the preflight's on the shortest row there is
    (engine.decoders.settings_refusal): settings every row would be refused for fail the
    job before it starts."""
    split_prompt(req, layout)
    if req.params.entropy_bound is not None and req.params.policy != "entropy_bound":
        return (f"entropy_bound is read by policy 'entropy_bound' only, and this row's policy is "
                f"{req.params.policy!r}: set policy 'entropy_bound' or leave entropy_bound unset")
    err = req.rule.unsupported(req, layout) or layout.family.row_refusal(req, layout)
    if err:
        return err
    shape, p = layout.shape, len(req.prompt + req.lead)
    width, blocks, L, context = shape.final_width(req), shape.blocks_needed(req), shape.block_length, \
        layout.model.max_seq_len
    if width > context:
        return f"prompt of {p} tokens + {blocks} blocks of {L} exceeds the model context of {context} tokens"
    if layout.config.token_budget is not None and width > layout.config.token_budget:  # None: not resolved yet
        return (f"request needs {width} tokens of batch budget alone (prompt {p} + {blocks} blocks of {L}), "
                f"more than token_budget={layout.config.token_budget}")
    return None
