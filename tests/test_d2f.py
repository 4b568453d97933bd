"""D2F (Discrete Diffusion Forcing) pipelined block decoding against a reference written
from D2F's published algorithm, token for token in float64.

`d2f_reference` follows `_generate_block_single` and `_update_block_completion_states`
of zhijie-group/Discrete-Diffusion-Forcing (D2F-eval/eval_llada.py), one request at a
time, with their loop structure and bookkeeping:

- `block_states` with the prompt as block 0 ('to_cache', complete, all decoded); at most
  max_new_tokens // L generated blocks;
- per step, in this order: add a block of masks when fewer exist and no EOS was
  committed and the last block's decoded fraction (total - mask_count) / total is
  >= block_add_threshold; then every block whose decoded fraction is >=
  decoded_token_threshold makes its successor complete (permanently); stop when no mask
  is left and no block is active;
- one forward from the first block not in the K/V cache to the end (the 'to_cache'
  blocks and the active ones) against the cached prefix, under D2F's block attention
  mask (prompt, earlier blocks, own block); the 'to_cache' blocks are then 'in_cache';
- per active block: probability (float64 softmax) of the argmax token; commit those
  strictly greater than skip_threshold, a complete block with none commits its most
  confident one; mask_count drops by what was committed; an EOS among the committed
  tokens stops new blocks;
- a block without masks whose predecessors are all non-active becomes 'to_cache'.

Two conventions are the engine's own, as in tests/test_reference_decoding.py: noise at
temperature > 0 (Gumbel, from a generator seeded per request, block and step), and a
block still holding masks after L steps in the complete state (only a model proposing
the mask token) is deactivated where D2F loops to its safety stop. The reference also
checks that no committed proposal was the mask token, where D2F's mask_count and the
engine's count of mask tokens would differ.
"""
from __future__ import annotations

import random

import pytest
import torch

from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model
from engine.models import KVCache

torch.set_num_threads(1)
L = 4
STOP = [12]


@pytest.fixture(scope="module")
def model():
    return build_model(ModelConfig.tiny("llada", dllm_attention="block_causal"), dtype=torch.float64, seed=0)


def block_attention(prompt_length: int, max_length: int, block_size: int) -> torch.Tensor:
    """create_full_block_attention_mask as a boolean mask (True = may attend)."""
    m = torch.zeros(max_length, max_length, dtype=torch.bool)
    m[:prompt_length, :prompt_length] = True
    for b in range((max_length - prompt_length + block_size - 1) // block_size):
        s, e = prompt_length + b * block_size, min(prompt_length + (b + 1) * block_size, max_length)
        m[s:e, :e] = True
    return m


def d2f_reference(model, prompt, sp: SamplingParams):
    """(generated tokens up to the first stop, finish reason) of D2F's single-request decoder."""
    cfg = model.config
    mask_id, stops = cfg.mask_token_id, set(sp.stop_token_ids)
    tau_add, tau_dec, skip = sp.block_add_threshold, sp.decoded_token_threshold, sp.threshold
    K, p = sp.max_new_tokens // L, len(prompt)
    max_length = p + K * L
    full_mask = block_attention(p, max_length, L)
    kv = KVCache.empty(cfg, 1, max_length, torch.float64, "cpu")
    x = list(prompt)
    states = {0: dict(start=0, end=p, mask_count=0, total=p, state="to_cache", complete=True, forced=0)}
    cache_length, current_blocks, eos, step = 0, 0, False, 0
    while True:
        step += 1
        if len(states) - 1 < K and not eos:
            last = states[len(states) - 1]
            if (last["total"] - last["mask_count"]) / last["total"] >= tau_add:
                states[len(states)] = dict(start=len(x), end=len(x) + L, mask_count=L, total=L, state="active",
                                           complete=False, forced=0)
                x += [mask_id] * L
                current_blocks += 1
        for bid in sorted(states):  # _update_block_completion_states
            s = states[bid]
            if (s["total"] - s["mask_count"]) / s["total"] >= tau_dec and bid + 1 in states:
                states[bid + 1]["complete"] = True
        if mask_id not in x and current_blocks == 0:
            break
        to_cache = [b for b, s in states.items() if s["state"] == "to_cache"]
        if to_cache:
            start = states[min(to_cache)]["start"]
            update = states[max(to_cache)]["end"] - start
        else:
            active = [b for b, s in states.items() if s["state"] == "active" and s["start"] >= cache_length]
            if not active:
                break
            start, update = min(states[b]["start"] for b in active), 0
        assert start == cache_length  # blocks reach the cache in order
        n = len(x)
        with torch.no_grad():
            logits = model(torch.tensor([x[start:]]), torch.arange(start, n)[None],
                           full_mask[start:n, :n][None, None], kv, start)[0].double()
        for b in to_cache:
            states[b]["state"] = "in_cache"
        deactivate = []
        for bid in sorted(states):
            s = states[bid]
            if s["state"] != "active":
                continue
            masked = [j for j in range(s["start"], s["end"]) if x[j] == mask_id]
            if not masked:
                deactivate.append(bid)
                continue
            lg = logits[[j - start for j in masked]]
            x0 = lg.argmax(-1)
            if sp.temperature > 0:  # the engine's noise convention (module doc)
                key = hash((sp.seed, (bid - 1) * L, step - 1)) & (2**62 - 1)
                u = torch.rand((L, lg.shape[-1]), generator=torch.Generator().manual_seed(key), dtype=torch.float64)
                u = u[[j - s["start"] for j in masked]]
                x0 = (lg - sp.temperature * torch.log(-torch.log(u))).argmax(-1)
            conf = torch.softmax(lg, -1).gather(-1, x0[:, None])[:, 0].tolist()
            take = [i for i, c in enumerate(conf) if c > skip]
            if s["complete"] and not take:
                take = [max(range(len(conf)), key=lambda i: conf[i])]  # topk(confidence, 1): the first maximum
            if s["complete"]:
                s["forced"] += 1
            for i in take:
                assert int(x0[i]) != mask_id  # D2F's mask_count and the count of mask tokens agree
                x[masked[i]] = int(x0[i])
            s["mask_count"] -= len(take)
            if any(int(x0[i]) in stops for i in take):
                eos = True
            if mask_id not in x[s["start"]:s["end"]] or s["forced"] >= L:
                deactivate.append(bid)
        for bid in deactivate:
            if states[bid]["state"] == "active" and all(states[i]["state"] != "active" for i in range(bid)):
                states[bid]["state"] = "to_cache"
                current_blocks -= 1
        cache_length += update
    gen = x[p:]
    cut = [j for j, t in enumerate(gen) if t in stops]
    return (gen[:cut[0]], "stop") if cut else (gen, "length")


def d2f_workload(n=10, seed=0):
    """D2F rows with each tau_add in {0.1, 0.7, 1.0} and different thresholds, next to
    semi-AR rows (threshold and fixed policies)."""
    rng = random.Random(seed)
    kinds = [dict(block_add_threshold=0.1, decoded_token_threshold=0.95, threshold=0.9),
             dict(block_add_threshold=0.7, decoded_token_threshold=0.5, threshold=0.4),
             dict(block_add_threshold=1.0, decoded_token_threshold=0.95, threshold=0.5),
             dict(policy="threshold", threshold=0.3),
             dict(block_add_threshold=0.1, decoded_token_threshold=0.75, threshold=0.6, temperature=0.7, seed=5),
             dict(policy="fixed"),
             dict(block_add_threshold=0.1, decoded_token_threshold=0.25, threshold=0.9)]
    prompts = [[rng.randrange(3, 60) for _ in range(rng.randint(3, 30))] for _ in range(n)]
    params = [SamplingParams(max_new_tokens=rng.randint(3, 6) * L + rng.randint(0, 2),
                             stop_token_ids=STOP if i % 4 else [], **kinds[i % len(kinds)]) for i in range(n)]
    return prompts, params


def run(model, prompts, params, **kw):
    cfg = dict(block_length=L, steps_per_block=L, cache="none", token_budget=300)
    eng = Engine(model, EngineConfig(**{**cfg, **kw}), record_batches=True)
    return eng.generate(prompts, params), eng


@pytest.fixture(scope="module")
def expected(model):
    """Per row: D2F's reference for D2F rows, the engine alone for semi-AR rows."""
    prompts, params = d2f_workload()
    out = []
    for pr, sp in zip(prompts, params):
        if sp.d2f:
            out.append(d2f_reference(model, pr, sp))
        else:
            o = run(model, [pr], [sp], scheduler="sequential")[0][0]
            out.append((o.token_ids, o.finish_reason))
    return prompts, params, out


@pytest.mark.parametrize("cache", ["none", "persistent", "refresh"])
@pytest.mark.parametrize("scheduler", ["blockserve", "static", "sequential"])
def test_mixed_batches_match_the_d2f_reference(model, expected, cache, scheduler):
    prompts, params, ref = expected
    outs, eng = run(model, prompts, params, cache=cache, scheduler=scheduler, max_batch_size=5)
    if scheduler != "sequential":  # D2F rows with several blocks in flight next to semi-AR rows
        assert max(len(b.request_ids) for b in eng.batch_log) > 1
    assert {r[1] for r in ref} == {"stop", "length"}
    for o, r in zip(outs, ref):
        assert (o.token_ids, o.finish_reason) == r


def test_d2f_keeps_several_blocks_in_flight_and_saves_forwards(model):
    """tau_add < 1 overlaps blocks (a row is wider than prompt + committed + one block at
    some step) and takes fewer steps than tau_add = 1."""
    prompts, _ = d2f_workload(n=4, seed=2)

    def sp(t):
        return SamplingParams(max_new_tokens=6 * L, block_add_threshold=t, decoded_token_threshold=0.25,
                              threshold=0.9, stop_token_ids=[])

    eng = Engine(model, EngineConfig(block_length=L, steps_per_block=L, cache="persistent", token_budget=300))
    widths = []
    eng.add_request(prompts[0], sp(0.1))
    while eng.has_unfinished():
        eng.step()
        if eng.batch is not None:
            widths.append(int(eng.batch.nact.max()))
    assert max(widths) >= 3
    steps = {t: sum(o.num_steps for o in run(model, prompts, [sp(t)] * 4, cache="persistent")[0])
             for t in (0.1, 1.0)}
    assert steps[0.1] < steps[1.0]


@pytest.mark.parametrize("cache", ["none", "persistent"])
def test_budget_holds_while_rows_add_blocks_mid_step(model, cache):
    """D2F rows add a block of L columns at steps inside a block; under a tight budget
    no forward's batch area (rows x widest row, every block in flight counted) exceeds
    the budget, rows go back to the queue and come back exactly where they were."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 60) for _ in range(rng.randint(12, 24))] for _ in range(8)]
    params = [SamplingParams(max_new_tokens=6 * L, block_add_threshold=(0.1, 0.7)[i % 2],
                             decoded_token_threshold=(0.25, 0.5)[i % 2], threshold=0.9, stop_token_ids=[])
              if i % 3 else SamplingParams(max_new_tokens=4 * L, policy="fixed", stop_token_ids=[]) for i in range(8)]
    budget = 130
    eng = Engine(model, EngineConfig(block_length=L, steps_per_block=L, cache=cache, token_budget=budget),
                 record_batches=True)
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    outs, used, in_flight = {}, [], []
    while eng.has_unfinished():
        outs.update((o.request_id, o) for o in eng.step())
        if eng.batch is not None:  # the step's counters: cells of its forward, blocks in flight per row
            used.append(eng.stats.budget_used)
            in_flight.append(int(eng.batch.nact.max()))
            assert eng.stats.budget_used == len(eng.batch.rows) * eng.batch.width
    log = eng.batch_log
    assert max(used) <= budget and max(b.cost for b in log) <= budget
    assert max(in_flight) >= 3 and eng.scheduler.preemptions > 0 and max(len(b.request_ids) for b in log) > 2
    for i, pr, sp in zip(ids, prompts, params):
        want = d2f_reference(model, pr, sp) if sp.d2f else \
            (lambda r: (r.token_ids, r.finish_reason))(run(model, [pr], [sp], scheduler="sequential")[0][0])
        assert (outs[i].token_ids, outs[i].finish_reason) == want


def test_d2f_rows_fail_alone_where_they_cannot_run(model):
    bidir = build_model(ModelConfig.tiny("llada"), dtype=torch.float64, seed=0)
    d2f = SamplingParams(max_new_tokens=8, block_add_threshold=0.5, stop_token_ids=[])
    plain = SamplingParams(max_new_tokens=8, stop_token_ids=[])
    cases = [(bidir, {}, d2f, "block-causal attention"),
             (model, dict(cache="dual"), d2f, "cache 'dual'"),
             (model, dict(canvas="full"), d2f, "block canvas"),
             (model, {}, SamplingParams(max_new_tokens=3, block_add_threshold=0.5), "whole blocks"),
             (model, {}, SamplingParams(block_add_threshold=0.5, policy="fixed"), "policy 'threshold'"),
             (model, {}, SamplingParams(block_add_threshold=1.5), "block_add_threshold must be in [0, 1]"),
             (model, {}, SamplingParams(decoded_token_threshold=-0.1), "decoded_token_threshold must be")]
    for m, kw, sp, msg in cases:
        bad, good = run(m, [[5, 6, 7], [5, 6, 7]], [sp, plain], **kw)[0]
        assert bad.finish_reason == "error" and msg in bad.error, (msg, bad.error)
        assert good.finish_reason == "length" and len(good.token_ids) == 8


def test_d2f_state_rules_by_hand():
    """D2F's bookkeeping on numbers one can check by eye (mask 9, stop 7, L = 4)."""
    from engine.d2f import D2FState
    st = D2FState(0.5, 0.75, 4, 3, 9, [7])
    assert st.n_active == 1 and st.active[0].complete  # block 1 at once: the prompt is decoded
    assert st.observe([1, 9, 9, 9]) == [] and not st.plan()  # 1/4 < 0.5: no block yet
    assert st.observe([1, 2, 9, 9]) == [] and st.plan()  # 2/4 >= 0.5: block 2, not complete (2/4 < 0.75)
    assert [b.complete for b in st.active] == [True, False]
    assert st.observe([1, 2, 3, 9, 4, 9, 9, 9]) == [] and not st.plan()  # block 2 at 1/4: no block 3
    assert [b.complete for b in st.active] == [True, True]  # block 1 at 3/4 >= 0.75: permanent
    assert st.observe([1, 2, 3, 5, 4, 7, 9, 9]) == [1, 2, 3, 5] and st.stopped  # a stop token: no more blocks
    assert not st.plan() and st.n_active == 1 and st.n_blocks == 2  # block 2 at 2/4 >= 0.5, but stopped
    assert st.observe([4, 7, 6, 9]) == [] and st.observe([4, 7, 6, 9]) == []  # complete, masked since step 4
    assert st.observe([4, 7, 6, 9]) == [4, 7, 6, 9]  # L steps complete and still masked: committed as it is
