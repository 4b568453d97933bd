"""gpu_memory_utilization (issue 42, acceptance 4): with token_budget unset, an engine
plans its budget at start from its device's free memory (engine.budget), runs within
it, and reports it (the actor's log line and posted stats, summary.json, the report);
the preflight refuses a model that cannot fit on the cluster's GPUs. There is no GPU
here: the tests fake only the device's memory query (engine.budget.device_memory), and
feed the cluster's GPU memory to the preflight as data."""
from __future__ import annotations

import json
import logging
import math
import os
import types

import pytest
import torch

import engine.budget as budget
from actors.engine_actor import DLLMEngineActor
from actors.spec import EngineSpec
from conftest import write_prompts
from engine import Engine, EngineConfig, SamplingParams, load_model
from engine.budget import plan_token_budget
from engine.config import DEFAULT_TOKEN_BUDGET
from pipeline.config import DLLMProcessorConfig
from pipeline.errors import JobError
from pipeline.resources import Cluster, check_gpu_memory

GiB = 1 << 30
TOTAL = 10 * GiB
UTIL = 0.8
# what the device reports free: (1 - UTIL) x TOTAL held back, the plan's 512 MiB reserve, and 6 MiB for the batch
FREE = math.ceil((1 - UTIL) * TOTAL) + (512 << 20) + (6 << 20)
CONFIG = EngineConfig(block_length=4, steps_per_block=4, max_batch_size=8, gpu_memory_utilization=UTIL)
PROMPTS = [[5 + (i % 7)] * (3 + i % 9) for i in range(14)]
PARAMS = SamplingParams(max_new_tokens=8, seed=3)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    torch.set_num_threads(1)
    return load_model(tiny_model_dir, dtype=torch.float64, tokenizer=False)[0]


@pytest.fixture
def fake_gpu(monkeypatch):
    """The device's memory query answers (FREE, TOTAL), whatever the device."""
    monkeypatch.setattr(budget, "device_memory", lambda device: (FREE, TOTAL))


def expected_plan(cfg):
    """plan_token_budget's answer for FREE of TOTAL at UTIL, the weights loaded."""
    usable = FREE - math.ceil((1 - UTIL) * TOTAL)
    return plan_token_budget(usable, cfg, torch.float64, CONFIG.cache, CONFIG.block_length, weights_loaded=True,
                             max_batch_size=CONFIG.max_batch_size, margin_frac=0.0,
                             max_area=CONFIG.max_batch_size * cfg.max_seq_len)


def test_the_planned_budget_is_plan_token_budgets_and_the_engine_stays_within_it(model, fake_gpu):
    plan = expected_plan(model.config)
    assert 40 < plan.token_budget < CONFIG.max_batch_size * model.config.max_seq_len  # the memory binds, not the cap
    eng = Engine(model, CONFIG, record_batches=True)
    assert eng.budget.source == "planned" and eng.budget.plan == plan
    assert eng.cfg.token_budget == eng.stats.token_budget == plan.token_budget
    outs = eng.generate(PROMPTS, PARAMS)
    assert all(o.finish_reason != "error" for o in outs)
    # the engine's own accounting: every batch within the budget, its K/V within the plan's K/V term
    assert max(b.cost for b in eng.batch_log) <= plan.token_budget
    assert len({len(b.request_ids) for b in eng.batch_log}) > 1  # the budget shaped the batches
    assert 0 < eng.stats.kv_peak_bytes <= plan.kv_per_token * plan.token_budget
    assert eng.slots.cells <= budget.SLACK * plan.token_budget
    assert plan.bytes_for(plan.token_budget) <= plan.free_bytes
    # the same tokens as an engine given that budget (the resolved number is all that changes)
    fixed = Engine(model, EngineConfig(block_length=4, steps_per_block=4, max_batch_size=8,
                                       token_budget=plan.token_budget, gpu_memory_utilization=UTIL))
    assert fixed.budget.source == "token_budget"
    assert [o.token_ids for o in fixed.generate(PROMPTS, PARAMS)] == [o.token_ids for o in outs]


def test_a_given_budget_wins_and_a_gpu_too_small_is_refused(model, fake_gpu, monkeypatch):
    eng = Engine(model, EngineConfig(block_length=4, steps_per_block=4, token_budget=300, gpu_memory_utilization=UTIL))
    assert (eng.budget.source, eng.cfg.token_budget) == ("token_budget", 300)
    monkeypatch.setattr(budget, "device_memory", lambda device: (FREE - (6 << 20), TOTAL))  # nothing past the reserve
    with pytest.raises(ValueError, match=r"no token budget fits on cpu: .* gpu_memory_utilization 0.8 leaves"):
        Engine(model, CONFIG)


def test_cpu_keeps_the_fixed_default_and_refuses_a_utilization(model):
    eng = Engine(model, EngineConfig(block_length=4, steps_per_block=4))
    assert (eng.budget.source, eng.cfg.token_budget) == ("default", DEFAULT_TOKEN_BUDGET)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.8: this engine runs on cpu"):
        Engine(model, CONFIG)


def test_the_actor_logs_posts_and_the_report_shows_the_planned_budget(tiny_model_dir, fake_gpu, caplog):
    """The actor resolves the budget once (before warm-up and engine), says it in its
    start-up log line and its posted stats, which become summary.json's and the report's
    per-engine figures (pipeline/run.py engine_figures)."""
    from pipeline.report import render_report
    from pipeline.run import engine_figures
    from pipeline.summary import format_summary

    with caplog.at_level(logging.INFO, logger="actors.engine_actor"):
        actor = DLLMEngineActor(EngineSpec(tiny_model_dir, CONFIG, PARAMS, dtype="float64", rank=0,
                                           enable_metrics=False, warmup=False))
    actor.loop.shutdown()
    n = expected_plan(actor.model.config).token_budget
    assert f"engine rank 0 ready on cpu ({tiny_model_dir}), token budget {n} planned from " in caplog.text
    assert "(gpu_memory_utilization 0.8)" in caplog.text
    stats = actor.engine_stats()
    assert stats["token_budget"] == n and stats["budget"]["source"] == "planned"
    figures = engine_figures(types.SimpleNamespace(engine_stats=lambda: {0: stats}))
    assert figures["0"]["token_budget"] == n and figures["0"]["budget"]["total_bytes"] == TOTAL
    summary = {"engines": json.loads(json.dumps(figures)), "rows": 0, "errors": 0, "generated_tokens": 0,
               "tokens_per_s": 0.0, "wall_s": 1.0, "finish_reasons": {}}
    assert f"token budget       engine 0: {n}" in format_summary(summary)
    assert f"{n} (planned: gpu_memory_utilization 0.8 of 10.0 GiB" in render_report(summary)


def gpu_cluster(memory: int) -> Cluster:
    node = {"CPU": 8.0, "GPU": 1.0, "accelerator_type:T4": 1.0}
    return Cluster(dict(node), [node], what="the test cluster", gpu_memory=memory, gpu_type="T4")


def test_the_preflight_refuses_a_model_that_cannot_fit(tmp_path, tiny_model_dir):
    from pipeline.preflight import check_model, preflight

    ckpt = check_model(tiny_model_dir, False)
    cfg = DLLMProcessorConfig(model=tiny_model_dir, engine=EngineConfig(block_length=4, steps_per_block=4))
    check_gpu_memory(cfg, ckpt, gpu_cluster(1 * GiB))  # fits: 0.9 GiB usable
    inp, out = str(tmp_path / "in.parquet"), str(tmp_path / "out")
    write_prompts(inp, "r{}", 3)
    with pytest.raises(JobError) as e:  # 0.9 x 512 MiB: less than the 512 MiB reserve alone
        preflight(inp, out, cfg, cluster=gpu_cluster(512 << 20))
    assert e.value.message == (
        f"model {tiny_model_dir} cannot fit on the GPUs of the test cluster: its weights take 46.2 KiB (23,648 "
        "parameters in bfloat16), with one row of one block and the reserve 512.1 MiB, more than "
        "gpu_memory_utilization 0.9 x the largest GPU's 512.0 MiB (T4) = 460.8 MiB. Use GPUs with more memory, "
        "a higher --gpu-memory-utilization or a smaller --dtype")
    assert set(e.value.options) == {"gpu_memory_utilization", "model", "dtype"}
    assert not os.path.exists(out)  # refused before the output is touched
    # engines on CPU read no utilization: refused, naming it
    cpu = DLLMProcessorConfig(model=tiny_model_dir, engine=EngineConfig(gpu_memory_utilization=0.5))
    with pytest.raises(JobError, match=r"^gpu_memory_utilization 0.5: the engines run on CPU"):
        check_gpu_memory(cpu, ckpt, Cluster({"CPU": 8.0}, [{"CPU": 8.0}]))


def test_the_preflight_knows_the_cpu_engines_budget(tmp_path):
    """Engines on CPU plan no budget (DEFAULT_TOKEN_BUDGET): settings every row exceeds it
    with are refused before the run, as with a given budget (Dream's published context of
    131,072 tokens holds such a row; on GPUs each engine plans its own and refuses it)."""
    import published
    from pipeline.preflight import preflight

    root = published.build("Dream-org__Dream-v0-Instruct-7B", str(tmp_path / "dream"))
    inp = str(tmp_path / "in.parquet")
    write_prompts(inp, "r{}", 3)
    cfg = DLLMProcessorConfig(model=root, sampling=SamplingParams(max_new_tokens=DEFAULT_TOKEN_BUDGET + 100))
    with pytest.raises(JobError, match=f"more than token_budget={DEFAULT_TOKEN_BUDGET}"):
        preflight(inp, str(tmp_path / "out"), cfg, cluster=Cluster({"CPU": 8.0}, [{"CPU": 8.0}]))


def test_the_option_and_its_help(tiny_model_dir):
    from pipeline.cli import build_config, build_parser, parse_args

    text = " ".join(build_parser().format_help().split())
    assert "--gpu-memory-utilization GPU_MEMORY_UTILIZATION" in text
    assert "given, it is used as is (it wins over gpu_memory_utilization)" in text
    cfg = build_config(parse_args(["--model", tiny_model_dir, "--gpu-memory-utilization", "0.5"]), 1)
    assert cfg.engine.gpu_memory_utilization == 0.5 and cfg.engine.token_budget is None
    with pytest.raises(SystemExit) as e:
        parse_args(["--gpu-memory-utilization", "1.5"])
    assert e.value.code == 2
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 0"):
        EngineConfig(gpu_memory_utilization=0)


def test_summary_json_carries_each_engines_budget(tmp_path, tiny_model_dir, ray_local):
    """The one Ray run: CPU engines, token_budget unset, report off: summary.json still
    says each engine's budget and where it came from."""
    from pipeline.run import run_offline

    inp, out = str(tmp_path / "in.parquet"), str(tmp_path / "out")
    write_prompts(inp, "r{}", 4)
    cfg = DLLMProcessorConfig(model=tiny_model_dir, num_engines=1, batch_size=4, enable_metrics=False,
                              engine=EngineConfig(block_length=4, steps_per_block=4),
                              sampling=SamplingParams(max_new_tokens=4))
    summary = run_offline(inp, out, cfg)
    with open(os.path.join(out, "summary.json")) as f:
        written = json.load(f)
    for s in (summary, written):
        (engine,) = s["engines"].values()
        assert engine["token_budget"] == DEFAULT_TOKEN_BUDGET
        assert engine["budget"] == {"token_budget": DEFAULT_TOKEN_BUDGET, "source": "default",
                                    "gpu_memory_utilization": None, "free_bytes": None, "total_bytes": None,
                                    "plan": None}
