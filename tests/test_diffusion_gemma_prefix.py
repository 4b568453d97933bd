"""DiffusionGemma's prefix cache (issue 40, acceptance 1 for the canvas engine): rows
sharing prompt prefixes of several lengths (a prefix ending mid-block, prompts that are
entirely a shared prefix) get, with the cache, exactly the tokens of transformers'
`generate` of each prompt alone, in float64, under blockserve, static and sequential,
and with preemption and eviction forced by a small token budget; the cache's counters
say what it reused."""
from __future__ import annotations

import random

import pytest
import torch

from engine.canvas import CanvasEngine, CanvasParams, load_diffusion_gemma

from tiny.diffusion_gemma import CANVAS, build


def _workload():
    rng = random.Random(5)
    pre = [2] + [rng.randrange(5, 59) for _ in range(19)]  # a 20-token preamble: 2 complete blocks + 4
    other = [2] + [rng.randrange(5, 59) for _ in range(11)]
    q = lambda n: [rng.randrange(5, 59) for _ in range(n)]  # noqa: E731
    prompts = [pre + q(3), pre[:8], pre[:16], pre + q(5), pre[:13] + q(4), pre[:16], other + q(2),
               pre[:8] + q(1), other + q(9), other[:8], pre + q(1), [2] + q(6), pre[:3] + q(2), pre[:16] + q(8)]
    max_tokens = [rng.choice((8, 16, 24)) for _ in prompts]
    return prompts, max_tokens, [300 + i for i in range(len(prompts))]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    torch.set_num_threads(1)
    ckpt = build(str(tmp_path_factory.mktemp("dgemma-prefix")), layers=2)
    model = load_diffusion_gemma(ckpt, torch.float64)
    prompts, max_tokens, seeds = _workload()
    eos = set(model.generation_config.eos_token_id)
    refs = []
    for p, n, s in zip(prompts, max_tokens, seeds):
        torch.manual_seed(s)
        seq = model.generate(torch.tensor([p]), max_new_tokens=n).sequences[0, len(p):].tolist()
        cut = next((i + 1 for i, t in enumerate(seq) if t in eos), len(seq))
        refs.append(seq[:min(cut, n)])
    return ckpt, model, refs


def _serve(setup, scheduler, cache=True, **kw):
    ckpt, model, _ = setup
    prompts, max_tokens, seeds = _workload()
    eng = CanvasEngine(model, CanvasParams.from_generation_config(ckpt), scheduler=scheduler,
                       enable_prefix_caching=cache, **kw)
    for i, (p, n, s) in enumerate(zip(prompts, max_tokens, seeds)):
        eng.add_request(i, p, n, s)
    while eng.has_unfinished():
        eng.step()
    outs = sorted(eng.outputs, key=lambda o: o.request_id)
    assert [o.request_id for o in outs] == list(range(len(prompts)))  # every row exactly once
    assert [o.error for o in outs] == [None] * len(prompts)
    return [o.token_ids for o in outs], eng


def _expected_hits(prompts, block):
    """Sequential serving with room for every block: a prompt reuses the longest chain of
    its complete blocks that an earlier prompt held."""
    seen, hits = set(), 0
    for p in prompts:
        keys = [tuple(p[:(i + 1) * block]) for i in range(len(p) // block)]
        hits += next((i for i, k in enumerate(keys) if k not in seen), len(keys))
        seen.update(keys)
    return hits


def test_sequential_reuses_every_shared_block_and_is_exact(setup):
    _, _, refs = setup
    prompts, _, _ = _workload()
    toks, eng = _serve(setup, "sequential")
    plain_toks, plain = _serve(setup, "sequential", cache=False)
    assert toks == refs and plain_toks == refs
    f = eng.prefix_figures()
    hits = _expected_hits(prompts, CANVAS)
    assert hits >= 8 and f["prefix_hit_blocks"] == hits and f["prefix_hit_tokens"] == hits * CANVAS
    assert f["prefix_query_tokens"] == sum(map(len, prompts))
    assert f["prefix_evictions"] == 0 and f["prefix_cached_blocks"] == f["prefix_inserted_blocks"] > 0
    # the same work but the reused prompt tokens; a prompt that is all cached blocks has no prefill
    assert eng.cells == plain.cells - f["prefix_hit_tokens"]
    assert eng.decoder_forwards == plain.decoder_forwards
    full_hits = sum(1 for i, p in enumerate(prompts) if len(p) % CANVAS == 0 and
                    all(tuple(p[:k]) in {tuple(x[:k]) for x in prompts[:i] if len(x) >= k}
                        for k in range(CANVAS, len(p) + 1, CANVAS)))
    assert full_hits >= 2 and eng.encoder_forwards == plain.encoder_forwards - full_hits


@pytest.mark.parametrize("scheduler,kw", [("blockserve", dict(max_batch_size=4, token_budget=200)),
                                          ("static", dict(max_batch_size=4))], ids=["blockserve", "static"])
def test_batched_schedulers_are_exact_with_the_cache(setup, scheduler, kw):
    _, _, refs = setup
    toks, eng = _serve(setup, scheduler, **kw)
    assert toks == refs
    assert eng.prefix_figures()["prefix_hit_blocks"] > 0


def test_rows_joining_together_take_shared_blocks_from_the_cache(setup):
    """Every row fits at once: a row whose first uncached block a row joining with it is
    about to encode waits a step and takes that block from the cache, so blockserve reuses
    as much as sequential serving does."""
    _, _, refs = setup
    prompts, _, _ = _workload()
    toks, eng = _serve(setup, "blockserve", max_batch_size=64)
    f = eng.prefix_figures()
    assert toks == refs
    assert f["prefix_hit_blocks"] == _expected_hits(prompts, CANVAS) and f["prefix_evictions"] == 0


def test_small_budget_forces_eviction_and_preemption_and_stays_exact(setup):
    """The cached blocks count in the token budget: at 96 tokens the admitted rows outgrow
    it (preempted, re-encoded after their cached blocks) and blocks are evicted."""
    _, _, refs = setup
    toks, eng = _serve(setup, "blockserve", max_batch_size=4, token_budget=96)
    f = eng.prefix_figures()
    assert toks == refs
    assert eng.preemptions > 0 and f["prefix_evictions"] > 0 and f["prefix_hit_blocks"] > 0
    assert f["prefix_cached_blocks"] * CANVAS <= 96


def test_serve_reads_the_setting_and_reports_the_counters(setup):
    """Auto (the default) caches (the encoder is causal: always exact); False does not."""
    from engine import EngineConfig, SamplingParams
    from engine.canvas import CanvasServe

    ckpt, model, refs = setup
    defaults = CanvasParams.from_generation_config(ckpt)
    assert CanvasServe(model, defaults).canvas.prefix is not None
    assert CanvasServe(model, defaults, EngineConfig(enable_prefix_caching=False)).canvas.prefix is None
    prompts, max_tokens, seeds = _workload()
    serve = CanvasServe(model, defaults, EngineConfig(enable_prefix_caching=True, scheduler="sequential"))
    outs = [serve.generate([p], SamplingParams(max_new_tokens=n, seed=s))[0]
            for p, n, s in zip(prompts[:4], max_tokens, seeds)]
    assert [o.token_ids for o in outs] == refs[:4]
    assert serve.stats.prefix_hit_blocks == _expected_hits(prompts[:4], CANVAS) > 0
    assert serve.stats.prefix_cached_blocks > 0
