"""Engine core: batched decoding gives exactly the tokens of decoding alone (float64),
the scheduler respects its budget, bad requests fail alone, and the loader reads real
checkpoint layouts."""
import dataclasses
import random

import pytest
import torch
from safetensors import safe_open

from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model, load_model, save_model
from engine.decoding import RowParams, select
from engine.selection import fixed_schedule

torch.set_num_threads(1)
L = 4
# Stop tokens the seed-0 random models emit often enough that some requests stop early.
STOPS = {"llada": [12], "Dream": [28, 47]}


@pytest.fixture(scope="module", params=["llada", "Dream"])
def model(request, tmp_path_factory):
    """A random tiny checkpoint written with the real weight names, then loaded back."""
    path = tmp_path_factory.mktemp(request.param)
    save_model(build_model(ModelConfig.tiny(request.param), dtype=torch.float64, seed=0), path)
    m, tok = load_model(path, dtype=torch.float64, device="cpu")
    assert tok is None
    return m


def workload(model_type, policy, n=18, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 60) for _ in range(rng.randint(3, 60))] for _ in range(n)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 6) * L - rng.randint(0, 2), policy=policy,
                             threshold=0.3, stop_token_ids=STOPS[model_type]) for _ in range(n)]
    return prompts, params


def alone(model, cfg, prompt, params):
    return Engine(model, EngineConfig(**{**cfg.__dict__, "scheduler": "sequential"})).generate([prompt], [params])[0]


@pytest.mark.parametrize("canvas", ["block", "full"])
@pytest.mark.parametrize("cache", ["none", "refresh", "dual"])
@pytest.mark.parametrize("policy", ["fixed", "threshold"])
def test_batched_equals_alone(model, cache, policy, canvas):
    prompts, params = workload(model.config.model_type, policy)
    results = {}
    for sched in ["blockserve", "static", "sequential"]:
        cfg = EngineConfig(block_length=L, steps_per_block=L, cache=cache, token_budget=240,
                           scheduler=sched, max_batch_size=6, canvas=canvas)
        eng = Engine(model, cfg, record_batches=True)
        results[sched] = eng.generate(prompts, params)
        if sched == "blockserve":
            assert max(len(b.request_ids) for b in eng.batch_log) > 1
            assert eng.stats.padded_cells > 0
    ref = [alone(model, cfg, p, sp) for p, sp in zip(prompts, params)]
    reasons = {o.finish_reason for o in ref}
    assert reasons == {"stop", "length"}, reasons  # both eviction paths are exercised
    for sched, outs in results.items():
        for o, r, sp in zip(outs, ref, params):
            assert (o.token_ids, o.finish_reason, o.num_blocks) == (r.token_ids, r.finish_reason, r.num_blocks), sched
            assert len(o.token_ids) <= sp.max_new_tokens
            assert (o.finish_reason == "length") == (len(o.token_ids) == sp.max_new_tokens)


def test_factor_and_temperature_batched_equals_alone(model):
    prompts, _ = workload(model.config.model_type, "factor", n=10, seed=1)
    params = [SamplingParams(max_new_tokens=12, policy=p, factor=1.5, temperature=t, seed=7, threshold=0.3,
                             stop_token_ids=STOPS[model.config.model_type])
              for p, t in [("factor", 0.0), ("threshold", 0.7)] * 5]
    cfg = EngineConfig(block_length=L, steps_per_block=L, cache="refresh", token_budget=300)
    outs = Engine(model, cfg).generate(prompts, params)
    for o, p, sp in zip(outs, prompts, params):
        assert o.token_ids == alone(model, cfg, p, sp).token_ids


def reference_generate(model, prompt, params, block_length, steps):
    """Independent one-request decoder written from the semantics (no cache, no batch)."""
    cfg, mask_id = model.config, model.config.mask_token_id
    gen, n_blocks = [], -(-params.max_new_tokens // block_length)
    for _ in range(n_blocks):
        x = torch.tensor([prompt + gen + [mask_id] * block_length])
        T = x.shape[1]
        for s in range(steps):
            is_mask = x[0, -block_length:] == mask_id
            if not is_mask.any():
                break
            with torch.no_grad():
                logits = model(x, torch.arange(T)[None], torch.ones(1, 1, T, T, dtype=torch.bool)).double()[0]
            if cfg.shift_logits:
                logits = torch.cat([logits[:1], logits[:-1]])
            blk = logits[-block_length:]
            x0 = blk.argmax(-1)
            conf = torch.softmax(blk, -1).gather(-1, x0[:, None])[:, 0]
            conf = torch.where(is_mask, conf, torch.tensor(-1.0, dtype=torch.float64))
            if params.policy == "fixed":
                k = block_length // steps + (s < block_length % steps)
                take = conf.argsort(descending=True, stable=True)[:k]
            else:
                take = torch.nonzero(conf >= params.threshold)[:, 0]
                take = take if len(take) else conf.argmax()[None]
            if s == steps - 1:
                take = torch.nonzero(is_mask)[:, 0]
            x[0, T - block_length + take] = x0[take]
        gen += x[0, -block_length:].tolist()
        hits = [i for i, t in enumerate(gen) if t in params.stop_token_ids]
        if hits:
            return gen[: min(hits[0], params.max_new_tokens)]
    return gen[: params.max_new_tokens]


@pytest.mark.parametrize("policy", ["fixed", "threshold"])
def test_engine_matches_reference_decoder(model, policy):
    """The block canvas (BlockServe's box) without Dream's first-position rule: the
    semantics this reference was written for (tests/test_reference_decoding.py covers
    the full canvas against the published algorithms)."""
    prompts, params = workload(model.config.model_type, policy, n=8, seed=2)
    params = [dataclasses.replace(sp, first_position=False) for sp in params]
    cfg = EngineConfig(block_length=L, steps_per_block=2 if policy == "fixed" else L, cache="none", token_budget=400,
                       canvas="block")
    outs = Engine(model, cfg).generate(prompts, params)
    for o, p, sp in zip(outs, prompts, params):
        assert o.token_ids == reference_generate(model, p, sp, L, cfg.steps_per_block)


def test_scheduler_respects_budget_and_evicts_at_block_boundary(model):
    prompts, params = workload(model.config.model_type, "threshold", n=24, seed=3)
    budget = 260
    eng = Engine(model, EngineConfig(block_length=L, steps_per_block=L, cache="refresh", token_budget=budget),
                 record_batches=True)
    outs = eng.generate(prompts, params)
    log = eng.batch_log
    assert all(b.cost <= budget for b in log)
    assert all(b.cost == len(b.request_ids) * b.width for b in log)
    cycles_of = {o.request_id: [i for i, b in enumerate(log) if o.request_id in b.request_ids] for o in outs}
    for o in outs:
        cyc = cycles_of[o.request_id]
        assert len(cyc) == o.num_blocks  # one cycle per block: a request leaves at the boundary where it ends
    first_block_enders = [o for o in outs if o.num_blocks == 1]
    assert first_block_enders and all(len(cycles_of[o.request_id]) == 1 for o in first_block_enders)
    # admissions interleave with evictions: someone joins after someone else has left
    starts = sorted(c[0] for c in cycles_of.values())
    ends = sorted(c[-1] for c in cycles_of.values())
    assert starts[-1] > ends[0]


def test_growth_over_budget_preempts_and_stays_exact(model):
    prompts, params = workload(model.config.model_type, "threshold", n=12, seed=4)
    params = [SamplingParams(max_new_tokens=6 * L, threshold=0.3, stop_token_ids=[]) for _ in prompts]
    budget = 150  # rows grow only under the block canvas (a full-canvas row is as wide as it will be)
    cfg = EngineConfig(block_length=L, steps_per_block=L, cache="refresh", token_budget=budget, canvas="block")
    eng = Engine(model, cfg, record_batches=True)
    outs = eng.generate(prompts, params)
    assert eng.scheduler.preemptions > 0
    assert all(b.cost <= budget for b in eng.batch_log)
    for o, p, sp in zip(outs, prompts, params):
        assert o.token_ids == alone(model, cfg, p, sp).token_ids


def test_bad_requests_fail_alone(model):
    V, ctx = model.config.vocab_size, model.config.max_seq_len
    good, gp = workload(model.config.model_type, "threshold", n=6, seed=5)
    cfg = EngineConfig(block_length=L, steps_per_block=L, cache="refresh", token_budget=300)
    bad = [
        ([], SamplingParams(max_new_tokens=4), "empty prompt"),
        ([5] * (ctx + 1), SamplingParams(max_new_tokens=4), "exceeds the model context"),
        ([5, 6], SamplingParams(max_new_tokens=0), "max_new_tokens"),
        ([5, V + 3], SamplingParams(max_new_tokens=4), f"token id {V + 3} outside the vocabulary"),
        ([-1, 4], SamplingParams(max_new_tokens=4), "token id -1 outside the vocabulary"),
        ([5] * 200, SamplingParams(max_new_tokens=200), "more than token_budget=300"),
        ("some text", SamplingParams(max_new_tokens=4), "no tokenizer"),
        ([5, 6], SamplingParams(max_new_tokens=4, threshold=1.5), "threshold"),
        ([5, 6], SamplingParams(max_new_tokens=4, policy="nope"), "policy"),
        ([5, "x"], SamplingParams(max_new_tokens=4), "could not be tokenized"),
    ]
    prompts = [p for p, _, _ in bad] + good
    params = [sp for _, sp, _ in bad] + gp
    outs = Engine(model, cfg).generate(prompts, params)
    for o, (_, _, msg) in zip(outs, bad):
        assert o.finish_reason == "error" and msg in o.error and o.token_ids == []
    for o, p, sp in zip(outs[len(bad):], good, gp):
        assert o.finish_reason != "error"
        assert o.token_ids == alone(model, cfg, p, sp).token_ids


def test_step_interface_and_stats(model):
    eng = Engine(model, EngineConfig(block_length=L, steps_per_block=L, token_budget=400))
    assert not eng.has_unfinished()
    ids = [eng.add_request([3, 4, 5], SamplingParams(max_new_tokens=8, stop_token_ids=[]), request_id=f"r{i}")
           for i in range(3)]
    assert eng.has_unfinished()
    first = eng.step()
    assert first == [] and eng.stats.active == 3 and eng.stats.cycles == 1
    done = eng.step()
    assert sorted(o.request_id for o in done) == ids and not eng.has_unfinished()
    assert all(o.num_blocks == 2 and len(o.token_ids) == 8 and o.finish_reason == "length" for o in done)
    assert eng.stats.generated_tokens == 24 and eng.stats.finished == {"length": 3}
    assert 0 < eng.stats.forward_s <= eng.stats.busy_s


def test_decoding_rules():
    assert fixed_schedule(torch.arange(4), 10, 4).tolist() == [3, 3, 2, 2]
    assert fixed_schedule(torch.arange(6), 4, 6).tolist() == [1, 1, 1, 1, 0, 0]
    conf = torch.tensor([[0.95, 0.2, 0.99, 0.5], [0.3, 0.1, 0.2, 0.25], [0.9, 0.8, 0.7, 0.1]], dtype=torch.float64)
    is_mask = torch.tensor([[True, True, False, True], [True, True, True, True], [True, True, True, True]])
    rp = RowParams.build([SamplingParams(policy="threshold", threshold=0.9)] * 2
                         + [SamplingParams(policy="factor", factor=1.0)], [None] * 3, "cpu")
    sel = select(conf, is_mask, torch.zeros(3, dtype=torch.long), rp, 4, 4)
    assert sel.tolist() == [[True, False, False, False],  # 0.99 is not masked; 0.95 passes
                            [True, False, False, False],  # none passes: the most confident one
                            [True, True, False, False]]  # factor: 0.8 >= 1-1/3, 0.7 < 1-1/4
    last = select(conf, is_mask, torch.full((3,), 3), rp, 4, 4)
    assert last.tolist() == is_mask.tolist()


def test_loader_sharded_and_errors(tmp_path):
    for mt, key in [("llada", "model.transformer.blocks.1.ff_out.weight"),
                    ("Dream", "model.layers.0.self_attn.q_proj.bias")]:
        m = build_model(ModelConfig.tiny(mt), dtype=torch.float32, seed=1)
        d = tmp_path / mt
        save_model(m, d, max_shard_bytes=20_000)
        assert (d / "model.safetensors.index.json").exists()
        m2, _ = load_model(d, dtype=torch.float32)
        for (n1, p1), (n2, p2) in zip(m.named_parameters(), m2.named_parameters()):
            assert n1 == n2 and torch.equal(p1, p2)
        one = tmp_path / f"{mt}-one"
        save_model(m, one)
        with safe_open(str(one / "model.safetensors"), "pt") as fh:
            keys = set(fh.keys())
        assert key in keys
        tensors = {k: torch.zeros(1) if k == key else safe_open(str(one / "model.safetensors"), "pt").get_tensor(k)
                   for k in keys}
        from safetensors.torch import save_file
        save_file(tensors, str(one / "model.safetensors"))
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            load_model(one)
        save_file({k: v for k, v in tensors.items() if k != key}, str(one / "model.safetensors"))
        with pytest.raises(KeyError, match=key.replace(".", r"\.")):
            load_model(one)


class PoisonModel(torch.nn.Module):
    """Raises when a row holds five 0 tokens (only the poison prompt does): stands for
    any failure inside a forward."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.config = inner, inner.config
        self.dtype, self.device = inner.dtype, inner.device

    def forward(self, ids, *args, **kw):
        if bool(((ids == 0).sum(1) >= 5).any()):
            raise RuntimeError("poisoned batch")
        return self.inner(ids, *args, **kw)


def test_engine_failure_fails_only_the_rows_it_was_serving(model):
    prompts, params = workload(model.config.model_type, "threshold", n=8, seed=6)
    cfg = EngineConfig(block_length=L, steps_per_block=L, cache="refresh", token_budget=10_000,
                       scheduler="sequential")
    eng = Engine(PoisonModel(model), cfg)
    outs = eng.generate(prompts[:3] + [[4, 0, 0, 0, 0, 0, 4]] + prompts[3:], params[:3] + [params[0]] + params[3:])
    assert outs[3].finish_reason == "error" and "poisoned batch" in outs[3].error
    good = outs[:3] + outs[4:]
    for o, p, sp in zip(good, prompts, params):
        assert o.finish_reason != "error" and o.token_ids == alone(model, cfg, p, sp).token_ids
    assert not eng.has_unfinished()


def test_a_failing_step_is_logged_with_its_traceback_once(model, caplog):
    """A step that raises is a bug or a broken device, never a row's fault: the engine logs
    it (engine.core), with its traceback the first time and one line after that, counts
    it, fails the rows it served with the message and goes on with the queued ones."""
    import logging

    cfg = EngineConfig(block_length=L, steps_per_block=L, cache="refresh", token_budget=10_000,
                       scheduler="sequential")
    eng = Engine(PoisonModel(model), cfg)
    poisoned, ok = [4, 0, 0, 0, 0, 0, 4], [5, 6, 7]
    with caplog.at_level(logging.ERROR, logger="engine.core"):
        outs = eng.generate([poisoned, poisoned, ok], SamplingParams(max_new_tokens=8))
    assert [o.finish_reason for o in outs][:2] == ["error", "error"] and outs[2].finish_reason != "error"
    assert all("poisoned batch" in o.error for o in outs[:2])
    records = [r for r in caplog.records if r.name == "engine.core"]
    assert len(records) == 2 and eng.stats.step_failures == 2
    assert records[0].exc_info is not None and "poisoned batch" in caplog.text  # the traceback, once
    assert records[1].exc_info is None and "again (2 so far)" in records[1].getMessage()


def test_catch_up_groups_pick_the_fewest_cells():
    """Rows with a long uncached stretch are forwarded first in groups of similar
    stretch only when that computes fewer cells than padding the whole batch."""
    import itertools

    from engine.runner import FORWARD_OVERHEAD_CELLS as C, catch_up_groups

    def cells(need, floor, groups, rejoin=True):
        caught = {i for g in groups for i in g}
        left = [need[i] for i in range(len(need)) if i not in caught]
        rest = max(left + [floor])
        batch = len(need) * rest if rejoin else (len(left) * rest + C if left else 0)
        return sum(len(g) * max(need[i] for i in g) + C for g in groups) + batch

    assert catch_up_groups([8] * 10, 8) == []  # nothing to catch up
    assert catch_up_groups([600, 590, 580, 570], 8) == []  # all wide alike: one forward pads little
    assert catch_up_groups([8] * 30 + [900], 8) == [[30]]  # one newcomer among block-wide rows
    groups = catch_up_groups([8] * 30 + [1000, 990, 300, 290], 8)
    assert sorted(map(sorted, groups)) == [[30, 31], [32, 33]]  # two groups of similar stretch
    # caught-up rows that take their logits from the catch-up: a lone newcomer runs once, alone
    assert catch_up_groups([900], 8, rejoin=False) == [] and catch_up_groups([8, 900], 8, rejoin=False) == [[1]]
    rng = random.Random(0)
    for _ in range(200):  # optimal over every way of catching up a by-need prefix in contiguous groups
        need = [rng.choice([8, 8, 8, rng.randint(8, 1200)]) for _ in range(rng.randint(1, 7))]
        for rejoin in (True, False):
            got = cells(need, 8, catch_up_groups(need, 8, rejoin=rejoin), rejoin)
            order = sorted(range(len(need)), key=lambda i: -need[i])
            best = cells(need, 8, [], rejoin)
            for k in range(1, len(need) + 1):
                for cuts in itertools.product([0, 1], repeat=k - 1):
                    groups, cur = [], [order[0]]
                    for i, c in zip(order[1:k], cuts):
                        groups, cur = (groups + [cur], [i]) if c else (groups, cur + [i])
                    best = min(best, cells(need, 8, groups + [cur], rejoin))
            assert got == best


def test_forward_overhead_is_fitted_from_the_engines_own_forwards():
    """ForwardFit recovers a / b from forwards of several sizes, keeps the default until
    it can, and the engine feeds it: the catch-up planner reads a measured overhead."""
    from engine.stats import ForwardFit

    fit = ForwardFit()
    assert fit.overhead_cells(256) == 256
    for i in range(40):
        cells = 32 * (1 + i % 7)
        fit.add(cells, 0.002 + 1e-5 * cells)  # a = 2 ms, b = 10 us per cell: 200 cells
    assert fit.overhead_cells(256) == pytest.approx(200.0, rel=1e-6)
    same = ForwardFit()
    for _ in range(40):
        same.add(64, 0.01)  # one size only: undetermined
    assert same.overhead_cells(256) == 256

    model = build_model(ModelConfig.tiny("llada"), dtype=torch.float64, seed=0)
    eng = Engine(model, EngineConfig(block_length=4, steps_per_block=4, cache="refresh", token_budget=400))
    rng = random.Random(0)
    eng.generate([[rng.randrange(3, 60) for _ in range(rng.randint(3, 60))] for _ in range(24)],
                 SamplingParams(max_new_tokens=12, stop_token_ids=[]))
    assert eng.runner.fit.count == eng.stats.forwards > 16
    assert eng.stats.forward_overhead_cells >= 0


def test_key_runs_skip_left_padding_and_share_calls():
    """Issue 28: rows attend keys from their run's first real column; rows of similar width
    share one attention call, a row much wider or narrower than its neighbours gets its own."""
    from engine.runner import key_runs

    assert key_runs([0, 1, 2], [10, 12, 11], 100, overhead=16) == [(0, 3, 10)]  # alike: one call
    assert key_runs([0, 1, 2], [0, 80, 81], 100, overhead=16) == [(0, 1, 0), (1, 3, 80)]  # no pad keys at all
    assert key_runs([3, 4, 7], [50, 50, 50], 100, overhead=16) == [(3, 5, 50), (7, 8, 50)]  # slots not consecutive
    runs = key_runs(list(range(8)), [5, 90, 7, 60, 61, 0, 95, 30], 128, overhead=16)
    assert [r for a, b, _ in runs for r in range(a, b)] == list(range(8))
    starts = [5, 90, 7, 60, 61, 0, 95, 30]
    assert sum(s - k for a, b, k in runs for s in starts[a:b]) <= 16 * len(starts)
