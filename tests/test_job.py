"""A2: `ray job submit --working-dir . -- python jobs/offline_eval.py …` against a real
head node on loopback (token auth on), then the job's outputs and summary.json.

Why the head is stopped through its process group and not `ray stop`: `ray stop` kills every Ray
process on the machine by name, including other clusters sharing it (this test's own
in-process Ray, other users' runs). `ray start --block` in a new session leads a process
group holding exactly this node's processes; the teardown signals that group (SIGTERM,
then SIGKILL after a grace period, as `ray stop` does). Its --temp-dir keeps the
`ray_current_cluster` marker out of /tmp/ray, so a later bare ray.init() never tries to
join this dead cluster.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

from bench.workloads import write_tiny_model
from conftest import RAY, ROOT, part_files, ray_env, read_parts, write_prompts


def test_ray_job_submit(tmp_path, head_node):
    model = write_tiny_model(str(tmp_path / "model"))
    inp, out = str(tmp_path / "prompts.parquet"), str(tmp_path / "out")
    write_prompts(inp, "r{}", 10, reference=["abc"] * 10, task=["copy"] * 10)
    job_id = f"blockray-test-{uuid.uuid4().hex[:8]}"
    cmd = [RAY, "job", "submit", "--address", head_node, "--submission-id", job_id, "--working-dir", ".", "--",
           "python", "jobs/offline_eval.py", "--model", model, "--input", inp, "--output", out, "--limit", "8",
           "--num-engines", "2", "--batch-size", "2", "--block-length", "4", "--steps-per-block", "4",
           "--max-new-tokens", "8", "--token-budget", "1024"]
    for _ in range(30):  # the head's job agent registers a while after its dashboard answers
        res = subprocess.run(cmd, cwd=ROOT, env=ray_env(), capture_output=True, text=True, timeout=400)
        logs = res.stdout + res.stderr
        if "No available agent to submit job" not in logs:  # Ray's own "please try again later"
            break
        time.sleep(2)
    probe = ("import sys; from ray.job_submission import JobSubmissionClient as C; "
             "print(C(sys.argv[1]).get_job_status(sys.argv[2]).value)")
    status = subprocess.run([sys.executable, "-c", probe, head_node, job_id], env=ray_env(),
                            capture_output=True, text=True, timeout=60)
    print(logs)
    assert status.stdout.strip().endswith("SUCCEEDED"), logs[-4000:] + status.stdout + status.stderr
    assert "=== summary ===" in logs and "tokens/s" in logs, logs[-4000:]

    summary = json.load(open(os.path.join(out, "summary.json")))
    files, table = part_files(out), read_parts(out)
    assert table.num_rows == summary["rows"] == 8
    assert sorted(table.column("id").to_pylist()) == sorted(f"r{i}" for i in range(8))
    assert summary["errors"] == sum(1 for e in table.column("error").to_pylist() if e)
    assert summary["generated_tokens"] == sum(table.column("num_generated_tokens").to_pylist())
    assert summary["scored_rows"] == 8 and 0.0 <= summary["exact_match"] <= 1.0
    assert summary["tokens_per_s"] > 0 and summary["wall_s"] > 0
    assert sorted(summary["output_files"]) == [os.path.basename(f) for f in files]
    assert not os.path.exists(os.path.join(out, "_tmp"))


def test_decoding_options_reach_the_configs():
    """The canvas, the dual cache and the reference decoding choices are job options."""
    from jobs.offline_eval import build_config, parse_args

    cfg = build_config(parse_args(["--canvas", "full", "--cache", "dual", "--policy", "timestep", "--remasking",
                                   "entropy", "--first-position", "--top-p", "0.9", "--top-k", "5", "--stop", "x",
                                   "\n"]), 0)
    assert (cfg.engine.canvas, cfg.engine.cache) == ("full", "dual")
    s = cfg.sampling
    assert (s.policy, s.remasking, s.first_position, s.top_p, s.top_k, s.stop) == (
        "timestep", "entropy", True, 0.9, 5, ["x", "\n"])
    assert build_config(parse_args([]), 0).engine.canvas == "auto"
