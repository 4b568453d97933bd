"""engine.batch.relayout's named steps, each on its own (issue 52, item 6): a layout of
the same rows is the old batch again; kept rows keep their bookkeeping, grown rows start
their next block; a stepwise rule's window holds its blocks' masks; a frozen row's masks
become pads."""
from __future__ import annotations

import torch

from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model
from engine.batch import keep_rows, relayout, scrub_frozen, window_masks


def _engine(**kw) -> Engine:
    model = build_model(ModelConfig.tiny("llada"), dtype=torch.float64, seed=0)
    eng = Engine(model, EngineConfig(block_length=4, steps_per_block=4, advance="step", **kw))
    for n, p in enumerate([[5, 6, 7], [8, 9, 10, 11, 12], [13]]):
        eng.add_request(p, SamplingParams(max_new_tokens=8 + n, policy="fixed"))
    eng.step()
    eng.step()
    return eng


def test_laying_out_the_same_rows_again_is_the_same_batch():
    eng = _engine()
    old = eng.batch
    b = relayout(old, old.rows, set(), layout=eng.layout, device=old.ids.device)
    assert torch.equal(b.ids, old.ids) and torch.equal(b.block_cols, old.block_cols)
    for name in ("lens", "tail", "step", "busy_steps", "prompt_fwd", "frozen", "masked", "cached"):
        assert torch.equal(getattr(b, name), getattr(old, name)), name
    assert b.row_params is old.row_params


def test_keep_rows_starts_a_grown_rows_next_block():
    eng = _engine()
    old = eng.batch
    grown = {old.rows[1]}
    book = keep_rows(old, old.rows, grown, eng.layout.shape, eng.layout.config.mode)
    assert book.kept.all() and book.grew.tolist() == [False, True, False]
    # the current block ends L columns later (block canvas: the row widens; full canvas: its masked suffix shrinks)
    assert (book.lens - book.tail).tolist() == [n + 4 * g for n, g in zip((old.lens - old.tail).tolist(), [0, 1, 0])]
    assert book.step.tolist() == [s * (1 - g) for s, g in zip(old.step.tolist(), [0, 1, 0])]
    assert book.masked[1].all()  # the new block: all masks
    new = keep_rows(None, old.rows, set(), eng.layout.shape, eng.layout.config.mode)
    assert not new.any_kept and new.step.tolist() == [0, 0, 0]


def test_window_masks_and_scrub_frozen():
    eng = _engine()
    rows = eng.batch.rows
    masked = torch.tensor([[True, False, True, False]] * 3)
    frozen = torch.tensor([False, True, False])
    w = window_masks(rows, masked, frozen, torch.ones(3, dtype=torch.long), eng.layout.shape, 95)
    assert torch.equal(w, masked)  # one block each, no stepwise rule
    ids = torch.tensor([[1, 95, 2, 95], [95, 3, 95, 4]])
    scrub_frozen(ids, torch.tensor([[1, 2, 3]] * 2), torch.tensor([0, 1]), mask_id=95, pad_id=0)
    assert ids.tolist() == [[1, 95, 2, 95], [95, 3, 0, 4]]
