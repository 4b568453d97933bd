"""LLaDA2.2's Levenshtein edit loop as a decoding rule (`SamplingParams.edit_ops`): mask
-> token (M2T) and token -> token (T2T) writes in one step, where a T2T write may be the
model's DELETE or SPLIT token, consumed left to right with the block kept at exactly
block_length.

HF's published loop (inclusionAI/LLaDA2.2-flash modeling_llada2_moe.py
`_joint_decode_block`, `_apply_edit_operations_with_tracking`) is not readable first-hand;
this follows its description in ../shared/checkpoints/REFERENCES.md ("LLaDA2.2-flash",
steps 1-5) and FLX-OSS/FluxServe dev-notes/llada2.2-model-support-development-guide.md
section 4, with SGLang's JointThresholdInDel for what they leave open. Per step of the
row's block (HF's variant):

1. post_steps: reset to 0 while an original mask (one the block started with, tracked
   through edits) remains, else counted up; the step is the block's final round when
   post_steps >= max_post_steps (max_post_steps 0: when this step's M2T resolves every
   original mask left) or at step max_steps_per_block - 1.
2. proposals: argmax of the logits and its softmax probability (float64); on the final
   round the mask, DELETE and SPLIT logits are -inf (it writes no control token).
3. M2T: every mask whose probability is strictly above `threshold`, unless fewer than
   schedule[step] + new_mask_count (the schedule spreads the block's initial masks over
   steps_per_block steps, LLaDA's get_num_transfer_tokens; new masks: those edits created),
   then that many most confident masks; past the schedule and on the final round every mask.
4. T2T: every decoded non-prompt position whose proposal differs, probability strictly
   above `edit_threshold` (None: 2.2's 0.0).
5. anti-loop: while the written block (before DELETE/SPLIT are consumed) was already seen
   in this block, up to 5 times, one changed position drawn at random (from the row's seed:
   `escape_key`, so batching never changes a row) takes its next best token (each token it
   was given this step at -inf); never on the final round.
6. DELETE drops the position, SPLIT becomes [mask, the token there before the step];
   the block is truncated or right-padded with (new) masks to block_length.
7. the block ends after its final round, or after a step that started with no mask and
   changed nothing; the engine commits it and its K/V are recomputed from the final tokens
   when the next block starts (engine.modes: a committed block is not cached yet).

SGLang's variant (`edit_ops_variant="sglang"`, JointThresholdInDel): the M2T floor is
1 + new_mask_count (no schedule), the post counter never resets, the final round comes
at post_steps >= max_post_steps or past block_length + max_post_steps steps, and the
anti-loop position is the lowest-confidence changed one (deterministic), once.

Each step reads the proposals of this rule's rows back to the host (one read for all of
them, plus one per escape or final-round recompute): the loop is per row on the host."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

from .layout import Layout
from .reads import INDEL_ROW
from .rules import NOISE_MASK, BlockRule
from .step_view import StepView, Verdict

if TYPE_CHECKING:
    import torch

ESCAPE_TRIES = 5  # HF's anti-loop retries
EDIT_THRESHOLD_DEFAULT = 0.0  # LLaDA2.2's editing_threshold


def escape_key(seed: int, before: int, step: int, attempt: int) -> int:
    """The seed of an anti-loop draw: the row's seed, the tokens before its block, the step
    in the block and the try (ints only: the same in every process)."""
    return hash((seed, before, step, attempt, 22)) & NOISE_MASK


def schedule(n: int, steps: int) -> List[int]:
    """LLaDA's get_num_transfer_tokens: n masks spread over `steps` steps, the first n % steps one more."""
    base, rem = divmod(n, steps)
    return [base + (t < rem) for t in range(steps)]


def consume(tokens: List[int], before: List[int], orig: List[bool], n_prompt: int, mask_id: int,
            delete_id: int, split_id: int) -> Tuple[List[int], List[bool]]:
    """Step 6: the written block `tokens` with DELETE / SPLIT consumed left to right (SPLIT
    restores the token of `before`, the step's input), and the original-mask flags moved
    with their positions; exactly len(tokens) long."""
    L = len(tokens)
    out, flags = list(tokens[:n_prompt]), [False] * n_prompt
    for j in range(n_prompt, L):
        t = tokens[j]
        if t == delete_id:
            continue
        if t == split_id:
            out += [mask_id, before[j]]
            flags += [False, orig[j]]
        else:
            out.append(t)
            flags.append(orig[j])
    out, flags = out[:L], flags[:L]
    return out + [mask_id] * (L - len(out)), flags + [False] * (L - len(flags))


@dataclass
class IndelState:
    """One row's current block under the edit loop (host values)."""

    mask_id: int
    delete_id: int
    split_id: int
    steps: int  # steps_per_block: the M2T schedule's length
    tokens: List[int] = field(default_factory=list)  # the block now
    orig: List[bool] = field(default_factory=list)  # which positions hold an original mask's place
    n_prompt: int = 0  # prompt positions at the block's start (its first block: the prompt's tail)
    plan: List[int] = field(default_factory=list)  # M2T schedule of the initial masks
    step: int = 0
    post_steps: int = 0
    finished: bool = False
    had_mask: bool = True  # the step being taken started with masks (busy accounting)
    seen: Set[Tuple[int, ...]] = field(default_factory=set)
    counts: Dict[str, int] = field(default_factory=dict)  # what fired (tests read them)

    def count(self, what: str, n: int = 1) -> None:
        if n:
            self.counts[what] = self.counts.get(what, 0) + n


class IndelRule(BlockRule):
    name = "edit_ops"
    reads = INDEL_ROW

    def applies(self, params: Any) -> bool:
        return params.edit_ops is True

    def unsupported(self, req: Any, layout: Layout) -> Optional[str]:
        m = layout.model
        if getattr(m, "delete_token_id", None) is None or getattr(m, "split_token_id", None) is None:
            return (f"edit_ops (LLaDA2.2's Levenshtein edit loop) needs the checkpoint's DELETE and SPLIT tokens "
                    f"(config.json delete_token_id / split_token_id); this {m.model_type} model names none")
        if not layout.absolute or layout.shape.full_canvas:
            return "edit_ops is implemented for LLaDA2's block canvas (blocks at absolute positions)"
        p = req.params
        if p.edit_ops_variant == "sglang" and p.max_steps_per_block != type(p)().max_steps_per_block:
            return ("max_steps_per_block is HF's bound (edit_ops_variant 'hf'); SGLang's variant takes "
                    "block_length + max_post_steps + 1 steps: leave it at the default")
        return None

    def noise_keys(self, req: Any, seed: int, step: int) -> List[Optional[int]]:
        """None: propose draws nothing for its rows (greedy); the seed is the anti-loop's (escape_key)."""
        return [None]

    def step_cap(self, req: Any, block_length: int, steps: int) -> int:
        return self.max_steps(req.params, block_length)

    @staticmethod
    def max_steps(p: Any, block_length: int) -> int:
        if p.edit_ops_variant == "sglang":
            return block_length + p.max_post_steps + 1
        return p.max_steps_per_block

    def start(self, req: Any, layout: Layout) -> IndelState:
        m = layout.model
        return IndelState(m.mask_token_id, m.delete_token_id, m.split_token_id, layout.config.steps_per_block,
                          counts={})

    def fresh(self, r: Any, L: int) -> IndelState:
        """The row's state at its block's first step (the counts carried over)."""
        old = r.state
        n = 0 if r.generated else len(r.lead)
        return IndelState(old.mask_id, old.delete_id, old.split_id, old.steps,
                          list(r.lead[:n]) + [old.mask_id] * (L - n), [False] * n + [True] * (L - n), n,
                          schedule(L - n, old.steps), counts=old.counts)

    def select(self, view: StepView, rows: List[int], sel: torch.Tensor) -> torch.Tensor:
        """Its rows' blocks are written by `rewrite`: the policies' choice is dropped."""
        if not rows:
            return sel
        from .transfer import indices

        NB = view.n_window
        out = sel.clone()
        out[indices([i * NB + NB - 1 for i in rows], sel.device)] = False
        return out

    def rewrite(self, view: StepView, rows: List[int], window: torch.Tensor) -> torch.Tensor:
        """The step of the module docstring for each of its rows: their new blocks written
        into `window` [B, NB L] (device)."""
        import torch

        from .transfer import indices

        L, live, new = view.block_length, [], {}
        for i, st in zip(rows, view.step[rows].tolist()):
            r = view.rows[i]
            if st == 0:
                r.state = self.fresh(r, L)
            if not r.state.finished:
                live.append(i)
        if not live:
            return window
        dev = window.device
        logits = view.logits[indices(live, dev)][:, -L:]  # [n, L, V]
        x0, p = proposals(logits)
        x0, p = torch.stack([x0.to(p.dtype), p]).cpu().unbind(0)  # one read (token ids are exact in float64)
        x0 = x0.long()
        for k, i in enumerate(live):
            r = view.rows[i]
            new[i] = self.step(r, r.state, logits[k], x0[k], p[k], L)
        out = window.clone()
        at = indices(list(new), dev)
        out[at, -L:] = indices([new[i] for i in new], dev, window.dtype)
        return out

    def step(self, r: Any, st: IndelState, logits: torch.Tensor, x0: torch.Tensor, p: torch.Tensor,
             L: int) -> List[int]:
        """One step of row `r`'s block (state `st`): its new tokens."""
        mask_id, steps, prm = st.mask_id, st.steps, r.params
        sglang = prm.edit_ops_variant == "sglang"
        x = st.tokens
        n_prompt = st.n_prompt
        masked = [j >= n_prompt and t == mask_id for j, t in enumerate(x)]
        n_mask = sum(masked)
        n_orig = sum(mk and o for mk, o in zip(masked, st.orig))
        new_masks = n_mask - n_orig
        st.had_mask = n_mask > 0
        if n_orig > 0 and not sglang:
            st.post_steps = 0
        elif n_orig == 0:
            st.post_steps += 1
        mp = prm.max_post_steps
        final = st.step >= self.max_steps(prm, L) - 1 or (st.post_steps >= mp if mp > 0 else n_orig == 0)
        ethr = EDIT_THRESHOLD_DEFAULT if prm.edit_threshold is None else float(prm.edit_threshold)

        if final or (not sglang and st.step >= steps):  # the final round, or past the schedule: every mask
            take = masked
        else:
            take = m2t(masked, p, float(prm.threshold), (1 if sglang else st.plan[st.step]) + new_masks)
        if mp == 0 and not final and n_orig > 0 and all(t for t, mk, o in zip(take, masked, st.orig) if mk and o):
            final = True  # max_post_steps 0: the step that resolves the last original masks is the final round
        if final:
            x0, p = proposals(logits[None], banned=(mask_id, st.delete_id, st.split_id))
            x0, p = x0[0].cpu(), p[0].cpu()
            take = masked
        x0l = x0.tolist()
        edit = [j >= n_prompt and not masked[j] and x0l[j] != x[j] and float(p[j]) > ethr for j in range(L)]
        writes = [a or b for a, b in zip(take, edit)]
        st.count("m2t", sum(take))
        st.count("t2t", sum(edit))
        cand = [x0l[j] if writes[j] else x[j] for j in range(L)]
        if not final:
            cand = self.escape(r, st, logits, cand, x, writes, p, sglang)
        st.seen.add(tuple(cand))
        st.count("delete", sum(t == st.delete_id for j, t in enumerate(cand) if writes[j]))
        st.count("split", sum(t == st.split_id for j, t in enumerate(cand) if writes[j]))
        out, st.orig = consume(cand, x, st.orig, n_prompt, mask_id, st.delete_id, st.split_id)
        st.finished = final or (n_mask == 0 and out == x)
        if st.finished:
            st.count("final" if final else "stable")
        st.tokens = out
        st.step += 1
        return out

    def escape(self, r: Any, st: IndelState, logits: torch.Tensor, cand: List[int], x: List[int],
               writes: List[bool], p: torch.Tensor, sglang: bool) -> List[int]:
        """Step 5 (anti-loop): `cand` with changed positions resampled while it repeats."""
        import torch

        banned: Dict[int, List[int]] = {}
        for attempt in range(1 if sglang else ESCAPE_TRIES):
            if tuple(cand) not in st.seen:
                break
            changed = [j for j in range(len(x)) if writes[j] and cand[j] != x[j]]
            if not changed:
                break
            if sglang:
                j = min(changed, key=lambda c: (float(p[c]), c))
            else:
                g = torch.Generator().manual_seed(escape_key(r.noise_seed or 0, len(r.generated), st.step, attempt))
                j = changed[int(torch.randint(len(changed), (1,), generator=g))]
            banned.setdefault(j, []).append(cand[j])
            row = logits[j].clone()
            row[banned[j]] = -torch.inf
            cand = list(cand)
            cand[j] = int(row.argmax())
            st.count("escape")
        return cand

    def after_step(self, view: StepView, rows: List[int], blocks: torch.Tensor, done: torch.Tensor) -> Verdict:
        """Its rows' blocks end when the loop says (not when they hold no mask); a step that
        started with no mask is a step of the request too (busy)."""
        done, busy = done.clone(), view.busy_steps.new_zeros(done.shape)
        for i in rows:
            st = view.rows[i].state
            done[i] = st.finished
            if not st.had_mask:
                busy[i] = 1
        return Verdict(done, busy)


def m2t(masked: List[bool], p: torch.Tensor, threshold: float, need: int) -> List[bool]:
    """Step 3: the masks whose probability `p` [L] (host float64) is strictly above
    `threshold`, unless fewer than `need`; then the min(need, masks) most confident."""
    import torch

    high = [mk and float(p[j]) > threshold for j, mk in enumerate(masked)]
    if sum(high) >= need:
        return high
    conf = torch.where(torch.tensor(masked), p, torch.tensor(-torch.inf, dtype=p.dtype))
    out = [False] * len(masked)
    for j in torch.topk(conf, k=min(need, sum(masked))).indices.tolist():
        out[j] = True
    return out


def proposals(logits: torch.Tensor, banned: Tuple[int, ...] = ()) -> Tuple[torch.Tensor, torch.Tensor]:
    """[n, L] argmax of `logits` [n, L, V] (the `banned` ids at -inf) and its float64 softmax probability."""
    import torch

    lg = logits.to(torch.float64)
    if banned:
        lg = lg.clone()
        lg[..., list(banned)] = -torch.inf
    x0 = lg.argmax(-1)
    return x0, torch.softmax(lg, -1).gather(-1, x0[..., None]).squeeze(-1)


INDEL = IndelRule()
