"""Issue 37, point 3: no failure hides as a hang or a "bug".

- Storage failing after every part file (report.html, summary.json, the lease's removal or
  refresh) is exit 2 with one `error:` line naming the file and the store's answer, and
  every row is in the part files exactly once; a rerun writes the summary and generates
  nothing again. The failures are real ones of a real store: S3 (moto on loopback) behind
  a proxy answering 403 AccessDenied to the writes of the chosen files. (A local disk
  filling up cannot be aimed at one file: RLIMIT_FSIZE on the driver, the closest
  stand-in without root, first fails Ray Data's own log on the driver, which ends the run
  as `run failed, no summary written: OSError: [Errno 27] File too large`, exit 2 too.)
- A run whose lease another run takes over stops writing there and exits 2 naming that run.
- Late parts: a part a dying run commits after another run listed the output is kept out
  of it (the part manifest, pipeline/writer.py), never counted twice.
- An engine that cannot be rebuilt after a failed step fails the rows in flight and every
  later one instead of leaving its callers waiting forever.
CLI runs join the session's Ray (`ray_address`); every subprocess has a timeout.
"""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable, List, Optional, Tuple

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ROOT, S3_KEY, S3_REGION, S3_SECRET, part_files, read_parts, write_prompts
from engine import Engine, EngineConfig, SamplingParams, load_model
from procs import job_ray
from s3_fault_proxy import ACCESS_DENIED, FaultProxy

TINY = ["--num-engines", "1", "--batch-size", "4", "--block-length", "4", "--steps-per-block", "4",
        "--max-new-tokens", "8", "--token-budget", "1024"]
N = 8


def cli(*args: str, address: str, env: Optional[dict] = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python jobs/offline_eval.py …` joining the Ray at `address`."""
    with job_ray(address) as ray:
        return subprocess.run([sys.executable, "jobs/offline_eval.py", *args, *ray], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout, start_new_session=True, stdin=subprocess.DEVNULL,
                              env={**os.environ, **(env or {})})


def one_error(res: subprocess.CompletedProcess, *words: str) -> str:
    """Exit 2, stderr's last line the only `error:` line, holding `words`; not an internal error."""
    lines = res.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-4000:]
    assert errors == lines[-1:], res.stderr[-4000:]
    assert "internal error" not in res.stderr
    for w in words:
        assert w in errors[0], (w, errors[0])
    return errors[0]


def keys(table: pa.Table) -> List[Tuple[str, int]]:
    """The (id, sample_index) of every row, sorted."""
    return sorted(zip(table.column("id").to_pylist(), table.column("sample_index").to_pylist()))


EXPECTED = [(f"r{i}", 0) for i in range(N)]


class RefusingProxy(FaultProxy):
    """S3 through a proxy that answers 403 AccessDenied (as after a policy change) to the
    requests of `methods` whose path, or body (a multi-object delete, POST ?delete, names
    its keys there), holds one of `names`; it forwards the rest unchanged."""

    def __init__(self, upstream: str, *names: str, methods=("PUT", "POST", "DELETE")):
        self.names, self.methods, self._local = names, methods, threading.local()
        super().__init__(upstream, fail_rate=0.0, delay_rate=0.0)

    def _handler(self):
        proxy = self

        class Handler(super()._handler()):
            def _body(self) -> bytes:
                proxy._local.body = super()._body()
                return proxy._local.body

        return Handler

    def _decide(self, method: str, path: str):
        bulk_delete = getattr(self._local, "body", b"") if method == "POST" and "?delete" in path else b""
        if method in self.methods and any(n in path or n.encode() in bulk_delete for n in self.names):
            with self.lock:
                self.write_faults += 1
            return ACCESS_DENIED, False
        return super()._decide(method, path)


S3_ENV = {"AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET, "AWS_DEFAULT_REGION": S3_REGION}


def foreign_lease(now: float) -> dict:
    """The lease of a live run elsewhere."""
    return {"token": "t-other", "host": "other-host", "pid": 4242, "run_id": "r-other", "acquired_at": now,
            "heartbeat_at": now, "ttl_s": 600}


def when_held(out: str, act: Callable[[], Any], stop: threading.Event) -> threading.Thread:
    """A thread that calls act() once the run on `out` holds its lease and has listed
    the output: its part manifest names its lease (`writer`), which it writes once every
    preflight check passed, before Ray and the engines start."""
    def watch() -> None:
        while not stop.wait(0.02):
            try:
                with open(os.path.join(out, "_lock.json")) as f:
                    token = json.load(f)["token"]
                with open(os.path.join(out, "_parts.json")) as f:
                    writer = json.load(f)["writer"]
            except (OSError, ValueError, KeyError):
                continue
            if token[:12] == writer:
                act()
                return
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


# --- storage failing after every part file ------------------------------------------------

def test_report_summary_and_lease_refused_by_s3(tmp_path, tiny_model_dir, ray_address, s3_endpoint, s3fs_client):
    """S3 refuses report.html: exit 2 after every part file. The reruns generate nothing;
    S3 refusing summary.json, then the lease's removal (once summary.json is written) is
    exit 2 too, each saying what is written."""
    inp, out, key = str(tmp_path / "in.parquet"), "s3://hostile-finish/out", "hostile-finish/out"
    write_prompts(inp, "r{}", N)
    s3fs_client.mkdir("hostile-finish")

    def run(*names: str, methods=("PUT", "POST", "DELETE")) -> subprocess.CompletedProcess:
        with RefusingProxy(s3_endpoint, *names, methods=methods) as proxy:
            res = cli("--model", tiny_model_dir, "--input", inp, "--output", out, *TINY, "--endpoint-url", proxy.url,
                      address=ray_address, env=S3_ENV)
        assert proxy.write_faults >= 1
        assert keys(read_parts(key, s3fs_client)) == EXPECTED  # every row, once
        return res

    written = "Every row is written, in the part files in s3://hostile-finish/out, but not the run's summary: " \
              "rerun with the same --output to write it (no row is generated again)"
    one_error(run("report.html"), f"upload of {out}/report.html failed", "AccessDenied", written)
    one_error(run("summary.json"), f"upload of {out}/summary.json failed", "AccessDenied", written)
    assert not s3fs_client.exists(f"{key}/summary.json")
    one_error(run("_lock.json", methods=("POST", "DELETE")),  # taken and refreshed, never removed
              f"removal of the output's lease {out}/_lock.json failed", "AccessDenied",
              "Every row and summary.json are written")
    s3fs_client.invalidate_cache()
    summary = json.loads(s3fs_client.cat_file(f"{key}/summary.json"))
    assert (summary["rows_skipped"], summary["rows_processed"], summary["rows_total"]) == (N, 0, N)
    assert s3fs_client.exists(f"{key}/report.html")


# --- the lease lost ---------------------------------------------------------------------------

def test_run_whose_lease_is_taken_over_stops_and_exits_2(tmp_path, tiny_model_dir, ray_address):
    """Another run takes the output over (it found this one's lease stale, say) once this
    one holds it and before its first part: this run commits nothing more, writes no
    summary, leaves the other run's lease alone and exits 2 naming it."""
    inp, out = str(tmp_path / "in.parquet"), str(tmp_path / "out")
    write_prompts(inp, "r{}", N)

    def take_over() -> None:
        tmp = os.path.join(out, "_lock.json.other")
        with open(tmp, "w") as f:
            json.dump(foreign_lease(time.time()), f)
        os.replace(tmp, os.path.join(out, "_lock.json"))

    stop = threading.Event()
    when_held(out, take_over, stop)
    try:
        res = cli("--model", tiny_model_dir, "--input", inp, "--output", out, *TINY, address=ray_address)
    finally:
        stop.set()
    one_error(res, f"output file://{out} was taken over by run r-other (pid 4242 on other-host",
              "stopped writing there")
    assert part_files(out) == [] and not os.path.exists(os.path.join(out, "summary.json"))
    assert json.load(open(os.path.join(out, "_lock.json")))["token"] == "t-other"


def test_lease_that_cannot_be_refreshed_is_lost(s3_endpoint, s3fs_client):
    """S3 refuses the lease's refresh once it is held: after its ttl the holder has lost it
    (another run may take the output), its write tasks' check refuses to commit, and its
    removal, refused too, is a StorageWriteError naming the lease (the job exits 2 on it)."""
    from common.storage import StorageOptions, StorageWriteError, get_filesystem
    from pipeline.output_lock import LeaseLost, OutputLock

    s3fs_client.mkdir("hostile-lease")
    with RefusingProxy(s3_endpoint) as proxy:
        fs, path = get_filesystem("s3://hostile-lease/out", StorageOptions(
            endpoint_url=proxy.url, key=S3_KEY, secret=S3_SECRET, region=S3_REGION))
        lock = OutputLock(fs, path, run_id="r1", ttl_s=1.0, settle_s=0.05).acquire()
        guard = lock.guard()
        guard()  # held: a write task may commit
        proxy.names = ("_lock.json",)
        deadline = time.time() + 60
        while lock.lost is None:
            assert time.time() < deadline, "the lease was never found lost"
            time.sleep(0.1)
        assert "could not be refreshed for 1 s" in lock.lost and "AccessDenied" in lock.lost, lock.lost
        with pytest.raises(LeaseLost, match="could not be refreshed"):
            lock.verify()
        with pytest.raises(LeaseLost, match="was not refreshed for"):
            guard()
        with pytest.raises(StorageWriteError, match="removal of the output's lease s3://hostile-lease/out/_lock.json "
                                                    "failed: .*AccessDenied"):
            lock.release(check=True)


# --- late parts of a run that lost the lease --------------------------------------------------

def _commit_part(out: str, writer: str, task: int, ids: List[str]) -> str:
    """A part file of the run whose lease id is `writer`, committed as its write tasks do
    (atomic_write_table), holding rows `ids`."""
    import fsspec

    from pipeline.writer import atomic_write_table

    table = pa.table({"id": ids, "sample_index": [0] * len(ids), "generated_text": ["late"] * len(ids)})
    name = f"part-{writer}-{task:06d}.parquet"
    atomic_write_table(fsspec.filesystem("file"), f"{out}/{name}", table)
    return name


def test_late_part_is_kept_out_by_the_run_that_took_over(tmp_path, tiny_model_dir, ray_address):
    """An earlier run died holding the output before its first part; this run takes it over
    and lists it (empty). Then a write task of the dead run commits a part with rows 4-5,
    which this run generates too: this run removes it before its summary, and every row
    is in the output once."""
    inp, out = str(tmp_path / "in.parquet"), str(tmp_path / "out")
    write_prompts(inp, "r{}", N)
    late: List[str] = []
    stop = threading.Event()
    when_held(out, lambda: late.append(_commit_part(out, "0123456789ab", 99, ["r4", "r5"])), stop)
    try:
        res = cli("--model", tiny_model_dir, "--input", inp, "--output", out, "--no-report", *TINY,
                  address=ray_address)
    finally:
        stop.set()
    assert res.returncode == 0, res.stderr[-3000:]
    assert late and not os.path.exists(os.path.join(out, late[0]))
    assert keys(read_parts(out)) == EXPECTED
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert (summary["rows_processed"], summary["rows_total"]) == (N, N)


def test_late_part_is_left_out_by_every_later_listing(tmp_path, tiny_model_dir):
    """Without Ray, through the preflight's listing: run A's late part lands after run B
    listed the output, and B fails before its summary. Run C neither counts it (its rows,
    which B wrote too, would be there twice) nor keeps it; a part named by hand counts."""
    from pipeline import DLLMProcessorConfig
    from pipeline.preflight import preflight

    inp, out = str(tmp_path / "in.parquet"), str(tmp_path / "out")
    write_prompts(inp, "r{}", N)
    config = DLLMProcessorConfig(model=tiny_model_dir)
    a = preflight(inp, out, config, run_id="a")
    _commit_part(out, a.lock.writer_id, 0, ["r0", "r1"])
    a.release()  # A failed and let go of the output; one of its write tasks is still running
    b = preflight(inp, out, config, run_id="b")
    assert sorted(b.done) == ["r0", "r1"]
    late = _commit_part(out, a.lock.writer_id, 1, ["r2", "r3"])  # A's write task commits
    _commit_part(out, b.lock.writer_id, 0, ["r2", "r3", "r4"])  # what B wrote before it failed
    pq.write_table(pa.table({"id": ["r5"], "sample_index": [0], "generated_text": ["x"]}),
                   os.path.join(out, "part-by-hand.parquet"))
    b.release()
    c = preflight(inp, out, config, run_id="c")
    try:
        assert sorted(c.done) == ["r0", "r1", "r2", "r3", "r4", "r5"]
        assert not os.path.exists(os.path.join(out, late))
        assert keys(read_parts(out)) == [(f"r{i}", 0) for i in range(6)]
    finally:
        c.release()


# --- an engine that cannot be rebuilt -------------------------------------------------------

ENGINE_ERROR = "CUDA error: an illegal memory access was encountered"
REBUILD_ERROR = "CUDA error: out of memory"


TINY_ENGINE = EngineConfig(block_length=4, steps_per_block=4, token_budget=1024)


class StepFails(Engine):
    def step(self):
        raise RuntimeError(ENGINE_ERROR)


@pytest.fixture(scope="module")
def broken_engines(tiny_model_dir):
    """Makes engine factories: the first engine's step raises, and building its replacement
    raises too."""
    import torch

    model, _ = load_model(tiny_model_dir, dtype=torch.float32)

    def make():
        built = []

        def factory() -> Engine:
            built.append(1)
            if len(built) > 1:
                raise RuntimeError(REBUILD_ERROR)
            return StepFails(model, TINY_ENGINE)
        return factory

    return make


def test_loop_whose_engine_cannot_be_rebuilt_fails_every_request(broken_engines):
    from actors.engine_loop import EngineLoop

    loop = EngineLoop(broken_engines())
    try:
        params = SamplingParams(max_new_tokens=4)
        in_flight = [loop.submit([5, 6, 7], params, f"a{i}") for i in range(3)]
        outs = [f.result(timeout=120) for f in in_flight]  # never waits forever
        later = loop.submit([5, 6], params, "b").result(timeout=5)
    finally:
        loop.shutdown()
    for out in outs + [later]:
        assert out.finish_reason == "error", out
        assert out.error == (f"engine step failed: RuntimeError: {ENGINE_ERROR}; rebuilding the engine failed: "
                             f"RuntimeError: {REBUILD_ERROR}"), out.error
    assert later.prompt_token_ids == [5, 6] and not loop._thread.is_alive()


def test_actor_batches_fail_with_the_engine_error(tiny_model_dir, broken_engines):
    """Through the engine actor: run_batch returns its rows as error rows (it would await
    its futures forever)."""
    from actors.engine_actor import DLLMEngineActor
    from actors.engine_loop import EngineLoop
    from actors.spec import EngineSpec

    actor = DLLMEngineActor(EngineSpec(tiny_model_dir, TINY_ENGINE, SamplingParams(max_new_tokens=4), rank=0,
                                       enable_metrics=False, warmup=False))
    actor.loop.shutdown()
    actor.loop = EngineLoop(broken_engines())
    batch = pa.table({"prompt_token_ids": [[5, 6, 7], [8, 9], [5]], "error": [None, None, None]})

    async def run():
        return await asyncio.wait_for(asyncio.gather(actor.run_batch(batch), actor.run_batch(batch)), 120)

    try:
        first, second = asyncio.run(run())
    finally:
        actor.loop.shutdown()
    for table in (first, second):
        assert table.column("finish_reason").to_pylist() == ["error"] * 3
        assert all(REBUILD_ERROR in e for e in table.column("error").to_pylist())
