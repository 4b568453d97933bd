"""d3LLM's multi-block decoding as a decoding rule (engine.rules): every block of the
answer is a block in flight from admission, and one step may commit masks in any of
the active ones.

The rules follow SGLang's `FullAttnMultiBlock` (sgl-project/sglang,
python/sglang/srt/dllm/algorithm/full_attn_multi_block.py, commit 26eb1bf9: d3LLM's
`_sample_multi_block` without cache), for one request:

1. the canvas is the prompt and all max_new_tokens masks, in blocks of block_length;
   every column is recomputed at every step under full bidirectional attention;
2. at each step, before selecting: block k (k >= 1) becomes active once block k - 1's
   decoded fraction (after the previous step) is >= block_add_threshold or it has no
   mask, and an active block becomes fully active once block k - 1's decoded fraction
   is >= decoded_token_threshold (both flags permanent; block 0 is both from the start;
   a block's flags read its predecessor's count, never its predecessor's flags);
3. the eligible positions are every mask up to the end of the last block that is
   active and either fully active or still holding masks;
4. an eligible mask is committed (to its argmax) when the entropy
   -sum p log(p + 1e-12) of its softmax is strictly below entropy_threshold. The engine
   reads it off the step's one softmax pass (engine.decoding.propose: a multi_block row's
   confidence is minus this entropy, kind MULTI_BLOCK_ENTROPY), in float64 as every
   confidence propose computes; SGLang's `.float()` computes it in float32 (the same values
   on float64 logits; on narrower ones they differ by float32 rounding);
5. the first fully active block still holding masks that committed none at this step
   commits its lowest-entropy mask (the first on ties), whatever other blocks did.

The engine's own bookkeeping: a leading block without masks is committed (its tokens
are final: the loop never rewrites a decoded token), so a stop token ends the row at
its block; and a request still holding masks after max_new_tokens + 1 steps (only a
model proposing the mask token itself gets there: SGLang's `max_nfe` for one request)
commits its blocks as they stand."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, List, Optional

from .layout import Layout
from .reads import MULTI_BLOCK_ROW
from .rules import InFlightRule
from .step_view import StepView

if TYPE_CHECKING:
    import torch

BLOCK_ADD_DEFAULT = 0.1  # FullAttnMultiBlock's block_add_threshold (SamplingParams.block_add_threshold None)
ENTROPY_EPS = 1e-12  # FullAttnMultiBlock: log(probs + 1e-12)


@dataclass
class Block:
    tokens: List[int]
    active: bool = False  # "added": its masks are eligible
    fully_active: bool = False  # may be forced to commit its lowest-entropy mask


@dataclass
class MultiBlockState:
    """One request's blocks not yet committed (host copies: a re-layout rebuilds the row
    from them), and the step at which each block became active and fully active."""

    block_add_threshold: float
    decoded_token_threshold: float
    entropy_threshold: float
    block_length: int
    mask_id: int
    blocks: List[Block]
    committed: int = 0  # leading blocks committed
    steps: int = 0  # forwards this request took part in (SGLang's nfe)
    activated: List[int] = field(default_factory=list)  # step at which each block became active
    fully_activated: List[int] = field(default_factory=list)  # ... and fully active

    @classmethod
    def fresh(cls, block_add: float, decoded: float, entropy: float, L: int, n_blocks: int,
              mask_id: int) -> "MultiBlockState":
        st = cls(block_add, decoded, entropy, L, mask_id, [Block([mask_id] * L) for _ in range(n_blocks)])
        st.activated, st.fully_activated = [-1] * n_blocks, [-1] * n_blocks
        st.blocks[0].active = st.blocks[0].fully_active = True
        st.activated[0] = st.fully_activated[0] = 0
        st.plan()
        return st

    @property
    def n_active(self) -> int:
        """Blocks in flight: every block not yet committed."""
        return len(self.blocks)

    @property
    def first_active(self) -> int:
        """Generated blocks before the first in flight: the committed ones."""
        return self.committed

    def tokens(self) -> List[int]:
        return [t for b in self.blocks for t in b.tokens]

    def masks(self, b: Block) -> int:
        return sum(t == self.mask_id for t in b.tokens)

    def plan(self) -> None:
        """Rule 2 for the next step: a block's flags from its predecessor's decoded fraction
        (a committed predecessor is fully decoded)."""
        for j, b in enumerate(self.blocks):
            prev = 1.0 if j == 0 else 1 - self.masks(self.blocks[j - 1]) / self.block_length
            if not b.active and (prev >= self.block_add_threshold or prev == 1.0):
                b.active = True
                self.activated[self.committed + j] = self.steps
            if b.active and not b.fully_active and prev >= self.decoded_token_threshold:
                b.fully_active = True
                self.fully_activated[self.committed + j] = self.steps

    def last_eligible(self) -> int:
        """Rule 3: the last block in flight whose masks are eligible (-1: none)."""
        return max((j for j, b in enumerate(self.blocks)
                    if b.active and (b.fully_active or self.mask_id in b.tokens)), default=-1)

    def force_unit(self) -> Optional[int]:
        """Rule 5: the first fully active block in flight that still holds masks."""
        return next((j for j, b in enumerate(self.blocks) if b.fully_active and self.mask_id in b.tokens), None)

    def observe(self, tokens: List[int], max_steps: int) -> List[int]:
        """Take the step's tokens of the blocks in flight; returns the tokens of the leading
        blocks it left without masks (all of them past `max_steps`), in order, and plans
        the next step."""
        L = self.block_length
        self.steps += 1
        for j, b in enumerate(self.blocks):
            b.tokens = list(tokens[j * L:(j + 1) * L])
        done: List[int] = []
        while self.blocks and (self.mask_id not in self.blocks[0].tokens or self.steps >= max_steps):
            done += self.blocks.pop(0).tokens
            self.committed += 1
        self.plan()
        return done


class MultiBlockRule(InFlightRule):
    """`SamplingParams.multi_block`: d3LLM's multi-block decoding (see the module
    docstring), on bidirectional models with blocks after the prompt, without a cache."""

    name = "multi_block"
    reads = MULTI_BLOCK_ROW

    def applies(self, params: Any) -> bool:
        return params.multi_block is True

    def unsupported(self, req: Any, layout: Layout) -> Optional[str]:
        m, L, why = layout.model, layout.shape.block_length, None
        if m.block_causal:
            why = ("decodes with full bidirectional attention over every block (SGLang's FullAttnMultiBlock); this "
                   "model is block-causal (config.json dllm_attention or its family)")
        elif layout.absolute:
            why = f"is implemented for blocks after the prompt; {layout.family.name} places its blocks at absolute positions"
        elif layout.config.cache != "none":
            why = (f"recomputes every column at every step (FullAttnMultiBlock without cache); cache "
                   f"{layout.config.cache!r} would reuse stale K/V: set cache 'none'")
        elif req.params.max_new_tokens % L:
            why = (f"decodes max_new_tokens masks in blocks of block_length: max_new_tokens="
                   f"{req.params.max_new_tokens} is not a multiple of block_length={L}")
        return f"multi_block (d3LLM decoding) {why}" if why else None

    def start(self, req: Any, layout: Layout) -> MultiBlockState:
        p, L = req.params, layout.shape.block_length
        add = BLOCK_ADD_DEFAULT if p.block_add_threshold is None else float(p.block_add_threshold)
        return MultiBlockState.fresh(add, float(p.decoded_token_threshold), float(p.entropy_threshold), L,
                                     self.blocks_needed(req, L), layout.model.mask_token_id)

    def select(self, view: StepView, rows: List[int], sel: torch.Tensor) -> torch.Tensor:
        """Its rows' blocks take rules 3-5: the eligible masks under the entropy threshold,
        and the forced block's lowest-entropy mask."""
        import torch  # here: the module is torch-free at import (the preflight reads `unsupported`)

        from .transfer import to_device

        NB, L = view.n_window, view.block_length
        U = len(view.rows) * NB
        mine = torch.zeros(U, dtype=torch.bool)
        eligible = torch.zeros(U, dtype=torch.bool)
        force = torch.zeros(U, dtype=torch.bool)
        thr = torch.zeros(U, dtype=torch.float64)
        for i in rows:
            st = view.rows[i].state
            base = (i + 1) * NB - st.n_active  # the row's first block in flight among its NB units
            mine[i * NB:(i + 1) * NB] = True
            eligible[base:base + st.last_eligible() + 1] = True
            f = st.force_unit()
            if f is not None:
                force[base + f] = True
            thr[i * NB:(i + 1) * NB] = st.entropy_threshold
        mine, eligible, force = to_device([mine, eligible, force], sel.device)
        (thr,) = to_device([thr], sel.device)
        need = view.is_mask & eligible[:, None]
        conf = getattr(view, "conf", None)  # propose's: minus the entropy at every masked position of these rows
        ent = entropies(view.logits.reshape(U, L, -1), need) if conf is None else \
            torch.where(need, -conf, torch.full_like(conf, torch.inf))
        over = (ent < thr[:, None].to(ent.dtype)) & need
        forced = force & ~over.any(1)
        first = torch.arange(L, device=sel.device)[None] == ent.argmin(1)[:, None]  # the first minimum
        out = over | (forced[:, None] & first & need)
        return torch.where(mine[:, None], out, sel)

    def commit(self, engine: Any, view: StepView, rows: List[int], blocks: torch.Tensor, done: torch.Tensor) -> None:
        """Every step: the blocks in flight take the step's tokens, leading blocks without
        masks are committed (the row may finish; the row's width stays p + K L)."""
        L = view.block_length
        for i in rows:
            r = view.rows[i]
            st = r.state
            before = st.n_active
            committed = st.observe(blocks[i, -before * L:].tolist(), r.params.max_new_tokens + 1)
            r.num_steps = st.steps
            r.prompt_forwarded = int(view.prompt_fwd[i])
            if committed:
                engine.commit(i, committed)
                engine.relayout()  # fewer blocks in flight (or a frozen row)


def entropies(logits: torch.Tensor, need: torch.Tensor) -> torch.Tensor:
    """[U, L] entropy -sum p log(p + 1e-12) of softmax(logits) at `need` (inf elsewhere), in
    float32 or the logits' dtype when wider (SGLang's `.float()`), a few positions at a time:
    for a view without propose's confidence (the rule's selection called by hand); the
    engine's step reads propose's (one softmax pass)."""
    import torch

    dtype = torch.promote_types(logits.dtype, torch.float32)
    out = torch.full(need.shape, torch.inf, dtype=dtype, device=logits.device)
    idx = need.nonzero(as_tuple=True)
    at = idx[0] * need.shape[1] + idx[1]
    flat = logits.reshape(-1, logits.shape[-1])
    chunk, vals = 256, []
    for s in range(0, at.shape[0], chunk):
        p = torch.softmax(flat.index_select(0, at[s:s + chunk]).to(dtype), dim=-1)
        vals.append(-torch.sum(p * torch.log(p + ENTROPY_EPS), dim=-1))
    if vals:
        out[idx] = torch.cat(vals)
    return out


MULTI_BLOCK = MultiBlockRule()
