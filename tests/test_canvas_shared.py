"""The admission and preemption rules the block engine and the canvas engine share
(engine.admission, issue 52 item 5): the rules themselves, that both engines call them,
and what they mean for the canvas engine (the newest admitted row is the one preempted;
a bad row is refused at intake, with the block engine's message for a bad prompt)."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

import engine.admission as admission
import engine.canvas.engine as canvas_engine
import engine.scheduler as scheduler
from engine import SamplingParams
from engine.admission import AdmissionOrder, fits, newest, preempt
from engine.canvas import CanvasEngine, CanvasParams, CanvasServe, load_diffusion_gemma

from tiny.diffusion_gemma import IMAGE, build


@dataclass(eq=False)
class _R:
    cost: int
    seq: int = 0


def _stamped(*costs):
    order, rows = AdmissionOrder(), [_R(c) for c in costs]
    for r in rows:
        order.stamp(r)
    return rows


def test_fits_evicts_until_the_need_fits_and_no_further():
    cache = [4, 4, 4]  # cached blocks' cells
    evicted = []

    def evict():
        if not cache:
            return False
        evicted.append(cache.pop())
        return True
    assert fits(10, 20, lambda: sum(cache), evict) and evicted == [4]  # 10 + 12 > 20: one block goes
    assert not fits(21, 20, lambda: sum(cache), evict) and cache == []  # never fits: everything went
    assert fits(20, 20, lambda: 0) and not fits(21, 20, lambda: 0)  # no cache: the plain test


def test_newest_is_the_latest_admitted_of_the_movable_rows():
    rows = _stamped(1, 1, 1, 1)
    assert newest(rows) is rows[3]
    assert newest(rows, lambda r: r is not rows[3]) is rows[2]
    assert newest(rows, lambda r: False) is rows[3]  # none movable: all are


def test_preempt_evicts_first_then_the_newest_rows_and_never_the_oldest():
    rows = _stamped(10, 10, 10, 10)
    active, cache = list(rows), [5]

    def evict():
        return bool(cache) and cache.pop() > 0
    left = preempt(active, lambda: sum(r.cost for r in active) + sum(cache) > 15, evict)
    assert cache == [] and left == [rows[3], rows[2], rows[1]] and active == [rows[0]]
    active = list(rows)
    assert preempt(active, lambda: True) == rows[:0:-1] and active == [rows[0]]  # the oldest stays, always


def test_both_engines_call_the_shared_rules():
    for mod in (scheduler, canvas_engine):
        assert mod.preempt is admission.preempt and mod.fits is admission.fits and \
            mod.AdmissionOrder is admission.AdmissionOrder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    torch.set_num_threads(1)
    ckpt = build(str(tmp_path_factory.mktemp("dgemma-shared")), layers=2)
    return ckpt, load_diffusion_gemma(ckpt, torch.float32)


def test_canvas_engine_preempts_the_newest_admitted_row(tiny):
    """Under a small budget the admitted rows outgrow it: each row sent back is the most
    recently admitted of the active ones, and the oldest is never sent back."""
    ckpt, model = tiny
    eng = CanvasEngine(model, CanvasParams.from_generation_config(ckpt), max_batch_size=8, token_budget=60)
    rng = random.Random(0)
    for i in range(12):
        eng.add_request(i, [2] + [rng.randrange(5, 59) for _ in range(rng.randrange(1, 20))], 16, 100 + i)
    seen = []
    save = eng._save

    def recording(row):
        seen.append((row.seq, [r.seq for r in eng.active]))  # at _save, the victims have left `active`
        save(row)
    eng._save = recording
    while eng.has_unfinished():
        eng.step()
    assert eng.preemptions > 0 and len(seen) == eng.preemptions
    assert all(all(seq > s for s in kept) and kept for seq, kept in seen)
    assert sorted(o.request_id for o in eng.outputs) == list(range(12))
    assert all(o.error is None for o in eng.outputs)


def test_canvas_serve_refuses_a_bad_row_at_intake(tiny):
    """The canvas engine's own checks run as EngineCore's `check`: the row never reaches its
    queue, and a bad prompt gets the block engine's message (engine.core.prompt_refusal)."""
    ckpt, model = tiny
    serve = CanvasServe(model, CanvasParams.from_generation_config(ckpt))
    serve.add_request([2, IMAGE, 7], SamplingParams(max_new_tokens=8, seed=1), "img")
    serve.add_request([2, 7], SamplingParams(max_new_tokens=10 ** 6, seed=1), "wide")
    outs = {o.request_id: o for o in serve.step()}
    assert not serve.canvas.waiting and not serve.canvas.active and not serve.has_unfinished()
    assert "image" in outs["img"].error and "token budget" in outs["wide"].error
    assert serve.stats.finished == {"error": 2}
    alone = CanvasEngine(model, CanvasParams.from_generation_config(ckpt))
    alone.add_request("oov", [2, model.config.text_config.vocab_size], 8, 0)
    assert "outside the vocabulary" in alone.outputs[0].error
