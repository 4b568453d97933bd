"""Benchmark plumbing: the planted-stop wrapper really ends each request after its
planted number of blocks (through the Engine, every cache mode and scheduler), the
token-budget sizer's arithmetic, and both benchmark scripts run end to end on a tiny
config and write the JSON they promise. No wall-clock thresholds: timings are noise here."""
import json
import math

import pytest
import torch

from bench import engine_bench
from bench.gpu import gpu_bench, prefix_gpu
from bench.planted import Markers, PlantedStops
from bench.workloads import SMOKE_SKEWED, skewed
from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model
from engine.budget import (activation_bytes_per_token, kv_bytes_per_token, kv_peak_bytes_per_token,
                           logits_bytes_per_row, plan_token_budget, weight_bytes)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def work():
    return skewed(SMOKE_SKEWED)


def serve(w, **cfg):
    eng = Engine(w.model, EngineConfig(block_length=w.block_length, steps_per_block=w.steps_per_block,
                                       token_budget=400, max_batch_size=4, **cfg))
    return eng.generate(w.prompts, w.params)


def planted_tokens(w, prompt):
    """Tokens before the planted EOS: T - p, with T decoded from the marker."""
    return prompt[0] - w.model.markers.marker_base - len(prompt)


@pytest.mark.parametrize("cache", ["none", "refresh", "persistent"])
@pytest.mark.parametrize("scheduler,advance", [("blockserve", "block"), ("static", "block"), ("sequential", "block"),
                                               ("blockserve", "step"),
                                               ("static", "step")])
def test_planted_stops_end_requests_at_planted_block(work, cache, scheduler, advance):
    outs = serve(work, cache=cache, scheduler=scheduler, advance=advance)
    assert [o.error for o in outs] == [None] * len(outs)
    assert [o.num_blocks for o in outs] == work.planted_blocks
    assert all(o.finish_reason == "stop" for o in outs)
    for o, p, k in zip(outs, work.prompts, work.planted_blocks):
        n = planted_tokens(work, p)
        assert (k - 1) * work.block_length < n < k * work.block_length
        assert len(o.token_ids) == n
    assert len(set(work.planted_blocks)) > 2  # a real mix of difficulties


def test_planted_marker_is_read_back_from_the_cache(work):
    """Cached block-only steps do not carry the prompt: the marker comes from layer-0 V."""
    work.model._v_table.clear()
    serve(work, cache="refresh", scheduler="blockserve")
    assert work.model._v_table  # the V-matching path ran (and its answers gave the planted blocks above)


def test_planted_tokens_per_step_speed_up_blocks(work):
    outs = serve(work, cache="refresh", scheduler="sequential")
    steps_per_block = [o.num_steps / o.num_blocks for o in outs]
    assert min(steps_per_block) < work.block_length  # several tokens per step, not the flat model's one
    assert sum(len(o.token_ids) for o in outs) / sum(o.num_steps for o in outs) > 1.5


def test_planted_rejects_unmarked_prompts():
    cfg = ModelConfig.tiny("llada", vocab_size=256, mask_token_id=255)
    model = PlantedStops(build_model(cfg, seed=0), Markers(marker_base=128, n_markers=100), block_length=4)
    eng = Engine(model, EngineConfig(block_length=4, steps_per_block=4, token_budget=200))
    out = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8))[0]
    assert out.finish_reason == "error" and "marker" in out.error
    with pytest.raises(ValueError, match="mask or stop"):
        PlantedStops(build_model(cfg, seed=0), Markers(marker_base=200, n_markers=56), block_length=4)


def test_budget_arithmetic():
    llada = ModelConfig(model_type="llada", vocab_size=126464, hidden_size=4096, n_layers=32, n_heads=32,
                        n_kv_heads=32, intermediate_size=12288, mask_token_id=126336, eos_token_id=126081)
    bf16 = torch.bfloat16
    assert kv_bytes_per_token(llada, bf16) == 2 * 32 * 32 * 128 * 2 == 512 * 1024  # K and V, 32 layers
    assert kv_bytes_per_token(ModelConfig.tiny("Dream"), torch.float32) == 2 * 2 * 2 * 8 * 4  # GQA: 2 kv heads
    # the peak holds one buffer (slots that outlive batches, 5% slack) and one layer's K of
    # transient; none holds no cache
    assert kv_peak_bytes_per_token(llada, bf16, "refresh") == kv_peak_bytes_per_token(llada, bf16, "persistent") \
        == math.ceil(1.05 * 512 * 1024) + 512 * 1024 // 64
    assert kv_peak_bytes_per_token(llada, bf16, "none") == 0
    assert weight_bytes(llada, bf16) == 2 * llada.num_params()
    assert activation_bytes_per_token(llada, bf16) == (4 * 12288 + 12 * 4096 + 6 * 4096) * 2 + 8 * 4096
    assert logits_bytes_per_row(llada, bf16, 32) == 32 * (126464 * 2 + 126464 * 24)
    with pytest.raises(ValueError):
        kv_peak_bytes_per_token(llada, bf16, "bogus")

    free = 140 * 2**30
    plan = plan_token_budget(free, llada, bf16, "refresh", 32, min_prompt_len=96)
    per_token = plan.kv_per_token + plan.activations_per_token
    avail = free - plan.weights_bytes - plan.margin_bytes
    assert plan.weights_bytes == weight_bytes(llada, bf16) and plan.margin_bytes == int(0.10 * free)
    assert plan.min_row_width == 128
    # the largest area whose estimate fits: A * per_token + floor(A / 128) * logits_per_row <= avail
    A = plan.token_budget
    assert A * per_token + (A // 128) * plan.logits_per_row <= avail
    assert (A + 1) * per_token + ((A + 1) // 128) * plan.logits_per_row > avail
    assert plan.bytes_for(A) <= free < plan.bytes_for(A + 1)
    assert 30_000 < A < 200_000  # an H200 holds tens of thousands of cells of LLaDA-8B

    # less memory per token -> more tokens; weights already resident -> more tokens
    assert plan_token_budget(free, llada, bf16, "none", 32, min_prompt_len=96).token_budget > A
    assert plan_token_budget(free, llada, bf16, "persistent", 32, min_prompt_len=96).token_budget == A
    assert plan_token_budget(free, llada, bf16, "refresh", 32, min_prompt_len=96,
                             weights_loaded=True).token_budget > A
    # short prompts: more rows per token of area, so more logits workspace, so a smaller budget
    assert plan_token_budget(free, llada, bf16, "refresh", 32, min_prompt_len=1).token_budget < A
    # a row cap makes the logits a constant: A = (avail - R * logits_per_row) // per_token
    capped = plan_token_budget(free, llada, bf16, "refresh", 32, min_prompt_len=1, max_batch_size=64)
    assert capped.token_budget == (avail - 64 * capped.logits_per_row) // per_token
    # nothing fits: budget 0
    assert plan_token_budget(10 * 2**30, llada, bf16).token_budget == 0


EXPECTED_RUN_KEYS = {"tokens_per_s", "requests_per_s", "wall_s", "padding_fraction", "forward_fraction",
                     "host_overhead", "latency_p50_s", "latency_p99_s", "scheduler", "token_budget",
                     "peak_kv_over_budget", "kv_bytes_copied_per_token", "host_ms_per_step", "syncs_per_step"}


def test_engine_bench_smoke_writes_json(tmp_path):
    out = tmp_path / "smoke.json"
    engine_bench.main(["--workload", "skewed", "--smoke", "--out", str(out), "--threads", "1"])
    d = json.loads(out.read_text())
    assert d["command"].startswith("python bench/engine_bench.py --workload skewed --smoke")
    assert {"cpu_count", "platform", "torch"} <= set(d["machine"])
    assert d["workload"]["name"] == "skewed" and d["decoding"]["policy"] == "threshold"
    assert set(d["schedulers"]) == {"sequential", "static-B2", "blockserve@B2", "static-B4", "blockserve@B4"}
    for s in d["schedulers"].values():
        assert EXPECTED_RUN_KEYS <= set(s) and s["tokens_per_s"] > 0 and s["error"] is None
    # equal memory: blockserve's budget is the padded area static-B used
    assert d["schedulers"]["blockserve@B4"]["token_budget"] == d["schedulers"]["static-B4"]["peak_cost"]
    assert {"blockserve/static@B2", "blockserve@B4/sequential"} <= set(d["ratios"])
    assert d["outputs_agree"] is True
    assert (tmp_path / "smoke.png").stat().st_size > 0


def test_fixed_planner_overhead_makes_bench_runs_reproducible(work):
    """Issue 28: with the catch-up planner's overhead an input (EngineConfig), two runs of
    the same bench make the same forwards, pad the same cells and give the same tokens
    (the online fit follows wall-clock timings, so its plans vary from run to run)."""
    from bench.runner import RunSpec, fit_overhead, run

    spec = RunSpec("b", "blockserve", 200, cache="dual", advance="step", canvas="full")
    fitted = fit_overhead(work, spec, n=4)
    assert fitted >= 0
    spec.forward_overhead_cells = 48.0
    a, b = run(work, spec), run(work, spec)
    assert a.error is None and a.forward_overhead_cells == 48.0
    assert (a.forwards, a.computed_cells, a.padded_cells, a.tokens) == (b.forwards, b.computed_cells, b.padded_cells,
                                                                        b.tokens)
    assert a.output_digests == b.output_digests and a.padded_cells > 0


def test_gpu_bench_smoke_runs_on_cpu(tmp_path):
    d = gpu_bench.main(["--smoke", "--out", str(tmp_path), "--n-requests", "6", "--deadline-s", "120"])
    saved = json.loads((tmp_path / "gpu_bench.json").read_text())
    assert saved["done"] is True and saved["smoke"] is True
    labels = {r["label"] for r in saved["runs"]}
    assert {"static-B2", "blockserve@B2", "sequential"} <= labels
    assert all(r["mfu_wall"] > 0 and r["tokens_per_s"] > 0 for r in saved["runs"])
    # the engine's memory and host-loop figures, so that the first H200 run shows them
    assert all(r["syncs_per_step"] == 1.0 and r["host_ms_per_step"] > 0 for r in saved["runs"])
    assert all(0 < r["peak_kv_over_budget"] <= 1.05 + 1 / 4 for r in saved["runs"] if r["scheduler"] == "blockserve")
    assert "blockserve@B2/static-B2" in saved["ratios"] and saved["auto_budget"]["token_budget"] > 0
    # the D2F variant (issue 25): semi-AR and D2F on the same weights read as block-causal
    assert {"blockserve+block-causal@B2", "blockserve+d2f-0.7@B2", "d2f-sequential"} <= labels
    assert "blockserve+d2f-0.7@B2/semi-AR tokens per step" in saved["ratios"]
    assert d["model"]["params"] == saved["model"]["params"]


def test_kv_bench_smoke_reports_the_engine_figures(tmp_path):
    """bench/kv_bench.py (without its baseline worktree here): one run per budget with the
    memory and host-loop figures, and K/V copies by cause."""
    from bench import kv_bench

    d = kv_bench.main(["--smoke", "--out", str(tmp_path / "kv.json")])
    runs = d["new"]["runs"]
    assert set(runs) == {"refresh@B2", "refresh@B4", "persistent@B4"}
    for r in runs.values():
        assert r["syncs_per_step"] == 1.0 and r["host_ms_per_step"] > 0 and r["peak_kv_over_budget"] > 0
        assert set(r["kv_copied_by_per_token"]) == {"regrow", "move", "shift"}
        assert sum(r["kv_copied_by_per_token"].values()) == pytest.approx(r["kv_bytes_copied_per_token"])


def test_d2f_bench_smoke_writes_the_three_tables(tmp_path):
    """bench/d2f_bench.py: the step histogram, the batching table and D2F against semi-AR,
    from the engine's counters; D2F at tau_add <= 0.7 takes fewer steps for the same tokens."""
    from bench import d2f_bench

    d = d2f_bench.main(["--smoke", "--out", str(tmp_path / "d2f.json")])
    h = d["step_histogram"]
    assert len(h["steps"]) == d["workload"]["n_requests"] and sum(h["counts"].values()) == len(h["steps"])
    assert set(d["batching"]) == {1, 4, "one_at_a_time", "requests"} and d["batching"][4]["gain_over_one_at_a_time"] > 0
    v = d["d2f_vs_semi_ar"]
    for t in d2f_bench.TAUS:
        assert v[f"d2f-{t}"]["same_tokens_per_request"] and v[f"d2f-{t}"]["requests_with_more_steps"] == 0
    assert d["d2f_fewer_forwards_per_token_at_tau_add_le_0.7"] is True
    assert (tmp_path / "d2f.png").stat().st_size > 0


def test_bench_readme_is_what_the_json_says():
    """bench/README.md is written by bench/report.py from bench/results/*.json (issue 28):
    a hand edit, or a new result without `python bench/report.py`, fails here."""
    from bench import report

    assert report.main(["--check"]) == 0


def test_prefix_gpu_smoke_runs_on_cpu(tmp_path):
    """bench/gpu/prefix_gpu.py (issue 40 at LLaDA2.0-mini's shape on a GPU), on the CPU at a
    tiny shape: both modes, both orders, the cache hit, the tokens equal (checked inside)."""
    prefix_gpu.main(["--smoke", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "prefix_gpu.json").read_text())
    assert saved["done"] is True and saved["skipped"] == [] and set(saved["modes"]) == {"refresh", "persistent"}
    for mode in saved["modes"].values():
        assert len(mode["rounds"]) == prefix_gpu.ROUNDS and mode["cells_ratio"] > 1
        for pair in mode["rounds"]:
            assert pair["on"]["prefix_hit_blocks"] > 0 and pair["off"]["prefix_hit_blocks"] == 0
            assert pair["on"]["tokens"] == pair["off"]["tokens"] == 3 * 64
