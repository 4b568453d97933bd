"""Issue 39: the lock-step loop of a tensor-parallel engine (actors/tensor_parallel.py)
without Ray: two real processes on gloo (a file:// rendezvous), each with its shard of the
tiny model in float64; rank 0 runs LockstepLoop (rows submitted from another thread, as
the engine actor's event loop does, in two waves), rank 1 `follow`s its StepOrders.

- The rows come back with the tokens of one device (Engine.generate on the whole model),
  seeds included; a sampled row without a seed gets one drawn on rank 0 and runs (the
  engine refuses a seedless sampled row under tensor_parallel_size > 1).
- A step that raises on every rank alike (an injected fault, the same step on both) fails
  the requests in flight with the step's error, as one engine does; every rank then builds a
  fresh engine and the rows submitted after run, with one device's tokens.
- The loop stops on shutdown: rank 1's `follow` returns (no lost rank)."""
from __future__ import annotations

import multiprocessing as mp
import os
import traceback

import torch

from engine import Engine, EngineConfig, SamplingParams, load_model

CFG = EngineConfig(block_length=4, steps_per_block=4, token_budget=1024, tensor_parallel_size=2)
PROMPTS = [[5 + (i * 3 + j) % 20 for j in range(2 + i % 5)] for i in range(10)]
PARAMS = [SamplingParams(max_new_tokens=8 + 4 * (i % 3), temperature=0.8, seed=100 + i) for i in range(10)]
FAULT = ("b", 0)  # the request whose admission makes the engine's second step after it raise, on every rank


class FaultyEngine(Engine):
    """The real engine, whose second step after admitting request FAULT raises: the same
    step on every rank, as a deterministic error would."""

    steps_run, fail_at = 0, 0

    def add_request(self, prompt, params=SamplingParams(), request_id=None):
        if request_id == FAULT:
            self.fail_at = self.steps_run + 2
        return super().add_request(prompt, params, request_id)

    def step(self):
        self.steps_run += 1
        if self.steps_run == self.fail_at:
            raise RuntimeError("injected step fault")
        return super().step()


def _rank(rank: int, where: str, model_dir: str, queue) -> None:
    try:
        torch.set_num_threads(1)
        from actors.tensor_parallel import LockstepLoop, follow
        from engine.parallel import destroy_tensor_parallel, init_tensor_parallel

        tp = init_tensor_parallel(rank, 2, where)
        model, _ = load_model(model_dir, dtype=torch.float64, tokenizer=False, tp=tp)
        built = []

        def factory():
            built.append(FaultyEngine(model, CFG))
            return built[-1]

        if rank:
            queue.put(("follow", follow(tp, factory), len(built)))
            destroy_tensor_parallel()
            return
        loop = LockstepLoop(factory, tp, idle_wait_s=0.05)
        wave1 = [loop.submit(p, sp, ("a", i)) for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS))]
        unseeded = loop.submit(PROMPTS[0], SamplingParams(max_new_tokens=8, temperature=0.8), ("u", 0))
        first = [f.result(timeout=300) for f in wave1] + [unseeded.result(timeout=300)]
        failed = [loop.submit(p, sp, ("b", i)) for i, (p, sp) in enumerate(zip(PROMPTS[:4], PARAMS[:4]))]
        failed = [f.result(timeout=300) for f in failed]
        wave3 = [loop.submit(p, sp, ("c", i)) for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS))]
        third = [f.result(timeout=300) for f in wave3]
        loop.shutdown(timeout=60)
        queue.put(("lead", [(o.token_ids, o.finish_reason, o.error) for o in first + failed + third], len(built)))
        destroy_tensor_parallel()
    except BaseException:  # noqa: BLE001 - the parent asserts on it
        queue.put(("error", traceback.format_exc(), rank))


def test_lockstep_loop_on_two_gloo_ranks(tmp_path, tiny_model_dir):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    where = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_rank, args=(r, where, tiny_model_dir, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        kind, value, engines = queue.get(timeout=600)
        assert kind != "error", value
        got[kind] = (value, engines)
    for p in procs:
        p.join(60)
        assert p.exitcode == 0

    one, _ = load_model(tiny_model_dir, dtype=torch.float64, tokenizer=False)
    ref = Engine(one, EngineConfig(block_length=4, steps_per_block=4, token_budget=1024)).generate(PROMPTS, PARAMS)
    want = [(o.token_ids, o.finish_reason, None) for o in ref]
    rows, engines = got["lead"]
    first, unseeded, failed, third = rows[:10], rows[10], rows[11:15], rows[15:]
    assert first == want  # one device's tokens, seeds and all
    assert unseeded[1] != "error" and unseeded[2] is None and len(unseeded[0]) == 8  # its seed drawn on rank 0
    assert [r[1:] for r in failed] == [("error", "engine step failed: RuntimeError: injected step fault")] * 4
    assert third == want  # a fresh engine on every rank, in lock step again
    steps, follower_engines = got["follow"]
    assert engines == follower_engines == 2  # one rebuild, on both ranks
    assert steps > 0
    assert len({tuple(r[0]) for r in first}) > 5  # rows differ: the comparison means something
