"""Host waits per denoising step on a stand-in CUDA device (bench.counting.StandInCuda,
issue 51): every wait a GPU would make (a device -> host read, `.item()`/`.tolist()`, a
blocking upload, a data-dependent op) is counted where it is made. A denoising step waits
once, at its designed read (Engine._fetch: the window's tokens), and EngineStats.syncs
counts exactly the waits the step makes; the stand-in run's tokens are the CPU run's.
Rows draw no noise here (temperature 0): a CUDA torch.Generator cannot be stood in."""
from __future__ import annotations

import random
import tempfile
from collections import Counter
from typing import List, Tuple

import pytest
import torch

import published
from bench import gpu_shape
from bench.counting import StandInCuda
from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model

LLADA, DREAM, LLADA2 = "GSAI-ML__LLaDA-8B-Instruct", "Dream-org__Dream-v0-Instruct-7B", "inclusionAI__LLaDA2.0-mini"


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def _model(folder: str):
    torch.manual_seed(0)
    return build_model(ModelConfig.from_hf(published.shrink(published.config(folder))), dtype=torch.float32)


def _serve(folder: str, stand_in: bool, params: SamplingParams, **kw) -> Tuple[list, List[Counter], Engine, int]:
    """Eight rows of one width served to the end: (their tokens, each denoising step's waits
    by (kind, where), the engine, all its waits). Waits are booked to the denoising step
    (Engine._denoise) they were made in; a re-layout's (Engine._form_batch) are not a step's."""
    model = _model(folder)
    s = StandInCuda() if stand_in else None
    steps: List[Counter] = []
    with s if s is not None else torch.no_grad():
        if s is not None:
            s.move(model)
        cfg = dict(block_length=8, steps_per_block=4, cache="refresh", canvas="block", advance="step",
                   token_budget=4096, max_batch_size=8)
        e = Engine(model, EngineConfig(**{**cfg, **kw}))
        if s is not None:
            denoise = e._denoise

            def counted():
                with s.counting() as got:
                    out = denoise()
                steps.append(got)
                return out
            e._denoise = counted
        rng = random.Random(0)
        for _ in range(8):
            e.add_request([rng.randrange(10, model.config.vocab_size - 10) for _ in range(40)], params)
        outs = []
        while e.has_unfinished():
            outs += e.step()
    return sorted((o.request_id, o.token_ids) for o in outs), steps, e, s.waits if s is not None else 0


def _kinds(steps: List[Counter]) -> List[List[Tuple[str, str]]]:
    """Per step, the (kind, function) of its waits."""
    return [sorted((k, where.split()[-1]) for (k, where), n in c.items() for _ in range(n)) for c in steps]


def test_stand_in_counts_every_kind_of_wait():
    with StandInCuda() as s:
        x = torch.arange(6).pin_memory().to("cuda", non_blocking=True)  # pinned, non-blocking: no wait
        y = torch.arange(6).to("cuda")  # pageable: a wait
        z = x + y
        assert z.device.type == "cuda" and s.waits == 1
        assert z.cpu().tolist() == [0, 2, 4, 6, 8, 10]
        assert z.tolist()[1] == 2 and z.sum().item() == 30
        assert s.host(z[z > 2]).tolist() == [4, 6, 8, 10] and z.nonzero().shape == (5, 1)
        assert z[torch.arange(6, device="cuda") < 3].shape == (3,)  # a mask: a wait, wherever it was made
        with pytest.raises(RuntimeError, match="host tensor"):
            z + torch.arange(6)  # as on CUDA: devices do not mix
    assert sorted(k for k, _ in s.where.elements()) == [
        "d2h", "data-dependent index by a mask", "data-dependent index by a mask", "data-dependent nonzero", "h2d",
        "item", "tolist"]


GREEDY = SamplingParams(max_new_tokens=16, policy="fixed", ignore_eos=True)


@pytest.mark.parametrize("advance", ["step", "block"])
def test_llada_denoising_step_waits_once(advance):
    cpu, *_ = _serve(LLADA, False, GREEDY, advance=advance)
    got, steps, e, waits = _serve(LLADA, True, GREEDY, advance=advance)
    assert got == cpu  # token for token
    assert len(steps) == 8  # two blocks of four steps
    assert _kinds(steps) == [[("d2h", "_fetch")]] * 8
    assert e.stats.syncs == 8
    assert waits == 8  # admission and re-layouts upload in pinned, non-blocking copies: no wait


def test_dream_top_p_top_k_step_waits_once():
    params = SamplingParams(max_new_tokens=16, top_p=0.9, top_k=20, ignore_eos=True)
    cpu, *_ = _serve(DREAM, False, params)
    got, steps, e, waits = _serve(DREAM, True, params)
    assert got == cpu
    assert len(steps) == 16  # Dream's default policy: up to max(steps, block length) steps a block
    assert _kinds(steps) == [[("d2h", "_fetch")]] * 16
    assert e.stats.syncs == 16
    assert waits == 16


def test_llada2_step_waits_once():
    """The MoE forward waits for nothing (engine/models/moe.py: the experts' offsets found
    on the device, two grouped GEMMs): the step waits once, its read."""
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    cpu, *_ = _serve(LLADA2, False, params)
    got, steps, e, waits = _serve(LLADA2, True, params)
    assert got == cpu
    assert len(steps) == 8
    assert _kinds(steps) == [[("d2h", "_fetch")]] * 8
    assert e.stats.syncs == waits == 8


@pytest.fixture(scope="module")
def gemma_ckpt():
    from tiny.diffusion_gemma import build
    torch.set_num_threads(1)
    return build(tempfile.mkdtemp(prefix="dgemma"), layers=2)


def _canvas(ckpt, stand_in: bool):
    """Eight DiffusionGemma rows of one prompt length for 12 steps: (outputs, per step its
    waits, its syncs and whether rows joined or left in it, the engine)."""
    from engine.canvas import CanvasEngine, CanvasParams, load_diffusion_gemma
    model = load_diffusion_gemma(ckpt, torch.float32)
    s = StandInCuda() if stand_in else None
    per = []
    with s if s is not None else torch.no_grad():
        if s is not None:
            s.move(model)
        eng = CanvasEngine(model, CanvasParams.from_generation_config(ckpt), max_batch_size=8)
        rng = random.Random(0)
        for i in range(8):
            eng.add_request(i, [2] + [rng.randrange(5, 59) for _ in range(10)], 48, 1000 + i)
        for _ in range(12):
            rows, syncs = list(eng.rows), eng.syncs
            with (s.counting() if s is not None else torch.no_grad()) as got:
                eng.step()
            per.append((got, eng.syncs - syncs, rows != list(eng.rows) or not rows))
    return sorted((o.request_id, o.token_ids) for o in eng.outputs), per, eng


def test_canvas_step_waits_once(gemma_ckpt):
    """Every step, rows joining and leaving too: its read of the stopped canvases."""
    cpu, _, _ = _canvas(gemma_ckpt, False)
    got, per, _ = _canvas(gemma_ckpt, True)
    assert got == cpu
    assert sum(changed for _, _, changed in per) == 4  # steps where rows joined (the first) or left
    for c, syncs, _ in per:
        assert _kinds([c]) == [[("tolist", "_denoise")]]
        assert syncs == 1


def test_logprob_rows_count_their_reads():
    """A step of rows asking for logprobs reads twice (the positions written, then their
    logprobs) and waits for nothing else; EngineStats.syncs counts both."""
    params = SamplingParams(max_new_tokens=16, policy="fixed", ignore_eos=True, logprobs=2)
    cpu, *_ = _serve(LLADA, False, params)
    got, steps, e, waits = _serve(LLADA, True, params)
    assert got == cpu
    assert _kinds(steps) == [[("d2h", "_fetch")] * 3] * 8  # the step's own read and the two logprob reads
    assert e.stats.syncs == waits == 24


@pytest.mark.parametrize("family", sorted(gpu_shape.FAMILIES))
def test_every_family_steps_in_bfloat16_on_the_stand_in_device(family):
    """Every family the transformer serves, bfloat16 on the stand-in device: each engine
    step runs its CUDA paths with no host tensor mixed into a device op (the stand-in
    refuses one, as CUDA does) and waits once, at its read (the canvas engine: above).
    FakeTensorMode would fake the host's own bookkeeping tensors too, whose values the
    step reads by design; the stand-in keeps them real."""
    model = build_model(gpu_shape.config(family), dtype=torch.bfloat16)
    with StandInCuda() as s:
        s.move(model)
        e = Engine(model, EngineConfig(block_length=8, steps_per_block=4, canvas="block", advance="step",
                                       token_budget=4096, max_batch_size=4))
        # Nemotron-Labs-Diffusion's fixed schedule needs steps = block length: its threshold here
        policy = dict(policy="threshold", threshold=0.9) if family == "nemotron_labs_diffusion" else dict(policy="fixed")
        for n in (9, 14, 20, 31):
            e.add_request(list(range(40, 40 + n)), SamplingParams(max_new_tokens=16, ignore_eos=True, **policy))
        per_step = []
        while e.has_unfinished():
            with s.counting() as got:
                e.step()
            per_step.append(got)
    assert e.stats.steps >= 4 and e.stats.generated_tokens == 4 * 16  # every row served, none refused
    assert [sum(c.values()) for c in per_step] == [1] * e.stats.steps, [c for c in per_step if sum(c.values()) > 1]
    assert e.stats.syncs == e.stats.steps
