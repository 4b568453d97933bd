"""Tests for pipeline.sorter: cost estimates, calibration fit, and sharding properties."""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.sorter import (
    CPU,
    H200,
    CostModel,
    DeviceProfile,
    ModelProfile,
    PrefixTrie,
    RequestFeatures,
    ShardPlan,
    estimate,
    fit_cycle_time,
    padding_fraction,
    shard,
)

LLADA_CFG = dict(model_type="llada", d_model=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                 mlp_hidden_size=12288, vocab_size=126464, embedding_size=126464)
DREAM_CFG = dict(model_type="Dream", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, torch_dtype="bfloat16")
LLADA = ModelProfile.from_config(LLADA_CFG)
TINY = ModelProfile(n_layers=2, hidden_size=64, n_heads=4, n_kv_heads=2, intermediate_size=128, vocab_size=100)
MIN_PREFIX = 16
PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --------------------------------------------------------------------------- helpers


def _groups(feats: List[RequestFeatures], m: int) -> Dict[Tuple[int, ...], List[int]]:
    """Reference grouping, independent of the trie: two requests share >= m tokens
    iff both prefixes have >= m tokens and their first m tokens are equal."""
    out: Dict[Tuple[int, ...], List[int]] = {}
    for i, f in enumerate(feats):
        if f.prefix is not None and len(f.prefix) >= m:
            out.setdefault(f.prefix[:m], []).append(i)
    return out


def _rank_of(plan: ShardPlan) -> Dict[int, int]:
    return {i: r for r, rk in enumerate(plan.ranks) for i in rk}


@st.composite
def workloads(draw) -> Tuple[List[RequestFeatures], int]:
    """Small random workloads with a few shared prefixes over a 3-token vocabulary
    (so long common prefixes actually occur) and some ungrouped requests."""
    bases = draw(st.lists(st.lists(st.integers(0, 2), min_size=8, max_size=40), min_size=1, max_size=4))
    n = draw(st.integers(1, 40))
    feats = []
    for _ in range(n):
        p = draw(st.integers(1, 400))
        g = draw(st.integers(1, 200))
        if draw(st.integers(0, 3)) == 0:
            prefix: Optional[Tuple[int, ...]] = None
        else:
            tail = draw(st.lists(st.integers(0, 2), max_size=12))
            prefix = tuple(draw(st.sampled_from(bases)) + tail)
        feats.append(RequestFeatures(prompt_len=p, max_new_tokens=g, prefix=prefix))
    return feats, draw(st.integers(1, 6))


def _plan(feats: List[RequestFeatures], R: int) -> ShardPlan:
    return shard(feats, num_ranks=R, model=TINY, device=H200, block_length=8, steps_per_block=4,
                 min_prefix=MIN_PREFIX, batch_size=4)


# --------------------------------------------------------------------------- properties


@PROPS
@given(workloads())
def test_every_request_assigned_once_and_lpt_bound(wl):
    feats, R = wl
    plan = _plan(feats, R)
    assert len(plan.ranks) == R
    flat = [i for rk in plan.ranks for i in rk]
    assert sorted(flat) == list(range(len(feats)))
    # items partition the requests and each lies within one rank (they are real units)
    assert sorted(i for it in plan.items for i in it) == list(range(len(feats)))
    where = _rank_of(plan)
    assert all(len({where[i] for i in it}) == 1 for it in plan.items)
    cost = np.array(plan.costs)
    total = float(cost.sum())
    largest = max(float(cost[it].sum()) for it in plan.items)
    opt_lb = max(total / R, largest)
    rank_cost = [float(cost[rk].sum()) for rk in plan.ranks]
    assert np.allclose(rank_cost, plan.report["rank_cost"])
    assert max(rank_cost) <= (4.0 / 3.0 * opt_lb + largest) * (1 + 1e-9)
    # an item is bigger than one rank's share only if it is a single request
    assert all(len(it) == 1 or float(cost[it].sum()) <= total / R * (1 + 1e-9) for it in plan.items)


@PROPS
@given(workloads())
def test_prefix_groups_below_share_never_split(wl):
    feats, R = wl
    plan = _plan(feats, R)
    cost = np.array(plan.costs)
    share = float(cost.sum()) / R
    where = _rank_of(plan)
    for members in _groups(feats, MIN_PREFIX).values():
        if float(cost[members].sum()) <= share * (1 - 1e-9):
            assert len({where[i] for i in members}) == 1, members


@PROPS
@given(workloads())
def test_shards_sorted_by_length_with_groups_contiguous(wl):
    feats, R = wl
    plan = _plan(feats, R)
    gid = {}
    for k, members in enumerate(_groups(feats, MIN_PREFIX).values()):
        for i in members:
            gid[i] = ("g", k)
    for rk in plan.ranks:
        units: List[List[int]] = []
        for i in rk:
            key = gid.get(i, ("s", i))
            if units and gid.get(units[-1][0], ("s", units[-1][0])) == key:
                units[-1].append(i)
            else:
                units.append([i])
        keys = [gid.get(u[0], ("s", u[0])) for u in units]
        assert len(keys) == len(set(keys)), "a prefix group is not contiguous on its rank"
        for u in units:
            lens = [feats[i].prompt_len for i in u]
            assert lens == sorted(lens, reverse=True)
        firsts = [feats[u[0]].prompt_len for u in units]
        assert firsts == sorted(firsts, reverse=True)


# --------------------------------------------------------------------------- skewed workload


def _skewed(seed: int = 0, n: int = 200) -> List[RequestFeatures]:
    """20% of prompts 8x longer than the rest, adversarially ordered (all long first)."""
    rng = np.random.default_rng(seed)
    n_long = n // 5
    short = rng.integers(128, 384, size=n - n_long)
    long = 8 * rng.integers(128, 384, size=n_long)
    gens = rng.integers(128, 257, size=n)
    lens = list(long) + list(short)
    return [RequestFeatures(prompt_len=int(p), max_new_tokens=int(g)) for p, g in zip(lens, gens)]


def test_skewed_workload_balanced_and_less_padding_than_naive():
    feats = _skewed()
    plan = shard(feats, num_ranks=2, model=LLADA, device=H200, block_length=32, steps_per_block=8,
                 min_prefix=32, batch_size=8)
    rep = plan.report
    assert rep["imbalance"] <= 1.05
    assert rep["naive_imbalance"] >= 1.2  # long-first chunking piles the long prompts on rank 0
    assert rep["naive_imbalance"] > rep["imbalance"] + 0.15
    assert rep["padding_mean"] < rep["naive_padding_mean"]
    assert max(rep["padding"]) < min(rep["naive_padding"])
    # same mix: each rank gets about half of the long prompts
    long_per_rank = [sum(feats[i].prompt_len >= 1024 for i in rk) for rk in plan.ranks]
    assert all(abs(c - 20) <= 3 for c in long_per_rank), long_per_rank
    # the naive numbers are what a contiguous split really gives
    naive = np.array_split(np.arange(len(feats)), 2)
    cost = np.array(plan.costs)
    assert np.allclose(rep["naive_rank_cost"], [cost[c].sum() for c in naive])


def test_padding_fraction_definition():
    assert padding_fraction([10, 10, 10, 10], 2) == 0.0
    # windows [10, 30] and [20, 20]: cells 80, padded 2*30 + 2*20 = 100
    assert padding_fraction([10, 30, 20, 20], 2) == pytest.approx(0.2)
    assert padding_fraction([], 4) == 0.0


# --------------------------------------------------------------------------- prefix trie


def test_trie_groups_and_splits_oversized_group_along_subtrees():
    base = tuple(range(40))
    feats = []
    # a big family sharing 40 tokens: two sub-families sharing 50 tokens
    for sub in (100, 200):
        for k in range(6):
            feats.append(RequestFeatures(prompt_len=300, max_new_tokens=64, prefix=base + (sub,) * 10 + (k,)))
    feats += [RequestFeatures(prompt_len=50, max_new_tokens=64, prefix=(7,) * 40) for _ in range(2)]
    # R=2: the 12-request family is ~90% of the cost, far above one rank's share
    plan = shard(feats, num_ranks=2, model=LLADA, block_length=32, steps_per_block=8, min_prefix=32)
    assert plan.report["num_split_groups"] == 1
    where = _rank_of(plan)
    sub_a, sub_b = list(range(6)), list(range(6, 12))
    cost = np.array(plan.costs)
    share = cost.sum() / 2
    assert cost[sub_a].sum() <= share and cost[sub_b].sum() <= share
    # the cut follows the trie: each 50-token sub-family stays on one rank
    assert len({where[i] for i in sub_a}) == 1 and len({where[i] for i in sub_b}) == 1
    assert where[12] == where[13]
    assert plan.report["imbalance"] < 1.2


def test_trie_members_and_group_nodes():
    trie = PrefixTrie()
    trie.insert((1, 2, 3, 4), 0)
    trie.insert((1, 2, 3, 5), 1)
    trie.insert((1, 2, 9), 2)
    trie.insert((1, 2), 3)
    trie.insert((8,), 4)
    assert sorted(PrefixTrie.members(trie.root)) == [0, 1, 2, 3, 4]
    groups = sorted(sorted(PrefixTrie.members(n)) for n in trie.group_nodes(3))
    assert groups == [[0, 1], [2]]
    groups = sorted(sorted(PrefixTrie.members(n)) for n in trie.group_nodes(2))
    assert groups == [[0, 1, 2, 3]]


# --------------------------------------------------------------------------- cost estimate


def _brute_force(p: int, g: int, m: ModelProfile, L: int, S: int) -> Tuple[float, float]:
    """Cycle-by-cycle FLOPs and KV bytes with the refresh cache (reference for the closed form)."""
    flops = kv = 0.0
    for b in range(math.ceil(g / L)):
        w = p + (b + 1) * L
        flops += m.linear_flops_per_token() * w + m.attention_flops_per_pair() * w * w
        kv += m.kv_bytes_per_token() * w
        for _ in range(S - 1):
            flops += m.linear_flops_per_token() * L + m.attention_flops_per_pair() * L * w
            kv += m.kv_bytes_per_token() * (w + L)
        flops += m.head_flops_per_token() * S * L
    return flops, kv


@pytest.mark.parametrize("p,g,L,S", [(1, 1, 32, 32), (100, 64, 32, 8), (777, 300, 16, 4), (5, 33, 32, 1)])
def test_estimate_matches_cycle_by_cycle_sum(p, g, L, S):
    c = estimate(RequestFeatures(p, g), LLADA, H200, block_length=L, steps_per_block=S)
    flops, kv = _brute_force(p, g, LLADA, L, S)
    assert c.blocks == math.ceil(g / L)
    assert c.flops == pytest.approx(flops, rel=1e-12)
    assert c.kv_bytes == pytest.approx(kv, rel=1e-12)
    assert c.time_s == max(c.compute_s, c.memory_s)


def test_density_depends_on_length_and_device():
    short, long = RequestFeatures(64, 256), RequestFeatures(4096, 256)
    hs, hl = estimate([short, long], LLADA, H200, block_length=32, steps_per_block=32)
    cs, cl = estimate([short, long], LLADA, CPU, block_length=32, steps_per_block=32)
    assert hl.flops > hs.flops and hl.kv_bytes > hs.kv_bytes
    assert not math.isclose(hs.density, hl.density, rel_tol=0.05)
    # same request, different roofline: density scales by (bw/peak) ratio of the devices
    assert cs.density != hs.density
    ratio = (CPU.mem_bandwidth / CPU.peak_flops) / (H200.mem_bandwidth / H200.peak_flops)
    assert cs.density / hs.density == pytest.approx(ratio)
    assert cs.time_s > hs.time_s
    # GQA (Dream: 4 kv heads) moves far fewer KV bytes per token than MHA (LLaDA)
    dream = ModelProfile.from_config(DREAM_CFG)
    assert estimate(long, dream, H200).density > estimate(long, LLADA, H200).density


def test_calibration_scales_blocks_not_beyond_budget():
    f = RequestFeatures(100, 256)
    full = estimate(f, LLADA, block_length=32)
    half = estimate(f, LLADA, block_length=32, calibration=0.5)
    over = estimate(f, LLADA, block_length=32, calibration=3.0)
    assert (full.blocks, half.blocks, over.blocks) == (8, 4, 8)
    assert half.flops < full.flops
    with pytest.raises(ValueError):
        estimate(f, LLADA, calibration=0.0)


def test_model_profile_from_config_both_layouts():
    assert (LLADA.hidden_size, LLADA.n_layers, LLADA.n_heads, LLADA.n_kv_heads, LLADA.head_dim,
            LLADA.intermediate_size, LLADA.vocab_size) == (4096, 32, 32, 32, 128, 12288, 126464)
    dream = ModelProfile.from_config(DREAM_CFG)
    assert (dream.hidden_size, dream.n_layers, dream.n_heads, dream.n_kv_heads, dream.head_dim,
            dream.intermediate_size, dream.vocab_size) == (3584, 28, 28, 4, 128, 18944, 152064)
    assert ModelProfile.from_config({**DREAM_CFG, "torch_dtype": "float32"}).bytes_per_element == 4.0
    with pytest.raises(KeyError):
        ModelProfile.from_config({"vocab_size": 10})


# --------------------------------------------------------------------------- calibration


def test_fit_cycle_time_recovers_constants():
    a, b = 0.012, 3.5e-7
    cells = np.array([1000, 5000, 12000, 30000, 65536], dtype=float)
    fit = fit_cycle_time(zip(cells, a + b * cells))
    assert fit.a == pytest.approx(a, rel=1e-9) and fit.b == pytest.approx(b, rel=1e-9)
    assert fit.rmse == pytest.approx(0.0, abs=1e-12) and fit.n == 5
    rng = np.random.default_rng(1)
    x = rng.uniform(500, 65536, size=400)
    noisy = fit_cycle_time(zip(x, a + b * x + rng.normal(0, 1e-4, size=x.size)))
    assert noisy.a == pytest.approx(a, rel=0.05) and noisy.b == pytest.approx(b, rel=0.02)
    assert noisy.predict(10000.0) == pytest.approx(a + b * 10000, rel=0.01)
    with pytest.raises(ValueError):
        fit_cycle_time([(100, 1.0), (100, 2.0)])
    with pytest.raises(ValueError):
        fit_cycle_time([(100, 1.0)])


def test_cost_model_feeds_back_into_shard():
    fit = fit_cycle_time([(1000, 0.01 + 1e-6 * 1000), (9000, 0.01 + 1e-6 * 9000)])
    cm = CostModel.from_fit(fit, block_length=32, concurrency=4)
    f = RequestFeatures(100, 64)  # 2 blocks, widths 132 and 164
    assert cm.time_for(f) == pytest.approx(2 * 0.01 / 4 + 1e-6 * (132 + 164))
    # cells the engine forwards per request with S = 8 steps per block, per cache mode
    cells = {c: float(CostModel(0.0, 1.0, 32, steps_per_block=8, cache=c).cells(100, 2))
             for c in ("none", "refresh", "persistent")}
    assert cells == {"none": 8 * (132 + 164), "refresh": 132 + 164 + 2 * 7 * 32, "persistent": 100 + 32 + 32 * 2 + 2 * 7 * 32}
    feats = _skewed(seed=3, n=60)
    plan = shard(feats, num_ranks=3, model=LLADA, block_length=32, steps_per_block=8, cost_model=cm)
    assert plan.costs == pytest.approx([cm.time_for(x) for x in feats])
    assert plan.report["cost_unit"].startswith("s (fitted")
    assert plan.report["imbalance"] <= 1.05


def test_edge_cases():
    plan = shard([], num_ranks=3, model=TINY)
    assert plan.ranks == [[], [], []] and plan.report["imbalance"] == 1.0
    one = shard([RequestFeatures(10, 5)], num_ranks=4, model=TINY)
    assert sum(len(r) for r in one.ranks) == 1
    with pytest.raises(ValueError):
        shard([RequestFeatures(10, 5)], num_ranks=0, model=TINY)
    with pytest.raises(ValueError):
        RequestFeatures(10, 0)
    assert RequestFeatures(3, 1, prefix=[1, 2, 3]).prefix == (1, 2, 3)
    assert isinstance(DeviceProfile("x", 1.0, 1.0), DeviceProfile)
