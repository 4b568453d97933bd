"""Issue 40: prefix caching (engine/prefix_cache.py). In float64, rows decoded with the
cache give exactly the tokens they give without it, on LLaDA2.0 and LLaDA2.1 (with
editing; the model is built from LLaDA2.0-mini's published files, which LLaDA2.1-mini's
config.json equals), rows sharing prefixes of several lengths (one ending mid-block, a prompt that is
all shared prefix), under every scheduler and cache mode, with preemption and eviction
forced by a small budget; K/V peak memory stays within the budget's (plus one layer); a
family whose prompt's K/V depend on what follows is refused, by the engine and by the
job's preflight; the dispatcher's prefix affinity; the sorter's prefix locality knob."""
from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model, load_model
from engine.slots import SLACK
from test_llada2 import L, SETTINGS, most_emitted, published_llada2

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def llada2(tmp_path_factory):
    """test_llada2.published_llada2 (its folder and model), and a stop id: the token the
    model emits most on the workload without one, so rows stop early."""
    folder, model = published_llada2(str(tmp_path_factory.mktemp("llada2")))
    prompts, jobs = shared_prefix_workload()
    free = Engine(model, EngineConfig(block_length=L, steps_per_block=4, token_budget=512)).generate(
        prompts, params_of(jobs, stop=[]))
    return SimpleNamespace(folder=folder, model=model, stop=[most_emitted(o.token_ids for o in free)])


def shared_prefix_workload(n=14, seed=0):
    """Prompts from one 14-token preamble cut at 0, 3 (mid-block), 4, 8, 11 (mid-block) and
    14 tokens (some prompts are the preamble alone), then 0-6 tokens of their own; and a
    second preamble, so the cache holds two chains."""
    rng = random.Random(seed)
    pre = [[rng.randrange(13, 60) for _ in range(14)], [rng.randrange(13, 60) for _ in range(9)]]
    prompts, names = [], list(SETTINGS)
    for i in range(n):
        p = pre[i % 3 == 2]
        k = rng.choice([3, 4, 8, 11, len(p), len(p)])
        own = [] if i % 4 == 0 else [rng.randrange(13, 60) for _ in range(rng.randint(1, 6))]
        prompts.append(p[:k] + own)
    jobs = [(names[i % len(names)], rng.randint(1, 3) * L - rng.randint(0, 2)) for i in range(n)]
    return prompts, jobs


def params_of(jobs, stop):
    return [SamplingParams(max_new_tokens=n, policy="threshold", stop_token_ids=stop, **SETTINGS[name][0])
            for name, n in jobs]


def generate(llada2, prompts, jobs, **cfg):
    """Without the cache unless asked (auto would turn it on for LLaDA2): the tests compare."""
    cfg.setdefault("enable_prefix_caching", False)
    eng = Engine(llada2.model, EngineConfig(block_length=L, steps_per_block=4, **cfg))
    return [o.token_ids for o in eng.generate(prompts, params_of(jobs, llada2.stop))], eng


@pytest.mark.parametrize("scheduler,cache,budget,advance", [
    ("blockserve", "persistent", 32, "block"), ("blockserve", "refresh", 40, "step"), ("blockserve", "dual", 56, "block"),
    ("static", "persistent", 120, "block"), ("sequential", "persistent", 28, "block"),
    ("sequential", "refresh", 32, "block")])
def test_the_cache_gives_the_same_tokens(llada2, scheduler, cache, budget, advance):
    """Every row's tokens equal with and without the cache; the cache was used (hits),
    and under the small budgets it evicted and (blockserve) rows were preempted."""
    prompts, jobs = shared_prefix_workload()
    # prefixes ending mid-block, the whole preamble (14 tokens: mid-block), prompts that are
    # all shared prefix (rows 0, 4, 8, ...: no tokens of their own), some of whole blocks only
    assert any(len(p) % L for p in prompts) and any(len(p) == 14 for p in prompts)
    assert any(len(p) % L == 0 for i, p in enumerate(prompts) if i % 4 == 0)
    cfg = dict(scheduler=scheduler, cache=cache, token_budget=budget, max_batch_size=4, advance=advance)
    off, _ = generate(llada2, prompts, jobs, **cfg)
    on, eng = generate(llada2, prompts, jobs, **cfg, enable_prefix_caching=True)
    assert on == off
    st = eng.stats
    assert st.prefix_hit_blocks > 0 and st.prefix_query_blocks >= st.prefix_hit_blocks
    assert st.prefix_hit_tokens == L * st.prefix_hit_blocks and 0 < st.prefix_hit_rate <= 1
    if scheduler != "static":
        assert st.prefix_evictions > 0  # the budget forced the cache to give room
    if scheduler == "blockserve" and cache == "persistent":
        assert eng.scheduler.preemptions > 0
    assert any(len(o) < n for o, (_, n) in zip(off, jobs))  # some rows stopped early


def test_rows_that_join_together_compute_a_shared_prefix_once(llada2):
    """Rows admitted in one batch that share uncached blocks: a leader computes them, the
    others take them from the cache (fewer prompt columns computed, the same tokens)."""
    rng = random.Random(5)
    pre = [rng.randrange(13, 60) for _ in range(16)]
    prompts = [pre + [rng.randrange(13, 60) for _ in range(rng.randint(0, 5))] for _ in range(4)]
    jobs = [("2.1-edit", 2 * L)] * 4
    off, e0 = generate(llada2, prompts, jobs, cache="persistent", token_budget=400)
    on, e1 = generate(llada2, prompts, jobs, cache="persistent", token_budget=400, enable_prefix_caching=True)
    assert on == off
    assert e1.stats.prefix_hit_blocks == 3 * 4  # 3 followers x 4 blocks of the preamble
    assert e1.stats.forward_tokens < e0.stats.forward_tokens


def test_peak_kv_within_the_budget_with_the_cache_full(llada2):
    """K/V peak <= the slots' budget (SLACK x token_budget cells) plus one layer's K, while
    the cache fills what the batch leaves (it had to evict)."""
    prompts, jobs = shared_prefix_workload(n=20, seed=3)
    _, eng = generate(llada2, prompts, jobs, cache="persistent", token_budget=48, max_batch_size=4,
                      enable_prefix_caching=True)
    st, cfg = eng.stats, llada2.model.config
    assert st.prefix_evictions > 0 and st.prefix_inserted_blocks > st.prefix_cached_blocks
    one_layer = st.kv_budget_bytes // (2 * cfg.n_layers)
    assert 0 < st.kv_peak_bytes <= SLACK * st.kv_budget_bytes + one_layer


def test_bidirectional_prompts_are_refused(llada2, tiny_model_dir):
    """LLaDA (a bidirectional prompt), cache none and the full canvas: refused, saying why;
    by the engine and by the job's preflight (no Ray)."""
    from engine.checkpoint import Checkpoint
    from pipeline.checkpoint_check import CheckpointRefused, check_settings

    llada = build_model(ModelConfig.tiny(), dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="enable_prefix_caching: .*depend on the rest of each prompt"):
        Engine(llada, EngineConfig(block_length=4, token_budget=64, enable_prefix_caching=True))
    with pytest.raises(ValueError, match="cache 'none'"):
        Engine(llada2.model, EngineConfig(block_length=4, cache="none", token_budget=64, enable_prefix_caching=True))
    with pytest.raises(ValueError, match="full canvas"):
        Engine(llada2.model, EngineConfig(block_length=4, canvas="full", token_budget=64, enable_prefix_caching=True))
    cfg = EngineConfig(enable_prefix_caching=True)
    with pytest.raises(CheckpointRefused, match="cannot be reused exactly") as e:
        check_settings(Checkpoint.open(tiny_model_dir), SamplingParams(), cfg)
    assert "--enable-prefix-caching" in str(e.value)
    check_settings(Checkpoint.open(llada2.folder), SamplingParams(), cfg)  # accepted


def test_auto_is_on_where_exact(llada2, tiny_model_dir):
    """The default (auto) caches where the cache is exact and is off, silently, elsewhere;
    the engine, the Checkpoint (the preflight's) and the dispatcher's spec resolve it alike;
    False turns it off; the command line has --no-enable-prefix-caching."""
    from actors.spec import EngineSpec
    from engine.checkpoint import Checkpoint
    from pipeline.cli import build_config, parse_args

    llada = build_model(ModelConfig.tiny(), dtype=torch.float32, seed=0)
    published, tiny = Checkpoint.open(llada2.folder), Checkpoint.open(tiny_model_dir)
    cases = [(llada2.model, published, EngineConfig(), True),
             (llada2.model, published, EngineConfig(cache="dual"), True),
             (llada2.model, published, EngineConfig(enable_prefix_caching=False), False),
             (llada2.model, published, EngineConfig(cache="none"), False),
             (llada2.model, published, EngineConfig(canvas="full"), False),
             (llada, tiny, EngineConfig(), False)]  # LLaDA: a bidirectional prompt
    for model, ckpt, cfg, on in cases:
        eng = Engine(model, dataclasses.replace(cfg, block_length=L, token_budget=64))
        assert (eng.prefix is not None, eng.cfg.enable_prefix_caching) == (on, on), cfg
        assert ckpt.prefix_caching(cfg) is on and EngineSpec(ckpt, cfg).prefix_caching() is on, cfg
    assert EngineSpec(llada2.folder).prefix_caching()  # a path: the spec opens it
    assert build_config(parse_args([]), 0).engine.enable_prefix_caching is None
    assert build_config(parse_args(["--no-enable-prefix-caching"]), 0).engine.enable_prefix_caching is False
    assert build_config(parse_args(["--enable-prefix-caching"]), 0).engine.enable_prefix_caching is True


def test_prefix_affinity_routes_to_the_engine_holding_the_prefix():
    from actors.prefix_affinity import PrefixAffinity, prefix_key

    a, b = [list(range(40))], [list(range(100, 140))]
    ka, kb = prefix_key(a, 8), prefix_key(b, 8)
    assert ka != kb and prefix_key([[1, 2]], 8) is None
    r = PrefixAffinity(slack=1)
    assert r.choose(ka, {0: 0, 1: 0}, default=1) == 1  # unknown prefix: the least loaded (own first)
    r.record(ka, 1)
    assert r.choose(ka, {0: 0, 1: 1}, default=0) == 1  # within slack: where its prefix is
    assert r.choose(ka, {0: 0, 1: 2}, default=0) == 0  # too busy: the least loaded
    assert r.choose(ka, {0: 3}, default=0) == 0  # its engine is gone
    assert r.choose(kb, {0: 2, 1: 0}, default=0) == 1


def test_metrics_and_report_show_the_prefix_cache(llada2):
    """The engine's prefix counters reach the Ray metrics (as deltas) and the report."""
    from actors.metrics import PREFIX_METRICS, EngineMetrics
    from pipeline.report import render_report

    prompts, jobs = shared_prefix_workload()
    _, eng = generate(llada2, prompts, jobs, cache="persistent", token_budget=48, max_batch_size=4,
                      enable_prefix_caching=True)
    st = eng.stats

    class Recorder:
        def __init__(self):
            self.value = 0.0

        def inc(self, v):
            self.value += v

        def set(self, v):
            self.value = v

    m = EngineMetrics(0, "tiny", "r")
    m.record_step(type(st)(), [])  # no lookups yet: no prefix series
    assert m._prefix == {}
    m.record_step(st, [])
    assert set(m._prefix) == PREFIX_METRICS
    m._prefix = {k: Recorder() for k in m._prefix}
    more = type(st)(**{**st.__dict__, "prefix_hit_blocks": st.prefix_hit_blocks + 3,
                       "prefix_query_blocks": st.prefix_query_blocks + 5})
    m.record_step(more, [])
    assert m._prefix["blockray_prefix_cache_hit_blocks"].value == 3
    assert m._prefix["blockray_prefix_cache_query_blocks"].value == 5
    assert m._prefix["blockray_prefix_cache_evictions"].value == 0
    assert m._prefix["blockray_prefix_cache_blocks"].value == st.prefix_cached_blocks
    assert m._prefix["blockray_prefix_cache_hit_rate"].value == more.prefix_hit_rate
    figures = {k: getattr(st, k) for k in ("prefix_query_blocks", "prefix_hit_blocks", "prefix_query_tokens",
                                           "prefix_hit_tokens", "prefix_cached_blocks", "prefix_evictions")}
    page = render_report({"engines": {"0": figures, "1": {"prefix_query_blocks": 0}}})
    assert "Prefix cache" in page and f"{st.prefix_hit_rate:.3g}"[:4] in page
    assert "Prefix cache" not in render_report({"engines": {"0": {"steps": 3}}})


def test_the_sorters_prefix_locality_knob():
    """sort_prefix_locality 0: the order by cost (prefix groups only within a bucket); 1:
    every prefix group's rows side by side at its costliest row's place."""
    import pyarrow as pa

    from common.schema import TOKEN_IDS
    from pipeline.sorting.cost import CostModel
    from pipeline.sorting.order import SortWindowUDF

    rng = random.Random(0)
    pre = {t: [rng.randrange(3, 999) for _ in range(40)] for t in "ab"}
    rows = [(t, pre[t] + [rng.randrange(3, 999) for _ in range(rng.randint(1, 9))], rng.randint(8, 512))
            for t in "abababababab"]
    table = pa.table({TOKEN_IDS: [r[1] for r in rows], "sampling_params": [{"max_new_tokens": r[2]} for r in rows],
                      "task": [r[0] for r in rows]})
    cost = CostModel(a=0.0, b=1.0, block_length=4, steps_per_block=4)

    def order(loc):
        return SortWindowUDF(cost, SamplingParams(), "sampling_params", 2, None, loc)(table).column("task").to_pylist()

    runs = lambda seq: 1 + sum(x != y for x, y in zip(seq, seq[1:]))  # noqa: E731
    assert runs(order(0.0)) > 2
    assert runs(order(1.0)) == 2
    assert runs(order(0.0)) >= runs(order(0.75)) >= runs(order(1.0))


def test_a_processor_run_with_two_engines(ray_local, llada2):
    """The job's path with the default settings: two engine actors with the cache (auto:
    on for LLaDA2), batches routed by prefix affinity, the sorter keeping prefixes
    together; every row once, the tokens of an engine without the cache, and the engines'
    stats show hits."""
    import ray

    from pipeline import DLLMProcessorConfig, build_processor

    folder = llada2.folder
    rng = random.Random(7)
    pre = [[rng.randrange(13, 60) for _ in range(20)] for _ in range(3)]
    rows = [{"id": f"r{i:02d}", "prompt_token_ids": pre[i % 3] + [rng.randrange(13, 60) for _ in range(i % 5)]}
            for i in range(12)]
    engine = EngineConfig(block_length=L, steps_per_block=2, cache="persistent", token_budget=512, max_batch_size=8)
    sampling = SamplingParams(max_new_tokens=8, policy="threshold", threshold=0.2, stop_token_ids=[])
    cfg = DLLMProcessorConfig(model=folder, num_engines=2, batch_size=3, max_concurrent_batches=2, dtype="float64",
                              detokenize=False, sort_min_prefix=16, sort_prefix_locality=1.0,
                              engine=engine, sampling=sampling, collect_engine_stats=True)
    proc = build_processor(cfg)
    out = proc(ray.data.from_items(rows, override_num_blocks=4)).take_all()
    assert sorted(r["id"] for r in out) == [r["id"] for r in rows]
    stats = proc.engine_stats()
    assert sum(s["prefix_hit_blocks"] for s in stats.values()) > 0
    model, _ = load_model(folder, dtype=torch.float64, tokenizer=False)
    plain = dataclasses.replace(engine, enable_prefix_caching=False)
    want = [o.token_ids for o in Engine(model, plain).generate([r["prompt_token_ids"] for r in rows],
                                                                [sampling] * len(rows))]
    got = {r["id"]: r["generated_token_ids"] for r in out}
    assert [got[r["id"]] for r in rows] == want
