"""Issue 7, A2 / issue 17, acceptance 5: one of two engines is SIGKILLed mid-run; the
batches it held are run by the other engine at once, not after its restart; the run
completes with every id exactly once and no error rows from the kill, and (the
report on, as the job has it) writes its report.

How (actors/engine_router.py): the engine stage's Ray Data actors are dispatchers, each
with an engine actor of its own (max_restarts=-1, max_task_retries=0). The calls in
flight to a killed engine fail within about 2 s, and its dispatcher sends those batches to
the live engine with the fewest batches in flight; Ray restarts the killed engine
meanwhile, and it takes a new rank (above 1 here).
Before (Ray Data's pool of engines, max_task_retries=-1) the batches waited for the
killed actor's restart and ran there.

The victim is found among the worker processes of *this* test's Ray (children of its
raylet, itself a child of this process), never by name across the machine."""
from __future__ import annotations

import os

from conftest import blocking_gets, part_files, read_parts, write_prompts
from engine import EngineConfig, SamplingParams
from pipeline import DLLMProcessorConfig
from pipeline.run import run_offline
from procs import kill_mid_run

N = 24


def _busy_engine(engines: dict):
    """Engine actors' titles: `ray::DLLMEngineActor`, `.run_batch` appended while it runs a
    batch (their dispatchers, `MapWorker(MapBatches(EngineDispatcher))`, hold no engine).
    The victim: one running a batch, once both engines are up."""
    busy = [pid for pid, title in engines.items() if title.endswith(".run_batch")]
    return busy[0] if len(engines) >= 2 and busy else None


def test_engine_actor_killed_mid_run(tmp_path, tiny_model_dir, ray_local):
    inp, out = str(tmp_path / "in.parquet"), str(tmp_path / "out")
    write_prompts(inp, "k{:02d}", N)
    config = DLLMProcessorConfig(model=tiny_model_dir, num_engines=2, batch_size=2, max_concurrent_batches=2,
                                 engine=EngineConfig(block_length=4, steps_per_block=4, token_budget=1024),
                                 sampling=SamplingParams(max_new_tokens=16, policy="fixed"))
    t, killed = kill_mid_run(_busy_engine, lambda: len(part_files(out)), ("ray::DLLMEngineActor",))
    summary = run_offline(inp, out, config, rows_per_file=None, report=True)  # as the job does: engines post stats
    t.join(5)
    assert "pid" in killed, "the run ended before an engine could be killed"
    assert killed["parts_before"] < N // 2  # killed mid-run, not after the last batch
    table = read_parts(out)
    assert sorted(table.column("id").to_pylist()) == [f"k{i:02d}" for i in range(N)]  # exactly once
    assert not [e for e in table.column("error").to_pylist() if e]  # the kill caused no error rows
    assert summary["rows"] == N and summary["errors"] == 0
    assert os.path.getsize(os.path.join(out, "report.html")) > 0  # the report survives an engine's death

    rows = table.select(["id", "engine_rank", "engine_retries", "finished_at", "latency_s"]).to_pylist()
    for r in rows:
        r["started_at"] = r["finished_at"] - r["latency_s"]  # when its engine took it
    resent = [r for r in rows if r["engine_retries"]]
    before = {r["engine_rank"] for r in rows if r["finished_at"] < killed["t"]}
    restarted = {r["engine_rank"] for r in rows} - {0, 1}  # the killed engine, back under a new rank
    print({"kill_t": killed["t"], "resent": resent, "ranks_before_kill": sorted(before),
           "restarted_ranks": sorted(restarted),
           "restarted_first_start": min((r["started_at"] for r in rows if r["engine_rank"] in restarted), default=None)})
    # the killed engine held batches, and they were sent again...
    assert resent, "no row was in flight on the killed engine"
    assert summary["engine_retried_rows"] == len(resent)
    # ...to the engine that was already running (the other original rank), not to the
    # killed engine once restarted (a rank above 1)...
    survivors = {r["engine_rank"] for r in resent}
    assert len(survivors) == 1 and survivors <= {0, 1}, resent
    # ...which took them before the restarted engine took any row: they did not wait for it.
    took = max(r["started_at"] for r in resent)
    assert all(took < r["started_at"] for r in rows if r["engine_rank"] in restarted), (took, restarted)
    # no actor of the run, the restarted engine included, blocked its event loop on ray.get
    assert not blocking_gets(ray_local.address_info["session_dir"])
