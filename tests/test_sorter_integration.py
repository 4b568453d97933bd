"""sort="blendserve" in the processor (pipeline/sorting/order.py): lazy in every sort mode,
every id comes back exactly once with the same tokens as sort="none", and rows reach the
engine pool costliest first with shared prefixes side by side."""
from __future__ import annotations

import json
import os

import pytest
import ray

from engine import EngineConfig, SamplingParams
from pipeline import DLLMProcessorConfig, build_processor
from pipeline.sorting import PREFIX_CHUNK, order_dataset, prefix_key
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


def test_processor_is_lazy_in_every_sort_mode(tiny_model_dir, ray_local, tmp_path):
    """processor(ds) only builds the plan: no stage runs (the preprocess would leave a
    file), no engine starts, until the dataset is consumed."""
    marker = tmp_path / "ran"

    def pre(row):
        marker.write_text("x")
        return {}

    for sort in ("blendserve", "none"):
        cfg = DLLMProcessorConfig(model=tiny_model_dir, num_engines=1, engine=ENGINE, sampling=SAMPLING, sort=sort)
        proc = build_processor(cfg, preprocess=pre)
        ds = proc(ray.data.from_items(skewed_rows(6)))
        assert not marker.exists() and ds._current_executor is None
    assert len(ds.take_all()) == 6 and marker.exists()


def test_blendserve_matches_none(tiny_model_dir, ray_local):
    rows = skewed_rows()
    _, base, base_stats = _run(tiny_model_dir, "none", rows)
    _, out, stats = _run(tiny_model_dir, "blendserve", rows)
    assert sorted(r["id"] for r in out) == sorted(r["id"] for r in rows)  # exactly once
    by_id = {r["id"]: r for r in base}
    for r in out:
        assert r["generated_token_ids"] == by_id[r["id"]]["generated_token_ids"], r["id"]
        assert r["finish_reason"] == by_id[r["id"]]["finish_reason"]
    assert not [c for c in out[0] if c.startswith("__")]
    assert stats and base_stats  # (padding against arrival order: bench/sorter_bench.py)


def _tokenized(rows, n_blocks=5):
    return ray.data.from_items(rows, override_num_blocks=n_blocks)


def test_order_is_costliest_first(tiny_model_dir, ray_local):
    rows = [{"id": f"r{i}", TOKEN_IDS: [5] * (3 + (i * 7) % 40)} for i in range(30)]
    cfg = DLLMProcessorConfig(model=tiny_model_dir, num_engines=2, batch_size=4, engine=ENGINE, sampling=SAMPLING)
    out = order_dataset(_tokenized(rows), cfg).take_all()
    assert sorted(r["id"] for r in out) == sorted(r["id"] for r in rows)
    lens = [len(r[TOKEN_IDS]) for r in out]
    assert lens == sorted(lens, reverse=True)  # one budget: cost follows the prompt length
    assert set(out[0]) == {"id", TOKEN_IDS}
    # a bigger budget (per-row override, vLLM's name) is costlier than a longer prompt
    rows.append({"id": "big", TOKEN_IDS: [5] * 3, "sampling_params": {"max_tokens": 64}})
    assert order_dataset(_tokenized(rows), cfg).take(1)[0]["id"] == "big"


def test_prefix_key_compares_whole_chunks():
    a = list(range(3 * PREFIX_CHUNK + 5))
    b = a[:2 * PREFIX_CHUNK] + [999] + a[2 * PREFIX_CHUNK + 1:]
    ka, kb = prefix_key(a), prefix_key(b)
    assert len(ka) == 3 and ka[:2] == kb[:2] and ka[2] != kb[2]
    assert prefix_key(a[:PREFIX_CHUNK - 1]) == ()


def test_shared_prefixes_sit_side_by_side(tiny_model_dir, ray_local):
    """Three few-shot templates (48 shared tokens) among singletons of the same cost:
    each template's rows are adjacent in the order. Every row exactly once."""
    rows = []
    for t in range(3):
        rows += [{"id": f"t{t}-{i}", TOKEN_IDS: [7 + t] * 48 + [20 + i] * 2} for i in range(5)]
    rows += [{"id": f"s{i}", TOKEN_IDS: [30 + i] * 50} for i in range(9)]
    cfg = DLLMProcessorConfig(model=tiny_model_dir, num_engines=2, batch_size=4, engine=ENGINE, sampling=SAMPLING)
    ids = [r["id"] for r in order_dataset(_tokenized(rows), cfg).take_all()]
    assert sorted(ids) == sorted(r["id"] for r in rows)
    for t in range(3):
        pos = [k for k, i in enumerate(ids) if i.startswith(f"t{t}-")]
        assert pos == list(range(pos[0], pos[0] + 5)), ids


def test_sort_modes_validated(tiny_model_dir):
    with pytest.raises(ValueError):
        DLLMProcessorConfig(model=tiny_model_dir, sort="bogus")


def test_sorter_bench_smoke_writes_json(tmp_path, ray_local):
    """bench/sorter_bench.py runs end to end (both modes; on the session's Ray, which the
    bench uses when its process has one) and reports every row once, per mode."""
    from bench import sorter_bench

    out = tmp_path / "sorter.json"
    sorter_bench.main(["--rows", "10", "--orders", "front_loaded", "--hidden-size", "32", "--layers", "1",
                       "--max-new-tokens", "8", "--out", str(out)])
    res = json.loads(out.read_text())["front_loaded"]
    for mode in ("none", "blendserve"):
        assert res[mode]["rows_out"] == 10 and res[mode]["ids_exactly_once"] and res[mode]["errors"] == 0
    assert set(res["summary"]["targets"]) == {"wall_ratio<=1.02", "busy_spread_sorter<=0.10",
                                              "busy_cpu_spread_sorter<=0.10", "padding_sorter<padding_none"}


def test_sorter_bench_scale_smoke_writes_json_and_png(tmp_path, ray_local):
    """The scale mode (bench/sorter_scale.py) runs end to end on tiny sizes (on the
    session's Ray): every run returns every id once, the summary carries the issue's keys,
    the PNG is written."""
    from bench import sorter_bench

    out = tmp_path / "scale.json"
    sorter_bench.main(["--scale", "--scale-rows", "24,48", "--scale-orders", "front_loaded", "--reps", "1",
                       "--ordering-rows", "3000", "--max-new-tokens", "8", "--hidden-size", "32", "--layers", "1",
                       "--out", str(out)])
    res = json.loads(out.read_text())
    assert len(res["end_to_end"]) == 4
    for r in res["end_to_end"]:
        assert r["ids_exactly_once"] and r["errors"] == 0 and r["driver_peak_rss_mb"] > 0
    assert [o["rows_out"] for o in res["ordering"]] == [3000]
    summary = res["summary"]
    assert set(summary["r2"]) == {"blendserve", "none"} and "blendserve_over_none_24" in summary
    assert "front_loaded_48_blendserve_faster" in summary["targets"]
    assert os.path.getsize(res["plot"]) > 0
