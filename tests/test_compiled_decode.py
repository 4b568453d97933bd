"""The dual cache's block-only step through torch.compile (EngineConfig.compile_decode,
issue 28): on the CPU (inductor) it gives the tokens of the eager step, in float64. One
shape only (two requests of one length finishing together), so it compiles once."""
import torch

from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model


def test_compiled_block_step_gives_the_eager_tokens():
    model = build_model(ModelConfig.tiny("llada"), dtype=torch.float64, seed=0)
    prompts = [[5, 9, 13, 17, 21, 25], [30, 28, 26, 24, 22, 20]]
    sp = SamplingParams(max_new_tokens=8, policy="threshold", threshold=0.5, stop_token_ids=[])
    out = {}
    for compiled in (False, True):
        eng = Engine(model, EngineConfig(block_length=4, steps_per_block=4, cache="dual", canvas="full",
                                         advance="step", token_budget=200, compile_decode=compiled))
        out[compiled] = [o.token_ids for o in eng.generate(prompts, sp)]
        if compiled:
            assert eng.runner.compiled_forwards > 0
    assert out[True] == out[False] and all(len(t) == 8 for t in out[True])
