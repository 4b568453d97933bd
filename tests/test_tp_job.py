"""Issue 39, acceptance 2 and 5: one engine over two ranks on a placement group (CPU
bundles, gloo), through the real job.

2. The job CLI with `--tensor-parallel-size 2 --num-engines 1` writes every row exactly
   once, with the tokens of tensor_parallel_size 1 (the engine on one device, float64,
   sampled with the seeds the job derives per row: they reach the other rank), and
   summary.json records tensor_parallel_size.
5. A follower rank (`ray::TensorParallelFollower`) SIGKILLed while its engine runs a batch:
   rank 0 sees it lost and exits, Ray restarts the engine on its placement group, and the
   batches in flight are sent again; every row is written exactly once, with no error row.

Both run on the session's Ray (2 CPUs): an engine of two CPU bundles of 0.25 CPU each.
The victim is found among the worker processes of this test's Ray (children of its
raylet, itself a child of this process), never by name across the machine."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT, part_files, read_parts, write_prompts
from engine import EngineConfig, SamplingParams
from pipeline import DLLMProcessorConfig
from pipeline.run import run_offline
from procs import kill_mid_run

N = 24
ARGS = ["--block-length", "4", "--steps-per-block", "4", "--max-new-tokens", "12", "--token-budget", "1024",
        "--dtype", "float64", "--temperature", "0.7", "--seed", "11", "--batch-size", "4", "--num-engines", "1",
        "--no-enable-metrics", "--no-report"]


def cli(*args: str, address: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "jobs/offline_eval.py", *ARGS, *args, "--address", address], cwd=ROOT,
                          capture_output=True, text=True, timeout=400, start_new_session=True, stdin=subprocess.DEVNULL)


def test_cli_job_with_two_ranks_gives_the_tokens_of_one(tmp_path, tiny_model_dir, ray_address):
    """The tokens of tensor_parallel_size 1: the engine on one device, in-process, with the
    seeds the job gives each row (derived from --seed and the row's id)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from actors.engine_actor import derive_seed
    from engine import Engine, load_model

    ids = [f"t{i:02d}" for i in range(N)]
    prompts = [[5 + (i * 7 + j) % 30 for j in range(2 + i % 6)] for i in range(N)]
    inp, out = str(tmp_path / "in.parquet"), str(tmp_path / "out")
    pq.write_table(pa.table({"id": ids, "prompt_token_ids": prompts}), inp)
    res = cli("--model", tiny_model_dir, "--input", inp, "--output", out, "--tensor-parallel-size", "2",
              address=ray_address)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = read_parts(out).to_pylist()
    assert sorted(r["id"] for r in rows) == ids  # every row exactly once
    assert [r["error"] for r in rows] == [None] * N
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["tensor_parallel_size"] == 2 and summary["rows"] == N and summary["errors"] == 0

    model, _ = load_model(tiny_model_dir, dtype=torch.float64, tokenizer=False)
    engine = Engine(model, EngineConfig(block_length=4, steps_per_block=4, token_budget=1024))
    ref = engine.generate(prompts, [SamplingParams(max_new_tokens=12, temperature=0.7, seed=derive_seed(11, i))
                                    for i in ids])
    assert {r["id"]: r["generated_token_ids"] for r in rows} == {i: o.token_ids for i, o in zip(ids, ref)}
    assert len({tuple(o.token_ids) for o in ref}) > N // 2  # rows differ: the comparison means something


def _following_rank(ranks: dict):
    """Engine ranks' titles: `ray::DLLMEngineActor…` (rank 0, `.run_batch` while it runs a
    batch) and `ray::TensorParallelFollower…` (`.run` once it follows). The victim: a
    follower, while its engine runs a batch."""
    busy = any(t.startswith("ray::DLLMEngineActor.run_batch") for t in ranks.values())
    followers = [pid for pid, t in ranks.items() if t.startswith("ray::TensorParallelFollower.run")]
    return followers[0] if busy and followers else None


def test_a_killed_follower_rank_fails_its_engine_and_every_row_is_written_once(tmp_path, tiny_model_dir, ray_local):
    inp, out = str(tmp_path / "in.parquet"), str(tmp_path / "out")
    write_prompts(inp, "f{:02d}", N)
    config = DLLMProcessorConfig(model=tiny_model_dir, num_engines=1, tensor_parallel_size=2, batch_size=2,
                                 max_concurrent_batches=2, enable_metrics=False,
                                 engine=EngineConfig(block_length=4, steps_per_block=4, token_budget=1024),
                                 sampling=SamplingParams(max_new_tokens=16, policy="fixed"))
    t, killed = kill_mid_run(_following_rank, lambda: len(part_files(out)),
                             ("ray::DLLMEngineActor", "ray::TensorParallelFollower"))
    summary = run_offline(inp, out, config, rows_per_file=None, report=False)
    t.join(5)
    assert "pid" in killed, "the run ended before a rank could be killed"
    assert killed["parts_before"] < N // 2  # killed mid-run, not after the last batch
    table = read_parts(out)
    assert sorted(table.column("id").to_pylist()) == [f"f{i:02d}" for i in range(N)]  # exactly once
    assert not [e for e in table.column("error").to_pylist() if e]  # the kill caused no error rows
    assert summary["rows"] == N and summary["errors"] == 0
    rows = table.select(["id", "engine_rank", "engine_retries"]).to_pylist()
    resent = [r for r in rows if r["engine_retries"]]
    assert resent, "no row was in flight on the engine whose rank was killed"
    assert summary["engine_retried_rows"] == len(resent)
    # the engine came back (a new rank 0, numbered anew by the run's group) and took them
    assert {r["engine_rank"] for r in resent} == {1}, resent


def test_tensor_parallel_size_is_one_placement_group_per_engine():
    """The option's plumbing, no Ray: the engine's placement group (one bundle per rank,
    PACK; rank 0, the engine actor, asks for bundle 0), the pool check's totals, the engine
    config's field kept in step, and what cannot be placed refused naming the option."""
    import pytest

    from pipeline.processor import DLLMProcessor
    from pipeline.resources import Cluster, check_resources
    from pipeline.errors import JobError

    cpu = DLLMProcessorConfig(model="m", tensor_parallel_size=2)
    assert cpu.engine.tensor_parallel_size == 2
    assert cpu.engine_resources(0) == {"num_gpus": 0.0, "num_cpus": 0.5, "resources": {}, "device": "cpu",
                                       "placement": {"bundles": [{"CPU": 0.25}, {"CPU": 0.25}], "strategy": "PACK"}}
    gpu = DLLMProcessorConfig(model="m", tensor_parallel_size=4, num_engines=2, accelerator_type="H200",
                              resources_per_engine={"engine_slot": 1})
    res = gpu.engine_resources(8)
    assert (res["num_gpus"], res["num_cpus"], res["device"]) == (4.0, 4.0, "cuda")
    h200 = {"accelerator_type:H200": 0.001}
    assert res["placement"] == {"bundles": [{"CPU": 1.0, "GPU": 1.0, "engine_slot": 1, **h200}] +
                                [{"CPU": 1.0, "GPU": 1.0, **h200}] * 3, "strategy": "PACK"}
    assert DLLMProcessor(gpu).engine_options() == {"num_cpus": 1.0, "num_gpus": 1.0, "placement": res["placement"],
                                                   "resources": {"engine_slot": 1, **h200}}
    node = {"CPU": 16.0, "GPU": 4.0, "accelerator_type:H200": 1.0}
    check_resources(gpu, Cluster({"CPU": 32.0, "GPU": 8.0, "accelerator_type:H200": 2.0}, [node, node]))
    with pytest.raises(JobError, match=r"needs 8 GPU \(2 engine\(s\) x 4\)"):  # GPUs = engines x ranks
        check_resources(gpu, Cluster(node, [node]))
    pg = DLLMProcessorConfig(model="m", tensor_parallel_size=2,
                             placement_group_config={"bundle_per_worker": {"GPU": 1, "CPU": 2}})
    assert pg.engine_resources(2)["placement"]["bundles"] == [{"GPU": 1, "CPU": 2}] * 2
    assert (pg.engine_resources(2)["num_gpus"], pg.engine_resources(2)["num_cpus"]) == (2.0, 4.0)

    from engine import EngineConfig as EC
    assert DLLMProcessorConfig(model="m", engine=EC(tensor_parallel_size=2)).tensor_parallel_size == 2
    refusals = {
        "tensor_parallel_size 2, but the engine config says 4": dict(engine=EC(tensor_parallel_size=4)),
        "num_gpus_per_engine 1 with tensor_parallel_size 2": dict(num_gpus_per_engine=1),
        "1 bundle(s) for tensor_parallel_size 2": dict(placement_group_config={"bundles": [{"GPU": 1}]}),
        "strategy SPREAD for tensor_parallel_size 2": dict(placement_group_config={"bundles": [{"GPU": 1}] * 2,
                                                                                  "strategy": "SPREAD"}),
        "at most 1 GPU per bundle": dict(placement_group_config={"bundles": [{"GPU": 2}] * 2}),
        "bundles[1] asks for nothing": dict(placement_group_config={"bundles": [{"CPU": 1}, {"CPU": 0}]}),
        "num_cpus_per_engine 0 with tensor_parallel_size 2": dict(num_cpus_per_engine=0),
        "tensor_parallel_size must be an integer >= 1": dict(tensor_parallel_size=0),
    }
    for words, kw in refusals.items():
        with pytest.raises(ValueError) as info:
            DLLMProcessorConfig(model="m", tensor_parallel_size=kw.pop("tensor_parallel_size", 2), **kw)
        assert words in str(info.value), (words, str(info.value))
