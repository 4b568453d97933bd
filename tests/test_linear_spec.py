"""Issue 54: Nemotron-Labs-Diffusion's LinearSpec self-speculation and AR mode
(engine.linear_spec), exact against float64 transcriptions of the published
`linear_spec_generate` and `ar_generate` (modeling_nemotron_labs_diffusion.py, read in the
public code index), one request at a time, and served in batches.

The transcriptions keep the published loops' order and tests, at batch size 1, greedy
(temperature 0), no thinking budget, no LoRA (the draft threshold both at its default 0
and > 0):

- `linear_spec_generate`: a causal prefill whose last logit's argmax is the first token
  (an eos there ends the row); then, while fewer than max_new_tokens tokens are out, a
  block [seed, mask x (L-1)]: one bidirectional draft pass over it (use_cache=False: it
  reads the cached prefix and writes nothing), its argmax put in every mask position (the
  mask id not excluded), one causal verify pass over the drafted block (use_cache=True:
  its K/V appended), `accepted` = the longest run with ar[i] == block[i+1] plus one, the
  cache cropped to cache_len + accepted, ar[accepted-1] the next seed; the first eos among
  the accepted tokens ends it (kept); the loop stops once total_gen >= max_new_tokens (it
  may overshoot by up to L - 1 tokens: the engine cuts at max_new_tokens).
- `ar_generate`: a causal prefill, then per step the argmax of the last logit, appended;
  an eos ends it; a causal forward of the new token when more are to come.

The encoder is test_nemotron_labs_diffusion's `PublishedNemotron` (Ministral3's layer over
the checkpoint tensors in float64, its DynamicCache a dict of per-layer K/V that
use_cache=True appends to and use_cache=False only reads), the crop `_crop_dynamic_cache`.
The engine cuts its token ids before the first stop id, as blockray's other engines do;
the published outputs keep it."""
from __future__ import annotations

from collections import Counter
from typing import List, Optional, Tuple

import pytest
import torch

import test_nemotron_labs_diffusion as nld
from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model
from engine.linear_spec import LinearSpecEngine, accepted_lengths
from engine.sequence import FinishReason

torch.set_num_threads(1)
VOCAB, MASK, EOS = nld.VOCAB, nld.MASK, nld.EOS
L = 8


@pytest.fixture(scope="module")
def model():
    """test_nemotron_labs_diffusion's tiny Nemotron-Labs-Diffusion model: from the located 8B
    config, YaRN and Llama-4's q scaling active from position 8 on, eos now and then."""
    return nld.nemotron_model(0)


def crop(cache, max_length: int) -> None:
    """_crop_dynamic_cache: every layer's K/V cut to their first `max_length` columns."""
    for i, (k, v) in cache.items():
        cache[i] = (k[:, :max_length], v[:, :max_length])


def hf_linear_spec_generate(enc: nld.PublishedNemotron, prompt: List[int], max_new_tokens: int, block_length: int,
                            mask_id: int, eos: Optional[int],
                            threshold: float = 0.0) -> Tuple[List[int], int, List[int]]:
    """linear_spec_generate at temperature 0: (output ids with the prompt, nfe, the accepted
    length of each block)."""
    cache = {}  # the DynamicCache: {layer: (K, V)}
    last_logit = enc(prompt, cache, causal=True, use_cache=True)[-1]  # prefill (causal)
    nfe = 1
    next_token = int(last_logit.argmax())
    if eos is not None and next_token == eos:
        return prompt + [next_token], nfe, []
    generated, total_gen, accepts = [next_token], 1, []
    while total_gen < max_new_tokens:
        cache_len = cache[0][0].shape[1]  # past_key_values.get_seq_length()
        block = torch.full((block_length,), mask_id)
        block[0] = next_token
        while True:  # the draft (bidirectional, use_cache=False): threshold 0 breaks after one pass
            is_mask = block == mask_id
            if not is_mask.any():
                break
            draft_logits = enc(block.tolist(), cache, causal=False, use_cache=False)
            nfe += 1
            draft_tokens = draft_logits.argmax(dim=-1)
            draft_probs = torch.softmax(draft_logits, dim=-1)
            if threshold > 0:
                draft_conf = torch.gather(draft_probs, -1, draft_tokens.unsqueeze(-1)).squeeze(-1)
                draft_conf = torch.where(is_mask, draft_conf, -torch.inf)
                unmask = draft_conf >= threshold
                if not unmask.any():  # force progress
                    best_idx = draft_conf.view(-1).argmax()
                    unmask = torch.zeros_like(is_mask, dtype=torch.bool)
                    unmask.view(-1)[best_idx] = True
                block[unmask] = draft_tokens[unmask]
            else:
                block[is_mask] = draft_tokens[is_mask]
                break
        verify_logits = enc(block.tolist(), cache, causal=True, use_cache=True)  # the verify (causal)
        nfe += 1
        ar_tokens = verify_logits.argmax(dim=-1).tolist()
        accepted = 0
        for i in range(block_length - 1):
            if ar_tokens[i] == int(block[i + 1]):
                accepted += 1
            else:
                break
        accepted += 1
        accepted_toks = ar_tokens[:accepted]
        generated += accepted_toks
        total_gen += accepted
        accepts.append(accepted)
        crop(cache, cache_len + accepted)
        next_token = ar_tokens[accepted - 1]
        if eos is not None and eos in accepted_toks:
            first = accepted_toks.index(eos)
            del generated[len(generated) - accepted + first + 1:]
            break
        if total_gen >= max_new_tokens:
            break
    return prompt + generated, nfe, accepts


def hf_ar_generate(enc: nld.PublishedNemotron, prompt: List[int], max_new_tokens: int,
                   eos: Optional[int]) -> Tuple[List[int], int]:
    """ar_generate at temperature 0: (output ids with the prompt, nfe)."""
    cache = {}
    next_logit = enc(prompt, cache, causal=True, use_cache=True)[-1]
    generated, nfe = [], 0
    for step in range(max_new_tokens):
        nfe += 1
        next_token = int(next_logit.argmax())
        generated.append(next_token)
        if eos is not None and next_token == eos:
            break
        if step < max_new_tokens - 1:
            next_logit = enc([next_token], cache, causal=True, use_cache=True)[-1]
    return prompt + generated, nfe


def served(prompt: List[int], out_ids: List[int], max_new_tokens: int) -> Tuple[List[int], FinishReason]:
    """What the engine answers for a published output: cut at max_new_tokens, and before
    the first eos (then finish_reason stop)."""
    gen = out_ids[len(prompt):][:max_new_tokens]
    if EOS in gen:
        return gen[:gen.index(EOS)], FinishReason.STOP
    return gen, FinishReason.LENGTH


def workload(n: int = 12, seed: int = 0) -> Tuple[List[List[int]], List[int]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (int(torch.randint(2, 14, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    lengths = [int(torch.randint(1, 48, (1,), generator=g)) for _ in range(n)]
    return prompts, lengths


@pytest.fixture(scope="module")
def refs(model):
    enc = nld.PublishedNemotron(model)
    prompts, lengths = workload()
    spec = [hf_linear_spec_generate(enc, p, n, L, MASK, EOS) for p, n in zip(prompts, lengths)]
    # one more row: a block accepting >= 2 tokens that crosses max_new_tokens (the published loop overshoots)
    i, b = next((i, b) for i, (_, _, acc) in enumerate(spec) for b, a in enumerate(acc) if a >= 2)
    prompts.append(prompts[i])
    lengths.append(1 + sum(spec[i][2][:b]) + 1)
    spec.append(hf_linear_spec_generate(enc, prompts[-1], lengths[-1], L, MASK, EOS))
    ar = [hf_ar_generate(enc, p, n, EOS) for p, n in zip(prompts, lengths)]
    return prompts, lengths, spec, ar


def params(n: int, decoding: str = "linear_spec") -> SamplingParams:
    return SamplingParams(decoding=decoding, max_new_tokens=n, stop_token_ids=[EOS])


def test_accepted_length_is_the_agreeing_prefix_plus_the_bonus():
    draft = torch.tensor([[5, 1, 2, 3]] * 3)
    assert accepted_lengths(draft, torch.tensor([[1, 2, 9, 4], [7, 2, 3, 4], [1, 2, 3, 4]])).tolist() == [3, 1, 4]
    assert accepted_lengths(torch.tensor([[5]]), torch.tensor([[6]])).tolist() == [1]  # a block of one: AR


def test_the_workload_exercises_every_rule(refs):
    """Rows accept different lengths (rejections fire, and full blocks too), some stop at
    eos, some run to max_new_tokens, the published loop overshoots max_new_tokens, and a
    block of 2 forwards each (nfe = 1 + 2 per block)."""
    prompts, lengths, spec, _ = refs
    accepts = [a for _, _, acc in spec for a in acc]
    assert min(accepts) == 1 and max(accepts) > 2 and len(set(accepts)) >= 3, accepts
    assert any(max(acc, default=0) != min(acc, default=0) for _, _, acc in spec)  # within one row too
    reasons = [served(p, out, n)[1] for p, n, (out, _, _) in zip(prompts, lengths, spec)]
    assert FinishReason.STOP in reasons and FinishReason.LENGTH in reasons
    assert any(len(out) - len(p) > n for p, n, (out, _, _) in zip(prompts, lengths, spec))
    for _, nfe, acc in spec:
        assert nfe == 1 + 2 * len(acc)


@pytest.mark.parametrize("decoding", ["linear_spec", "ar"])
def test_batch_size_one_equals_the_published_loop(model, refs, decoding):
    prompts, lengths, spec, ar = refs
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        eng = LinearSpecEngine(model, EngineConfig(block_length=L, token_budget=4096))
        out = eng.generate([p], params(n, decoding))[0]
        ids = spec[i][0] if decoding == "linear_spec" else ar[i][0]
        assert (out.token_ids, out.finish_reason) == served(p, ids, n), i
        if decoding == "linear_spec":
            assert out.num_blocks == len(spec[i][2]) or out.finish_reason == FinishReason.STOP
            assert out.num_steps == spec[i][1] or out.finish_reason == FinishReason.STOP


@pytest.mark.parametrize("scheduler", ["blockserve", "static", "sequential"])
def test_a_mixed_batch_gives_each_row_its_batch_size_one_tokens(model, refs, scheduler):
    """One engine, the 12 rows at once (LinearSpec and AR rows alike, different prompts,
    different lengths, different accepted lengths in one forward); blockserve under a
    budget that preempts."""
    prompts, lengths, spec, ar = refs
    budget = 160 if scheduler == "blockserve" else 4096
    eng = LinearSpecEngine(model, EngineConfig(block_length=L, token_budget=budget, scheduler=scheduler,
                                               max_batch_size=8))
    kinds = ["ar" if i % 3 == 1 else "linear_spec" for i in range(len(prompts))]
    outs = eng.generate(prompts, [params(n, k) for n, k in zip(lengths, kinds)])
    for i, (p, n, k, out) in enumerate(zip(prompts, lengths, kinds, outs)):
        ids = spec[i][0] if k == "linear_spec" else ar[i][0]
        assert (out.token_ids, out.finish_reason) == served(p, ids, n), (i, k)
    if scheduler != "sequential":
        assert eng.forwards < sum(o.num_steps for o in outs)  # rows shared forwards
    assert eng.accepted[1] > 0 and len(eng.accepted) >= 2  # rejections, and different accepted lengths, fired
    assert eng.box.grows <= 12  # K/V stored in place: the box copies only as it doubles
    if scheduler == "blockserve":
        assert eng.scheduler.preemptions > 0
        assert any(o.prompt_tokens_forwarded > len(p) for p, o in zip(prompts, outs))  # a preempted row's again


def test_a_block_is_two_forwards_of_a_row_and_an_ar_token_one(model, refs):
    """LinearSpec: a prefill, then per block exactly one draft and one verify forward of the
    row; AR: a prefill, then one forward per token after the first."""
    prompts, lengths, _, _ = refs
    eng = LinearSpecEngine(model, EngineConfig(block_length=L, token_budget=4096))
    for decoding, per_block in (("linear_spec", 2), ("ar", 1)):
        for o in eng.generate(prompts, [params(n, decoding) for n in lengths]):
            assert o.num_steps == 1 + per_block * o.num_blocks, (decoding, o)


@pytest.mark.parametrize("change, message", [
    (dict(temperature=0.5), "temperature"),
    (dict(policy="fixed"), "policy"),
    (dict(decoding="diffusion"), "serves decoding 'linear_spec' and 'ar'"),
    (dict(decoding="bogus"), "decoding must be one of"),
    (dict(max_new_tokens=5000), "exceeds the model context"),
    (dict(decoding="ar", draft_threshold=0.5), "draft_threshold is read by decoding 'linear_spec' only"),
])
def test_settings_it_does_not_serve_are_refused(model, change, message):
    eng = LinearSpecEngine(model, EngineConfig(block_length=L, token_budget=4096))
    sp = SamplingParams(**{**dict(decoding="linear_spec", max_new_tokens=8), **change})
    out = eng.generate([[1, 2, 3]], sp)[0]
    assert out.finish_reason == FinishReason.ERROR and message in out.error, out.error


def test_other_families_and_engine_settings_are_refused(model):
    with pytest.raises(ValueError, match="cache"):
        LinearSpecEngine(model, EngineConfig(block_length=L, cache="none"))
    llada = build_model(ModelConfig.tiny("llada"), torch.float64)
    out = LinearSpecEngine(llada, EngineConfig(block_length=L, token_budget=4096)).generate([[1, 2, 3]], params(4))[0]
    assert out.finish_reason == FinishReason.ERROR and "trained for causal and bidirectional" in out.error


def test_the_block_engine_refuses_decoding_modes_it_does_not_serve(model):
    eng = Engine(model, EngineConfig(block_length=L, token_budget=4096))
    out = eng.generate([[1, 2, 3]], params(4))[0]
    assert out.finish_reason == FinishReason.ERROR and "decoding" in out.error, out.error


DRAFT_THRESHOLD = 0.3


@pytest.fixture(scope="module")
def threshold_refs(model, refs):
    enc = nld.PublishedNemotron(model)
    prompts, lengths = refs[0][:8], refs[1][:8]
    return prompts, lengths, [hf_linear_spec_generate(enc, p, n, L, MASK, EOS, DRAFT_THRESHOLD)
                              for p, n in zip(prompts, lengths)]


@pytest.mark.parametrize("scheduler", ["blockserve", "static"])
def test_the_draft_threshold_iterates_as_published(model, threshold_refs, scheduler):
    """threshold > 0: the draft repeats until the block holds no mask (more than two
    forwards a block, fired below), in a batch with rows that draft once."""
    prompts, lengths, spec = threshold_refs
    assert any(nfe > 1 + 2 * len(acc) for _, nfe, acc in spec)  # some blocks took several draft passes
    eng = LinearSpecEngine(model, EngineConfig(block_length=L, token_budget=4096, scheduler=scheduler))
    sps = [SamplingParams(decoding="linear_spec", max_new_tokens=n, stop_token_ids=[EOS],
                          draft_threshold=DRAFT_THRESHOLD if i % 2 == 0 else None) for i, n in enumerate(lengths)]
    outs = eng.generate(prompts, sps)
    for i, (p, n, out) in enumerate(zip(prompts, lengths, outs)):
        if i % 2 == 0:
            assert (out.token_ids, out.finish_reason) == served(p, spec[i][0], n), i
            if out.finish_reason == FinishReason.LENGTH:
                assert out.num_steps == spec[i][1]


def test_an_adapter_is_refused(model):
    eng = LinearSpecEngine(model, EngineConfig(block_length=L, token_budget=4096), adapter="some/lora")
    out = eng.generate([[1, 2, 3]], params(4))[0]
    assert out.finish_reason == FinishReason.ERROR and "LoRA applies to its draft forward only" in out.error


def test_one_engine_serves_the_three_modes(model, refs):
    """DecodingModes (what the engine actor builds for Nemotron-Labs-Diffusion): diffusion
    rows go to the block engine, LinearSpec and AR rows to the LinearSpec engine, each row
    with the tokens it gets alone; the stats add up."""
    from engine.linear_spec import DecodingModes

    prompts, lengths, spec, ar = refs
    kinds = ["linear_spec", "ar", "diffusion"] * 4
    sps = [params(n, k) if k != "diffusion" else SamplingParams(max_new_tokens=n, stop_token_ids=[EOS])
           for n, k in zip(lengths, kinds)]
    modes = DecodingModes.over(Engine(model, EngineConfig(block_length=L, token_budget=4096)))
    outs = modes.generate(prompts[:12], sps)
    alone = Engine(model, EngineConfig(block_length=L, token_budget=4096)).generate(
        [p for p, k in zip(prompts, kinds) if k == "diffusion"], [sp for sp, k in zip(sps, kinds) if k == "diffusion"])
    for i, (p, n, k, out) in enumerate(zip(prompts, lengths, kinds, outs)):
        if k == "diffusion":
            want = alone.pop(0)
            assert (out.token_ids, out.finish_reason) == (want.token_ids, want.finish_reason), i
        else:
            ids = spec[i][0] if k == "linear_spec" else ar[i][0]
            assert (out.token_ids, out.finish_reason) == served(p, ids, n), (i, k)
    st = modes.stats
    assert st.forwards == modes.block.stats.forwards + modes.spec.stats.forwards > modes.spec.stats.forwards > 0
    assert sum(st.finished.values()) == 12


def test_a_failing_step_fails_its_rows_and_the_engine_goes_on(model, monkeypatch):
    eng = LinearSpecEngine(model, EngineConfig(block_length=L, token_budget=4096, scheduler="static"))
    real = eng._block
    monkeypatch.setattr(eng, "_block", lambda rows: (_ for _ in ()).throw(RuntimeError("boom")))
    outs = eng.generate([[5, 6, 7], [8, 9]], params(8))
    assert all(o.finish_reason == FinishReason.ERROR and "boom" in o.error for o in outs)
    monkeypatch.setattr(eng, "_block", real)
    assert eng.generate([[5, 6, 7]], params(8))[0].finish_reason != FinishReason.ERROR


@pytest.fixture(scope="module")
def nemotron_dir(model, tmp_path_factory):
    from engine.loader import save_model

    path = tmp_path_factory.mktemp("nemotron")
    save_model(model, path)
    return str(path)


def test_the_job_builds_the_three_modes_and_its_preflight_checks_them(nemotron_dir, tmp_path):
    from engine.checkpoint import Checkpoint
    from engine.engines import engine_for
    from engine.linear_spec import DecodingModes
    from engine.loader import save_model
    from pipeline.checkpoint_check import CheckpointRefused, check_settings

    ckpt = Checkpoint.open(nemotron_dir)
    engine = EngineConfig(block_length=L, token_budget=4096)
    check_settings(ckpt, params(16), engine)  # served
    check_settings(ckpt, params(16, "ar"), engine)
    for sp, cfg, match in ((params(16), EngineConfig(block_length=L, steps_per_block=4), "steps_per_block"),
                           (SamplingParams(decoding="linear_spec", policy="fixed"), engine, "policy"),
                           (params(5000), engine, "context")):
        with pytest.raises(CheckpointRefused, match=match):
            check_settings(ckpt, sp, cfg)
    built = engine_for(ckpt.serving).build(ckpt, engine, dtype=torch.float64, device=torch.device("cpu"),
                                           weights_dir=nemotron_dir, tokenizer=lambda: None)
    modes = built.factory()
    assert isinstance(modes, DecodingModes)
    outs = modes.generate([[5, 6, 7]] * 3, [params(8), params(8, "ar"), SamplingParams(max_new_tokens=8)])
    assert all(o.finish_reason != FinishReason.ERROR for o in outs), [o.error for o in outs]
    assert modes.spec.stats.finished and modes.block.stats.finished  # each engine served its rows
    save_model(build_model(ModelConfig.tiny("llada"), torch.float32), tmp_path / "llada")
    with pytest.raises(CheckpointRefused, match="trained for causal and bidirectional"):
        check_settings(Checkpoint.open(str(tmp_path / "llada")), params(16), EngineConfig(block_length=L))


def test_bench_smoke_writes_json(tmp_path):
    import json

    from bench.linear_spec import main

    out = tmp_path / "linear_spec.json"
    report = main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text())["models"].keys() == {"random", "trained"}
    assert (tmp_path / "linear_spec.png").exists()
    runs = report["models"]["random"]["runs"]
    assert {r["tokens"] for r in runs.values()} == {3 * 16}  # every mode: every row its max_new_tokens
    assert runs["linear_spec"]["blocks"] > 0 and runs["ar"]["tokens_per_row_forward"] == 1.0


def test_the_engine_actor_serves_linear_spec_rows(model, nemotron_dir, refs):
    """The engine actor (in process, as tests/test_engine_fields.py drives it) on the saved
    tiny checkpoint, the job's default decoding linear_spec, rows overriding it with ar
    and diffusion: each row its tokens."""
    import asyncio

    import pyarrow as pa

    from actors.engine_actor import DLLMEngineActor
    from actors.spec import EngineSpec

    prompts, lengths, spec, ar = refs
    actor = DLLMEngineActor(EngineSpec(nemotron_dir, EngineConfig(block_length=L, token_budget=4096),
                                       params(24), dtype="float64", device="cpu", rank=0, enable_metrics=False,
                                       warmup=False))
    over = [None, {"decoding": "ar"}, {"decoding": "diffusion"}] * 2
    table = pa.table({"prompt_token_ids": prompts[:6], "sampling_params": over, "row": list(range(6))})

    async def run():
        return [b async for b in actor(table)]

    (out,) = asyncio.run(run())
    actor.loop.shutdown()
    alone = Engine(model, EngineConfig(block_length=L, token_budget=4096)).generate(
        [prompts[2], prompts[5]], SamplingParams(max_new_tokens=24, stop_token_ids=[EOS]))
    for r in out.to_pylist():
        i = r["row"]
        assert r["error"] is None, r["error"]
        if i in (2, 5):
            want = alone[i // 3].token_ids
        else:
            enc = nld.PublishedNemotron(model)
            ids = hf_linear_spec_generate(enc, prompts[i], 24, L, MASK, EOS)[0] if i % 3 == 0 \
                else hf_ar_generate(enc, prompts[i], 24, EOS)[0]
            want = served(prompts[i], ids, 24)[0]
        assert r["generated_token_ids"] == want, i


def test_a_block_waits_on_the_host_once():
    """On the stand-in CUDA device (bench.counting.StandInCuda, issue 51): a LinearSpec or AR
    block (draft, verify, accepted lengths) makes one host wait, the read of the verify's
    tokens and the accepted lengths, its uploads pinned and non-blocking; a prefill reads its
    first tokens once. The rows' tokens are the CPU run's."""
    from bench.counting import StandInCuda

    def serve(stand_in: bool):
        m = nld.nemotron_model(0)
        s = StandInCuda() if stand_in else None
        blocks: List[Counter] = []
        with s if s is not None else torch.no_grad():
            if s is not None:
                s.move(m)
            eng = LinearSpecEngine(m, EngineConfig(block_length=L, token_budget=4096, max_batch_size=4))
            if s is not None:
                block = eng._block

                def counted(rows):
                    with s.counting() as got:
                        block(rows)
                    blocks.append(got)
                eng._block = counted
            kinds = ["linear_spec", "ar", "linear_spec", "linear_spec"]
            prompts = [[20 + i + j for j in range(5 + 3 * i)] for i in range(4)]
            outs = eng.generate(prompts, [params(24, k) for k in kinds])
        return [o.token_ids for o in outs], blocks, s.waits if s is not None else 0

    cpu, _, _ = serve(False)
    got, blocks, total = serve(True)
    assert got == cpu
    assert blocks and [sum(c.values()) for c in blocks] == [1] * len(blocks), blocks
    assert {k for c in blocks for k, _ in c} == {"tolist"}
    assert total == len(blocks) + 1  # and one prefill read (the four rows start together)
