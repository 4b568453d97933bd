"""The full canvas against the reference algorithms, token for token in float64.

`reference_decode` is written from the published decoders, one request at a time and
with their own loop structure, not from the engine: LLaDA's `generate` (no cache) and
Fast-dLLM's `generate_with_prefix_cache` / `generate_with_dual_cache` for LLaDA, and
Fast-dLLM's Dream block decoding (`_sample` with and without `dual_cache`):

- the canvas is the prompt followed by all ceil(g / L) blocks of masks; positions
  0..n-1, no padding, every column attends to every column;
- a block's first step runs the whole canvas (storing every column's K/V when cached);
  later steps run the whole canvas (none), the block and everything after it against
  the prefix K/V of that first step (prefix), or the block alone against the prefix and
  suffix K/V of that first step (dual), storing the block's new K/V;
- Dream reads position i's logits from position i - 1 (`cat([l[:1], l[:-1]])` over the
  forwarded columns) and its block's first step commits only the block's first
  position; then `confidence_threshold`, or its timestep schedule with the
  negative-entropy confidence (`alg="entropy"`);
- selection as `get_transfer_index` (fixed: `get_num_transfer_tokens` over the block's
  masks; threshold: top-1 plus every confidence >= tau) and
  `get_transfer_index_dynamic` (factor), loops that run until the block has no mask.

Two conventions are the engine's own, because the published code leaves them open:
noise (Gumbel at temperature > 0, random remasking) comes from a generator seeded per
request, block and step instead of the global RNG, and a block whose model keeps
proposing the mask token is committed after max(S, L) steps (the references loop
forever there). The engine runs the same requests in mixed batches, under every
scheduler, advance mode and cache, and must give exactly these tokens.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model
from engine.models import KVCache

torch.set_num_threads(1)
L, S = 4, 4
STOPS = {"llada": [12], "Dream": [28, 47]}


@pytest.fixture(scope="module", params=["llada", "Dream"])
def model(request):
    return build_model(ModelConfig.tiny(request.param), dtype=torch.float64, seed=0)


# --- the reference ------------------------------------------------------------------
def num_transfer_tokens(n_mask: int, steps: int):
    """get_num_transfer_tokens: n masks over `steps` steps, the first ones take the remainder."""
    base, rem = divmod(n_mask, steps)
    return [base + (i < rem) for i in range(steps)]


def transfer_threshold(conf, masked, tau):
    order = sorted(masked, key=lambda j: -conf[j])
    return [order[0]] + [j for j in order[1:] if conf[j] >= tau]


def transfer_factor(conf, masked, factor):
    ordered = sorted(masked, key=lambda j: -conf[j])
    threshs = [1 - factor / (n + 1) for n in range(1, len(ordered) + 1)]
    threshs[0] = -1
    top_i = 0
    for top_i in range(len(threshs)):
        if conf[ordered[top_i]] < threshs[top_i]:
            break
    if top_i == 0 or top_i == len(threshs) - 1:
        top_i += 1
    return ordered[:top_i]


def transfer_timestep(conf, masked, i, steps):
    t = torch.linspace(1, 1e-3, steps + 1)
    n = torch.tensor(len(masked)) / 1  # Dream: mask_index.sum() / batch size, a float tensor
    k = int(n * (1 - t[i + 1] / t[i])) if i < steps - 1 else len(masked)
    return sorted(masked, key=lambda j: -conf[j])[:k]


def reference_decode(model, prompt, sp: SamplingParams, cache: str):
    cfg = model.config
    mask_id, shift = cfg.mask_token_id, cfg.shift_logits
    first_position = cfg.model_type == "Dream" if sp.first_position is None else sp.first_position
    p, K = len(prompt), math.ceil(sp.max_new_tokens / L)
    n = p + K * L
    x = torch.tensor([prompt + [mask_id] * (K * L)])
    pos, keys = torch.arange(n)[None], torch.ones(1, 1, 1, n, dtype=torch.bool)
    kv = None if cache == "none" else KVCache.empty(cfg, 1, n, torch.float64, "cpu")

    def forward(lo, hi):
        """Logits of columns [lo, hi) (Dream: read from the column before, within them)."""
        with torch.no_grad():
            out = model(x[:, lo:hi], pos[:, lo:hi], keys, kv, lo)[0].double()
        return torch.cat([out[:1], out[:-1]]) if shift else out

    for b in range(K):
        start, end = p + b * L, p + (b + 1) * L
        schedule = num_transfer_tokens(L, S)
        i = 0
        while (x[0, start:end] == mask_id).any() and i < (S if sp.policy in ("fixed", "timestep") else max(S, L)):
            if i == 0 or cache == "none":
                logits = forward(0, n)[start:end]
            elif cache == "refresh":
                logits = forward(start, n)[:L]
            else:
                logits = forward(start, end)
            blk = x[0, start:end]
            masked = [j for j in range(L) if blk[j] == mask_id]
            x0 = logits.argmax(-1)
            drawn = None
            if sp.temperature > 0 or sp.remasking == "random":
                g = torch.Generator().manual_seed(hash((sp.seed, b * L, i)) & (2**62 - 1))
                if sp.temperature > 0:
                    u = torch.rand(logits.shape, generator=g, dtype=torch.float64)
                    x0 = (logits - sp.temperature * torch.log(-torch.log(u))).argmax(-1)
                if sp.remasking == "random":
                    drawn = torch.rand(L, generator=g, dtype=torch.float64)
            probs = torch.softmax(logits, -1)
            conf = {"low_confidence": probs.gather(-1, x0[:, None])[:, 0],
                    "entropy": (probs * torch.log(probs + 1e-10)).sum(-1),
                    "margin": probs.topk(2, -1).values[:, 0] - probs.topk(2, -1).values[:, 1],
                    "random": drawn}[sp.remasking].tolist()
            last = i == (S if sp.policy in ("fixed", "timestep") else max(S, L)) - 1
            if first_position and i == 0:
                take = [0]
            elif last:
                take = masked
            elif sp.policy == "fixed":
                take = sorted(masked, key=lambda j: -conf[j])[:schedule[i]]
            elif sp.policy == "threshold":
                take = transfer_threshold(conf, masked, sp.threshold)
            elif sp.policy == "factor":
                take = transfer_factor(conf, masked, sp.factor)
            else:
                take = transfer_timestep(conf, masked, i, S)
            for j in take:
                x[0, start + j] = x0[j]
            i += 1
    gen = x[0, p:].tolist()
    stops = [j for j, t in enumerate(gen) if t in sp.stop_token_ids]
    return gen[: min(stops[0], sp.max_new_tokens)] if stops else gen[: sp.max_new_tokens]


# --- the engine against it ----------------------------------------------------------
def workload(model_type, n=9, seed=0):
    """Rows of every policy (and Dream's and LLaDA's own choices) in one batch."""
    rng = random.Random(seed)
    if model_type == "llada":
        kinds = [dict(policy="fixed"), dict(policy="threshold", threshold=0.3), dict(policy="factor", factor=1.5),
                 dict(policy="fixed", remasking="random", seed=3), dict(policy="threshold", threshold=0.5,
                                                                        temperature=0.8, seed=5)]
    else:  # Dream: its block decoding (first position) with confidence_threshold and alg="entropy"
        kinds = [dict(policy="threshold", threshold=0.3), dict(policy="timestep", remasking="entropy"),
                 dict(policy="factor", factor=1.5), dict(policy="fixed", remasking="margin"),
                 dict(policy="threshold", threshold=0.4, temperature=0.8, seed=5)]
    prompts = [[rng.randrange(3, 60) for _ in range(rng.randint(3, 40))] for _ in range(n)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 5) * L - rng.randint(0, 2),
                             stop_token_ids=STOPS[model_type], **kinds[i % len(kinds)]) for i in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def references(model):
    prompts, params = workload(model.config.model_type)
    return prompts, params, {c: [reference_decode(model, pr, sp, c) for pr, sp in zip(prompts, params)]
                             for c in ["none", "refresh", "dual"]}


@pytest.fixture(scope="module")
def fresh_dynamo():
    """Dynamo keeps compiled graphs per code object, for every model of the process: this
    module's compiled runs start from none, so that other tests' graphs in this worker
    never exhaust the runner's recompile limit (which would make it fall back to eager)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# compile: the dual cache's block-only step through torch.compile (inductor on the CPU)
@pytest.mark.parametrize("cache,compile", [("none", False), ("refresh", False), ("dual", False), ("dual", True)])
@pytest.mark.parametrize("scheduler,advance", [("blockserve", "block"), ("blockserve", "step"), ("static", "block"),
                                               ("static", "step"), ("sequential", "block"), ("sequential", "step")])
def test_full_canvas_matches_the_reference(model, references, cache, compile, scheduler, advance, request):
    prompts, params, ref = references
    if compile:
        request.getfixturevalue("fresh_dynamo")
    cfg = EngineConfig(block_length=L, steps_per_block=S, cache=cache, scheduler=scheduler, advance=advance,
                       token_budget=220, max_batch_size=5, compile_decode=compile)
    eng = Engine(model, cfg, record_batches=True)
    assert eng.full_canvas  # canvas="auto" on a bidirectional model
    outs = eng.generate(prompts, params)
    if compile:  # every block-only step ran compiled: none fell back to eager
        assert eng.stats.compile_fallbacks == 0 and eng.stats.compiled_forwards > 0
    if scheduler != "sequential":
        assert max(len(b.request_ids) for b in eng.batch_log) > 1  # mixed batches
    if scheduler == "blockserve":  # full-canvas rows count p + K L columns from admission
        assert all(b.cost <= cfg.token_budget for b in eng.batch_log)
    assert {o.finish_reason for o in outs} == {"stop", "length"}
    for o, r in zip(outs, ref[cache]):
        assert o.token_ids == r


def test_the_canvas_changes_tokens_of_bidirectional_models(model, references):
    """Why the full canvas is the default for these models: the block canvas gives other tokens."""
    prompts, params, ref = references
    block = Engine(model, EngineConfig(block_length=L, steps_per_block=S, cache="none", canvas="block",
                                       token_budget=220)).generate(prompts, params)
    assert sum(o.token_ids != r for o, r in zip(block, ref["none"])) >= len(prompts) // 3


def test_reference_rules_by_hand():
    """The selection rules the reference follows, on numbers one can check by eye."""
    conf = [0.95, 0.2, 0.7, 0.5]
    assert num_transfer_tokens(10, 4) == [3, 3, 2, 2]
    assert transfer_threshold(conf, [0, 1, 2, 3], 0.9) == [0]
    assert transfer_threshold(conf, [1, 3], 0.9) == [3]  # the most confident always
    assert transfer_factor([0.9, 0.8, 0.7, 0.1], [0, 1, 2, 3], 1.0) == [0, 1]  # 0.7 < 1 - 1/4
    # only the least confident misses its bar: the reference still takes all n
    assert transfer_factor([0.99, 0.9, 0.85, 0.1], [0, 1, 2, 3], 1.0) == [0, 1, 2, 3]
    assert transfer_timestep(conf, [0, 1, 2, 3], 1, 4) == [0]  # int(4 * (1 - t2/t1)) = 1
    assert transfer_timestep(conf, [0, 1, 2, 3], 3, 4) == [0, 2, 3, 1]


def test_engine_selection_follows_the_reference_factor_rule():
    """engine.decoding.select on the case where the old rule differed from Fast-dLLM's."""
    from engine.decoding import RowParams, select

    conf = torch.tensor([[0.99, 0.9, 0.85, 0.1], [0.9, 0.8, 0.7, 0.1]], dtype=torch.float64)
    rp = RowParams.build([SamplingParams(policy="factor", factor=1.0)] * 2, [None] * 2, "cpu")
    sel = select(conf, torch.ones(2, 4, dtype=torch.bool), torch.zeros(2, dtype=torch.long), rp, 4, 4)
    assert sel.tolist() == [[True] * 4, [True, True, False, False]]
