"""Issue 42, `logprobs`: per generated token, the log-probability the model gave it at the
step that wrote it (engine.logprobs), checked in float64 for equality against log_softmax
of the engine's own logits recorded at every step (a test-side wrap of the runner's
step logits), the written positions read off the batch's columns; under blockserve mixed
batches (rows with and without logprobs, different policies and decoding rules: LLaDA's
full canvas, Dream's shifted logits, D2F and sub-blocks on a block-causal model,
LLaDA2.1's token editing), with the tokens unchanged against the same run without
logprobs."""
from __future__ import annotations

import math

import pyarrow as pa
import pytest
import torch

from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model
from test_llada2 import tiny_llada2

torch.set_num_threads(1)
SP = SamplingParams


def rows(*params):
    return list(params)


CASES = {
    "llada-full-canvas": (ModelConfig.tiny("llada"), EngineConfig(block_length=4, steps_per_block=4, token_budget=256,
                                                                   max_batch_size=4), rows(
        SP(max_new_tokens=12, policy="fixed", logprobs=3), SP(max_new_tokens=8, threshold=0.3),
        SP(max_new_tokens=12, temperature=0.8, seed=1, logprobs=0), SP(max_new_tokens=8, policy="fixed",
                                                                        remasking="random", seed=2, logprobs=1),
        SP(max_new_tokens=12, policy="factor", logprobs=2), SP(max_new_tokens=12, min_tokens=9, logprobs=4))),
    "dream-dual-cache": (ModelConfig.tiny("Dream"), EngineConfig(block_length=4, steps_per_block=4, cache="dual",
                                                                 token_budget=256, max_batch_size=3), rows(
        SP(max_new_tokens=8, policy="timestep", remasking="entropy", logprobs=2),
        SP(max_new_tokens=12, temperature=0.9, top_p=0.8, seed=5, logprobs=1), SP(max_new_tokens=8),
        SP(max_new_tokens=12, policy="timestep", remasking="margin", logprobs=0))),
    "block-causal-d2f-sub-blocks": (
        ModelConfig.tiny("llada", dllm_attention="block_causal"),
        EngineConfig(block_length=4, steps_per_block=4, cache="persistent", token_budget=256, max_batch_size=4), rows(
            SP(max_new_tokens=12, block_add_threshold=0.5, decoded_token_threshold=0.5, threshold=0.2, logprobs=2),
            SP(max_new_tokens=12, sub_block_length=2, logprobs=1), SP(max_new_tokens=12, policy="fixed"),
            SP(max_new_tokens=16, block_add_threshold=0.25, decoded_token_threshold=0.75, threshold=0.5),
            SP(max_new_tokens=12, entropy_bound=2.0, policy="entropy_bound", logprobs=0))),
    "llada2-editing": (tiny_llada2(), EngineConfig(block_length=4, steps_per_block=4, cache="none", token_budget=256,
                                                   max_batch_size=3), rows(
        SP(max_new_tokens=12, threshold=0.15, edit_threshold=0.1, logprobs=3), SP(max_new_tokens=8, threshold=0.15),
        SP(max_new_tokens=12, threshold=0.2, edit_threshold=0.05, max_post_steps=1, logprobs=0),
        SP(max_new_tokens=8, threshold=0.15, edit_threshold=1.0, logprobs=1))),
}
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [14, 15], [16, 17, 18, 19], [20, 21, 22, 23, 24, 25], [26, 27]]


class Recorder:
    """Wraps an engine's step: the step's raw window logits, and for every position whose
    token the step changed, its answer position (from the batch's columns) and
    log_softmax of its logits in float64: what the request's logprobs must hold."""

    def __init__(self, eng: Engine):
        self.written = {}  # request id -> {answer position: (token, log-probabilities over the vocabulary)}
        self.steps_with_edits = 0
        step_logits, denoise = eng.runner.step_logits, eng._denoise

        def record_logits(b):
            out = step_logits(b)
            self.logits = out.clone()
            return out

        def record_writes():
            b = eng.batch
            before = b.ids.clone()
            gen = [len(r.generated) for r in b.rows]
            out = denoise()
            for i, c in (b.ids != before).nonzero().tolist():
                r = b.rows[i]
                assert len(r.generated) == gen[i]  # commits come after the step
                p = int((b.block_cols[i] == c).nonzero())
                answer = c - (b.width - int(b.lens[i])) - len(r.prompt) - len(r.lead)
                if before[i, c] != eng.mcfg.mask_token_id:
                    self.steps_with_edits += 1
                lp = torch.log_softmax(self.logits[i, p].to(torch.float64), dim=-1)
                self.written.setdefault(r.request_id, {})[answer] = (int(b.ids[i, c]), lp)
            return out

        eng.runner.step_logits, eng._denoise = record_logits, record_writes


@pytest.mark.parametrize("case", list(CASES))
def test_logprobs_are_the_models_at_the_writing_step(case):
    cfg, ecfg, params = CASES[case]
    model = build_model(cfg, dtype=torch.float64, seed=0)
    prompts = PROMPTS[:len(params)] + PROMPTS[:len(params)]  # twice: more rows than max_batch_size
    params = params + params[::-1]
    eng = Engine(model, ecfg)
    rec = Recorder(eng)
    outs = eng.generate(prompts, params)
    off = Engine(model, ecfg).generate(prompts, [SP(**{**p.__dict__, "logprobs": None}) for p in params])
    checked = 0
    for k, (o, f, p) in enumerate(zip(outs, off, params)):
        assert o.error is None, o.error
        assert (o.token_ids, o.finish_reason, o.num_steps) == (f.token_ids, f.finish_reason, f.num_steps)
        assert f.logprobs is None and f.top_logprobs is None
        if p.logprobs is None:
            assert o.logprobs is None and o.top_logprobs is None
            continue
        assert len(o.logprobs) == len(o.token_ids) and (o.top_logprobs is None) == (p.logprobs == 0)
        written = rec.written[k]
        for j, t in enumerate(o.token_ids):
            if j not in written:  # never chosen: a D2F block committed as it stands, with a mask
                assert t == model.config.mask_token_id and math.isnan(o.logprobs[j])
                continue
            token, lp = written[j]
            assert token == t and o.logprobs[j] == lp[t].item(), (case, k, j)  # float64 equality
            if p.logprobs:
                vals, ids = lp.sort(descending=True, stable=True)
                assert o.top_logprobs[j] == list(zip(ids[:p.logprobs].tolist(), vals[:p.logprobs].tolist()))
            checked += 1
    assert checked > 20
    if case == "llada2-editing":
        assert rec.steps_with_edits > 0  # a token written again carries its last write's logprob


def test_logprob_columns_through_build_processor(ray_local, tiny_model_dir):
    """The one Ray run: ray.data.llm-style rows (its example's detokenize=False,
    max_completion_tokens) get generated_logprobs / top_logprobs columns, null where not
    asked, the engine's values for that prompt alone; a refused no-op value fails its
    row only, naming the key."""
    import ray

    from engine import load_model
    from pipeline import DLLMProcessorConfig, build_processor

    ecfg = EngineConfig(block_length=4, steps_per_block=4, token_budget=1024)
    cfg = DLLMProcessorConfig(model=tiny_model_dir, num_engines=1, batch_size=4, dtype="float64",
                              wait_for_engines_s=0, engine=ecfg, sampling=SP(max_new_tokens=4, policy="fixed"))
    asks = {"a": {"temperature": 0, "max_completion_tokens": 8, "detokenize": False, "logprobs": 2},
            "b": {"max_tokens": 8},
            "c": {"max_tokens": 8, "logprobs": 0, "min_tokens": 6, "ignore_eos": True},
            "d": {"skip_special_tokens": False}}
    items = [{"id": k, "prompt": f"copy: {k}bcdefg", "sampling_params": v} for k, v in asks.items()]
    table = pa.Table.from_pylist(items)  # one Arrow struct: every row every key, null where not given
    rows = {r["id"]: r for r in build_processor(cfg)(ray.data.from_arrow(table)).take_all()}
    assert sorted(rows) == ["a", "b", "c", "d"]
    assert rows["d"]["finish_reason"] == "error" and "skip_special_tokens=False" in rows["d"]["error"]
    assert rows["d"]["generated_logprobs"] is None
    model, tok = load_model(tiny_model_dir, dtype=torch.float64)
    for k in "abc":
        r = rows[k]
        params = SP.from_dict(asks[k], cfg.sampling)
        ref = Engine(model, ecfg, tokenizer=tok).generate([r["prompt"]], params)[0]
        assert (r["generated_token_ids"], r["error"], r["generated_text"]) == (ref.token_ids, None, ref.text)
        # the engine alone runs the prompt in a batch of one: its logits, and so the logprobs, may differ in
        # the last bits (the exact check against the logits of the run itself is the test above)
        near = lambda x: pytest.approx(x, rel=1e-12, abs=0)  # noqa: E731
        assert r["generated_logprobs"] == (None if ref.logprobs is None else near(ref.logprobs))
        top = r["top_logprobs"]
        assert (top is None) == (ref.top_logprobs is None)
        for got, want in zip(top or [], ref.top_logprobs or []):
            assert [g["token_id"] for g in got] == [t for t, _ in want]
            assert [g["logprob"] for g in got] == near([v for _, v in want])
    assert rows["b"]["generated_logprobs"] is None and rows["c"]["top_logprobs"] is None
    assert len(rows["a"]["top_logprobs"][0]) == 2 and len(rows["c"]["generated_logprobs"]) == 8
