"""Issue 7, A2: one of two engine actors is SIGKILLed mid-run; Ray Data restarts it
(actor pools default to max_restarts=-1, max_task_retries=-1) and re-runs the batches it
held; the run completes with every id exactly once and no error rows from the kill.

The victim is found among the worker processes of *this* test's Ray (children of its
raylet, itself a child of this process), never by name across the machine."""
from __future__ import annotations

import os
import signal
import threading
import time

from conftest import part_files, read_parts, write_prompts
from engine import EngineConfig, SamplingParams
from pipeline import DLLMProcessorConfig
from pipeline.run import run_offline
from procs import children

N = 24


def _engine_pids():
    pids = []
    for raylet in children(os.getpid()):
        for w in children(raylet):
            try:
                cmd = open(f"/proc/{w}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if "DLLMEngineActor" in cmd:
                pids.append(w)
    return pids


def test_engine_actor_killed_mid_run(tmp_path, tiny_model_dir, ray_local):
    inp, out = str(tmp_path / "in.parquet"), str(tmp_path / "out")
    write_prompts(inp, "k{:02d}", N)
    config = DLLMProcessorConfig(model=tiny_model_dir, num_engines=2, batch_size=2, max_concurrent_batches=2,
                                 engine=EngineConfig(block_length=4, steps_per_block=4, token_budget=1024),
                                 sampling=SamplingParams(max_new_tokens=16, policy="fixed"))
    killed = {}

    def killer():
        deadline = time.time() + 240
        while time.time() < deadline:
            pids = _engine_pids()
            if len(pids) >= 2 and part_files(out):
                os.kill(pids[0], signal.SIGKILL)
                killed["pid"], killed["parts_before"] = pids[0], len(part_files(out))
                return
            time.sleep(0.05)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    summary = run_offline(inp, out, config, rows_per_file=None)
    t.join(5)
    assert "pid" in killed, "the run ended before an engine could be killed"
    assert killed["parts_before"] < N // 2  # killed mid-run, not after the last batch
    table = read_parts(out)
    assert sorted(table.column("id").to_pylist()) == [f"k{i:02d}" for i in range(N)]  # exactly once
    assert not [e for e in table.column("error").to_pylist() if e]  # the kill caused no error rows
    assert summary["rows"] == N and summary["errors"] == 0
