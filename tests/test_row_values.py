"""Issue 23, in process (no Ray): the boundary where per-row values become typed values
(actors/row_values.py), the sorter that cannot hang on a huge budget, and a Hypothesis
property test that feeds random per-row values of random Arrow types through the
tokenize, sort and engine stages' row-level functions (the real tiny engine in this
process) and checks that every row comes out exactly once, the bad ones as error rows
naming their field.
"""
from __future__ import annotations

import asyncio
import math
import os
import time
from typing import Any, Dict, List, Tuple

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import ROOT
from engine import EngineConfig, SamplingParams
from actors.row_values import RowValueError, parse_messages, parse_sampling, parse_seed, parse_token_ids
from pipeline.sorting.cost import CostModel, work
from pipeline.sorting.order import SortWindowUDF
from pipeline.stages import PRE_ERROR, TOKEN_IDS, detokenize_stage, tokenize_stage

TINY = os.path.join(ROOT, "engine", "assets", "tiny-dllm")  # vocabulary 47, context 256
BASE = SamplingParams(max_new_tokens=4, policy="fixed")
ENGINE = EngineConfig(block_length=4, steps_per_block=4, token_budget=1024)
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
INF, NAN = math.inf, math.nan


# --- the boundary ------------------------------------------------------------------------

@pytest.mark.parametrize("override, field", [
    ({"top_p": "abc"}, "top_p"), ({"top_p": [0.5]}, "top_p"), ({"top_p": {"x": 1}}, "top_p"),
    ({"top_p": NAN}, "top_p"), ({"temperature": INF}, "temperature"), ({"temperature": 10**400}, "temperature"),
    ({"stop_token_ids": [INF]}, "stop_token_ids"), ({"stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"stop_token_ids": 3}, "stop_token_ids"), ({"max_tokens": 2**63}, "max_tokens"),
    ({"max_tokens": 7.9}, "max_tokens"), ({"max_tokens": True}, "max_tokens"), ({"max_tokens": "8"}, "max_tokens"),
    ({"n": 0}, "n"), ({"seed": NAN}, "seed"), ({"policy": 3}, "policy"), ({"stop": [1]}, "stop"),
    ({"first_position": 1}, "first_position"), ({"bogus": 1}, "bogus"), ("max_tokens=8", "must be a struct"),
])
def test_bad_sampling_values_name_their_field(override, field):
    with pytest.raises(RowValueError, match=rf"^bad sampling_params: .*{field}"):
        parse_sampling(override, BASE)


def test_good_sampling_values_are_typed():
    p = parse_sampling({"max_tokens": 8.0, "top_p": 1, "stop_token_ids": [3.0, np.int64(4)], "stop": "x",
                        "seed": None, "temperature": np.float32(0.5)}, BASE)
    assert (p.max_new_tokens, p.top_p, p.stop_token_ids, p.stop, p.seed, p.temperature) == (8, 1.0, [3, 4], ["x"],
                                                                                          None, 0.5)
    assert type(p.max_new_tokens) is int and type(p.top_p) is float
    assert parse_sampling(None, BASE) is BASE and parse_sampling({}, BASE) is BASE


def test_token_ids_seed_and_messages():
    assert parse_token_ids([1, 2.0, np.uint64(3)], "ids", 47) == [1, 2, 3]
    for bad, words in (([7.9], "must be an integer, got 7.9"), ([INF], "got inf"), ([1, "a"], "got 'a'"),
                       ([[1]], "got [1]"), ("abc", "must be a list"), ([2**63], "token id 9223372036854775808 "
                                                                           "outside the vocabulary [0, 47)"),
                       ([47], "outside the vocabulary"), ([-1], "outside the vocabulary")):
        with pytest.raises(RowValueError, match="'ids'") as info:
            parse_token_ids(bad, "ids", 47)
        assert words in str(info.value), (bad, str(info.value))
    assert parse_seed(None, "s") is None and parse_seed(3.0, "s") == 3
    for bad in (NAN, INF, "7", 2**64, 1.5):
        with pytest.raises(RowValueError, match="bad seed column 's'"):
            parse_seed(bad, "s")
    assert parse_messages([{"role": "user", "content": "hi", "name": None}], "m") == [{"role": "user",
                                                                                        "content": "hi"}]
    for bad in ([], "hi", [{"role": 1, "content": "x"}], [{"role": "user", "content": 2.5}], ["x"]):
        with pytest.raises(RowValueError, match="m"):
            parse_messages(bad, "m")


# --- the sorter --------------------------------------------------------------------------

def _loop_work(p, K, L, S, cache, full):
    """The cost model as it was, a Python loop over blocks: the reference of the closed form."""
    from pipeline.sorting.cost import _columns

    p, K = np.asarray(p, np.float64), np.asarray(K, np.float64)
    cells, pairs, kv = np.zeros_like(p), np.zeros_like(p), np.zeros_like(p)
    if cache == "persistent" and not full:
        cells, pairs, kv = cells + p, pairs + p * p, kv + p
    for b in range(int(K.max())):
        on = (b < K).astype(np.float64)
        w = p + K * L if full else p + (b + 1) * L
        if cache == "none":
            qf, qr, c = w, w, 0.0
        elif cache == "persistent" and not full:
            qf, qr, c = L, L, L * (b + 1 < K)
        elif full and cache != "dual":
            qf, qr, c = w, (K - b) * L, 0.0
        else:
            qf, qr, c = w, L, 0.0
        q = qf + (S - 1) * qr + c
        cells, pairs = cells + on * q, pairs + on * w * q
        kv += on * (_columns(qf, w) + (S - 1) * _columns(qr, w) + _columns(c, w))
    return cells, pairs, kv


@pytest.mark.parametrize("cache", ["none", "refresh", "dual", "persistent"])
@pytest.mark.parametrize("full", [False, True])
def test_closed_form_cost_equals_the_block_loop(cache, full):
    rng = np.random.default_rng(1)
    p, K = rng.integers(0, 200, 64), rng.integers(0, 30, 64)
    p[:3], K[:4] = 0, [0, 1, 2, 3]
    for L, S in ((4, 4), (3, 7), (32, 1)):
        w = work(p, K, L, S, cache, full)
        for got, want in zip((w.cells, w.pairs, w.kv_columns), _loop_work(p, K, L, S, cache, full)):
            assert np.array_equal(got, want)


def test_sorter_refuses_a_huge_budget_at_no_cost():
    """Case 3 / 3b: a budget of 10^9 tokens (or past int64, or unparsable) costs the sorter
    nothing: the row goes first, to the engine that makes it an error row."""
    sp = pa.array([{"max_tokens": 10**9}, None, {"max_tokens": 2**63 + 5}, {"max_tokens": 3}, {"top_p": None}],
                  pa.struct([("max_tokens", pa.uint64()), ("top_p", pa.float64())]))
    ids = pa.array([[5, 6]] * 5, pa.list_(pa.int64()))
    table = pa.table({"id": list("abcde"), TOKEN_IDS: ids, "sampling_params": sp})
    udf = SortWindowUDF(CostModel(a=0.0, b=1.0, block_length=4, steps_per_block=4), BASE, "sampling_params", 0,
                        max_width=256)
    t0 = time.process_time()
    gens, refused = udf.budgets(table, np.full(5, 2))
    out = udf(table)
    assert time.process_time() - t0 < 60  # the acceptance bound; a closed form takes milliseconds
    assert refused.tolist() == [True, False, True, False, False] and gens.tolist() == [1, 4, 1, 3, 4]
    assert sorted(out.column("id").to_pylist()[:2]) == ["a", "c"] and out.num_rows == 5
    assert work(np.array([10]), np.array([10**9 // 4]), 4, 4, "refresh", True).cells[0] > 0  # no loop either


# --- the property test ---------------------------------------------------------------------

# Per-row values of a field: a pool of candidates, written into a column of a random
# Arrow type (a candidate the type cannot hold is left out). The oracle decides from the
# value the column holds (what a stage reads back) whether the row is usable.
NUMBERS = [None, 0, 1, 2, 3, -3, 7.5, 2.0, 0.5, NAN, INF, -INF, 2**63, 2**64 - 1, 1e30, "abc", "0.5", "fixed",
           [1.0], [INF], [2.5], {"a": 1}]
TYPES = {"int64": pa.int64(), "uint64": pa.uint64(), "float64": pa.float64(), "string": pa.string(),
         "list<double>": pa.list_(pa.float64()), "struct": pa.struct([("a", pa.int64())])}
# field -> (key in the sampling struct or None for a column of its own, ok(value))
def _int_in(lo, hi):
    def ok(v):
        return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v == int(v)
                and lo <= int(v) <= hi and abs(v) < 2**63)
    return ok


def _float_in(lo, hi, lo_open=False):
    def ok(v):
        return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                and (lo < v if lo_open else lo <= v) and v <= hi)
    return ok


def _ints(v) -> bool:
    return isinstance(v, list) and all(_int_in(-(2**63), 2**63 - 1)(t) for t in v)


SAMPLING_FIELDS = {"max_tokens": _int_in(1, 8), "top_p": _float_in(0.0, 1.0, lo_open=True),
                   "temperature": _float_in(0.0, 1e300), "top_k": _int_in(-1, 2**63), "n": _int_in(1, 3),
                   "seed": _int_in(-(2**63), 2**63 - 1), "stop_token_ids": _ints,
                   "policy": lambda v: v in ("fixed", "threshold", "factor", "timestep")}


def _fits(value: Any, tp: pa.DataType) -> Any:
    """The value as a column of `tp` holds it, or a marker that it does not fit."""
    try:
        return pa.array([value], tp).to_pylist()[0]
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError, OverflowError):
        return _MISSING


_MISSING = object()


@st.composite
def column(draw, n: int, ok) -> Tuple[pa.Array, List[bool]]:
    """n values of a random Arrow type, and whether each is usable."""
    tp = TYPES[draw(st.sampled_from(sorted(TYPES)))]
    pool = [v for v in (_fits(c, tp) for c in NUMBERS) if v is not _MISSING]
    values = [draw(st.sampled_from(pool)) for _ in range(n)]
    good = [v is None or ok(v) for v in values]
    return pa.array(values, tp), good


def _ids_ok(v) -> bool:
    return v is not None and isinstance(v, list) and len(v) > 0 and all(
        isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t == int(t)
        and 3 <= t < 47 for t in v)


IDS_POOL = [[5, 6, 7], [40], [7.9], [INF], [NAN], [47], [2**63], [-1], [], None, [5.0, 6.0], ["a"], [[5]]]
ID_TYPES = {"list<int64>": pa.list_(pa.int64()), "list<uint64>": pa.list_(pa.uint64()),
            "list<double>": pa.list_(pa.float64()), "list<string>": pa.list_(pa.string()), "string": pa.string(),
            "list<list<int64>>": pa.list_(pa.list_(pa.int64()))}
MSG = pa.struct([("role", pa.string()), ("content", pa.string())])
MSG_POOL = [[{"role": "user", "content": "copy: ab"}], [{"role": "user", "content": None}], [], None,
            [{"role": None, "content": "rev: ab"}], [{"role": "", "content": "x"}]]


@st.composite
def batches(draw) -> Tuple[pa.Table, Dict[str, List[str]], str]:
    """A batch of 1-5 rows with random per-row values for every per-row field; the fields
    that make each row unusable; the prompt source ("ids" or "messages")."""
    n = draw(st.integers(1, 5))
    cols: Dict[str, Any] = {"id": [f"r{i}" for i in range(n)]}
    bad: Dict[str, List[str]] = {f"r{i}": [] for i in range(n)}
    struct_fields, struct_cols = [], []
    for key in draw(st.lists(st.sampled_from(sorted(SAMPLING_FIELDS)), min_size=1, max_size=3, unique=True)):
        arr, good = draw(column(n, SAMPLING_FIELDS[key]))
        struct_fields.append(pa.field(key, arr.type))
        struct_cols.append(arr)
        for i, g in enumerate(good):
            if not g:
                bad[f"r{i}"].append(key)
    nulls = [draw(st.booleans()) and not bad[f"r{i}"] for i in range(n)]  # a null struct: the defaults
    cols["sampling_params"] = pa.StructArray.from_arrays(struct_cols, fields=struct_fields,
                                                         mask=pa.array(nulls, pa.bool_()))
    seed, good = draw(column(n, _int_in(-(2**63), 2**63 - 1)))
    cols["seed"] = seed
    for i, g in enumerate(good):
        if not g:
            bad[f"r{i}"].append("seed")
    source = draw(st.sampled_from(["ids", "messages"]))
    if source == "ids":
        tp = ID_TYPES[draw(st.sampled_from(sorted(ID_TYPES)))]
        pool = [v for v in (_fits(c, tp) for c in IDS_POOL) if v is not _MISSING]
        values = [draw(st.sampled_from(pool)) for _ in range(n)]
        cols["prompt_token_ids"] = pa.array(values, tp)
        for i, v in enumerate(values):
            if not _ids_ok(v):
                bad[f"r{i}"].insert(0, "prompt_token_ids")
    else:
        values = [draw(st.sampled_from(MSG_POOL)) for _ in range(n)]
        cols["messages"] = pa.array(values, pa.list_(MSG))
        for i, v in enumerate(values):
            if not (v and all(m["role"] and m["content"] for m in v)):
                bad[f"r{i}"].insert(0, "messages")
    return pa.table(cols), bad, source


@pytest.fixture(scope="module")
def actor():
    from actors.engine_actor import DLLMEngineActor
    from actors.spec import EngineSpec

    a = DLLMEngineActor(EngineSpec(TINY, ENGINE, BASE, warmup=False, enable_metrics=False, seed_column="seed",
                                   token_ids_column=TOKEN_IDS, error_column=PRE_ERROR))
    yield a
    a.loop.shutdown(timeout=5)


FIELD_WORDS = {"max_tokens": ("max_tokens", "max_new_tokens"), "seed": ("seed",)}


@settings(max_examples=30, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=batches())
def test_random_per_row_values_never_fail_the_batch(actor, case):
    table, bad, source = case
    chat = dict(messages_column="messages", chat_template=TEMPLATE, mode=None, keep_prompt=True)
    t = tokenize_stage(table, model=TINY, prompt_column="prompt", prompt_token_ids_column="prompt_token_ids",
                       chat=chat if source == "messages" else None)
    t = SortWindowUDF(CostModel(a=0.0, b=1.0, block_length=4, steps_per_block=4), BASE, "sampling_params", 1,
                      max_width=256)(t)
    out = detokenize_stage(asyncio.run(actor.run_batch(t)), model=TINY)
    rows = out.to_pylist()
    # every row exactly once per sample: an error row once, a good row n times
    keys = sorted((r["id"], r["sample_index"]) for r in rows)
    want = []
    for i, r in enumerate(table.column("sampling_params").to_pylist()):
        rid = f"r{i}"
        n = int((r or {}).get("n") or 1) if not bad[rid] else 1
        want += [(rid, k) for k in range(n)]
    assert keys == sorted(want), (keys, want, bad)
    for r in rows:
        fields = bad[r["id"]]
        if fields:
            assert r["finish_reason"] == "error", (r, fields)
            words = FIELD_WORDS.get(fields[0], (fields[0],))
            assert any(w in r["error"] for w in words) or any(
                w in r["error"] for f in fields for w in FIELD_WORDS.get(f, (f,))), (r["error"], fields)
        else:
            assert r["finish_reason"] != "error", (r["error"], table.slice(int(r["id"][1:]), 1).to_pylist())
