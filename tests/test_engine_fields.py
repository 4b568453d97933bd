"""No setting silently ignored (issue 36, acceptance 6): every SamplingParams and
EngineConfig field, set to a value other than its default for a DiffusionGemma
checkpoint, either changes what the run returns or is refused with a message naming
it. The refusals come from what each engine declares it reads (engine.reads); the test
also holds the declaration to account: a field DiffusionGemma's engine reads must have
an effect, every other one must be refused."""
from __future__ import annotations

import asyncio
import dataclasses

import pyarrow as pa
import pytest
import torch

from actors.engine_actor import DLLMEngineActor
from actors.spec import EngineSpec
from engine import EngineConfig, SamplingParams
from engine.canvas import CanvasParams, CanvasServe, load_diffusion_gemma
from engine.checkpoint import Checkpoint
from engine.reads import CANVAS, MASKED
from tiny.diffusion_gemma import build

# A value other than the default for every field (a field added to either dataclass must
# be added here: the test fails until it is).
SAMPLING = {"max_new_tokens": 8, "policy": "fixed", "threshold": 0.5, "factor": 2.0, "temperature": 0.7,
            "stop_token_ids": [3], "seed": 123, "remasking": "random", "first_position": True, "top_p": 0.5,
            "top_k": 5, "stop": ["w1"], "n": 2, "block_add_threshold": 0.5, "decoded_token_threshold": 0.5,
            "edit_threshold": 0.5, "max_post_steps": 3, "sub_block_length": 4, "max_denoising_steps": 1,
            "entropy_bound": 5.0, "t_min": 0.0, "t_max": 3.0, "stability_threshold": 4, "confidence_threshold": 100.0,
            "alg_temp": 0.5, "min_tokens": 3, "ignore_eos": True, "include_stop_str_in_output": True, "logprobs": 2,
            "structured_outputs": {"regex": "[a-z]+"}, "multi_block": True, "entropy_threshold": 0.5,
            "decoding": "linear_spec", "draft_threshold": 0.5,
            "edit_ops": True, "edit_ops_variant": "sglang", "max_steps_per_block": 10}
ENGINE = {"block_length": 8, "steps_per_block": 8, "cache": "none", "token_budget": 40, "scheduler": "sequential",
          "max_batch_size": 1, "advance": "step", "canvas": "block", "forward_overhead_cells": 10.0,
          "compile_decode": True, "profile": True, "gpu_memory_utilization": 0.5, "enable_prefix_caching": False,
          "tensor_parallel_size": 2, "structured_max_states": 100, "structured_max_chars": 100,
          "structured_compile_timeout_s": 1.0}
BASE = SamplingParams(max_new_tokens=24, seed=7)
PROMPTS = [[2, 11, 12, 13], [2, 21, 22], [2] + list(range(5, 40))]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    return build(str(tmp_path_factory.mktemp("dgemma-fields")), layers=2)


def test_every_field_is_listed():
    assert set(SAMPLING) == {f.name for f in dataclasses.fields(SamplingParams)}
    assert set(ENGINE) == {f.name for f in dataclasses.fields(EngineConfig)}
    for name, value in {**SAMPLING, **ENGINE}.items():  # each value differs from the default
        default = getattr(SamplingParams() if name in SAMPLING else EngineConfig(), name)
        assert value != default, name


def test_every_sampling_field_has_an_effect_or_is_refused(ckpt):
    """One batch on the engine actor (which reads `n` and the seed itself): a baseline row,
    then one row per field with that field overridden."""
    actor = DLLMEngineActor(EngineSpec(ckpt, EngineConfig(max_batch_size=64), BASE, rank=0, enable_metrics=False,
                                       warmup=False))
    names = list(SAMPLING)
    table = pa.table({"prompt_token_ids": [PROMPTS[0]] * (1 + len(names)),
                      "sampling_params": [None] + [{n: SAMPLING[n]} for n in names],
                      "row": ["base"] + names})

    async def run():
        return [b async for b in actor(table)]

    (out,) = asyncio.run(run())
    actor.loop.shutdown()
    rows = out.to_pylist()
    by_row = {}
    for r in rows:
        by_row.setdefault(r["row"], []).append(
            (r["generated_token_ids"], r["finish_reason"], r["num_steps"], r["error"]))
    base = by_row.pop("base")
    assert base[0][3] is None and len(base) == 1
    reads = CANVAS.sampling | {"n"}  # n: the actor expands a row into n requests
    for name, got in by_row.items():
        refused = got[0][1] == "error" and name in (got[0][3] or "")
        effect = got != base and not refused
        assert refused or effect, (name, got, base)
        assert refused == (name not in reads), (name, got[0][3])


def test_every_engine_field_has_an_effect_or_is_refused(ckpt):
    """CanvasServe built with each EngineConfig field set (the actor builds it the same
    way), on three requests of which one is long; and the job's preflight refusal."""
    from pipeline.checkpoint_check import CheckpointRefused, check_settings

    model = load_diffusion_gemma(ckpt, torch.float32)
    defaults = CanvasParams.from_generation_config(ckpt)

    def serve(cfg: EngineConfig):
        eng = CanvasServe(model, defaults, cfg)
        outs = eng.generate(PROMPTS, BASE)
        # a prefix cache changes no token (tests/test_diffusion_gemma_prefix.py): its effect is what it holds
        return ([(o.token_ids, o.finish_reason, o.error) for o in outs], eng.canvas.decoder_forwards,
                eng.stats.prefix_cached_blocks)

    base = serve(EngineConfig())
    checkpoint = Checkpoint.open(ckpt)
    for name, value in ENGINE.items():
        cfg = EngineConfig(**{name: value})
        if name == "tensor_parallel_size":  # read: it must match the model's shards (a model loaded whole here)
            with pytest.raises(ValueError, match="tensor_parallel_size=2, but the model was loaded whole"):
                serve(cfg)
            assert name in CANVAS.engine  # its effect, tokens of N ranks: tests/test_tensor_parallel.py
            continue
        try:
            got = serve(cfg)
        except ValueError as e:
            assert name in str(e) and name not in CANVAS.engine, (name, e)
            with pytest.raises(CheckpointRefused, match=name):
                check_settings(checkpoint, SamplingParams(), cfg)
            continue
        assert name in CANVAS.engine and got != base, (name, got, base)


def test_the_masked_engine_refuses_diffusion_gemmas_knobs(tiny_model_dir):
    """The other way round: DiffusionGemma's knobs on a masked-diffusion model are refused
    per row, naming them (they were silently ignored)."""
    from engine import Engine, load_model

    model, _ = load_model(tiny_model_dir, dtype=torch.float32, tokenizer=False)
    eng = Engine(model, EngineConfig(block_length=4, steps_per_block=4, token_budget=256))
    # entropy_bound: read by the masked engine's policy entropy_bound only
    for name in sorted(CANVAS.sampling - MASKED.sampling) + ["entropy_bound"]:
        out = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, **{name: SAMPLING[name]}))[0]
        assert out.finish_reason == "error" and name in out.error, (name, out.error)
    out = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, max_post_steps=3))[0]
    assert out.finish_reason == "error" and "max_post_steps" in out.error and "edit_threshold" in out.error
