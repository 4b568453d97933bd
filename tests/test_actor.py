"""The engine actor: one output row per input row in input order, per-row errors that
never fail a batch, per-row sampling overrides, recovery from a crashed step, and (A5)
batches in flight sharing the engine's block cycles — in process and as a Ray actor."""
from __future__ import annotations

import asyncio

import pyarrow as pa
import pytest

from actors.engine_actor import OUTPUT_SCHEMA, DLLMEngineActor
from actors.spec import EngineSpec
from actors.engine_loop import EngineLoop
from engine import Engine, EngineConfig, SamplingParams, load_model

ENGINE = EngineConfig(block_length=4, steps_per_block=4, token_budget=2048, max_batch_size=64)
# No stop tokens: every request runs all its blocks, so a batch stays in the engine long
# enough for the next one to join it.
LONG = SamplingParams(max_new_tokens=48, policy="fixed", stop_token_ids=[])


def _batch(seq: int, n: int) -> pa.Table:
    return pa.table({"prompt_token_ids": [[4 + (seq * 7 + i) % 40] * (3 + i) for i in range(n)],
                     "row": [f"b{seq}r{i}" for i in range(n)]})


def _batches_per_cycle(log):
    return [{rid[0] for rid in cycle} for cycle in log]


def test_rows_errors_and_overrides_in_process(tiny_model_dir):
    actor = DLLMEngineActor(EngineSpec(tiny_model_dir, ENGINE, SamplingParams(max_new_tokens=8), rank=5,
                                       enable_metrics=False, warmup=False))
    table = pa.table({
        "prompt_token_ids": [[5, 6, 7], [], None, [5, 6], [8] * 5, [9, 99999]],
        "sampling_params": [None, None, None, {"max_new_tokens": 4}, {"bogus": 1}, None],
        "error": [None, None, None, None, None, None],
        "keep": [1, 2, 3, 4, 5, 6],
    })

    async def run():
        return [b async for b in actor(table)]

    (out,) = asyncio.run(run())
    assert out.num_rows == 6 and out.column("keep").to_pylist() == [1, 2, 3, 4, 5, 6]
    assert out.schema.field("generated_token_ids").type == OUTPUT_SCHEMA.field("generated_token_ids").type
    rows = out.to_pylist()
    assert [r["finish_reason"] == "error" for r in rows] == [False, True, True, False, True, True]
    assert rows[1]["error"] == "empty prompt"
    assert "prompt_token_ids" in rows[2]["error"] and "bogus" in rows[4]["error"]
    assert "outside the vocabulary" in rows[5]["error"]
    assert len(rows[3]["generated_token_ids"]) <= 4 < len(rows[0]["generated_token_ids"])
    assert {r["engine_rank"] for r in rows} == {5}
    # the engine alone gives the same tokens
    model, _ = load_model(tiny_model_dir, dtype=actor.model.dtype)
    ref = Engine(model, ENGINE).generate([[5, 6, 7]], SamplingParams(max_new_tokens=8))[0]
    assert rows[0]["generated_token_ids"] == ref.token_ids
    actor.loop.shutdown()


def test_batches_share_block_cycles_in_process(tiny_model_dir):
    actor = DLLMEngineActor(EngineSpec(tiny_model_dir, ENGINE, LONG, rank=0, enable_metrics=False,
                                       record_batches=True, warmup=False))

    async def run():
        return await asyncio.gather(actor.run_batch(_batch(0, 4)), actor.run_batch(_batch(1, 4)))

    a, b = asyncio.run(run())
    assert a.column("row").to_pylist() == [f"b0r{i}" for i in range(4)]
    assert b.column("row").to_pylist() == [f"b1r{i}" for i in range(4)]
    assert any(len(s) > 1 for s in _batches_per_cycle(actor.batch_log()))
    actor.loop.shutdown()


def test_batches_overlap_in_a_ray_actor(tiny_model_dir, ray_local):
    """A5: two batches sent to one actor (max_concurrency > 1, as Ray Data does with
    max_concurrent_calls_per_actor) run in the same block cycles of its one engine."""
    import ray

    Actor = ray.remote(DLLMEngineActor)
    actor = Actor.options(num_cpus=0.5, max_concurrency=4).remote(
        EngineSpec(tiny_model_dir, ENGINE, LONG, rank=0, record_batches=True, enable_metrics=False))
    try:
        outs = ray.get([actor.run_batch.remote(_batch(0, 6)), actor.run_batch.remote(_batch(1, 6))], timeout=120)
        assert [t.num_rows for t in outs] == [6, 6]
        assert all(e is None for t in outs for e in t.column("error").to_pylist())
        per_cycle = _batches_per_cycle(ray.get(actor.batch_log.remote()))
        assert any(s == {0, 1} for s in per_cycle), per_cycle
    finally:
        ray.kill(actor)


class _CrashOnce(Engine):
    crashed = False

    def step(self):
        if not _CrashOnce.crashed:
            _CrashOnce.crashed = True
            raise RuntimeError("CUDA error: device-side assert (simulated)")
        return super().step()


def test_loop_fails_in_flight_rows_and_recovers(tiny_model_dir):
    model, _ = load_model(tiny_model_dir, dtype=__import__("torch").float32)
    loop = EngineLoop(lambda: _CrashOnce(model, ENGINE))
    try:
        first = loop.submit([5, 6, 7], SamplingParams(max_new_tokens=4), "a").result(timeout=60)
        assert first.finish_reason == "error" and "simulated" in first.error
        second = loop.submit([5, 6, 7], SamplingParams(max_new_tokens=4), "b").result(timeout=60)
        assert second.finish_reason in ("stop", "length") and second.error is None
        loop.submit([5, 6], SamplingParams(max_new_tokens=4), "c")
        with pytest.raises(ValueError, match="duplicate"):  # while "c" is in flight
            loop.submit([5, 6], SamplingParams(max_new_tokens=4), "c")
    finally:
        loop.shutdown()


def test_dispatcher_puts_engine_columns_on_the_whole_batch():
    """The engine stage's dispatcher sends the engine only the columns it reads, with each
    row's index, and puts the engine's columns back on the whole batch: pass-through columns
    kept, a row per sample (row 1 with two samples here), an input column named like an
    output column replaced, `engine_retries` added."""
    from actors.engine_router import _ADDED, _ROW, EngineDispatcher
    from common.schema import ENGINE_RETRIES, STOP_TEXT

    table = pa.table({"id": ["a", "b"], "payload": ["x", "y"], "engine_rank": [9, 9]})
    rows = [0, 1, 1]
    engine_out = {_ROW: pa.array(rows, pa.int64())}
    for f in OUTPUT_SCHEMA:
        engine_out[f.name] = pa.nulls(len(rows), f.type)
    engine_out["engine_rank"] = pa.array([3, 3, 3], pa.int64())
    engine_out["sample_index"] = pa.array([0, 0, 1], pa.int64())
    engine_out[STOP_TEXT] = pa.nulls(len(rows), pa.string())
    out = EngineDispatcher._merge(table, pa.table(engine_out), retries=1)
    assert out.column_names == ["id", "payload", *_ADDED, ENGINE_RETRIES.name]
    assert out.column("id").to_pylist() == ["a", "b", "b"] and out.column("payload").to_pylist() == ["x", "y", "y"]
    assert out.column("engine_rank").to_pylist() == [3, 3, 3]
    assert out.column("sample_index").to_pylist() == [0, 0, 1]
    assert out.column(ENGINE_RETRIES.name).to_pylist() == [1, 1, 1]



def test_dispatcher_imports_no_torch():
    """The engine stage's dispatchers hold no engine: their module (and the group actor's)
    loads in a fresh process without torch."""
    import subprocess
    import sys

    from conftest import ROOT

    code = "import sys, actors.engine_router, actors.rank, common.schema; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
