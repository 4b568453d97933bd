"""DiffusionGemma: every request served by the canvas engine (blockserve with joins and
leaves at any step, static, sequential) equals `torch.manual_seed(S);
model.generate(prompt alone, max_new_tokens=N)` of transformers' own model, token for
token, in float64; float32 agrees on >= 23/24."""
from __future__ import annotations

import random

import pytest
import torch

from engine.canvas import CanvasEngine, CanvasParams, load_diffusion_gemma

from tiny.diffusion_gemma import IMAGE, build

N_PROMPTS = 24


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    torch.set_num_threads(1)
    # two layers still hold one sliding and one global layer, MoE and the shared MLP
    return build(str(tmp_path_factory.mktemp("dgemma")), layers=2)


def _workload():
    rng = random.Random(0)
    prompts = [[2] + [rng.randrange(5, 59) for _ in range(rng.randrange(1, 20))] for _ in range(N_PROMPTS)]
    max_tokens = [rng.choice((8, 16, 24, 20)) for _ in range(N_PROMPTS)]
    seeds = [1000 + i for i in range(N_PROMPTS)]
    return prompts, max_tokens, seeds


def _reference(model, prompt, n, seed):
    torch.manual_seed(seed)
    seq = model.generate(torch.tensor([prompt]), max_new_tokens=n).sequences[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    cut = next((i + 1 for i, t in enumerate(seq) if t in eos), len(seq))
    return seq[:min(cut, n)]


def _serve(model, ckpt, scheduler, **kw):
    prompts, max_tokens, seeds = _workload()
    eng = CanvasEngine(model, CanvasParams.from_generation_config(ckpt), scheduler=scheduler, **kw)
    for i, (p, n, s) in enumerate(zip(prompts, max_tokens, seeds)):
        eng.add_request(i, p, n, s)
    while eng.has_unfinished():
        eng.step()
    outs = sorted(eng.outputs, key=lambda o: o.request_id)
    assert [o.request_id for o in outs] == list(range(N_PROMPTS))
    return outs, eng


@pytest.fixture(scope="module")
def f64(ckpt):
    """The float64 model and its 24 references, computed once for the module."""
    model = load_diffusion_gemma(ckpt, torch.float64)
    prompts, max_tokens, seeds = _workload()
    refs = [_reference(model, p, n, s) for p, n, s in zip(prompts, max_tokens, seeds)]
    return model, refs


@pytest.fixture(scope="module")
def sequential(ckpt, f64):
    """The float64 workload served one request at a time (outputs, engine), run once."""
    return _serve(f64[0], ckpt, "sequential")


@pytest.mark.parametrize("scheduler,kw", [("blockserve", dict(max_batch_size=8, token_budget=200)),
                                          ("blockserve", dict(max_batch_size=8, token_budget=60)),
                                          ("static", dict(max_batch_size=8)), ("sequential", {})],
                         ids=["blockserve", "blockserve-preempting", "static", "sequential"])
def test_float64_equals_transformers_generate(ckpt, f64, scheduler, kw, request):
    model, refs = f64
    outs, eng = request.getfixturevalue("sequential") if scheduler == "sequential" else \
        _serve(model, ckpt, scheduler, **kw)
    assert [o.error for o in outs] == [None] * N_PROMPTS
    assert [o.token_ids for o in outs] == refs
    reasons = {o.finish_reason for o in outs}
    assert reasons == {"stop", "length"}  # rows leave at EOS and at max_tokens
    assert len({o.num_steps for o in outs}) > 3  # canvases stop at different steps
    assert eng.row_forwards == sum(o.num_steps for o in outs)  # a finished canvas never rides along
    commits = sum(o.num_blocks - 1 for o in outs)  # a row's last canvas is never encoded
    prefills = N_PROMPTS + eng.preemptions  # a preempted row re-encodes prompt + canvases once
    if scheduler == "blockserve":  # joins at steps where others are mid-canvas, under the budget
        assert eng.decoder_forwards < eng.row_forwards
        assert eng.encoder_forwards < prefills + commits  # canvases finishing together commit in one forward
        if kw["token_budget"] == 60:  # admitted rows outgrew the budget: preempted, recomputed, still exact
            assert eng.preemptions > 3
    else:
        assert eng.preemptions == 0
        assert eng.encoder_forwards == prefills + commits if scheduler == "sequential" else \
            eng.encoder_forwards < prefills + commits
        prompts, _, _ = _workload()  # tokens forwarded: prompts, committed canvases, L per decoder row
        assert eng.cells == sum(map(len, prompts)) + eng.L * (commits + eng.row_forwards)


def test_float32_agrees(ckpt):
    model = load_diffusion_gemma(ckpt, torch.float32)
    prompts, max_tokens, seeds = _workload()
    refs = [_reference(model, p, n, s) for p, n, s in zip(prompts, max_tokens, seeds)]
    outs, _ = _serve(model, ckpt, "blockserve", max_batch_size=8, token_budget=200)
    assert sum(o.token_ids == r for o, r in zip(outs, refs)) >= N_PROMPTS - 1


def test_bad_rows_get_their_own_error(ckpt, f64):
    model, refs = f64
    prompts, max_tokens, seeds = _workload()
    eng = CanvasEngine(model, CanvasParams.from_generation_config(ckpt), max_batch_size=4)
    eng.add_request("img", [2, IMAGE, 7], 8, 0)
    eng.add_request("steps", [2, 7], 8, 0, {"max_denoising_steps": 0})
    eng.add_request("ok", prompts[0], max_tokens[0], seeds[0])
    while eng.has_unfinished():
        eng.step()
    by = {o.request_id: o for o in eng.outputs}
    assert "image" in by["img"].error and by["img"].finish_reason == "error"
    assert "max_denoising_steps" in by["steps"].error
    assert by["ok"].error is None and by["ok"].token_ids == refs[0]


def test_sampling_params_knobs_reach_the_loop(ckpt, f64):
    """SamplingParams' knobs (transformers' names) override generation_config.json per request."""
    from engine import SamplingParams

    model, _ = f64
    prompts, _, _ = _workload()
    sp = SamplingParams(max_denoising_steps=3, t_min=0.3, t_max=0.9, entropy_bound=0.2, confidence_threshold=0.9,
                        stability_threshold=1)
    knobs = dict(max_denoising_steps=3, t_min=0.3, t_max=0.9, confidence_threshold=0.9, stability_threshold=1)
    eng = CanvasEngine(model, CanvasParams.from_generation_config(ckpt), max_batch_size=2)
    eng.add_request(0, prompts[1], 16, 7, sp)
    eng.add_request(1, prompts[2], 16, 8)  # the checkpoint's defaults, in the same batch
    while eng.has_unfinished():
        eng.step()
    by = {o.request_id: o for o in eng.outputs}
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    torch.manual_seed(7)
    seq = model.generate(torch.tensor([prompts[1]]), max_new_tokens=16, sampler_config=EntropyBoundSamplerConfig(0.2),
                         **knobs).sequences[0, len(prompts[1]):].tolist()
    cut = next((i + 1 for i, t in enumerate(seq) if t == 1), len(seq))
    assert by[0].token_ids == seq[:min(cut, 16)]
    assert max(o.num_steps for o in [by[0]]) <= 3 * 2
    assert by[1].token_ids == _reference(model, prompts[2], 16, 8)
    assert SamplingParams(max_denoising_steps=0).validate().startswith("max_denoising_steps")


def test_sorter_cost_of_a_row_bounds_the_engines_work(ckpt, sequential):
    """The sorter charges a DiffusionGemma row as the canvas engine runs it: the prompt
    encoded once, K = ceil(g / L) canvases of at most max_denoising_steps decoder steps,
    every canvas but the last committed; the engine's own count never exceeds it."""
    import numpy as np
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import DiffusionGemmaGenerationConfig

    from engine import SamplingParams
    from engine.models.families.diffusion_gemma import DEFAULT_MAX_DENOISING_STEPS
    from pipeline.config import DLLMProcessorConfig
    from pipeline.sorting.order import cost_model

    assert DEFAULT_MAX_DENOISING_STEPS == DiffusionGemmaGenerationConfig._get_default_generation_params()[
        "max_denoising_steps"]
    cost = cost_model(DLLMProcessorConfig(model=ckpt))
    assert (cost.block_length, cost.steps_per_block, cost.cache, cost.full_canvas) == (8, 6, "persistent", False)
    assert cost_model(DLLMProcessorConfig(model=ckpt, sampling=SamplingParams(max_denoising_steps=3))
                      ).steps_per_block == 3
    prompts, max_tokens, _ = _workload()
    est = cost.estimate(np.array(list(map(len, prompts))), np.array(max_tokens))["cells"]
    outs, eng = sequential  # its engine's `cells` is the sum of these per-row counts (checked above)
    for p, n, o, cells in zip(prompts, max_tokens, outs, est):
        K = -(-n // 8)
        assert cells == len(p) + 8 * 6 * K + 8 * (K - 1)
        assert len(p) + 8 * o.num_steps + 8 * (o.num_blocks - 1) <= cells
    assert eng.cells <= est.sum()


def test_hand_written_denoiser_forward_equals_transformers(ckpt, f64):
    """bench/diffusion_gemma_backbone_bench.py's comparison: engine/canvas/denoiser.py
    computes transformers' decoder forward, on a mid-run batch."""
    from bench.diffusion_gemma_backbone_bench import engine_batch, hand_forward, transformers_forward
    from engine.canvas.denoiser import Denoiser

    model, _ = f64
    args = engine_batch(model, ckpt, 3)
    with torch.no_grad():
        assert torch.equal(hand_forward(Denoiser(model), *args), transformers_forward(model, *args))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_denoiser_is_bit_equal_to_transformers_decoder_at_every_step(ckpt, f64, dtype):
    """At every step of a run served through transformers' own modules (joins mid-canvas,
    canvases stopping at different steps): the hand-written denoiser the engine's decoder
    steps run gives exactly the logits of transformers' decoder module + LM head + softcap,
    with self-conditioning on every row, on none, and on some (a row's canvas just started)."""
    from engine.canvas.denoiser import Denoiser, refusal

    model = f64[0] if dtype == torch.float64 else load_diffusion_gemma(ckpt, dtype)
    assert refusal(model) is None
    prompts, _, seeds = _workload()
    eng = CanvasEngine(model, CanvasParams.from_generation_config(ckpt), max_batch_size=3, hand_denoiser=False,
                       fuse_encoder=False)
    assert eng.denoiser is None
    for i in range(5):
        eng.add_request(i, prompts[i], 24, seeds[i])
    hand, seen = Denoiser(model), set()
    with torch.inference_mode():
        while eng.has_unfinished():
            inputs = eng.decoder_inputs()
            if inputs is not None:
                cache, masks, pos, canvas, _ = inputs
                sc, sc_mask = eng._self_conditioning()
                seen.add("none" if sc is None else "some" if sc_mask is not None else "all")
                h = model.model.decoder(decoder_input_ids=canvas, cache=cache, self_conditioning_logits=sc,
                                        self_conditioning_mask=sc_mask, decoder_attention_mask=masks,
                                        decoder_position_ids=pos).last_hidden_state
                ref = model.lm_head(h).to(torch.float32)
                ref = torch.tanh(ref / model.final_logit_softcapping) * model.final_logit_softcapping
                got = hand(canvas, [(x.keys, x.values) for x in cache.layers], masks, hand.rope(pos), sc, sc_mask)
                assert torch.equal(got, ref)
            eng.step()
    assert seen == {"none", "some", "all"}


def test_engine_paths_give_the_same_tokens(ckpt, f64):
    """Fused encoder work and the hand-written denoiser on or off: the same tokens (float64),
    the same decoder forwards; fused, encoder work makes no model call of its own."""
    model, refs = f64
    runs = {}
    for fuse in (True, False):
        for hand in (True, False):
            outs, eng = _serve(model, ckpt, "blockserve", max_batch_size=8, token_budget=200, fuse_encoder=fuse,
                               hand_denoiser=hand)
            assert (eng.denoiser is not None) == hand
            runs[fuse, hand] = ([o.token_ids for o in outs], eng.decoder_forwards, eng.encoder_forwards, eng.cells)
            assert eng.fused_forwards == (eng.encoder_forwards if fuse else 0)
    assert len(set(map(repr, runs.values()))) == 1
    assert runs[True, True][0] == refs


def test_denoiser_refuses_what_it_does_not_implement(ckpt):
    """A model this forward would not reproduce runs through transformers' modules."""
    from engine.canvas.denoiser import refusal

    model = load_diffusion_gemma(ckpt, torch.float32)
    model.config.text_config.hidden_activation = "gelu"
    assert "hidden_activation" in refusal(model)
    eng = CanvasEngine(model, CanvasParams.from_generation_config(ckpt))
    assert eng.denoiser is None


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_hand_written_steps_are_bit_equal_to_transformers_modules_in_lock_step(ckpt, f64, dtype):
    """Two engines over the same requests, one through the hand-written denoiser, one
    through transformers' modules (decoder steps and fused passes: joins mid-canvas,
    commits, rows without encoder work): after every step the same logits (their
    self-conditioning copy) and the same K/V written, bit for bit."""
    model = f64[0] if dtype == torch.float64 else load_diffusion_gemma(ckpt, dtype)
    prompts, _, seeds = _workload()
    engines = [CanvasEngine(model, CanvasParams.from_generation_config(ckpt), max_batch_size=3, hand_denoiser=h)
               for h in (True, False)]
    for eng in engines:
        for i in range(6):
            eng.add_request(i, prompts[i], 24, seeds[i])
    a, b = engines
    assert a.denoiser is not None and b.denoiser is None
    steps = 0
    while a.has_unfinished():
        a.step(), b.step()
        steps += 1
        assert (a.sc is None) == (b.sc is None) and (a.sc is None or torch.equal(a.sc, b.sc))
        for i in range(a.kv.n_layers):
            assert torch.equal(a.kv.keys[i], b.kv.keys[i]) and torch.equal(a.kv.values[i], b.kv.values[i])
    assert not b.has_unfinished() and a.fused_forwards == b.fused_forwards > 3
    assert sorted(map(repr, a.outputs)) == sorted(map(repr, b.outputs))
