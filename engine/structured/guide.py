"""Structured outputs in the engine's step: for the batch's constrained rows, which tokens
each masked position of the window may take so that the whole answer can still be
completed into a string of the row's language (additive infilling), and the step's
commits re-checked jointly.

The answer of a constrained row is a chain of positions: committed ones (their automaton
states are advanced once, as they commit: RowConstraint), the window's (fixed tokens,
masks, or positions outside the answer: the prompt's tail under absolute blocks, blocks
already committed, past max_new_tokens), and after it the still-masked rest of the answer
up to max_new_tokens (Automaton.free). Over the window, a forward pass gives the states
reachable at each position and a backward pass those from which the rest can still be
completed; a masked position may take token t exactly when some state reachable there and
co-reachable goes on t to a state co-reachable at the next position. For a regular
language that is exact: every allowed token extends to a full answer in the language, and
every answer in it stays allowed. All rows run in one pass over the window: the batch's
distinct automata are laid side by side (block-diagonal), so the state sets are [R, S]
tensors whatever each row's constraint."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .automaton import Automaton, Compiler, ConstraintRefused

SKIP, FIXED, MASKED = 0, 1, 2
NEXT_CELLS = 1 << 22  # next-state lookups done at once (Guide._next): int64 cells, 32 MiB


@dataclass
class RowConstraint:
    """A request's automaton and the states after its committed answer tokens."""

    automaton: Automaton
    states: List[int]
    consumed: int = 0  # answer tokens already advanced over

    def catch_up(self, req: Any) -> None:
        """Advance over the answer tokens committed since the last step."""
        n = min(len(req.generated) - len(req.lead), req.params.max_new_tokens)
        if n > self.consumed:
            out = req.generated[len(req.lead):]
            self.states = self.automaton.advance(self.states, out[self.consumed:n])
            self.consumed = n


class Layout:
    """The batch's distinct automata side by side: one state space of S states (the
    last, DEAD, never reachable), joint token classes, and their transitions, sparse:
    edges (e_src, e_cls -> e_dst) sorted by `keys` = e_src * C + e_cls, and the distinct
    state pairs some token moves between (p_src, p_dst)."""

    def __init__(self, automata: Sequence[Automaton], device: torch.device):
        distinct: Dict[int, Automaton] = {}
        for a in automata:
            distinct.setdefault(id(a), a)
        self.automata = list(distinct.values())
        self.offset: Dict[int, int] = {}
        o = 0
        for a in self.automata:
            self.offset[id(a)] = o
            o += a.n_states
        self.S, self.dead = o + 1, o
        V = max(len(a.cls) for a in self.automata)
        stacked = torch.stack([a.cls for a in self.automata])  # [n, V]
        joint, self.jcls = torch.unique(stacked, dim=1, return_inverse=True)  # joint [n, C]
        C = joint.shape[1]
        src, cls, dst, psrc, pdst = [], [], [], [], []
        for k, a in enumerate(self.automata):
            off = self.offset[id(a)]
            # each of the automaton's transitions on class c, once per joint class refining c
            order = torch.argsort(joint[k], stable=True)
            counts = torch.bincount(joint[k], minlength=a.n_classes)
            starts = torch.cumsum(counts, 0) - counts
            q, c = a.keys // a.n_classes, a.keys % a.n_classes
            rep = counts[c]
            within = torch.arange(int(rep.sum())) - torch.repeat_interleave(torch.cumsum(rep, 0) - rep, rep)
            src.append(q.repeat_interleave(rep) + off)
            cls.append(order[starts[c].repeat_interleave(rep) + within])
            dst.append(a.dst.repeat_interleave(rep) + off)
            psrc.append(a.pair_src + off), pdst.append(a.pair_dst + off)
        e_src, e_cls, e_dst = torch.cat(src), torch.cat(cls), torch.cat(dst)
        keys, order = torch.sort(e_src * C + e_cls)
        self.keys = keys.to(device)
        self.e_src, self.e_cls, self.e_dst = (x[order].to(device) for x in (e_src, e_cls, e_dst))
        self.p_src, self.p_dst = torch.cat(psrc).to(device), torch.cat(pdst).to(device)
        self.states = torch.arange(self.S, device=device)
        self.jcls = self.jcls.to(device)
        self.V, self.C, self.device = V, C, device
        self._free: Dict[int, torch.Tensor] = {}

    def free(self, k: int) -> torch.Tensor:
        """[S] bool: every automaton's Automaton.free(k), side by side."""
        if k not in self._free:
            parts = [a.free(k) for a in self.automata] + [torch.zeros(1, dtype=torch.bool)]
            self._free[k] = torch.cat(parts).to(self.device)
        return self._free[k]

    def next_states(self, cls: torch.Tensor) -> torch.Tensor:
        """[R, S] the next state of every state on each row's joint class `cls` [R] (DEAD
        where it has none): a lookup of state * C + class in the sorted keys."""
        want = self.states[None, :] * self.C + cls[:, None]
        if not len(self.keys):
            return torch.full_like(want, self.dead)
        at = torch.searchsorted(self.keys, want).clamp(max=len(self.keys) - 1)
        return torch.where(self.keys[at] == want, self.e_dst[at], self.dead)

    def step_any(self, f: torch.Tensor) -> torch.Tensor:
        """[R, S] bool: the states some token reaches from a state of `f` [R, S]."""
        return torch.zeros_like(f).index_add_(1, self.p_dst, f[:, self.p_src]) > 0

    def back_any(self, b: torch.Tensor) -> torch.Tensor:
        """[R, S] bool: the states from which some token reaches a state of `b` [R, S]."""
        return torch.zeros_like(b).index_add_(1, self.p_src, b[:, self.p_dst]) > 0

    def start(self, rc: RowConstraint) -> torch.Tensor:
        s = torch.zeros(self.S, dtype=torch.bool)
        s[[self.offset[id(rc.automaton)] + q for q in rc.states]] = True
        return s


class Guide:
    """One step's constrained rows: their chains over the window, the allowed tokens of
    each masked position, and the joint re-check of the step's commits."""

    def __init__(self, layout: Layout, rows: List[int], rcs: List[RowConstraint], tokens: torch.Tensor,
                 kind: torch.Tensor, rest: List[int]):
        self.layout, self.rows, self.rcs = layout, rows, rcs
        self.tokens, self.kind = tokens, kind  # [R, W] window tokens and position kinds (device)
        rr = [j for j, rc in enumerate(rcs) for _ in rc.states]
        ss = [layout.offset[id(rc.automaton)] + q for rc in rcs for q in rc.states]
        self.start = torch.zeros(len(rcs), layout.S)
        self.start[rr, ss] = 1.0
        self.start = self.start.to(layout.device)  # [R, S]
        self.end = torch.stack([layout.free(k) for k in rest])  # [R, S]

    def _next(self, tokens: torch.Tensor) -> List[torch.Tensor]:
        """Per window position p, [R, S] the next state of every state on each row's token
        tokens[:, p]: looked up for as many positions at once as keep the lookup within
        NEXT_CELLS cells."""
        lay = self.layout
        R, W = tokens.shape
        cls = lay.jcls[tokens.clamp(0, lay.V - 1)]  # [R, W]
        step = max(1, NEXT_CELLS // max(1, R * lay.S))
        out: List[torch.Tensor] = []
        for p in range(0, W, step):
            c = cls[:, p:p + step]
            out.extend(lay.next_states(c.reshape(-1)).reshape(R, c.shape[1], lay.S).unbind(1))
        return out

    def forward(self, moves: List[torch.Tensor], kind: torch.Tensor) -> List[torch.Tensor]:
        """F[p] [R, S] float: states reachable before position p (p = 0..W); `moves` from _next."""
        F = [self.start.float()]
        lay = self.layout
        for p in range(kind.shape[1]):
            f = F[-1]
            masked = lay.step_any(f)
            fixed = torch.zeros_like(f).scatter_add_(1, moves[p], f) > 0
            k = kind[:, p, None]
            step = torch.where(k == MASKED, masked, torch.where(k == FIXED, fixed, f > 0)).float()
            step[:, lay.dead] = 0
            F.append(step)
        return F

    def backward(self, moves: List[torch.Tensor], kind: torch.Tensor) -> List[torch.Tensor]:
        """B[p] [R, S] float: states before position p from which the rest is completable."""
        B = [self.end.float()]
        lay = self.layout
        for p in range(kind.shape[1] - 1, -1, -1):
            b = B[-1]
            masked = lay.back_any(b)
            fixed = b.gather(1, moves[p]) > 0
            k = kind[:, p, None]
            B.append(torch.where(k == MASKED, masked, torch.where(k == FIXED, fixed, b > 0)).float())
        return B[::-1]

    def allowed(self, tokens: Optional[torch.Tensor] = None, kind: Optional[torch.Tensor] = None,
                at: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[R, W, C] bool: the token classes each masked position may take (False elsewhere);
        with `at` [R] only position at[r] of each row: [R, C]."""
        tokens = self.tokens if tokens is None else tokens
        kind = self.kind if kind is None else kind
        R, W = kind.shape
        lay = self.layout
        moves = self._next(tokens)
        F, B = torch.stack(self.forward(moves, kind), 1), torch.stack(self.backward(moves, kind), 1)  # [R, W+1, S]
        if at is not None:
            ar = torch.arange(R, device=lay.device)
            live, nxt = F[ar, at] * B[ar, at], B[ar, at + 1]  # [R, S]
        else:
            live = (F[:, :-1] * B[:, :-1] * (kind == MASKED)[..., None]).reshape(R * W, -1)
            nxt = B[:, 1:].reshape(R * W, -1)
        # a class is allowed when one of its edges leaves a live state for a co-reachable one
        prod = live[:, lay.e_src] * nxt[:, lay.e_dst]  # [N, E]
        out = torch.zeros(prod.shape[0], lay.C, device=lay.device).index_add_(1, lay.e_cls, prod) > 0
        return out if at is not None else out.reshape(R, W, lay.C)

    def token_mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """[.., V] bool from [.., C]."""
        return allowed[..., self.layout.jcls]

    def completable(self, tokens: torch.Tensor, kind: torch.Tensor) -> torch.Tensor:
        """[R] bool: the chain can still reach an accepting end."""
        return ((self.forward(self._next(tokens), kind)[-1] * self.end.float()).sum(1)) > 0

    def mask_logits(self, logits: torch.Tensor) -> None:
        """-inf at the tokens a masked position of a constrained row may not take (in place,
        row by row: two vocabulary-sized passes over the constrained rows' window)."""
        R, W = self.kind.shape
        V = logits.shape[-1]
        refuse = ~self.allowed() & (self.kind == MASKED)[..., None]  # [R, W, C]
        refuse = torch.index_select(refuse.reshape(R * W, -1), 1, self.layout.jcls[:V]).reshape(R, W, -1)
        with torch.inference_mode():
            for j, i in enumerate(self.rows):
                logits[i, :, :refuse.shape[2]].masked_fill_(refuse[j], -torch.inf)
                if refuse.shape[2] < V:  # model ids past the tokenizer's: never allowed at a masked position
                    logits[i, :, refuse.shape[2]:].masked_fill_((self.kind[j] == MASKED)[:, None], -torch.inf)

    def settle(self, sel: torch.Tensor, x0: torch.Tensor, conf: torch.Tensor, logits: torch.Tensor
               ) -> Tuple[torch.Tensor, torch.Tensor]:
        """The step's selection `sel` and proposals `x0` ([B, W]) once every constrained
        row's commits are jointly completable: when committing all of a row's selected
        positions together could break it, they are committed one at a time in
        confidence order, each taking its proposal if still allowed, else its most likely
        allowed token."""
        idx = torch.tensor(self.rows, device=sel.device)
        s, x = sel[idx], x0[idx]
        many = s.sum(1) > 1
        if not bool(many.any()):
            return sel, x0
        kind = torch.where(s, FIXED, self.kind)
        tokens = torch.where(s, x, self.tokens)
        bad = (many & ~self.completable(tokens, kind)).nonzero().flatten()
        if not len(bad):
            return sel, x0
        # the rows whose joint commit would break: position by position in confidence order,
        # all such rows at once (one pass over the window per rank)
        sub = Guide.__new__(Guide)
        sub.layout, sub.rows = self.layout, [self.rows[j] for j in bad.tolist()]
        sub.start, sub.end = self.start[bad], self.end[bad]
        rows = idx[bad]
        tok, kd, sb = self.tokens[bad].clone(), self.kind[bad].clone(), s[bad]
        order = torch.where(sb, conf[rows], -torch.inf).argsort(dim=1, descending=True, stable=True)
        count = sb.sum(1)
        x0 = x0.clone()
        ar = torch.arange(len(bad), device=sel.device)
        jcls = self.layout.jcls
        V = min(logits.shape[-1], len(jcls))
        for j in range(int(count.max())):
            p = order[:, j]
            ok = sub.allowed(tok, kd, at=p)  # [Rb, C]
            t = x0[rows, p]
            keep = ok[ar, jcls[t.clamp(max=len(jcls) - 1)]] & (t < len(jcls))
            best = logits[rows, p, :V].masked_fill(~ok[:, jcls[:V]], -torch.inf).argmax(-1)
            t = torch.where(keep, t, best)
            on = j < count
            x0[rows[on], p[on]] = t[on]
            tok[ar[on], p[on]] = t[on]
            kd[ar[on], p[on]] = FIXED
        return sel, x0


class StructuredOutputs:
    """The engine's structured outputs: the compiler (one per engine), each admitted
    row's RowConstraint, and the step's Guide."""

    def __init__(self, vocab_size: int, device: torch.device, config: Any):
        self.compiler: Optional[Compiler] = None  # for the engine's tokenizer, given at the first constrained row
        self.vocab_size, self.device, self.config = vocab_size, device, config  # config: EngineConfig (its caps)
        self._layout: Optional[Tuple[Tuple[int, ...], Layout]] = None

    def admit(self, req: Any, constraint: Any, stop_ids: Sequence[int], tokenizer: Any) -> Optional[str]:
        """Compile the row's constraint over `tokenizer`'s vocabulary (the engine's: an
        actor gives it one once a row needs it); why it cannot be served, or None."""
        if tokenizer is None:
            return "structured_outputs need the model's tokenizer (this engine has none)"
        if self.compiler is None or self.compiler.tokenizer is not tokenizer:
            self.compiler = Compiler(tokenizer, self.vocab_size, self.config)
        try:
            a = self.compiler.get(constraint, stop_ids)
        except ConstraintRefused as e:  # over a cap, or refused by outlines-core: the row's error
            return f"structured_outputs {constraint.describe()}: {e}"
        n = req.params.max_new_tokens
        if not bool(a.free(n)[a.init]):
            return (f"structured_outputs {constraint.describe()}: no answer of the language fits in "
                    f"max_new_tokens={n} tokens" + ("" if stop_ids else " exactly (the row has no stop id)"))
        req.constraint = RowConstraint(a, [a.init])
        return None

    def layout(self, automata: List[Automaton]) -> Layout:
        key = tuple(sorted({id(a) for a in automata}))
        if self._layout is None or self._layout[0] != key:
            self._layout = (key, Layout(automata, self.device))
        return self._layout[1]

    def guide(self, b: Any, window: torch.Tensor, is_mask: torch.Tensor) -> Optional[Guide]:
        """The step's Guide for the batch's live constrained rows (None: there are none).
        `window` [B, W] the window's tokens, `is_mask` [B, W] its masked positions."""
        frozen = b.frozen.tolist()
        rows = [i for i, r in enumerate(b.rows) if getattr(r, "constraint", None) is not None and not frozen[i]]
        if not rows:
            return None
        from ..logprobs import answer_index

        W = window.shape[1]
        rcs, rest, firsts, bases, ends = [], [], [], [], []
        for i in rows:
            r = b.rows[i]
            rc = r.constraint
            rc.catch_up(r)
            rcs.append(rc)
            first, N = answer_index(b, i), r.params.max_new_tokens
            firsts.append(first), bases.append(max(0, len(r.generated) - len(r.lead))), ends.append(N)
            rest.append(max(0, N - (first + W)))
        pos = torch.tensor(firsts)[:, None] + torch.arange(W)[None]
        kinds = torch.where((pos >= torch.tensor(bases)[:, None]) & (pos < torch.tensor(ends)[:, None]), FIXED, SKIP)
        lay = self.layout([rc.automaton for rc in rcs])
        idx = torch.tensor(rows, device=window.device)
        kind = kinds.to(window.device)
        kind = torch.where((kind == FIXED) & is_mask[idx], MASKED, kind)
        return Guide(lay, rows, rcs, window[idx], kind, rest)
