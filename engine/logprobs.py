"""What vLLM's `logprobs` and `min_tokens` mean for a masked-diffusion row, per
denoising step (engine.engine calls these around the step's selection).

`logprobs`: a diffusion model does not write its answer left to right, so a token's
log-probability is not a left-to-right likelihood: it is log softmax(logits) of the
committed token, in float64 over the model's raw logits (after the family's logit
shift; before temperature, top-k/top-p and min_tokens' mask, like vLLM's raw logprobs),
at the position it was written, at the step that wrote it, given the partly masked
canvas the model saw then. A token written again later (LLaDA2.1's token editing, a
re-masked position decoded again) carries the log-probability of its last write.
`top_logprobs`: the N most likely tokens there and their log-probabilities (ties by
token id). A position committed without ever being chosen (a D2F block committed as it
stands with a mask left) has NaN and no alternatives.

`min_tokens`: the row's stop ids get -inf logits at the answer positions before
min_tokens, so no proposal there is a stop id (the stop strings' side is the engine's
stop-string check); per row, so a row's tokens never depend on its batch."""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Sequence, Tuple

import torch

from .batch import Batch
from .sequence import Request
from .transfer import indices, to_device

TopLogprobs = List[Tuple[int, float]]


def answer_index(b: Batch, i: int) -> int:
    """The answer position (index into the request's output ids) of window position 0 of
    row i: the row's blocks in flight are the last nact L positions of the window."""
    r = b.rows[i]
    return len(r.generated) - len(r.lead) - int(b.n_window - b.nact[i]) * b.block_length


def mask_stop_ids(b: Batch, rows: Sequence[int], logits: torch.Tensor) -> Optional[Callable[[], None]]:
    """Set the stop ids' logits [B, NB L, V] to -inf at answer positions < min_tokens of
    `rows` (in place); returns what puts the model's values back (None: nothing masked)."""
    n, vocab = logits.shape[1], logits.shape[2]
    idx: List[Tuple[int, int, int]] = []
    for i in rows:
        r = b.rows[i]
        first = answer_index(b, i)
        if r.params.min_tokens <= first:
            continue
        ids = [t for t in r.stop_ids if 0 <= t < vocab]
        # window positions whose answer index is in [0, min_tokens)
        idx += [(i, p, t) for p in range(max(0, -first), min(n, r.params.min_tokens - first)) for t in ids]
    if not idx:
        return None
    at = tuple(indices(list(zip(*idx)), logits.device))
    saved = logits[at].clone()
    with torch.inference_mode():  # the model's logits are inference tensors
        logits[at] = -torch.inf

    def restore() -> None:
        with torch.inference_mode():
            logits[at] = saved
    return restore


def record(b: Batch, rows: Sequence[int], sel: torch.Tensor, x0: torch.Tensor, logits: torch.Tensor,
           fetch: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """For `rows` (rows that ask for logprobs: Batch.logprob_rows), the log-probability (and the top N) of every
    token the step wrote (`sel` [B NB, L], `x0` its tokens) from the step's window logits
    [B, NB L, V], kept on the request by answer position (a later write replaces it);
    two device reads (`fetch`): the positions written, then their logprobs."""
    if not rows:
        return
    B, dev = len(b.rows), logits.device
    mine = to_device([torch.tensor(rows)], dev)[0]
    # [k, 2]: (index into rows, window position) of the positions written, found on the host
    # (a read, counted by `fetch`: a nonzero on the device would be an uncounted wait)
    where = fetch(sel.reshape(B, -1)[mine]).nonzero()
    row, pos = to_device([torch.tensor(rows)[where[:, 0]], where[:, 1]], dev)
    lp = torch.log_softmax(logits[row, pos].to(torch.float64), dim=-1)
    tok = x0.reshape(B, -1)[row, pos]
    top = max(int(b.rows[i].params.logprobs) for i in rows)
    cols = [tok[:, None].to(torch.float64), lp.gather(-1, tok[:, None])]
    if top:
        vals, ids = lp.sort(dim=-1, descending=True, stable=True)
        cols += [ids[:, :top].to(torch.float64), vals[:, :top]]
    host = fetch(torch.cat(cols, dim=1)).tolist()  # ids < 2**53: exact in float64
    for (k, p), (t, chosen, *rest) in zip(where.tolist(), host):
        i = rows[int(k)]
        r = b.rows[i]
        n = int(r.params.logprobs)
        alts = list(zip(map(int, rest[:top][:n]), rest[top:][:n])) if n else None
        r.token_logprobs[answer_index(b, i) + int(p)] = (chosen, alts)


def collect(req: Request, n_tokens: int) -> Tuple[Optional[List[float]], Optional[List[TopLogprobs]]]:
    """The request's first `n_tokens` output tokens' logprobs and top logprobs (None when
    it did not ask; top None when it asked for none)."""
    n = req.params.logprobs
    if n is None:
        return None, None
    got = [req.token_logprobs.get(k, (math.nan, [])) for k in range(n_tokens)]
    return [g[0] for g in got], ([g[1] for g in got] if n else None)
