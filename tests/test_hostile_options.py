"""Issue 37 (part 2): bad options and input schemas are refused before Ray starts.

Every numeric option has its bounds declared once (the config dataclasses' field metadata,
pipeline/config.py JOB_BOUNDS) and is refused as it is parsed; the preflight refuses what
the engine pool can never get from the local Ray it will start (--num-cpus), an id column
missing from some or all files, a repeated column, a prompt column of a type no row can be
read as, a blockray.json key no option has, and settings every row would be refused for
(the engine's own checks of a one-token row). Each through the real CLI in a subprocess:
exit 2, one `error:` line naming the option, and Ray never started (its private temp dir
stays empty). A joined cluster is checked once connected, before any engine starts. Two
tiny real runs on the session's Ray: `--limit 0` (no rows, every check made) and the
<file>:<row> id fallback, stated in the run log, the summary and summary.json.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import ROOT, part_files, read_parts, write_prompts
from procs import ray_temp_dir

TINY = ["--block-length", "4", "--steps-per-block", "4", "--max-new-tokens", "8", "--token-budget", "1024",
        "--dtype", "float64", "--no-enable-metrics", "--no-report", "--batch-size", "2"]


def job(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "jobs/offline_eval.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, start_new_session=True, stdin=subprocess.DEVNULL)


def refused(model: str, inp: str, out: str, *args: str, ray: tuple = ("--num-cpus", "2")) -> str:
    """The job with a private local Ray (2 CPUs; `ray`: other flags) and `args` last: exit 2,
    one `error:` line (the only line on stderr but for Ray's own when it joins a cluster),
    no traceback, and Ray never started: its temp dir stays empty, no run line printed,
    the output untouched. Returns the line."""
    with ray_temp_dir() as ray_tmp:
        joins = "--address" in ray
        res = job("--model", model, "--input", inp, "--output", out, *ray, *(() if joins else ("--temp-dir", ray_tmp)),
                  *args)
        assert os.listdir(ray_tmp) == [], "Ray started before the refusal"
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-4000:]
    assert lines and lines[-1].startswith("error: ") and (joins or len(lines) == 1), res.stderr
    assert sum(line.startswith("error:") for line in lines) == 1, res.stderr
    assert "Traceback" not in res.stdout + res.stderr and "blockray offline eval:" not in res.stdout
    assert not os.path.exists(out), "the output was touched"
    return lines[-1]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """Prompt files: a good one, and one per hostile schema."""
    d = tmp_path_factory.mktemp("inputs")
    good = str(d / "good.parquet")
    write_prompts(good, "g{}", 3)
    files = {"good": good}
    tables = {
        "repeated": pa.Table.from_arrays([pa.array(["a"]), pa.array(["copy: a"]), pa.array(["copy: b"])],
                                         names=["id", "prompt", "prompt"]),
        "binary": pa.table({"id": ["a"], "prompt": pa.array([b"copy: a"], pa.binary())}),
        "int": pa.table({"id": ["a"], "prompt": pa.array([7], pa.int64())}),
        "null": pa.table({"id": ["a", "b"], "prompt": pa.nulls(2)}),
        "noprompt": pa.table({"id": ["a"], "question": ["copy: a"]}),
    }
    for name, table in tables.items():
        files[name] = str(d / f"{name}.parquet")
        pq.write_table(table, files[name])
    mixed = d / "mixed"  # one file with ids, one without
    mixed.mkdir()
    write_prompts(str(mixed / "a.parquet"), "a{}", 2)
    pq.write_table(pa.table({"prompt": ["copy: x"]}), mixed / "b.parquet")
    files["mixed"] = str(mixed)
    return files


# --- every numeric option has bounds, refused as it is parsed -------------------------------

def _outside(b):
    """A value outside Bounds `b` (None when it has no range)."""
    if b.low is not None:
        return b.low if b.low_open else b.low - 1
    return None if b.high is None else b.high + 1


def test_every_numeric_option_is_refused_outside_its_bounds(capsys):
    """Each int / float flag has declared Bounds (a new config field without them fails
    here), and a value outside them exits 2 with one line naming the flag."""
    from pipeline.cli import build_parser, option_bounds, parse_args

    bounds = option_bounds()
    numeric = [a for a in build_parser()._actions if a.type in (int, float) and a.nargs is None]
    assert len(numeric) > 30
    assert [a.dest for a in numeric if a.dest not in bounds] == []
    tried = 0
    for action in numeric:
        value = _outside(bounds[action.dest])
        if value is None:  # --seed: any integer
            continue
        flag = action.option_strings[0]
        with pytest.raises(SystemExit) as e:
            parse_args([flag, str(int(value) if action.type is int else value)])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and err.startswith(f"error: {flag} must be") and len(err.splitlines()) == 1, err
        tried += 1
    assert tried == len(numeric) - 1
    for flag, value in (("--top-p", "nan"), ("--temperature", "inf"), ("--limit", "1.5")):
        with pytest.raises(SystemExit):
            parse_args([flag, value])
        assert flag in capsys.readouterr().err


def test_the_same_bounds_hold_for_a_library_caller():
    """DLLMProcessorConfig (build_processor's), EngineConfig and SamplingParams read the
    same declarations; run_offline's own options too."""
    from engine import EngineConfig, SamplingParams
    from pipeline import DLLMProcessorConfig
    from pipeline.preflight import JobError
    from pipeline.run_spec import check_options

    for kw, named in ((dict(num_engines=0), "num_engines"), (dict(cpu_stage_num_cpus=0), "cpu_stage_num_cpus"),
                      (dict(wait_for_engines_s=-1), "wait_for_engines_s"), (dict(batch_size=2.5), "batch_size")):
        with pytest.raises(ValueError, match=named):
            DLLMProcessorConfig(model="m", **kw)
    with pytest.raises(ValueError, match="block_length must be an integer >= 1, got '8'"):
        EngineConfig(block_length="8")  # e.g. a string in blockray.json
    assert SamplingParams(entropy_bound=0).validate() == "entropy_bound must be > 0, got 0"
    with pytest.raises(JobError, match=r"limit must be an integer >= 0 .*got -1 \(--limit\)"):
        check_options(limit=-1)


# --- refused in the preflight, before Ray starts (CLI) --------------------------------------

# (case, the arguments after the defaults, the input, words of the error line)
CASES = [
    ("num-engines 0 is no 'unset'", ["--num-engines", "0"], "good", ["--num-engines must be an integer >= 1, got 0"]),
    ("limit -1", ["--limit", "-1"], "good", ["--limit must be an integer >= 0", "got -1"]),
    ("limit 0 still checks the first file", ["--limit", "0"], "noprompt", ["no prompt column 'prompt'"]),
    ("rows-per-file -1", ["--rows-per-file", "-1"], "good", ["--rows-per-file must be an integer >= 0"]),
    ("num-cpus 0", ["--num-cpus", "0"], "good", ["--num-cpus must be an integer >= 1, got 0"]),
    ("num-cpus 1: 2 engines never fit", ["--num-cpus", "1"], "good",
     ["needs 1.35 CPU (2 engine(s) x 0.5 + 2 dispatcher(s) x 0.05 + 0.25", "the local Ray (--num-cpus 1) has 1",
      "--num-engines", "--num-cpus-per-engine"]),
    ("one engine larger than the machine", ["--num-engines", "1", "--num-cpus-per-engine", "4"], "good",
     ["needs 4.3 CPU (1 engine(s) x 4", "(--num-cpus 2) has 2", "--num-cpus-per-engine"]),
    ("max-error-fraction", ["--max-error-fraction", "1.5"], "good", ["--max-error-fraction must be in [0, 1]"]),
    ("dtype float17", ["--dtype", "float17"], "good", ["dtype must be auto or one of", "'float17'"]),
    ("an unknown --id-column", ["--id-column", "uid"], "good",
     ["no input file has the id column 'uid'", "good.parquet", "columns: ['id', 'prompt']", "--id-column"]),
    ("the id column in some files only", [], "mixed",
     ["b.parquet has no id column 'id'", "a.parquet has (1 of 2 file(s)", "--id-column"]),
    ("a repeated column", [], "repeated", ["repeated.parquet has more than one column named 'prompt'", "--input"]),
    ("a binary prompt column", [], "binary",
     ["binary.parquet: column 'prompt' is binary, not text", "--prompt-column"]),
    ("an int prompt column", [], "int", ["int.parquet: column 'prompt' is int64, not text", "--prompt-column"]),
    ("an all-null prompt column", [], "null",
     ["column 'prompt' holds only nulls (in", "null.parquet", "--prompt-column"]),
    ("max_new_tokens past the context", ["--max-new-tokens", "100000"], "good",
     ["every row would be refused with these settings", "exceeds the model context of 1024 tokens"]),
    ("a row wider than the budget", ["--max-new-tokens", "600", "--token-budget", "300"], "good",
     ["every row would be refused", "more than token_budget=300"]),
    ("D2F on a bidirectional model", ["--block-add-threshold", "0.5"], "good",
     ["every row would be refused", "block_add_threshold (D2F decoding) needs block-causal attention"]),
    ("token editing outside LLaDA2", ["--edit-threshold", "0.9"], "good",
     ["every row would be refused", "edit_threshold (LLaDA2.1 token editing) is not part of LLaDA's decoding"]),
    ("a D2F option without D2F", ["--decoded-token-threshold", "0.5"], "good",
     ["decoded_token_threshold", "not read by this row's decoding (block)"]),
    ("prefix caching on a bidirectional prompt", ["--enable-prefix-caching"], "good",
     ["enable_prefix_caching: LLaDA attends over the whole prompt at once", "cannot be reused exactly",
      "--enable-prefix-caching"]),
]


@pytest.mark.parametrize("args, which, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_before_ray_starts(tmp_path, tiny_model_dir, inputs, args, which, words):
    err = refused(tiny_model_dir, inputs[which], str(tmp_path / "out"), *args)
    for w in words:
        assert w in err, (w, err)


def test_an_unknown_blockray_json_key_is_refused(tmp_path, tiny_model_dir, inputs):
    model = str(tmp_path / "model")
    shutil.copytree(tiny_model_dir, model)
    with open(os.path.join(model, "blockray.json"), "w") as f:
        json.dump({"block_lenght": 8, "max_new_tokens": 8}, f)
    err = refused(model, inputs["good"], str(tmp_path / "out"))
    assert "blockray.json of model" in err and "unknown key(s) 'block_lenght' (did you mean 'block_length'?)" in err


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    from tiny.diffusion_gemma import build

    tmp = tmp_path_factory.mktemp("dgemma")
    inp = str(tmp / "in.parquet")
    pq.write_table(pa.table({"id": ["g0"], "messages": [[{"role": "user", "content": "w1 w2"}]]}), inp)
    return build(str(tmp / "ckpt")), inp


def test_diffusion_gemma_knobs_every_row_refuses(tmp_path, gemma):
    """t_min 0.9 passes SamplingParams' bounds but not the canvas engine's own check once
    resolved over generation_config.json (t_max 0.8): every row would fail, so the
    preflight refuses it; so does a budget no canvas fits. entropy_bound 0 is out of its
    bounds (the canvas engine's, declared once on SamplingParams), refused as parsed."""
    from engine import EngineConfig, SamplingParams
    from pipeline.run import JobError, check_model

    model, inp = gemma
    err = refused(model, inp, str(tmp_path / "out"), "--t-min", "0.9")
    assert "every row would be refused with these settings (DiffusionGemma" in err
    assert "t_min must be below t_max, got t_min=0.9 t_max=0.8" in err
    with pytest.raises(JobError, match="exceed the token budget 64"):
        check_model(model, False, sampling=SamplingParams(max_new_tokens=200), engine=EngineConfig(token_budget=64))
    res = job("--model", model, "--input", inp, "--entropy-bound", "0")
    assert res.returncode == 2 and res.stderr.strip() == "error: --entropy-bound must be > 0, got 0.0 (see --help)"


def test_a_pool_the_machine_cannot_hold_is_refused(tmp_path, tiny_model_dir, inputs):
    """Without --num-cpus the local Ray would get the machine's CPUs, resolved as Ray does."""
    n = 2 * os.cpu_count() + 2
    err = refused(tiny_model_dir, inputs["good"], str(tmp_path / "out"), "--num-engines", str(n), ray=())
    assert f"needs {n * 0.55 + 0.25:g} CPU ({n} engine(s) x 0.5 + {n} dispatcher(s) x 0.05 + 0.25" in err, err
    assert "but the local Ray (this machine's CPUs; --num-cpus) has" in err


# --- a joined cluster: checked once connected, before the output or any engine ---------------------

def test_a_pool_the_joined_cluster_cannot_hold_is_refused(tmp_path, tiny_model_dir, inputs, ray_address):
    err = refused(tiny_model_dir, inputs["good"], str(tmp_path / "out"), "--num-engines", "4", *TINY,
                  ray=("--address", ray_address))
    assert err.startswith("error: the engine pool needs 2.45 CPU (4 engine(s) x 0.5 + 4 dispatcher(s)"), err
    assert "but the cluster has 2" in err and "--num-engines" in err


def test_run_offline_refuses_a_pool_the_cluster_cannot_hold(tmp_path, tiny_model_dir, inputs, ray_local):
    """A library caller's run_offline checks the pool against the Ray it is connected to."""
    from pipeline import DLLMProcessorConfig
    from pipeline.run import JobError, run_offline

    cfg = DLLMProcessorConfig(model=tiny_model_dir, num_engines=1, num_gpus_per_engine=1)
    with pytest.raises(JobError, match=r"needs 1 GPU \(1 engine\(s\) x 1\) but the cluster has 0.*"
                                       r"\(--num-gpus-per-engine\)"):
        run_offline(inputs["good"], str(tmp_path / "out"), cfg)
    assert not os.path.exists(tmp_path / "out")  # refused before the output was touched


def test_one_engine_must_fit_one_node():
    """Enough CPUs in total, but no node holds one engine: refused naming the option."""
    from pipeline import DLLMProcessorConfig
    from pipeline.preflight import JobError
    from pipeline.resources import Cluster, check_resources

    cfg = DLLMProcessorConfig(model="m", num_engines=1, num_cpus_per_engine=6)
    two_nodes = Cluster({"CPU": 8.0}, [{"CPU": 4.0}, {"CPU": 4.0}])
    with pytest.raises(JobError, match=r"one engine needs 6 CPU on a single node.*\(--num-cpus-per-engine\)"):
        check_resources(cfg, two_nodes)
    check_resources(DLLMProcessorConfig(model="m", num_engines=2, num_cpus_per_engine=3), two_nodes)


# --- two tiny real runs on the session's Ray -----------------------------------------------------

def test_limit_0_makes_every_check_and_no_row(tmp_path, tiny_model_dir, inputs, ray_address):
    out = str(tmp_path / "out")
    res = job("--model", tiny_model_dir, "--input", inputs["good"], "--output", out, "--limit", "0",
              "--address", ray_address, *TINY)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert (summary["rows"], summary["errors"], summary["status"], summary["ids_note"]) == (0, 0, "ok", None)
    assert part_files(out) == []


def test_ids_derived_without_an_id_column_are_stated(tmp_path, tiny_model_dir, ray_address):
    """No file has the default id column: each row's id is <file>:<row>, and the run log,
    the printed summary and summary.json say so."""
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    pq.write_table(pa.table({"prompt": ["copy: ab", "rev: cd"]}), d / "a.parquet")
    pq.write_table(pa.table({"prompt": ["copy: x"]}), d / "sub" / "b.parquet")
    out = str(tmp_path / "out")
    res = job("--model", tiny_model_dir, "--input", str(d), "--output", out, "--address", ray_address, *TINY,
              "--num-engines", "1", timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = {(r["id"], r["sample_index"]): r for r in read_parts(out).to_pylist()}
    assert sorted(rows) == [("a.parquet:0", 0), ("a.parquet:1", 0), ("sub/b.parquet:0", 0)]
    assert all(r["error"] is None for r in rows.values())
    note = json.load(open(os.path.join(out, "summary.json")))["ids_note"]
    assert note.startswith("the input has no 'id' column: each row's id is <file>:<row>") and "resume" in note
    assert f"ids: {note}" in res.stdout  # the run log, before Ray starts
    assert f"ids                {note}" in res.stdout  # the printed summary
