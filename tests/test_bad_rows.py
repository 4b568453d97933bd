"""Issue 23: one bad row never takes a run down, through the real job CLI and through
`build_processor`.

CLI runs are grouped so that few runs cover the table: one input with one bad row per
case of the default-typed columns (cases 1, 2, 3, 4, 12), one with the uint64 and list
columns (1 as a list, 3b, 5) resumed into the same output with other settings (case 6:
refused, then allowed on purpose); one long run that a second job on the same output
is refused against (7), then stopped by SIGINT (8), resumed and stopped by SIGTERM (9),
and resumed to the end; and a Ray that cannot start (11).
"""
from __future__ import annotations

import glob
import json
import math
import os
import signal
import subprocess
import sys
import time
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from conftest import ROOT, part_files, read_parts
from procs import job_ray, private_ray, ray_temp_dir, titles

TINY = ["--block-length", "4", "--steps-per-block", "4", "--max-new-tokens", "8", "--token-budget", "1024",
        "--num-engines", "1"]
SP = pa.struct([("top_p", pa.string()), ("stop_token_ids", pa.list_(pa.float64())), ("max_tokens", pa.int64())])


def cli(*args: str, timeout: float = 420, address: Optional[str] = None) -> subprocess.CompletedProcess:
    """The job CLI on the Ray at `address` (conftest.ray_address), else on a Ray of its own."""
    with job_ray(address) as ray:
        return subprocess.run([sys.executable, "jobs/offline_eval.py", *TINY, *args, *ray],
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout, start_new_session=True,
                              stdin=subprocess.DEVNULL)


def last_error(res) -> str:
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, res.stderr[-3000:]
    return lines[0]


def rows_by_key(out: str) -> dict:
    """{(id, sample_index): row} of every part file (each read alone: runs with other input
    types wrote them); asserts that no key is written twice."""
    rows = [r for p in part_files(out) for r in pq.read_table(p).to_pylist()]
    keys = [(r["id"], r["sample_index"]) for r in rows]
    assert len(keys) == len(set(keys)), "a row written twice"
    return dict(zip(keys, rows))


# --- cases 1, 2, 3, 4, 12 (one run), 1b, 3b, 5 and 6 (resume into the same output) ------

def write_default_typed(path: str) -> dict:
    """8 rows: one bad value per case, and two good rows; returns {id: words of its error}."""
    sp = pa.array([{"top_p": "abc"}, {"stop_token_ids": [math.inf]}, {"max_tokens": 10**9}, None, None, None,
                   None, {"max_tokens": 4}], SP)
    ids = pa.array([[5., 6., 7.], [5., 6.], [7., 8.], [5., math.inf], [5., 7.9], [9., 10.], [11., 12.], [13., 14.]])
    pq.write_table(pa.table({"id": [f"a{i}" for i in range(8)], "prompt_token_ids": ids, "sampling_params": sp,
                             "seed": [1., 2., 3., 4., 5., math.nan, 7., 8.]}), path)
    return {"a0": ["top_p", "'abc'"], "a1": ["stop_token_ids", "inf"], "a2": ["exceeds the model context"],
            "a3": ["prompt_token_ids", "inf"], "a4": ["prompt_token_ids", "7.9"], "a5": ["seed column 'seed'", "nan"],
            "a6": None, "a7": None}


def write_wide_typed(path: str) -> dict:
    """5 rows: top_p a list (case 1), max_tokens >= 2^63 in uint64 (3b), a token id 2^63 in
    list<uint64> (5)."""
    sp = pa.array([{"top_p": [0.5], "max_tokens": None}, {"top_p": None, "max_tokens": 2**63 + 1}, None, None, None],
                  pa.struct([("top_p", pa.list_(pa.float64())), ("max_tokens", pa.uint64())]))
    ids = pa.array([[5, 6], [7, 8], [5, 2**63], [9, 10], [11, 12]], pa.list_(pa.uint64()))
    pq.write_table(pa.table({"id": [f"b{i}" for i in range(5)], "prompt_token_ids": ids, "sampling_params": sp,
                             "seed": [1., 2., 3., 4., 5.]}), path)
    return {"b0": ["top_p", "[0.5]"], "b1": ["max_tokens", "9223372036854775809"],
            "b2": ["token id 9223372036854775808 outside the vocabulary"], "b3": None, "b4": None}


def check_rows(rows: dict, expected: dict) -> None:
    for rid, words in expected.items():
        r = rows[(rid, 0)]
        if words is None:
            assert r["finish_reason"] == "length" and r["num_generated_tokens"] > 0 and not r["error"], r
        else:
            assert r["finish_reason"] == "error", r
            assert all(w in r["error"] for w in words), (words, r["error"])


def test_bad_rows_are_error_rows_and_resume_refuses_other_settings(tmp_path, ray_address):
    a, b, out = str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet"), str(tmp_path / "out")
    want_a, want_b = write_default_typed(a), write_wide_typed(b)
    # cases 1, 2, 3, 4, 12 under the default sort; --max-error-fraction 0 (default): exit 2, every row written
    t0 = time.time()
    res = cli("--input", a, "--output", out, "--seed-column", "seed", address=ray_address)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "6 of 8 rows failed" in last_error(res) and "Traceback" not in res.stderr
    rows = rows_by_key(out)
    assert sorted(rows) == [(f"a{i}", 0) for i in range(8)]
    check_rows(rows, want_a)
    print(f"run a: {time.time() - t0:.1f} s")
    # case 6: more rows resumed into that output with another budget: refused before Ray starts
    res = cli("--input", b, "--output", out, "--seed-column", "seed", "--max-new-tokens", "12",
              "--max-error-fraction", "1")
    assert res.returncode == 2 and "blockray offline eval:" not in res.stdout, res.stderr[-3000:]
    err = last_error(res)
    assert "written with other settings" in err and "sampling.max_new_tokens: 8 -> 12" in err, err
    assert "--resume-mismatch allow" in err
    # ... unless mixing is asked for: cases 1 (a list), 3b, 5; summary.json keeps both runs
    res = cli("--input", b, "--output", out, "--seed-column", "seed", "--max-new-tokens", "12",
              "--max-error-fraction", "1", "--resume-mismatch", "allow", address=ray_address)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = rows_by_key(out)
    assert sorted(rows) == sorted([(f"a{i}", 0) for i in range(8)] + [(f"b{i}", 0) for i in range(5)])
    check_rows(rows, want_b)
    assert rows[("b3", 0)]["num_generated_tokens"] == 12 and rows[("a6", 0)]["num_generated_tokens"] == 8
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert [r["status"] for r in summary["runs"]] == ["failed", "ok"], summary["runs"]
    assert summary["runs"][1]["settings_changed"] == ["sampling.max_new_tokens: 8 -> 12"]
    assert summary["run_record"]["settings"]["sampling.max_new_tokens"] == 12


def test_run_record_names_model_template_and_engine_changes(tmp_path, tiny_model_dir):
    """Case 6's other differences, on the record alone (no run): the model's files, the
    chat template, an engine setting; fields that cannot change tokens are left out."""
    import shutil

    from pipeline import DLLMProcessorConfig
    from engine import EngineConfig
    from engine.checkpoint import Checkpoint
    from pipeline.run_record import build_record, differences

    other = str(tmp_path / "other")
    shutil.copytree(tiny_model_dir, other)
    cfg = DLLMProcessorConfig(model=tiny_model_dir)
    base = build_record(cfg, Checkpoint.open(tiny_model_dir), None)
    assert differences(base, build_record(DLLMProcessorConfig(model=other, num_engines=3, batch_size=2,
                                                              engine=EngineConfig(token_budget=999)),
                                          Checkpoint.open(other), None)) == []
    with open(os.path.join(other, "config.json"), "a") as f:
        f.write(" ")
    changed = differences(base, build_record(DLLMProcessorConfig(model=other, engine=EngineConfig(cache="none")),
                                             Checkpoint.open(other), "{{ messages }}"))
    assert [d.split(":")[0] for d in changed] == ["chat_template_sha256", "engine.cache", "model_sha256"], changed


# --- cases 7, 8, 9: one writer per output, clean stops ---------------------------------

def start(args, out: str, ray_flags: list, log: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "jobs/offline_eval.py", *TINY, *args, "--output", out,
                             *ray_flags], cwd=ROOT, stdout=open(log + ".out", "w"),
                            stderr=open(log + ".err", "w"), start_new_session=True, stdin=subprocess.DEVNULL)


def wait_for(cond, proc, timeout: float = 300, what=lambda: "") -> None:
    end = time.time() + timeout
    while not cond():
        assert proc is None or proc.poll() is None, f"exited {proc.returncode} early"
        assert time.time() < end, f"timed out {what()}"
        time.sleep(0.3)


def ray_processes(ray_tmp: str) -> list:
    """Processes of the Ray that used `ray_tmp` (its session dir is on their command line)."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                cmd = open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if ray_tmp in cmd:
                found.append(f"{d}: {cmd[:200]}")
    return found


def run_actors() -> set:
    """Pids of the blockray actors (engines, dispatchers, group) on this process's Ray."""
    import ray
    from ray._private import ray_constants

    raylet = ray._private.worker._global_node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    return {pid for pid, t in titles(raylet).items()
            if t.startswith(("ray::DLLMEngineActor", "ray::MapWorker", "ray::_EngineGroup"))}


def stop_midrun(args, out: str, sig: int, tmp_path, name: str, before=None, address: Optional[str] = None) -> str:
    """Start a run (on a Ray of its own, or joining the one at `address`), wait until its
    engines generate (a part file more than before), send `sig` to the driver; assert the
    clean stop (its Ray stopped, or its actors gone from the joined one) and return its stderr."""
    with ray_temp_dir() as ray_tmp:
        log = str(tmp_path / name)
        n0 = len(glob.glob(os.path.join(out, "part-*.parquet")))
        actors_before = run_actors() if address else set()
        proc = start(args, out, ["--address", address] if address else private_ray(ray_tmp), log)
        try:
            wait_for(lambda: "blockray offline eval:" in open(log + ".out").read(), proc)
            if before is not None:
                before()
            wait_for(lambda: len(glob.glob(os.path.join(out, "part-*.parquet"))) > n0, proc)
            proc.send_signal(sig)
            t0 = time.time()
            rc = proc.wait(120)
            stopped_in = time.time() - t0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        err = open(log + ".err").read()
        assert rc == 128 + sig, (rc, err[-3000:])
        print(f"{name}: stopped {stopped_in:.1f} s after the signal")
        lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
        assert lines == [lines[-1]] and lines[0].startswith(f"error: interrupted ({signal.Signals(sig).name})"), err
        assert "Traceback" not in err and "SIGABRT" not in err and "*** " not in err, err[-3000:]
        if address:  # the job's actors end with its driver
            wait_for(lambda: not run_actors() - actors_before, None, timeout=60)
        else:  # its Ray's processes exit (a worker may take a few seconds on a loaded machine)
            wait_for(lambda: not ray_processes(ray_tmp), None, timeout=30, what=lambda: ray_processes(ray_tmp))
    assert not os.path.exists(os.path.join(out, "_tmp")) and not os.path.exists(os.path.join(out, "_lock.json"))
    pq.read_table(out, columns=["id"])  # every part file there is complete
    return err


def test_one_writer_per_output_and_clean_signals(tmp_path, ray_address):
    inp, out = str(tmp_path / "in.parquet"), str(tmp_path / "out")
    n = 160
    pq.write_table(pa.table({"id": [f"s{i}" for i in range(n)],
                             "prompt": [f"copy: {'abcdefgh'[: i % 8 + 1]}" for i in range(n)]}), inp)
    args = ["--input", inp, "--rows-per-file", "0", "--batch-size", "4", "--max-error-fraction", "1",
            "--max-new-tokens", "24"]
    refused = {}

    def second_job():  # case 7: a second job on the output while the first runs
        t0 = time.time()
        res = cli(*args, "--output", out)
        refused.update(rc=res.returncode, err=last_error(res), s=time.time() - t0, out=res.stdout)

    stop_midrun(args, out, signal.SIGINT, tmp_path, "sigint", before=second_job)  # case 8
    assert refused["rc"] == 2 and "is being written by run" in refused["err"], refused
    assert "pid" in refused["err"] and "blockray offline eval:" not in refused["out"]
    # case 9 as `ray job stop` does it (SIGTERM to a driver that joined a cluster), resumed;
    # the SIGINT run above stopped a Ray of its own: the same handler, both Ray modes
    stop_midrun(args, out, signal.SIGTERM, tmp_path, "sigterm", address=ray_address)
    done = len(read_parts(out))
    assert 0 < done < n
    res = cli(*args, "--output", out, address=ray_address)  # resumable: the rest, every row once
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(rows_by_key(out)) == sorted((f"s{i}", 0) for i in range(n))
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["rows_skipped"] == done and summary["rows_processed"] == n - done


# --- case 11: Ray does not start ---------------------------------------------------------

def test_ray_start_failure_is_exit_2(tmp_path):
    inp = str(tmp_path / "in.parquet")
    pq.write_table(pa.table({"id": ["x"], "prompt": ["copy: a"]}), inp)
    (tmp_path / "file").write_text("")
    res = subprocess.run([sys.executable, "jobs/offline_eval.py", *TINY, "--input", inp, "--output",
                          str(tmp_path / "out"), "--temp-dir", str(tmp_path / "file" / "ray")], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert res.returncode == 2, res.stderr[-3000:]
    err = last_error(res)
    assert err.startswith("error: Ray did not start: NotADirectoryError") and "--num-cpus" in err, err
    assert "internal error" not in res.stderr and not os.path.exists(tmp_path / "out" / "_lock.json")


# --- cases 1, 2, 4 through build_processor on ray.data.from_items ----------------------

def test_bad_rows_through_build_processor(ray_local, tiny_model_dir):
    import ray

    from engine import EngineConfig, SamplingParams
    from pipeline import DLLMProcessorConfig, build_processor

    cfg = DLLMProcessorConfig(model=tiny_model_dir, num_engines=1, batch_size=4, dtype="float64",
                              wait_for_engines_s=0, should_continue_on_error=True, engine=EngineConfig(block_length=4, steps_per_block=4,
                                                                        token_budget=1024),
                              sampling=SamplingParams(max_new_tokens=4, policy="fixed"))
    items = [
        {"id": "p0", "prompt_token_ids": [5, 6], "sampling_params": {"top_p": "abc"}},
        {"id": "p2", "prompt_token_ids": [5, 6], "sampling_params": {"stop_token_ids": [math.inf]}},
        {"id": "p3", "prompt_token_ids": [5, math.inf], "sampling_params": None},
        {"id": "p4", "prompt_token_ids": [5, 7.9], "sampling_params": None},
        {"id": "p5", "prompt_token_ids": [5, 6], "sampling_params": {"max_tokens": 4}},
        {"id": "p6", "prompt_token_ids": [7, 8], "sampling_params": None},
    ]
    # (Rows whose same field has types Arrow cannot unify, a string here and a list there, fail in
    # Ray Data's own concatenation of blocks, before any stage: the list case runs through the CLI.)
    rows = {r["id"]: r for r in build_processor(cfg)(ray.data.from_items(items)).take_all()}
    assert sorted(rows) == ["p0", "p2", "p3", "p4", "p5", "p6"]
    for rid, words in {"p0": ["top_p", "'abc'"], "p2": ["stop_token_ids", "inf"],
                       "p3": ["prompt_token_ids", "inf"], "p4": ["prompt_token_ids", "7.9"]}.items():
        assert rows[rid]["finish_reason"] == "error" and all(w in rows[rid]["error"] for w in words), rows[rid]
    for rid in ("p5", "p6"):
        assert rows[rid]["finish_reason"] == "length" and rows[rid]["num_generated_tokens"] == 4, rows[rid]
