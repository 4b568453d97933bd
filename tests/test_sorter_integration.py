"""sort="blendserve" in the processor (pipeline/sharding.py): every id comes back exactly
once with the same tokens as sort="none", each row ran on the engine its plan named, in
plan order, the engines pad less than with arrival order, and the optional calibration
fits the cost model from engine timings."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import ray

from conftest import ROOT, ray_env
from engine import EngineConfig, SamplingParams
from pipeline import DLLMProcessorConfig, build_processor
from pipeline.sharding import PREFIX_CHUNK, calibrate_cost_model, prefix_key, shard_dataset
from pipeline.stages import TOKEN_IDS

ENGINE = EngineConfig(block_length=4, steps_per_block=2, cache="refresh", token_budget=4096, max_batch_size=8)
SAMPLING = SamplingParams(max_new_tokens=8, policy="threshold", threshold=0.3)


def skewed_rows(n: int = 18, long_share: float = 0.25, short_len: int = 3, factor: int = 8,
                order: str = "interleaved"):
    """`long_share` of the prompts `factor` x longer than the rest; order "long_first"
    (adversarial for balance: every long prompt first) or "interleaved" (lengths mixed
    through the input, as in real data: what pads without the sorter)."""
    n_long = int(n * long_share)
    every = max(1, n // max(n_long, 1))
    rows = []
    for i in range(n):
        is_long = i < n_long if order == "long_first" else (i % every == 0 and i // every < n_long)
        length = short_len * factor if is_long else short_len
        word = "".join("abcdefghijklmnopqrstuvwxyz"[(i + j) % 26] for j in range(length))
        rows.append({"id": f"r{i:03d}", "prompt": word})
    return rows


def _run(model: str, sort: str, rows, **kw):
    kw = {"batch_size": 3, "max_concurrent_batches": 2, **kw}
    cfg = DLLMProcessorConfig(model=model, num_engines=2, engine=ENGINE, sampling=SAMPLING, dtype="float64",
                              sort=sort, collect_engine_stats=True, **kw)
    proc = build_processor(cfg)
    out = proc(ray.data.from_items(rows, override_num_blocks=len(rows) // cfg.batch_size)).take_all()
    return proc, out, proc.engine_stats()


def _padding(stats):
    padded = sum(s["padded_cells"] for s in stats.values())
    computed = sum(s["computed_cells"] for s in stats.values())
    return padded / computed


def test_blendserve_matches_none_and_follows_plan(tiny_model_dir, ray_local):
    rows = skewed_rows()
    # One batch of 2 at a time per engine: which rows share a forward is then fixed by the
    # order each engine receives them in, not by when batches happen to arrive.
    one_at_a_time = dict(batch_size=2, max_concurrent_batches=1)
    _, base, base_stats = _run(tiny_model_dir, "none", rows, **one_at_a_time)
    # With calibration on: the cost model is fitted from in-process engine timings first.
    proc, out, stats = _run(tiny_model_dir, "blendserve", rows, calibrate=True, calibration_samples=6,
                            **one_at_a_time)

    ids = sorted(r["id"] for r in out)
    assert ids == sorted(r["id"] for r in rows)  # exactly once
    by_id = {r["id"]: r for r in base}
    for r in out:
        assert r["generated_token_ids"] == by_id[r["id"]]["generated_token_ids"], r["id"]
        assert r["finish_reason"] == by_id[r["id"]]["finish_reason"]
        assert r["engine_rank"] == r["shard_rank"]  # ran on the rank the plan named
    assert not [c for c in out[0] if c.startswith("__")]

    plan = proc.sharded.plan
    assert {r["engine_rank"] for r in out} == {0, 1}
    for rank, idx in enumerate(plan.ranks):
        mine = sorted((r for r in out if r["shard_rank"] == rank), key=lambda r: r["shard_order"])
        assert [r["shard_order"] for r in mine] == list(range(len(idx)))
        lens = [r["num_prompt_tokens"] for r in mine]
        assert lens == sorted(lens, reverse=True)  # each shard ordered by prompt length, longest first
    assert plan.report["imbalance"] <= plan.report["naive_imbalance"]
    assert proc.sharded.calibration is not None and plan.report["cost_unit"].startswith("s (fitted")

    # Acceptance 3: the engines' own padding counters are lower with the sorter.
    # (sort="none" may hand every batch to one engine: Ray Data's pool does not balance.)
    assert set(stats) == {0, 1} and base_stats
    assert _padding(stats) < _padding(base_stats), (_padding(stats), _padding(base_stats))


def test_prefix_key_compares_whole_chunks():
    a = list(range(3 * PREFIX_CHUNK + 5))
    b = a[:2 * PREFIX_CHUNK] + [999] + a[2 * PREFIX_CHUNK + 1:]
    ka, kb = prefix_key(a), prefix_key(b)
    assert len(ka) == 3 and ka[:2] == kb[:2] and ka[2] != kb[2]
    assert prefix_key(a[:PREFIX_CHUNK - 1]) == ()


def test_shared_prefixes_stay_on_one_engine_and_adjacent(tiny_model_dir, ray_local):
    """Three few-shot templates (48 shared tokens) among singletons: each template's rows
    land on one rank, next to each other in its shard; prefixes under sort_min_prefix
    are not grouped. Every row is in exactly one shard."""
    rows = []
    for t in range(3):
        head = [7 + t] * 48
        rows += [{"id": f"t{t}-{i}", TOKEN_IDS: head + [20 + i] * (2 + i)} for i in range(5)]
    rows += [{"id": f"s{i}", TOKEN_IDS: [30 + i] * (4 + 5 * i)} for i in range(9)]
    rows += [{"id": f"short{i}", TOKEN_IDS: [40] * 16 + [41 + i] * 20} for i in range(2)]  # 16 shared < 32
    cfg = DLLMProcessorConfig(model=tiny_model_dir, num_engines=2, batch_size=4, engine=ENGINE, sampling=SAMPLING)
    sharded = shard_dataset(ray.data.from_items(rows, override_num_blocks=5), cfg, "cpu")
    assert sharded.plan.report["num_groups"] == 3
    shards = [[r["id"] for r in ds.take_all()] if ds is not None else [] for ds in sharded.rank_datasets]
    assert sorted(i for s in shards for i in s) == sorted(r["id"] for r in rows)
    for t in range(3):
        where = [(k, pos) for k, s in enumerate(shards) for pos, i in enumerate(s) if i.startswith(f"t{t}-")]
        assert len({k for k, _ in where}) == 1, where
        pos = sorted(p for _, p in where)
        assert pos == list(range(pos[0], pos[0] + 5)), where
    off = dataclasses.replace(cfg, sort_min_prefix=0)
    assert shard_dataset(ray.data.from_items(rows), off, "cpu").plan.report["num_groups"] == 0


def test_calibration_fits_cost_model(tiny_model_dir, ray_local):
    cfg = DLLMProcessorConfig(model=tiny_model_dir, num_engines=2, batch_size=3, engine=ENGINE, sampling=SAMPLING)
    prompts = [[5 + (i % 20)] * (4 if i % 3 else 24) for i in range(8)]
    cm, report = calibrate_cost_model(cfg, prompts)
    assert report["n"] >= 2 and cm.a >= 0 and cm.b > 0  # clamped when the raw slope is not positive
    assert cm.block_length == ENGINE.block_length
    t = cm.times([4, 32], [8, 8])
    assert 0 < t[0] < t[1]  # longer prompts cost more


def test_sort_modes_validated(tiny_model_dir):
    with pytest.raises(ValueError):
        DLLMProcessorConfig(model=tiny_model_dir, sort="bogus")


def test_sorter_bench_smoke_writes_json(tmp_path):
    """bench/sorter_bench.py runs end to end (its own local Ray, both modes) and reports
    every row once, per mode."""
    out = tmp_path / "sorter.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "sorter_bench.py"), "--rows", "10",
                    "--orders", "front_loaded", "--hidden-size", "32", "--layers", "1", "--out", str(out)],
                   cwd=ROOT, env=ray_env(), check=True, timeout=600, capture_output=True)
    res = json.loads(out.read_text())["front_loaded"]
    for mode in ("none", "blendserve"):
        assert res[mode]["rows_out"] == 10 and res[mode]["ids_exactly_once"] and res[mode]["errors"] == 0
    assert set(res["summary"]["targets"]) == {"est_imbalance_sorter<=1.05", "busy_spread_sorter<=0.15",
                                              "busy_cpu_spread_sorter<=0.15", "padding_sorter<padding_none"}
