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

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ROOT, free_port, write_tiny_model

BIN = os.path.dirname(sys.executable)
RAY = os.path.join(BIN, "ray")


def _env() -> dict:
    env = dict(os.environ)
    env["RAY_AUTH_MODE"] = "token"  # keep authentication on; the CLI then sends ~/.ray/auth_token
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")  # the job's `python` is this venv's
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.fixture
def head_node():
    """A head node on loopback with 2 CPUs and the dashboard (job API) on free ports."""
    temp_dir = tempfile.mkdtemp(prefix="br-", dir="/tmp")  # short: Ray's unix sockets live under it
    gcs, dash = free_port(), free_port()
    cmd = [RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
           "--num-cpus", "2", "--disable-usage-stats", "--include-dashboard", "true",
           "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
           "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
           "--runtime-env-agent-port", str(free_port()), "--metrics-export-port", str(free_port()),
           "--ray-client-server-port", str(free_port()), "--temp-dir", temp_dir]
    log = open(os.path.join(temp_dir, "ray-start.log"), "w")
    proc = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                urllib.request.urlopen(address + "/api/version", timeout=2)
                break
            except urllib.error.HTTPError:  # 401 without a token: the server is up
                break
            except Exception:  # noqa: BLE001 - not up yet
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("ray head did not start:\n" + open(log.name).read()[-3000:])
                time.sleep(0.5)
        yield address
    finally:
        _stop_node(proc)
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _stop_node(proc: subprocess.Popen) -> None:
    """Stop this node and nothing else: SIGTERM to the process group that
    `ray start --block` leads (start_new_session: its raylet, GCS, dashboard, agents and
    workers, nothing outside it), as `ray stop` would send to every Ray process on the
    machine; SIGKILL for whatever is left after a grace period."""
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):  # `ray stop` waits 16 s
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        end = time.time() + grace
        while time.time() < end:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


def _input(tmp_path, n: int = 10) -> str:
    path = tmp_path / "prompts.parquet"
    prompts = [f"copy: {'abcdefgh'[: i % 8 + 1]}" for i in range(n)]
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(n)], "prompt": prompts,
                             "reference": ["abc"] * n, "task": ["copy"] * n}), path)
    return str(path)


def test_ray_job_submit(tmp_path, head_node):
    model = write_tiny_model(str(tmp_path / "model"))
    inp, out = _input(tmp_path), str(tmp_path / "out")
    job_id = f"blockray-test-{uuid.uuid4().hex[:8]}"
    cmd = [RAY, "job", "submit", "--address", head_node, "--submission-id", job_id, "--working-dir", ".", "--",
           "python", "jobs/offline_eval.py", "--model", model, "--input", inp, "--output", out, "--limit", "8",
           "--num-engines", "2", "--batch-size", "2", "--block-length", "4", "--steps-per-block", "4",
           "--max-new-tokens", "8", "--token-budget", "1024"]
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400)
    logs = res.stdout + res.stderr
    probe = ("import sys; from ray.job_submission import JobSubmissionClient as C; "
             "print(C(sys.argv[1]).get_job_status(sys.argv[2]).value)")
    status = subprocess.run([sys.executable, "-c", probe, head_node, job_id], env=_env(),
                            capture_output=True, text=True, timeout=60)
    print(logs)
    assert status.stdout.strip().endswith("SUCCEEDED"), logs[-4000:] + status.stdout + status.stderr
    assert "=== summary ===" in logs and "tokens/s" in logs, logs[-4000:]

    summary = json.load(open(os.path.join(out, "summary.json")))
    files = sorted(glob.glob(os.path.join(out, "part-*.parquet")))
    table = pa.concat_tables([pq.read_table(f) for f in files])
    assert table.num_rows == summary["rows"] == 8
    assert sorted(table.column("id").to_pylist()) == sorted(f"r{i}" for i in range(8))
    assert summary["errors"] == sum(1 for e in table.column("error").to_pylist() if e)
    assert summary["generated_tokens"] == sum(table.column("num_generated_tokens").to_pylist())
    assert summary["scored_rows"] == 8 and 0.0 <= summary["exact_match"] <= 1.0
    assert summary["tokens_per_s"] > 0 and summary["wall_s"] > 0
    assert sorted(summary["output_files"]) == [os.path.basename(f) for f in files]
    assert not os.path.exists(os.path.join(out, "_tmp"))
