"""D2F (Discrete Diffusion Forcing) pipelined block decoding as a decoding rule
(engine.rules): a request keeps several blocks in flight, each denoised by the step's one
forward, and commits them at any step.

The rules follow D2F's `_generate_block_single` / `_update_block_completion_states`
(zhijie-group/Discrete-Diffusion-Forcing, D2F-eval/eval_llada.py), with the prompt as
block 0 (fully decoded) and K = max_new_tokens // L blocks at most. One step is:

1. add: if fewer than K blocks exist and no stop token was committed, and the last
   block's decoded fraction (after the previous step) is >= block_add_threshold, a
   block of L masks is appended (at most one per step);
2. complete flags: a block whose predecessor's decoded fraction is >=
   decoded_token_threshold is "complete" from then on (the flag is permanent);
3. one forward over every block not yet cached (the blocks committed by the previous
   step are written to the cache by this forward);
4. commit, per block in flight: the masked positions whose probability is strictly
   greater than `threshold` (D2F's skip_threshold); a complete block that has none
   takes its most confident one;
5. the longest run of leading blocks without masks is committed (D2F: a block leaves
   the active set once it has no masks and no block before it is active).

The host runs 4's bookkeeping and 5, then 1 and 2 for the next step, right after the
step's one device read (`D2FRule.commit`), so a row's width grows by L between two steps.
Two conventions are the engine's own: decoded fractions count the block's tokens that
are not the mask (D2F decrements a counter per commit: the same unless the model
proposes the mask token itself), and a block still holding masks after L steps in the
complete state (only a model proposing the mask token gets there) is committed as it
stands, where D2F loops until its 10,000-step safety stop."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, List, Optional, Sequence

from .layout import Layout
from .reads import D2F_SAMPLING, MASKED_SAMPLING
from .rules import InFlightRule
from .step_view import StepView

if TYPE_CHECKING:
    import torch


@dataclass
class D2FBlock:
    tokens: List[int]
    complete: bool = False  # D2F's is_complete: may force its most confident token
    forced_steps: int = 0  # steps spent in the complete state while holding masks


@dataclass
class D2FState:
    """One request's blocks in flight (host copies: relayout rebuilds a row from them,
    so a preempted D2F request resumes exactly where it was)."""

    block_add_threshold: float
    decoded_token_threshold: float
    block_length: int
    max_blocks: int  # K = max_new_tokens // L (D2F's count)
    mask_id: int
    stop_ids: Sequence[int]
    active: List[D2FBlock] = field(default_factory=list)
    n_blocks: int = 0  # blocks added so far (committed + in flight)
    stopped: bool = False  # a stop token was committed: no new blocks (D2F's eos_detected)
    steps: int = 0  # denoising steps this request took part in (its noise keys count them)

    def __post_init__(self) -> None:
        self.plan()  # step 1 adds block 1 (the prompt is fully decoded) and marks it complete

    @property
    def n_active(self) -> int:
        return len(self.active)

    @property
    def first_active(self) -> int:
        """Index (0-based, among the generated blocks) of the first block in flight."""
        return self.n_blocks - len(self.active)

    def tokens(self) -> List[int]:
        return [t for b in self.active for t in b.tokens]

    def decoded(self, b: D2FBlock) -> float:
        return sum(t != self.mask_id for t in b.tokens) / self.block_length

    def plan(self) -> bool:
        """Steps 1 and 2 of the next step; True when a block was added."""
        added = False
        if self.n_blocks < self.max_blocks and not self.stopped:
            last = self.decoded(self.active[-1]) if self.active else 1.0  # committed blocks / prompt: decoded
            if last >= self.block_add_threshold:
                self.active.append(D2FBlock([self.mask_id] * self.block_length))
                self.n_blocks += 1
                added = True
        for i, b in enumerate(self.active):
            pred = self.decoded(self.active[i - 1]) if i > 0 else 1.0
            if pred >= self.decoded_token_threshold:
                b.complete = True
        return added

    def observe(self, tokens: Sequence[int]) -> List[int]:
        """Take the step's tokens of the blocks in flight; returns the tokens of the
        blocks committed by it (step 5), in order."""
        L = self.block_length
        self.steps += 1
        for j, b in enumerate(self.active):
            if b.complete and self.mask_id in b.tokens:
                b.forced_steps += 1
            b.tokens = list(tokens[j * L:(j + 1) * L])
        stops = set(self.stop_ids)
        if any(t in stops for t in self.tokens()):
            self.stopped = True
        done: List[int] = []
        while self.active and (self.mask_id not in self.active[0].tokens or self.active[0].forced_steps >= L):
            done += self.active.pop(0).tokens
        return done


class D2FRule(InFlightRule):
    """`SamplingParams.block_add_threshold` set: D2F's pipelined blocks (see the module
    docstring), on block-causal, unshifted models with blocks after the prompt."""

    name = "d2f"
    reads = MASKED_SAMPLING | D2F_SAMPLING

    def applies(self, params: Any) -> bool:
        return params.block_add_threshold is not None

    def unsupported(self, req: Any, layout: Layout) -> Optional[str]:
        m, shape, why = layout.model, layout.shape, None
        if not m.block_causal:
            why = ("needs block-causal attention (its blocks are decoded against unfinished predecessors); this "
                   "model is bidirectional (config.json dllm_attention)")
        elif m.shift_logits:
            why = f"is implemented for unshifted logits (LLaDA); {m.model_type} reads each position from the one before"
        elif layout.absolute:
            why = f"is implemented for blocks after the prompt; {layout.family.name} places its blocks at absolute positions"
        elif shape.full_canvas:
            why = "needs the block canvas (EngineConfig.canvas 'block' or 'auto')"
        elif layout.config.mode.caches_suffix:
            why = "forwards every block in flight; cache 'dual' forwards one: use none, refresh or persistent"
        elif req.params.max_new_tokens < shape.block_length:
            why = (f"decodes max_new_tokens // block_length whole blocks: max_new_tokens={req.params.max_new_tokens} "
                   f"< block_length={shape.block_length}")
        return f"block_add_threshold (D2F decoding) {why}" if why else None

    def start(self, req: Any, layout: Layout) -> D2FState:
        p, L = req.params, layout.shape.block_length
        return D2FState(float(p.block_add_threshold), float(p.decoded_token_threshold), L, self.blocks_needed(req, L),
                        layout.model.mask_token_id, req.stop_ids)

    def blocks_needed(self, req: Any, block_length: int) -> int:
        return req.params.max_new_tokens // block_length  # D2F's count: whole blocks only

    def select(self, view: StepView, rows: List[int], sel: torch.Tensor) -> torch.Tensor:
        """Its rows' blocks take D2F's rule: over threshold, or a complete block's most
        confident position."""
        import torch  # here: the module is torch-free at import (the preflight reads `unsupported`)

        from .decoding import select_d2f
        from .transfer import to_device

        NB = view.n_window
        units = torch.zeros(len(view.rows) * NB, dtype=torch.bool)
        complete = torch.zeros(len(view.rows) * NB, dtype=torch.bool)
        for i in rows:
            blocks = view.rows[i].state.active
            units[i * NB:(i + 1) * NB] = True
            complete[(i + 1) * NB - len(blocks):(i + 1) * NB] = torch.tensor([blk.complete for blk in blocks])
        dev = sel.device
        complete, units = to_device([complete, units], dev)
        mine = select_d2f(view.conf, view.is_mask, view.unit_params, complete)
        return torch.where(units[:, None], mine, sel)

    def commit(self, engine: Any, view: StepView, rows: List[int], blocks: torch.Tensor, done: torch.Tensor) -> None:
        """Every step: the blocks in flight take the step's tokens, leading finished blocks
        are committed (the row may leave), the next step's block is added (the row grows
        by L) and complete flags set."""
        L = view.block_length
        for i in rows:
            r = view.rows[i]
            st = r.state
            before = st.n_active
            committed = st.observe(blocks[i, -before * L:].tolist())
            r.num_steps = st.steps
            r.prompt_forwarded = int(view.prompt_fwd[i])
            if committed and engine.commit(i, committed):
                engine.relayout()  # a frozen row's blocks stop being denoised
                continue
            if st.plan():
                engine.grow(r)
            if st.n_active != before:
                engine.relayout()


D2F = D2FRule()
