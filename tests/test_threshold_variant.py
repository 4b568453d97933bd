"""A family's threshold semantics is a class or a parameter, never an edit of
engine/decoding.py (issue 52, acceptance 4): SDAR's block floor is written here twice,
once as a Selection class of this file's own and once as engine.selection.Threshold's
parameters, each given to a family registered by this file; an engine of either serves
SDAR's mixed batches (threshold, fixed and sequential rows) under every scheduler with
the published loop's tokens. A third class (at least the two most confident) shows a
variant the engine has never seen changing what a step commits."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams
from engine.models.families import register
from engine.models.families.sdar import SDAR
from engine.selection import Candidates, Selection, Threshold, fixed_schedule
from test_sdar import SHAPES, params, references, sdar_model, tiny_sdar


class BlockFloor(Selection):
    """SDAR's block_diffusion_generate: confidence strictly greater than the row's threshold,
    at least the fixed schedule's k of the step over steps_per_block steps."""

    name = "threshold"

    def choose(self, c: Candidates) -> torch.Tensor:
        k = fixed_schedule(c.step, c.block_length, c.steps)
        return (c.conf > c.params.dev.threshold[:, None]) | (c.rank < k[:, None])


class TopTwo(Selection):
    """Not a published rule: every position at or over the threshold, at least the two most
    confident."""

    name = "threshold"

    def choose(self, c: Candidates) -> torch.Tensor:
        return (c.conf >= c.params.dev.threshold[:, None]) | (c.rank < 2)


def _family(model_type: str, threshold) -> str:
    register(replace(SDAR, name=f"SDAR ({model_type})", model_type=model_type, aliases=(), threshold=threshold))
    return model_type


CLASS = _family("sdar_block_floor_class_test", BlockFloor())
PARAMETER = _family("sdar_block_floor_parameter_test", Threshold(floor=True))
TOP_TWO = _family("sdar_top_two_test", TopTwo())


@pytest.fixture(scope="module")
def published():
    """The published loop's tokens on SDAR's own (dense) model, block length 4."""
    return references(sdar_model(tiny_sdar(), seed=2), 4)[:3]


def _run(model_type: str, prompts, rows, scheduler: str, advance: str = "block"):
    model = sdar_model(tiny_sdar(model_type=model_type), seed=2)  # the same weights as SDAR's
    cfg = EngineConfig(block_length=4, steps_per_block=SHAPES[4], cache="persistent", scheduler=scheduler,
                       advance=advance, token_budget=84 if scheduler == "blockserve" else 4096, max_batch_size=6)
    eng = Engine(model, cfg, record_batches=True)
    return eng, eng.generate(prompts, [params(r) for r in rows])


@pytest.mark.parametrize("model_type", [CLASS, PARAMETER])
@pytest.mark.parametrize("scheduler,advance", [("blockserve", "block"), ("static", "block"), ("sequential", "block"),
                                               ("blockserve", "step")])
def test_a_threshold_variant_defined_here_serves_mixed_batches(published, model_type, scheduler, advance):
    prompts, rows, outs = published
    assert {r[0] for r in rows} >= {"low_confidence_dynamic", "low_confidence_static", "sequential"}  # mixed
    eng, got = _run(model_type, prompts, rows, scheduler, advance)
    if scheduler != "sequential":
        assert max(len(b.request_ids) for b in eng.batch_log) > 1
    assert [o.token_ids for o in got] == outs


def test_a_new_variant_changes_what_a_step_commits():
    """At least two a step: a threshold row of 4 tokens that no confidence passes takes 2 steps."""
    model = sdar_model(tiny_sdar(model_type=TOP_TWO), seed=2)
    eng = Engine(model, EngineConfig(block_length=4, steps_per_block=4, cache="none"))
    sp = [SamplingParams(max_new_tokens=4, policy="threshold", threshold=1.0, ignore_eos=True),
          SamplingParams(max_new_tokens=4, policy="fixed", ignore_eos=True)]
    got = eng.generate([[20, 21, 22, 23], [30, 31, 32, 33]], sp)
    assert [o.num_steps for o in got] == [2, 4]


def test_an_unknown_threshold_rule_is_refused():
    from engine.decoding import RowParams

    with pytest.raises(ValueError, match="unknown threshold rule"):
        RowParams.build([SamplingParams()], [None], "cpu", threshold="at_most_top1")
