"""Issue 54: LLaDA2.2's block routing in the MoE gate, exact against a float64 transcription.

The published gate (`LLaDA2MoeGate.block_routing`, modeling_llada2_moe.py of
inclusionAI/LLaDA2.2-flash) is not readable first-hand; `BlockRoutedLLaDA2.gate` is
transcribed from its description in FLX-OSS/FluxServe's
dev-notes/llada2.2-model-support-development-guide.md section 3 (index commit 87355a41)
and ../shared/checkpoints/REFERENCES.md: s = sigmoid(router logits), r = s + expert_bias;
the sequence cut into blocks of `block_size` tokens (its length a multiple of it); per block
and expert, the maximum of r over the block's tokens; the top `expert_capacity` experts
admitted for the block; each token's top-k of r among them; weights: s gathered,
renormalised, times routed_scaling_factor; n_group / topk_group unused. The rest of the
network is LLaDA2's published forward (tests/test_llada2.py's PublishedLLaDA2).

The model: LLaDA2.1-mini's published config.json with 2.2's located keys
(tests/test_not_served.py: rebuilt from located values, no byte copy is reachable) minus the
edit tokens (refused: the Levenshtein loop is not built), sizes shrunk (tests/published.py),
32 experts top-4 with expert_capacity scaled with the expert count (48 x 32 / 256 = 6), and
block_size shrunk with the decoding block (L = 4) so that every forward holds several
routing blocks. The engine's mixed batches, under every scheduler with preemption, must
give the transcribed LLaDA2.0 / 2.1 loops' tokens over the block-routed reference."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import published
from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model
from engine.models import moe
from engine.models.moe import routing_blocks
from test_llada2 import (HEAD_SCALE, L, SETTINGS, PublishedLLaDA2, block_mask, generate_20, generate_21, most_emitted,
                         published_tokens, reference, same_tokens_under_other_caches, with_biases, workload)
from test_not_served import EDIT_TOKENS, llada2_2_flash_config
from tp_ranks import run_ranks

torch.set_num_threads(1)
EXPERTS, TOP_K, CAPACITY = 32, 4, 48 * 32 // 256


def llada2_2_tiny(block_size: int = L, capacity: int = CAPACITY) -> dict:
    """2.2's config.json (edit tokens dropped), sizes shrunk, the expert layout as above."""
    hf = published.shrink({k: v for k, v in llada2_2_flash_config().items() if k not in EDIT_TOKENS})
    hf.update(num_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=8, topk_group=4, expert_capacity=capacity,
              block_size=block_size, num_hidden_layers=3)  # one dense layer, two MoE layers
    return hf


class BlockRoutedLLaDA2(PublishedLLaDA2):
    """PublishedLLaDA2 with LLaDA2.2's gate (the module docstring)."""

    routed = 0  # tokens whose experts block routing changed from the unrestricted top-k

    def gate(self, x, p):
        hf = self.hf
        scores = torch.sigmoid(F.linear(x, self.w[p + "mlp.gate.weight"]))
        routing = scores + self.w[p + "mlp.gate.expert_bias"]
        T, E, bs = x.shape[0], hf["num_experts"], hf["block_size"]
        assert T % bs == 0, "the published gate needs a whole number of routing blocks"
        block_scores = routing.view(T // bs, bs, E).amax(dim=1)
        allowed = torch.topk(block_scores, k=hf["expert_capacity"], dim=-1).indices
        allowed_mask = torch.zeros(T // bs, E, dtype=torch.bool).scatter_(1, allowed, True)
        allowed_mask = allowed_mask.repeat_interleave(bs, dim=0)
        topk_idx = torch.topk(routing.masked_fill(~allowed_mask, float("-inf")), k=hf["num_experts_per_tok"],
                              dim=-1).indices
        free = torch.topk(routing, k=hf["num_experts_per_tok"], dim=-1).indices
        self.routed += int((topk_idx.sort(-1).values != free.sort(-1).values).any(-1).sum())
        w = torch.gather(scores, 1, topk_idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_idx, w * hf["routed_scaling_factor"]


def tiny_model(dtype=torch.float64, **kw):
    cfg = ModelConfig.from_hf(llada2_2_tiny(**kw))
    model = with_biases(build_model(cfg, dtype=dtype, seed=0))
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    return model


@pytest.fixture(scope="module")
def pub():
    model = tiny_model()
    ref = BlockRoutedLLaDA2(model)
    mask = model.config.mask_token_id
    prompts, jobs = workload()
    free = [generate_21(ref, p, n, L, 0.15, 1.0, eos_id=-1, mask_id=mask) for p, (_, n) in zip(prompts, jobs)]
    return SimpleNamespace(model=model, ref=ref, mask=mask, eos=most_emitted(free))


def test_config_is_2_2s_with_block_routing(pub):
    spec = pub.model.config.moe
    assert (spec.block_routed, spec.expert_capacity, spec.block_size, spec.num_experts, spec.top_k) == (
        True, CAPACITY, L, EXPERTS, TOP_K)
    assert (spec.n_group, spec.topk_group) == (8, 4)  # present, unused


def batch_inputs(rows, vocab_pad: int, block: int):
    """The runner's layout of whole rows (no cache): left-padded to the widest, position ids
    from each row's first real column (padding at position 0), block-causal over absolute
    blocks, padding never attended."""
    W = max(len(r) for r in rows)
    ids = torch.full((len(rows), W), vocab_pad, dtype=torch.long)
    start = torch.tensor([W - len(r) for r in rows])
    for i, r in enumerate(rows):
        ids[i, W - len(r):] = torch.tensor(r)
    col = torch.arange(W)[None]
    pos = (col - start[:, None]).clamp(min=0)
    valid = col >= start[:, None]
    seg = pos // block
    mask = (valid[:, None, :] & (seg[:, None, :] <= seg[:, :, None]))[:, None]
    return ids, pos, mask, start


def test_forward_of_a_mixed_batch_equals_the_block_routed_reference(pub):
    """Rows of 1 to 5 routing blocks in one left-padded batch: each row's logits equal the
    float64 reference's and its own batch-size-1 forward's; block routing fired."""
    model, ref = pub.model, pub.ref
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, 150000, (n * L,), generator=g).tolist() for n in (3, 1, 5, 2)]
    ids, pos, mask, start = batch_inputs(rows, model.config.pad_token_id, L)
    before = ref.routed
    with torch.inference_mode():
        out = model(ids, pos, mask)
        for i, r in enumerate(rows):
            T = len(r)
            one = model(torch.tensor([r]), torch.arange(T)[None], block_mask(T // L, L)[None, None])[0]
            want = ref(torch.tensor(r), block_mask(T // L, L))
            torch.testing.assert_close(out[i, start[i]:], want, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(one, want, rtol=1e-12, atol=1e-12)
    assert ref.routed > before  # admission changed some tokens' experts


def test_routing_blocks_are_per_row_and_padding_apart():
    pos = torch.tensor([[0, 0, 0, 1, 2, 3, 4, 5], [3, 4, 5, 6, 7, 8, 9, 10], [0, 0, 0, 0, 0, 0, 0, 0]])
    b = routing_blocks(pos, 4)
    ids = b.ids.view(3, 8)
    pad = b.count - 1
    assert ids[0, :2].tolist() == [pad, pad] and len(set(ids[0, 2:6].tolist())) == 1 and ids[0, 6] != ids[0, 5]
    assert ids[1, 0] != ids[1, 1] and ids[1, 1] == ids[1, 4] and ids[1, 5] == ids[1, 7] != ids[1, 4]
    assert set(ids[2, :7].tolist()) == {pad} and ids[2, 7] != pad
    assert not set(ids[0].tolist()) & set(ids[1].tolist()) - {pad}  # never a block across rows


def test_a_block_length_that_cuts_routing_blocks_is_refusable():
    """MoESpec.block_length_refusal: what an engine must refuse (the published gate asserts
    whole routing blocks; a block-only step of 2 positions would route half a block)."""
    spec = ModelConfig.from_hf(llada2_2_tiny()).moe
    assert spec.block_length_refusal(L) is None and spec.block_length_refusal(2 * L) is None
    assert "not a multiple of the model's routing block_size=4" in spec.block_length_refusal(2)
    flash = ModelConfig.from_hf({k: v for k, v in llada2_2_flash_config().items() if k not in EDIT_TOKENS})
    assert flash.moe.block_length_refusal(16) is not None and flash.moe.block_length_refusal(64) is None


def test_the_engine_and_the_preflight_refuse_a_block_length_that_cuts_routing_blocks(pub):
    from pipeline.checkpoint_check import check_settings
    from pipeline.errors import CheckpointRefused

    with pytest.raises(ValueError, match="block_length=2 is not a multiple of the model's routing block_size=4"):
        Engine(pub.model, EngineConfig(block_length=2, steps_per_block=2, cache="none"))
    checkpoint = SimpleNamespace(family=pub.model.config.family, model="tiny 2.2", config=pub.model.config,
                                 serving=pub.model.config.family.serving)
    with pytest.raises(CheckpointRefused, match="routing block_size=4") as e:
        check_settings(checkpoint, None, EngineConfig(block_length=2, steps_per_block=2, cache="none"))
    assert e.value.options == ("block_length",)


def test_prefix_caching_gives_the_same_tokens(pub):
    """Prompts sharing whole blocks of a preamble: their cached K/V (computed with the
    preamble's own routing blocks) reused, the same tokens as without the prefix cache,
    the transcribed LLaDA2.0 loop's."""
    g = torch.Generator().manual_seed(5)
    pre = torch.randint(0, 150000, (3 * L,), generator=g).tolist()
    prompts = [pre[:n] + torch.randint(0, 150000, (k,), generator=g).tolist()
               for n, k in ((L, 1), (2 * L, 3), (3 * L, 2), (2 * L + 1, 4), (3 * L, 5), (L - 1, 2))]
    params = [SamplingParams(max_new_tokens=2 * L, stop_token_ids=[pub.eos], threshold=0.15) for _ in prompts]
    outs = []
    for on in (False, True):
        eng = Engine(pub.model, EngineConfig(block_length=L, steps_per_block=4, cache="refresh", token_budget=96,
                                             max_batch_size=2, enable_prefix_caching=on))
        outs.append([o.token_ids for o in eng.generate(prompts, params)])
        if on:
            assert eng.stats.prefix_hit_blocks > 0
    want = [published_tokens(generate_20(pub.ref, p, 2 * L, L, 4, 0.15, eos_id=pub.eos, mask_id=pub.mask), pub.eos)
            for p in prompts]
    assert outs[0] == outs[1] == want


def test_block_routing_needs_the_blocks():
    spec = ModelConfig.from_hf(llada2_2_tiny()).moe
    with pytest.raises(ValueError, match="routing block"):
        moe.route(torch.randn(8, EXPERTS), spec, None)


def references(pub):
    prompts, jobs = workload()
    return prompts, jobs, [reference(pub, p, name, n) for p, (name, n) in zip(prompts, jobs)]


@pytest.fixture(scope="module")
def refs(pub):
    return references(pub)


@pytest.mark.parametrize("steps", [2, 4])
@pytest.mark.parametrize("scheduler", ["blockserve", "static", "sequential"])
def test_mixed_batches_equal_the_block_routed_loops(pub, refs, scheduler, steps):
    """LLaDA2.0 and 2.1 rows (with and without editing) in one batch, persistent cache
    (block-only forwards: each a whole routing block at its absolute position), under every
    scheduler, a row preempted and readmitted: the transcribed loops' tokens exactly."""
    prompts, jobs, outs = refs
    pick = [i for i, (name, _) in enumerate(jobs) if SETTINGS[name][1] == steps]
    cfg = EngineConfig(block_length=L, steps_per_block=steps, cache="persistent", scheduler=scheduler,
                       token_budget=32, max_batch_size=4)  # 32: a row preempted
    eng = Engine(pub.model, cfg, record_batches=True)
    params = [SamplingParams(max_new_tokens=jobs[i][1], policy="threshold", stop_token_ids=[pub.eos],
                             **SETTINGS[jobs[i][0]][0]) for i in pick]
    got = eng.generate([prompts[i] for i in pick], params)
    if scheduler != "sequential":
        assert max(len(b.request_ids) for b in eng.batch_log) > 1
    if scheduler == "blockserve" and steps == 4:
        assert eng.scheduler.preemptions > 0
    assert [o.token_ids for o in got] == [outs[i] for i in pick]


def test_step_advance_and_other_caches_give_the_same_tokens(pub, refs):
    """Admission at any step (rows of other widths padded into the forward), the refresh
    cache, no cache (whole rows every step): the same tokens."""
    same_tokens_under_other_caches(pub, refs)


def test_the_workload_edits_and_stops(pub, refs):
    """2.1's edits change some block-routed row's tokens, some rows stop, some span blocks."""
    prompts, jobs, outs = refs
    ids = dict(eos_id=pub.eos, mask_id=pub.mask)
    edited = [generate_21(pub.ref, p, n, L, 0.15, 0.1, **ids) != generate_21(pub.ref, p, n, L, 0.15, 1.0, **ids)
              for p, (name, n) in zip(prompts, jobs) if name == "2.1-edit"]
    assert any(edited)
    assert any(len(o) < n for o, (_, n) in zip(outs, jobs)) and any(len(o) > L for o in outs)


def test_block_routing_changes_the_tokens(pub, refs):
    """The same weights under 2.1's grouped routing decode other tokens: the routing counts."""
    prompts, jobs, outs = refs
    grouped = PublishedLLaDA2(pub.model)  # LLaDA2.1's gate: n_group 8, topk_group 4
    other = SimpleNamespace(ref=grouped, eos=pub.eos, mask=pub.mask)
    assert any(reference(other, p, name, n) != o for p, (name, n), o in zip(prompts, jobs, outs))


def test_grouped_float32_gives_the_float64_loops_tokens(pub, monkeypatch):
    """The same weights in float32: the grouped experts, the float32 per-expert loop and the
    float64 model (which runs the loop) decode the same tokens, block-routed."""
    model = tiny_model(torch.float32)
    model.load_state_dict({k: v.float() for k, v in pub.model.state_dict().items()})
    layer = model.layers[1]
    assert moe.groupable(torch.empty(1, model.config.hidden_size), layer.w13, layer.w2)  # grouped_mm runs
    prompts = [[int(t) for t in torch.randint(3, 150000, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (5, 11, 17)]
    params = [SamplingParams(max_new_tokens=16, policy="fixed", stop_token_ids=[]) for _ in prompts]
    ecfg = EngineConfig(block_length=L, steps_per_block=2, cache="persistent", max_batch_size=4)
    with torch.inference_mode():
        grouped = Engine(model, ecfg).generate(prompts, params)
        exact = Engine(pub.model, ecfg).generate(prompts, params)
        monkeypatch.setattr(moe, "groupable", lambda *a: False)
        looped = Engine(model, ecfg).generate(prompts, params)
    assert [o.token_ids for o in grouped] == [o.token_ids for o in looped] == [o.token_ids for o in exact]
    assert all(len(o.token_ids) == 16 for o in grouped)


def published_layout() -> ModelConfig:
    """2.2-flash's expert layout unshrunk (256 experts, 48 admitted per 32 tokens, top-8),
    tiny hidden sizes (bench/gpu_shape.py's experts=True)."""
    hf = llada2_2_tiny(block_size=32, capacity=48)
    hf.update(num_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4)
    return ModelConfig.from_hf(hf)


@pytest.mark.parametrize("ranks", [2])
def test_expert_parallel_partials_sum_to_the_whole(ranks):
    """Expert parallel: each rank routes every token the same way (the router is replicated,
    the blocks are the forward's) and mixes its own experts; the partials sum to the whole."""
    cfg = published_layout()
    model = build_model(cfg, dtype=torch.float64)
    layer, spec = model.layers[1], cfg.moe
    x = torch.randn(2, 64, cfg.hidden_size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    blocks = routing_blocks(torch.arange(64).expand(2, 64), spec.block_size)
    E = spec.num_experts
    with torch.inference_mode():
        whole = moe.experts_forward(x, layer.router.weight, layer.expert_bias, layer.w13, layer.w2, spec,
                                    blocks=blocks)
        parts = [moe.experts_forward(x, layer.router.weight, layer.expert_bias, layer.w13[a:b], layer.w2[a:b], spec,
                                     range(a, b), blocks=blocks)
                 for a, b in ((r * E // ranks, (r + 1) * E // ranks) for r in range(ranks))]
    torch.testing.assert_close(sum(parts), whole, rtol=1e-12, atol=1e-12)


def ep_jobs(eos: int):
    """The steps-4 rows of the workload (2.1 with and without edits, 2.0 at S = L)."""
    prompts, jobs = workload()
    pick = [i for i, (name, _) in enumerate(jobs) if SETTINGS[name][1] == 4]
    return pick, [prompts[i] for i in pick], [SamplingParams(max_new_tokens=jobs[i][1], policy="threshold",
                                                             stop_token_ids=[eos], **SETTINGS[jobs[i][0]][0])
                                              for i in pick]


def test_expert_parallel_2_gives_the_transcribed_tokens(pub, refs, tmp_path):
    """Tensor parallel 2 over gloo (each rank half the experts, the router replicated, the
    routing blocks its forward's): every rank decodes the block-routed loops' tokens."""
    pick, prompts, params = ep_jobs(pub.eos)
    _, _, outs = refs
    got = run_ranks(pub.model, str(tmp_path), prompts, params,
                    EngineConfig(block_length=L, steps_per_block=4, cache="persistent", token_budget=32,
                                 max_batch_size=4))
    assert [g["own"] for g in got] == [list(range(0, EXPERTS // 2)), list(range(EXPERTS // 2, EXPERTS))]
    for g in got:
        assert g["tokens"] == [outs[i] for i in pick]
