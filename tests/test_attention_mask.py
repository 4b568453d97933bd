"""engine.batch.AttentionMask: a forward builds the mask of its own query columns only;
it must be exactly those rows of the whole [B, 1, W, W] mask, whose definition is spelt
out here (pad keys never attended; block-causal: the prompt sees the prompt, block j the
prompt, earlier blocks and itself; absolute blocks from position 0)."""
from __future__ import annotations

import torch

from engine.batch import AttentionMask


def whole(lens, prompt_len, W, L, block_causal, absolute):
    valid = torch.arange(W)[None] >= (W - lens)[:, None]
    if not block_causal:
        return valid[:, None, None, :]
    pos = [[max(0, c - (W - int(n))) for c in range(W)] for n in lens]
    seg = torch.tensor([[p // L if absolute else (0 if p < int(pl) else (p - int(pl)) // L + 1) for p in row]
                        for row, pl in zip(pos, prompt_len)])
    return (valid[:, None, :] & (seg[:, None, :] <= seg[:, :, None]))[:, None]


def test_query_rows_are_the_whole_masks_rows():
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        B, W, L = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 6), (4, 40), (1, 9)))
        lens = torch.randint(1, W + 1, (B,), generator=g)
        prompt_len = torch.minimum(torch.randint(0, W, (B,), generator=g), lens)
        cols = torch.randint(0, W, (B, int(torch.randint(1, W + 1, (1,), generator=g))), generator=g)
        pick = torch.randint(0, B, (B,), generator=g)
        for block_causal, absolute in ((False, False), (True, False), (True, True)):
            full = whole(lens, prompt_len, W, L, block_causal, absolute)
            m = AttentionMask.build(lens, prompt_len, W, L, block_causal, absolute)
            assert torch.equal(m.rows(), full)
            for rows, f in ((None, full), (pick, full[pick])):
                want = f if f.shape[2] == 1 else f.gather(2, cols[:, None, :, None].expand(-1, 1, -1, W))
                assert torch.equal(m.rows(cols, rows), want)
