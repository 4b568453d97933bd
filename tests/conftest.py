"""Shared fixtures for the Ray-side tests: a random tiny checkpoint with the tiny char
tokenizer, one in-process Ray for the session, and a real S3 endpoint on loopback.

Why session scope: starting Ray or moto costs seconds on a 2-core machine; every test
that needs them shares one instance, and each is torn down by the process that
started it (never by process name).
"""
from __future__ import annotations

import glob
import os
import posixpath
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bench.workloads import write_tiny_model
from procs import ray_temp_dir, stop_group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S3_KEY, S3_SECRET, S3_REGION = "testing", "testing", "eu-west-1"  # us-east-1 rejects a LocationConstraint


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- prompt inputs and result part files ------------------------------------------------

def write_prompts(where, id_fmt: str, rows, alphabet: str = "abcdefgh", **columns) -> None:
    """A prompt Parquet file at `where` (a path or an open binary file): for each index i in
    `rows` (an int n: 0..n-1), id `id_fmt.format(i)` and prompt `copy: <the first
    i % len(alphabet) + 1 letters of alphabet>`; then `columns` (lists), as given."""
    idx = range(rows) if isinstance(rows, int) else rows
    pq.write_table(pa.table({"id": [id_fmt.format(i) for i in idx],
                             "prompt": [f"copy: {alphabet[: i % len(alphabet) + 1]}" for i in idx], **columns}), where)


def part_files(out, fs=None) -> list:
    """The result part files (`part-*.parquet`) directly in `out`, sorted; with an fsspec
    `fs`, from its listing of `out`."""
    if fs is None:
        return sorted(glob.glob(os.path.join(out, "part-*.parquet")))
    return sorted(p for p in fs.ls(out) if posixpath.basename(p).startswith("part-") and p.endswith(".parquet"))


def read_parts(out, fs=None, columns=None) -> pa.Table:
    """The part files of `out` (see part_files) read and concatenated, in file order."""
    return pa.concat_tables([pq.read_table(p, columns=columns, filesystem=fs) for p in part_files(out, fs)])


BLOCKING_GET = "blocking ray.get inside async actor"  # Ray's warning (ray/_private/worker.py, `get`)


def blocking_gets(session_dir: str) -> list:
    """`file: line` for every line of a Ray session's logs (its workers' stdout and stderr
    among them) where Ray warns that an async actor called the blocking `ray.get`, which
    stalls every call in flight on that actor's event loop."""
    hits = []
    for path in sorted(glob.glob(os.path.join(session_dir, "logs", "*"))):
        if os.path.isfile(path):
            with open(path, errors="replace") as f:
                hits += [f"{os.path.basename(path)}: {line.strip()}" for line in f if BLOCKING_GET in line]
    return hits


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny-dllm")))


@pytest.fixture(scope="session")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="session")
def ray_address(ray_local) -> str:
    """The session Ray's address, for job CLI runs whose subject is not the start or the
    stop of a local Ray: joining it (`--address`) spares a run the Ray of its own (about
    15 CPU-s, and a start that can time out on a loaded 2-core machine)."""
    return ray_local.address_info["gcs_address"]


@pytest.fixture(scope="session")
def ray_local(metrics_port):
    """An in-process local Ray (2 CPUs, no dashboard UI) shared by the session, metrics on
    `metrics_port`. The actors and tasks of this process's runs export them every second
    (RAY_metrics_report_interval_ms in the job's env: a gauge is exported as its value at
    that instant, and test_metrics must catch a queue that lasts a fraction of a second);
    the Ray's own processes and the job CLI runs that join it keep Ray's 10 s (exporting
    every second there cost a fifth of an idle Ray's CPU, for the whole session)."""
    import ray

    from pipeline.local_ray import start_local_ray  # once more if its node times out while it starts

    if ray.is_initialized():
        ray.shutdown()
    env = {"PYTHONPATH": ROOT, "RAY_metrics_report_interval_ms": "1000"}
    ctx = start_local_ray(ray, num_cpus=2, include_dashboard=False, _metrics_export_port=metrics_port,
                          log_to_driver=False, runtime_env={"env_vars": env})
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield ctx
    ray.shutdown()


def start_moto():
    """moto_server in a subprocess on a free loopback port, once it answers: (proc, url)."""
    port = free_port()
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            urllib.request.urlopen(url, timeout=1)
            return proc, url
        except Exception:  # noqa: BLE001 - not up yet
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise RuntimeError("moto_server did not start")
            time.sleep(0.2)


@pytest.fixture(scope="session")
def s3_endpoint():
    """A real S3 API on loopback: moto_server in a subprocess on a free port; yields
    its endpoint URL. Terminated by its pid at the end of the session."""
    proc, url = start_moto()
    yield url
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture
def s3_storage(s3_endpoint):
    """StorageOptions for the loopback endpoint."""
    from common.storage import StorageOptions

    return StorageOptions(endpoint_url=s3_endpoint, key=S3_KEY, secret=S3_SECRET, region=S3_REGION)


@pytest.fixture
def s3fs_client(s3_endpoint):
    import s3fs

    return s3fs.S3FileSystem(key=S3_KEY, secret=S3_SECRET, endpoint_url=s3_endpoint,
                             client_kwargs={"region_name": S3_REGION}, skip_instance_cache=True)


# --- a real head node (ray start) for the job CLI tests --------------------------------

BIN = os.path.dirname(sys.executable)
RAY = os.path.join(BIN, "ray")


def ray_env() -> dict:
    """The environment for `ray` CLI calls: token auth on, this venv first, no RAY_ADDRESS."""
    env = dict(os.environ)
    env["RAY_AUTH_MODE"] = "token"  # keep authentication on; the CLI then sends ~/.ray/auth_token
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")  # the job's `python` is this venv's
    env.pop("RAY_ADDRESS", None)
    return env


@pytest.fixture
def head_node():
    """A head node on loopback with 2 CPUs and the dashboard (job API) on free ports.
    Stopped through the process group `ray start --block` leads, never `ray stop` (which
    kills every Ray process on the machine); its --temp-dir keeps the cluster marker out
    of /tmp/ray."""
    with ray_temp_dir() as temp_dir:  # short: Ray's unix sockets live under it
        gcs, dash = free_port(), free_port()
        cmd = [RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
               "--num-cpus", "2", "--disable-usage-stats", "--include-dashboard", "true",
               "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash),
               "--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
               "--runtime-env-agent-port", str(free_port()), "--metrics-export-port", str(free_port()),
               "--ray-client-server-port", str(free_port()), "--temp-dir", temp_dir]
        log = open(os.path.join(temp_dir, "ray-start.log"), "w")
        proc = subprocess.Popen(cmd, env=ray_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
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
            stop_group(proc, 10.0)  # `ray stop` waits 16 s; SIGTERM reaches raylet, GCS, dashboard, workers
            log.close()
