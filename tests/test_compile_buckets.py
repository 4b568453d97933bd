"""compile_decode (issue 51, item 5): the steady step's whole-batch forward compiled with its
shapes padded to buckets (engine.buckets), its K/V views marked static, under every cache
mode, with the tokens of the eager engine. A recording backend stands in for inductor: it
sees each graph dynamo makes and each call's inputs (shapes, static marks) and runs the
graph as traced, so the test costs dynamo's tracing, not inductor's compiles
(tests/test_reference_decoding.py runs the dual cache's step through inductor against the
published references)."""
from __future__ import annotations

import dataclasses
import math
import re
from typing import List, Tuple

import pytest
import torch

from bench.workloads import SMOKE_SKEWED, skewed
from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model
from engine.budget import kv_bytes_per_token, kv_peak_bytes_per_token, plan_token_budget
from engine.buckets import ROOM, ShapeBuckets, ladder, rungs
from engine.slots import SLACK

torch.set_num_threads(1)


class RecordingBackend:
    """A torch.compile backend that records each graph dynamo makes (per placeholder: its
    source, and whether dynamo made it a static input) and each call's inputs (per
    placeholder: its shape, and whether the tensor passed was marked static); runs the graph
    as traced."""

    def __init__(self):
        self.graphs: List[List[Tuple[str, bool]]] = []
        self.calls: List[List[Tuple[str, tuple, bool]]] = []

    def __call__(self, gm, example_inputs):
        names = [n._dynamo_source.name if n._dynamo_source else n.name for n in gm.graph.find_nodes(op="placeholder")]
        self.graphs.append([(name, bool(n.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")))
                            for name, n in zip(names, gm.graph.find_nodes(op="placeholder"))])

        def run(*args):
            self.calls.append([(name, tuple(t.shape), getattr(t, "_dynamo_static_input_type", None) is not None)
                               for name, t in zip(names, args) if torch.is_tensor(t)])
            return gm.forward(*args)
        return run

    @staticmethod
    def inputs(inputs, what: str):
        """The entries of tensor `what` (an argument, or the cache's K and V), not its sizes."""
        return [rest for name, *rest in inputs if re.fullmatch(re.escape(what) + r"(\.[kv]\[\d+\])?", name)]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Graphs of other tests' models in this worker must not count against the runner's limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_the_ladder():
    assert rungs(40, 4) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40]
    for n in range(1, 600):
        up = ladder(n, 4)
        assert up >= n and ladder(up, 4) == up and (n <= 4 or (up - n) / up < 0.2)
    b = ShapeBuckets(block_length=32, shift=1, max_rows=48)
    assert b.box(45, 33, 300, cached=True) == b.box(48, 33, 320, cached=True)
    assert (b.rows(45), b.keys(300), b.queries(33, 320, True), b.queries(60, 320, True)) == (48, 320, 33, 65)
    assert b.queries(5, 64, cached=False) == 64  # without a cache the query is the whole (padded) row


def _skewed(n: int):
    return skewed(dataclasses.replace(SMOKE_SKEWED, n_requests=n), dtype=torch.float64)


def _run(model, prompts, params, compile_decode: bool, **cfg):
    eng = Engine(model, EngineConfig(compile_decode=compile_decode, forward_overhead_cells=100, **cfg))
    backend = RecordingBackend()
    eng.runner.backend = backend
    outs = eng.generate(prompts, params)
    return eng, backend, [o.token_ids for o in outs]


# the skewed workload (shrunk), a budget its batches fill: under every cache mode
@pytest.mark.parametrize("cache,canvas", [("none", "full"), ("refresh", "full"), ("dual", "full"),
                                          ("persistent", "block")])
def test_compiled_steps_stay_on_their_buckets(cache, canvas):
    w = _skewed(8)
    cfg = dict(block_length=w.block_length, steps_per_block=w.steps_per_block, cache=cache, canvas=canvas,
               token_budget=384, max_batch_size=12)
    _, _, eager = _run(w.model, w.prompts, w.params, False, **cfg)
    eng, rec, tokens = _run(w.model, w.prompts, w.params, True, **cfg)
    assert tokens == eager
    st = eng.stats
    # every steady step ran compiled (none gave up, none ran eager); block starts' whole rows run eager
    assert st.compile_fallbacks == 0 and st.uncompiled_steps == 0 and st.compiled_forwards > st.steps // 2
    buckets, mcfg = eng.runner.buckets, w.model.config
    for g in rec.graphs:  # every layer's K and V is a static input of every graph
        kv = rec.inputs(g, "L['cache']")
        assert len(kv) == (0 if cache == "none" else 2 * mcfg.n_layers) and all(static for static, in kv)
    seen = set()
    for call in rec.calls:
        (ids, _), = rec.inputs(call, "L['ids']")
        rows, queries = ids
        kv = rec.inputs(call, "L['cache']")
        keys = queries if cache == "none" else kv[0][0][2]
        if kv:  # the whole bucket's K/V views, marked static (KVSlots.static_box)
            assert {shape for shape, _ in kv} == {(rows, mcfg.n_kv_heads, keys, mcfg.head_dim)}
            assert all(static for _, static in kv)
        assert rows == buckets.rows(rows) and keys == buckets.keys(keys)
        assert queries == buckets.queries(queries, keys, cache != "none")
        seen.add((rows, queries, keys))
    assert len(rec.calls) == st.compiled_forwards
    # the distinct shapes compiled are buckets, fewer than the buckets there are and than the
    # steps that ran them; dynamo's graphs (dynamic shapes) are no more than the shapes
    assert len(seen) <= buckets.count(eng.cfg.max_batch_size, max(len(p) for p in w.prompts)
                                      + len(SMOKE_SKEWED.difficulty) * w.block_length, cache != "none")
    assert len(seen) < st.compiled_forwards
    assert len(rec.graphs) <= len(seen)


def test_shifted_logits_and_a_wide_budget():
    """Dream reads logits from the column before (its step has L + 1 query columns), under a
    budget the batches do not fill."""
    model = build_model(ModelConfig.tiny("Dream"), dtype=torch.float64, seed=0)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40, (int(n),), generator=g).tolist() for n in (3, 9, 5, 14, 7, 4, 11)]
    params = [SamplingParams(max_new_tokens=m, policy="threshold", threshold=0.3, stop_token_ids=[28, 47])
              for m in (6, 12, 8, 4, 10, 12, 7)]
    for cache in ("dual", "refresh"):
        cfg = dict(block_length=4, steps_per_block=4, cache=cache, token_budget=1024, max_batch_size=8)
        _, _, eager = _run(model, prompts, params, False, **cfg)
        eng, rec, tokens = _run(model, prompts, params, True, **cfg)
        assert tokens == eager
        assert eng.stats.compiled_forwards > eng.stats.steps // 2
        assert eng.stats.uncompiled_steps == 0 and eng.stats.compile_fallbacks == 0
        queries = {rec.inputs(call, "L['ids']")[0][0][1] for call in rec.calls}
        assert 4 + 1 in queries  # the block step: L + 1 columns, not padded


def test_the_budget_plans_room_for_the_padding():
    """With compile_decode the K/V slots hold ROOM times more (a batch that fills the token
    budget pads into it), and the budget planned from free memory is smaller by as much."""
    cfg, f32 = ModelConfig.tiny("llada"), torch.float32
    kv = kv_bytes_per_token(cfg, f32)
    assert kv_peak_bytes_per_token(cfg, f32, "dual", compile_decode=True) == \
        math.ceil(SLACK * ROOM * kv) + kv // (2 * cfg.n_layers)
    plain, padded = (plan_token_budget(1 << 32, cfg, f32, "dual", 4, weights_loaded=True, compile_decode=c)
                     for c in (False, True))
    assert padded.token_budget < plain.token_budget
    eng = Engine(build_model(cfg, dtype=f32), EngineConfig(cache="dual", compile_decode=True, token_budget=500))
    assert eng.slots.slack == SLACK * ROOM
