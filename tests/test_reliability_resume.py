"""Issue 7, A3: the job driver (`python jobs/offline_eval.py`, local Ray) is SIGKILLed
mid-run after some part files exist; a rerun with the same output skips the ids already
written, processes only the missing ones, and every id ends up exactly once.

The driver runs in its own process group with its own Ray temp dir: the kill takes its
whole local Ray down (GCS, raylet, workers) and no `ray_current_cluster` marker in
/tmp/ray is left pointing to a dead head."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq

from conftest import ROOT, part_files, read_parts, write_prompts
from procs import private_ray, ray_temp_dir

N = 24


def _pgid_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _pids_mentioning(text: str):
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                cmd = open(f"/proc/{d}/cmdline", "rb").read().decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                out.append(int(d))
    return out


def _describe(pid: int) -> str:
    try:
        stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        return f"state={stat[0]} ppid={stat[1]} pgid={stat[2]} {cmd[:160]}"
    except OSError:
        return "gone"


def _job(model, inp, out, ray: list, *extra):
    return [sys.executable, "jobs/offline_eval.py", "--model", model, "--input", inp, "--output", out,
            "--num-engines", "1", "--batch-size", "2", "--max-concurrent-batches", "1", "--rows-per-file", "0",
            "--block-length", "4", "--steps-per-block", "4", "--max-new-tokens", "8", "--token-budget", "1024",
            "--policy", "fixed", *ray, *extra]


def _ids(out):
    return read_parts(out, columns=["id"]).column("id").to_pylist()


def test_killed_driver_then_resume(tmp_path, tiny_model_dir, ray_address):
    inp, out = str(tmp_path / "in.parquet"), str(tmp_path / "out")
    write_prompts(inp, "r{:03d}", N)
    marker = "/tmp/ray/ray_current_cluster"
    marker_before = open(marker).read() if os.path.exists(marker) else None
    with ray_temp_dir() as ray_tmp:  # removed once the killed job's processes are gone
        log = open(tmp_path / "run1.log", "w")
        proc = subprocess.Popen(_job(tiny_model_dir, inp, out, private_ray(ray_tmp)), cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.time() + 180
            while len(part_files(out)) < 2:
                assert proc.poll() is None, open(tmp_path / "run1.log").read()[-3000:]
                assert time.time() < deadline, "no part files appeared"
                time.sleep(0.1)
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the driver and the local Ray it started
            proc.wait(30)
            log.close()
        end = time.time() + 20
        while (_pgid_alive(proc.pid) or _pids_mentioning(ray_tmp)) and time.time() < end:
            time.sleep(0.2)
        # Ray workers run in process groups of their own: when the raylet dies with the group
        # they notice and exit, but maybe not quickly on a loaded node. Those left are ours
        # (they name our private temp dir): SIGKILL them by pid.
        leftovers = [(pid, _describe(pid)) for pid in _pids_mentioning(ray_tmp)]
        for pid, _ in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        end = time.time() + 10
        while _pids_mentioning(ray_tmp) and time.time() < end:
            time.sleep(0.2)
        assert not _pids_mentioning(ray_tmp), f"processes of the killed job survived: {leftovers}"
    print("killed job's orphaned workers cleaned by pid:", leftovers)
    assert not _pgid_alive(proc.pid)
    assert (open(marker).read() if os.path.exists(marker) else None) == marker_before  # /tmp/ray untouched

    first = _ids(out)
    assert 0 < len(first) < N and len(first) == len(set(first))
    assert not os.path.exists(os.path.join(out, "summary.json"))  # the killed run is not presented as done

    # the rerun joins the session's Ray: no second Ray of its own to start
    res = subprocess.run(_job(tiny_model_dir, inp, out, ["--address", ray_address]), cwd=ROOT, capture_output=True,
                         text=True, timeout=300, start_new_session=True)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    ids = _ids(out)
    assert sorted(ids) == [f"r{i:03d}" for i in range(N)]  # every id exactly once
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["rows_skipped"] == len(first)
    assert summary["rows_processed"] == summary["rows"] == N - len(first)
    assert summary["rows_total"] == N and summary["resumed"] is True
    assert not os.path.exists(os.path.join(out, "_tmp"))



def test_resume_reads_complete_parts_only(tmp_path):
    """Without Ray: the ids of complete part files are skipped at read time; `_tmp/`
    leftovers of a dead run are neither counted nor kept; a finished output resumes to nothing."""
    from pipeline.reader import PromptParquetDatasource
    from common.storage import get_filesystem
    from pipeline.writer import completed_ids, prepare_output

    inp, out = tmp_path / "in.parquet", tmp_path / "out"
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(10)], "prompt": ["copy: a"] * 10}), inp)
    (out / "_tmp").mkdir(parents=True)
    pq.write_table(pa.table({"id": ["r1", "r2"]}), out / "part-a-000000.parquet")
    pq.write_table(pa.table({"id": ["r3", "r4", "r5"]}), out / "_tmp" / "x-part-a-000001.parquet")  # partial
    (out / "summary.json").write_text("{}")
    fs, path = get_filesystem(str(out))
    prepare_output(fs, path, resume=True)
    assert not (out / "_tmp").exists() and not (out / "summary.json").exists()
    done = completed_ids(fs, path)
    assert done == ["r1", "r2"]
    src = PromptParquetDatasource(str(inp), exclude_ids=done)
    assert src.num_rows == 8 and src.num_excluded == 2
    rows = [i for t in src.get_read_tasks(1) for b in t() for i in b.column("id").to_pylist()]
    assert rows == [f"r{i}" for i in range(10) if i not in (1, 2)]
    everything = PromptParquetDatasource(str(inp), exclude_ids=[f"r{i}" for i in range(10)])
    assert everything.num_rows == 0 and everything.get_read_tasks(1) == []
