"""The step path's host work (issue 41): what is planned once per batch layout is not
planned again at every step (a block's later steps forward the same columns: their plan
and uploaded indices are reused), and the next forward prepared before the step's device
read (what runs while an accelerator computes) gives exactly the tokens of planning it
after, with the same one read per step."""
import random

import pytest
import torch

import engine.runner as runner_mod
from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model

torch.set_num_threads(1)
L = 4


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig.tiny("llada"), dtype=torch.float64, seed=0)


def requests(n=10, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 60) for _ in range(rng.randint(3, 40))] for _ in range(n)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 5) * L, policy="threshold", threshold=0.3,
                             stop_token_ids=[12], seed=i, temperature=0.5 if i % 3 == 0 else 0.0)
              for i in range(n)]
    return prompts, params


@pytest.mark.parametrize("advance", ["block", "step"])
def test_prepared_forward_same_tokens(model, advance):
    prompts, params = requests()
    cfg = EngineConfig(block_length=L, steps_per_block=L, cache="refresh", token_budget=200, advance=advance)
    got, hits = {}, {}
    for overlap in (False, True):
        eng = Engine(model, cfg)
        eng.overlap = overlap
        got[overlap] = [(o.token_ids, o.finish_reason, o.num_steps) for o in eng.generate(prompts, params)]
        assert eng.stats.syncs == eng.stats.steps  # still one device read per step
        hits[overlap] = eng.runner.prepared_hits  # whole-batch forwards that ran a plan made before them
        assert 0 < hits[overlap] < eng.stats.forwards
    assert got[True] == got[False]
    assert hits[True] >= hits[False]


def test_runs_planned_once_per_layout(model, monkeypatch):
    """key_runs (a Python loop over rows) runs once per (layout, row group), not per forward."""
    calls, pairs = [], set()
    key_runs, forward = runner_mod.key_runs, runner_mod.ModelRunner.forward

    def counting_key_runs(*a, **k):
        calls.append(1)
        return key_runs(*a, **k)

    def recording_forward(self, b, group=None, catch_up=False):
        pairs.add((id(b), None if group is None else tuple(group)))
        return forward(self, b, group, catch_up)

    monkeypatch.setattr(runner_mod, "key_runs", counting_key_runs)
    monkeypatch.setattr(runner_mod.ModelRunner, "forward", recording_forward)
    prompts, params = requests()
    eng = Engine(model, EngineConfig(block_length=L, steps_per_block=L, cache="refresh", token_budget=200))
    batches = []  # keep every batch alive, so that id() names one batch
    orig_form = eng._form_batch

    def keep():
        orig_form()
        batches.append(eng.batch)
    eng._form_batch = keep
    eng.generate(prompts, params)
    assert len(calls) == len(pairs) < eng.stats.forwards
