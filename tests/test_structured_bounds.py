"""Issue 53 (items 1 and 8): compiling a structured-outputs constraint is bounded. A regex
whose DFA blows up (`[ab]*a[ab]{14}`: 2^15 states from 16 characters) and a 1.4 MiB JSON
schema among plain rows are those rows' errors naming the cap (and how to raise it), at
the cost of the cap, not of the constraint; the other rows get the tokens they get
without them (float64). The state count stops at the cap (a regex of 2^41 states is
refused as fast as one of 2^15), outlines-core's index is held to the cap and to the
time limit (its child process killed past it), and back-references / look-around are
refused per row, with why, before the engine."""
from __future__ import annotations

import json
import os
import sys
import time
import tracemalloc

import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams, load_model
from engine.structured.automaton import Compiler, ConstraintRefused
from engine.structured.params import parse
from engine.structured.regular import OverCap, count_states

torch.set_num_threads(1)
TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine", "assets", "tiny-dllm")
BLOWUP = "[ab]*a[ab]{14}"
PLAIN = ["copy: abc", "rev: cab", "q: hello", "count to 5", "spell dog", "copy: dog"]


def big_schema() -> dict:
    """A JSON schema of about 1.4 MiB (28,000 string properties)."""
    return {"type": "object", "additionalProperties": False,
            "properties": {f"field_{i:05d}": {"type": "string", "maxLength": 8} for i in range(28_000)}}


@pytest.fixture(scope="module")
def tiny():
    return load_model(TINY, dtype=torch.float64, device="cpu")


def test_the_state_count_is_exact_below_the_cap_and_stops_at_it():
    # [ab]*a[ab]{k}: the subset construction's 2^(k+1) + 1 states
    assert count_states("[ab]*a[ab]{6}", 1000) == 129
    assert count_states("[ab]*a[ab]{6}", 129) == 129
    with pytest.raises(OverCap, match="more than 128 states"):
        count_states("[ab]*a[ab]{6}", 128)
    t0 = time.process_time()
    with pytest.raises(OverCap, match="more than 1,000 states"):
        count_states("[ab]*a[ab]{40}", 1000)  # 2^41 states: stops at the cap
    # many pieces: the NFA and the construction's work are capped too
    with pytest.raises(OverCap, match="its NFA has more than 64,000 states"):
        count_states("(a?){60000}", 1000)
    with pytest.raises(OverCap, match="tracks more than 128,000 NFA states"):
        count_states("(a?){3000}", 1000)
    assert time.process_time() - t0 < 30  # a bound the unbounded construction could never meet (2^41 states)


def test_rows_over_a_cap_are_errors_naming_it_and_the_other_rows_keep_their_tokens(tiny):
    model, tok = tiny
    schema = big_schema()
    assert 1.3 * 2**20 < len(json.dumps(schema)) < 1.5 * 2**20
    plain = [SamplingParams(max_new_tokens=12), SamplingParams(max_new_tokens=12, temperature=0.8, seed=4),
             SamplingParams(max_new_tokens=12, structured_outputs={"regex": "[a-c]{2,5}"}),
             SamplingParams(max_new_tokens=12, structured_outputs={"choice": ["yes", "no"]}),
             SamplingParams(max_new_tokens=12, structured_outputs={"regex": "(ab|ba)+"}),
             SamplingParams(max_new_tokens=12, policy="fixed")]
    hostile = [SamplingParams(max_new_tokens=12, structured_outputs={"regex": BLOWUP}),
               SamplingParams(max_new_tokens=12, structured_outputs={"json": schema})]
    cfg = EngineConfig(block_length=4, steps_per_block=4, max_batch_size=8)
    alone = Engine(model, cfg, tokenizer=tok).generate(PLAIN, plain)
    eng = Engine(model, cfg, tokenizer=tok)
    tracemalloc.start()
    outs = eng.generate(PLAIN[:3] + ["x", "y"] + PLAIN[3:], plain[:3] + hostile + plain[3:])
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    bad = outs[3:5]
    assert [o.finish_reason for o in bad] == ["error", "error"]
    assert "structured_max_states=10,000" in bad[0].error and "--structured-max-states" in bad[0].error, bad[0].error
    assert "structured_max_chars=65,536" in bad[1].error and "--structured-max-chars" in bad[1].error, bad[1].error
    assert len(bad[1].error) < 1000  # the schema is not echoed back
    good = outs[:3] + outs[5:]
    assert [o.error for o in good] == [None] * 6
    assert [o.token_ids for o in good] == [o.token_ids for o in alone]
    # the old dense states x states tables of BLOWUP alone were 1 GiB (bool) and 4 GiB (float)
    assert peak < 256 << 20, peak


def test_the_token_index_is_held_to_the_cap_and_to_the_time_limit(tiny):
    """outlines-core's index (built in the compiler's child process) counts states its own
    way (byte-level, its DFA's): over the cap it is refused too; past the time limit the
    child is killed, the row is an error naming the limit, and the next compile works."""
    model, tok = tiny
    slow = parse({"regex": "[ab]*a[ab]{13}"})  # 16,385 DFA states; its token index takes outlines-core a while
    comp = Compiler(tok, model.config.vocab_size, EngineConfig(structured_max_states=20_000))
    assert comp.get(parse({"regex": "[a-c]{3}"}), [1]).n_states > 3  # the child started and holds the vocabulary
    with pytest.raises(ConstraintRefused, match="its token-level index has [0-9,]+ states .*structured_max_states"):
        Compiler(tok, model.config.vocab_size, EngineConfig(structured_max_states=3000)).get(
            parse({"regex": "[ab]*a[ab]{10}"}), [1])  # 2,049 DFA states counted, more in outlines-core's index
    timed = Compiler(tok, model.config.vocab_size, EngineConfig(structured_max_states=20_000,
                                                                structured_compile_timeout_s=0.001))
    with pytest.raises(ConstraintRefused, match="took over 0.001 s.*structured_compile_timeout_s"):
        timed.get(slow, [1])
    with pytest.raises(ConstraintRefused, match="structured_compile_timeout_s"):  # refusals are cached too
        timed.get(slow, [1])
    assert timed.compiles == 1
    assert comp.get(parse({"regex": "(ab|ba)+"}), [1]).n_states > 1  # a new child


@pytest.fixture
def inductors_recursion_limit():
    """The recursion limit torch's inductor leaves behind (2000): a refusal must not depend on
    which tests ran before in the process."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(2000)
    yield
    sys.setrecursionlimit(old)


@pytest.mark.parametrize("spec, why", [
    ({"regex": "(a)\\1"}, "a back-reference (\\1, (?P=name))"),
    ({"regex": "a(?=b)[a-z]"}, "a look-ahead (?=...) is not supported"),
    ({"regex": "[a-z](?<!a)"}, "a look-behind (?<!...) is not supported"),
    ({"regex": "\\ba"}, "word boundaries"),
    ({"regex": "^[a-z]+"}, "anchors"),
    ({"json": {"type": "string", "pattern": "(?!x)[a-z]+"}}, "pattern '(?!x)[a-z]+': a look-ahead (?!...)"),
    ({"regex": "(" * 600 + "a" + ")" * 600}, "nested too deeply to parse"),  # past MAX_GROUP_DEPTH
    ({"json": {"type": "string", "pattern": "(" * 101 + "a" + ")" * 101}}, "nested too deeply to parse"),
    ({"json": "[" * 3000 + "]" * 3000}, "nested too deeply to read"),
])
def test_what_a_dfa_cannot_express_is_refused_per_row_with_why(tiny, spec, why, inductors_recursion_limit):
    assert why in SamplingParams(structured_outputs=spec).validate()  # before the engine
    model, tok = tiny
    outs = Engine(model, EngineConfig(block_length=4, steps_per_block=4), tokenizer=tok).generate(
        ["a", "b"], [SamplingParams(max_new_tokens=8, structured_outputs=spec), SamplingParams(max_new_tokens=8)])
    assert outs[0].finish_reason == "error" and why in outs[0].error, outs[0].error
    assert outs[1].error is None


def test_through_the_cli_under_a_memory_limit(tmp_path):
    """Acceptance 1: the two rows among 6 plain ones, the job on a local Ray of its own
    under a 6 GiB limit on every process's private memory (RLIMIT_DATA, inherited by Ray's
    processes and the engine actor; RLIMIT_AS would also count Ray's shared object store):
    exit 0, the plain rows generated, the two rows errors naming the cap, every row from
    engine 0 and none sent again (a restarted engine gets a new rank and resends its batch)."""
    import resource
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq

    from conftest import ROOT, read_parts
    from procs import job_ray

    ids = [f"p{i}" for i in range(6)] + ["blowup", "schema"]
    sp = [None] * 6 + [{"structured_outputs": {"regex": BLOWUP, "json": None}},
                       {"structured_outputs": {"regex": None, "json": json.dumps(big_schema())}}]
    pq.write_table(pa.table({"id": ids, "prompt": PLAIN + ["x", "y"], "sampling_params": sp}), tmp_path / "in.parquet")
    limit = 6 << 30

    def cap_memory():
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))

    out = str(tmp_path / "out")
    with job_ray() as ray:
        res = subprocess.run([sys.executable, "jobs/offline_eval.py", "--model", TINY, "--input",
                              str(tmp_path / "in.parquet"), "--output", out, "--block-length", "4", "--steps-per-block",
                              "4", "--max-new-tokens", "8", "--token-budget", "1024", "--num-engines", "1",
                              "--max-error-fraction", "1", "--no-report", *ray], cwd=ROOT, capture_output=True,
                             text=True, timeout=420, start_new_session=True, stdin=subprocess.DEVNULL,
                             preexec_fn=cap_memory)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = {r["id"]: r for r in read_parts(out).to_pylist()}
    assert sorted(rows) == sorted(ids)
    assert [(rows[i]["error"], rows[i]["finish_reason"] in ("stop", "length"))
            for i in ids[:6]] == [(None, True)] * 6, rows
    assert "structured_max_states=10,000" in rows["blowup"]["error"]
    assert "structured_max_chars=65,536" in rows["schema"]["error"]
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    assert summary["engine_rows"] == {"0": 8} and summary["engine_retried_rows"] == 0, summary
