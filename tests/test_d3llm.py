"""d3LLM's multi-block decoding (`SamplingParams.multi_block`, engine.multi_block) against a
float64 transcription of SGLang's `FullAttnMultiBlock`, token for token.

`multi_block_reference` follows `FullAttnMultiBlock.run` (sgl-project/sglang,
python/sglang/srt/dllm/algorithm/full_attn_multi_block.py, commit 26eb1bf9) for one
request, with its loop structure and bookkeeping, over the model's tensors:

- the sequence is the prompt and gen_length = max_new_tokens masks; `blocks` of
  block_size from the prompt's end, block 0 active and fully active;
- `while True`: stop when no mask is left or nfe >= max_nfe (gen_length + 1 for one
  request); one forward over the whole sequence under full bidirectional attention (no
  cache: cache_delay_iter 10000); Dream's logits are read from the position before
  (SGLang's DreamModel shifts its hidden states, `cat([part[:1], part[:-1]])`);
- per block k >= 1: active once its predecessor's progress 1 - mask_count / total is
  >= block_add_threshold or its mask_count is 0; fully active (when active) once that
  progress is >= decoded_token_threshold;
- active_end: the end of the last block that is active and fully active or still
  masked; every mask before it is decodable; entropy -sum p log(p + 1e-12) of the
  softmax (SGLang's `.float()`: float64 here, as the engine computes it in propose's
  softmax pass), x0 the argmax; transfer entropy < threshold; the first
  fully active block with masks that transfers nothing takes its argmin entropy;
- the generated tokens, cut at the first stop id (SGLang's output is finished there).

The engine runs multi_block rows in mixed batches with ordinary block rows (LLaDA's
generate / Dream's block decoding: tests/test_reference_decoding.py's transcription)
under blockserve, static and sequential, both advance modes, and must give exactly these
tokens and the same number of forwards (num_steps = nfe). The workload is built so that
every rule fires, and the test asserts that it does: blocks activated while their
predecessor is still being decoded, full activation, several masks of several blocks
committed in one step under the threshold, and the forced commit.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model
from engine.multi_block import MultiBlockState
from test_reference_decoding import reference_decode
from tp_ranks import run_ranks

torch.set_num_threads(1)
L = 4  # test_reference_decoding's block length and steps
STOPS = {"llada": [12], "Dream": [28, 47]}
# entropy thresholds of the tiny random models (their entropies lie in about [3.5, 3.9] nats)
ENTROPY = {"llada": (3.7, 3.8, 3.8), "Dream": (3.8, 3.8, 3.83)}


@pytest.fixture(scope="module", params=["llada", "Dream"])
def model(request):
    return build_model(ModelConfig.tiny(request.param), dtype=torch.float64, seed=0)


# --- the reference ------------------------------------------------------------------
def multi_block_reference(model, prompt, sp: SamplingParams, trace=None):
    """(generated tokens up to the first stop, forwards until they were decoded) of
    FullAttnMultiBlock for one request; `trace` (a dict) collects what fired."""
    cfg = model.config
    mask_id, shift = cfg.mask_token_id, cfg.shift_logits
    threshold = sp.entropy_threshold
    block_add_threshold = 0.1 if sp.block_add_threshold is None else sp.block_add_threshold
    decoded_token_threshold = sp.decoded_token_threshold
    block_size, gen_length, start = L, sp.max_new_tokens, len(prompt)
    ids = torch.tensor(prompt + [mask_id] * gen_length)
    n = len(ids)
    pos, keys = torch.arange(n)[None], torch.ones(1, 1, 1, n, dtype=torch.bool)
    num_blocks = (gen_length + block_size - 1) // block_size
    blocks = []
    for k in range(num_blocks):
        bs = start + k * block_size
        be = min(bs + block_size, start + gen_length)
        blocks.append(dict(start=bs, end=be, total=be - bs, mask_count=be - bs, is_active=k == 0,
                           is_fully_active=k == 0, completed_at_nfe=None))
    t = trace if trace is not None else {}
    t.update(activated=[0] + [None] * (num_blocks - 1), fully=[0] + [None] * (num_blocks - 1), forced=0,
             multi=0, early=0)
    nfe, max_nfe = 0, gen_length + 1
    while True:
        if (ids == mask_id).sum().item() == 0:
            break
        if nfe >= max_nfe:
            break
        with torch.no_grad():
            logits = model(ids[None], pos, keys, None, 0)[0].double()
        if shift:
            logits = torch.cat([logits[:1], logits[:-1]])
        nfe += 1
        for k in range(1, len(blocks)):
            prev = blocks[k - 1]
            prev_progress = 1 - prev["mask_count"] / prev["total"]
            if not blocks[k]["is_active"]:
                if prev_progress >= block_add_threshold or prev["mask_count"] == 0:
                    blocks[k]["is_active"] = True
                    t["activated"][k] = nfe - 1
                    t["early"] += prev["mask_count"] > 0
            if blocks[k]["is_active"] and not blocks[k]["is_fully_active"]:
                if prev_progress >= decoded_token_threshold:
                    blocks[k]["is_fully_active"] = True
                    t["fully"][k] = nfe - 1
        active_end = 0
        for blk in blocks:
            if blk["is_active"] and (blk["is_fully_active"] or blk["mask_count"] > 0):
                active_end = blk["end"]
        if active_end == 0:
            continue
        decode_mask = ids[:active_end].eq(mask_id)
        if decode_mask.sum().item() == 0:
            continue
        mask_logits = logits[:active_end][decode_mask]
        probs = torch.softmax(mask_logits, dim=-1)  # float64 (SGLang: .float())
        entropy = -torch.sum(probs * torch.log(probs + 1e-12), dim=-1)
        x0 = torch.argmax(mask_logits, dim=-1)
        full_entropy = torch.full((active_end,), float("inf"), dtype=entropy.dtype)
        full_x0 = ids[:active_end].clone()
        full_entropy[decode_mask] = entropy
        full_x0[decode_mask] = x0
        transfer = (full_entropy < threshold) & decode_mask
        first_fa_blk = next((blk for blk in blocks if blk["is_fully_active"] and blk["mask_count"] > 0), None)
        if first_fa_blk is not None:
            bs_, be_ = first_fa_blk["start"], min(first_fa_blk["end"], active_end)
            if not transfer[bs_:be_].any():
                blk_mask = ids[bs_:be_].eq(mask_id)
                blk_ent = full_entropy[bs_:be_].clone()
                blk_ent[~blk_mask] = float("inf")
                transfer[bs_ + blk_ent.argmin()] = True
                t["forced"] += 1
        touched = {(j - start) // block_size for j in transfer.nonzero().flatten().tolist()}
        t["multi"] += len(touched) > 1 and int(transfer.sum()) > 1
        full_transfer = torch.zeros(len(ids), dtype=torch.bool)
        full_transfer[:active_end] = transfer
        ids[full_transfer] = full_x0[transfer]
        for blk in blocks:
            if blk["mask_count"] > 0:
                new_count = ids[blk["start"]:blk["end"]].eq(mask_id).sum().item()
                if new_count == 0 and blk["completed_at_nfe"] is None:
                    blk["completed_at_nfe"] = nfe
                blk["mask_count"] = new_count
    gen = ids[start:].tolist()
    stops = [j for j, tok in enumerate(gen) if tok in sp.stop_token_ids]
    if not stops:
        return gen, nfe
    # the forwards until the blocks up to the stop's were complete: where a server returns the answer
    done = [blk["completed_at_nfe"] for blk in blocks[:stops[0] // block_size + 1]]
    return gen[:stops[0]], (nfe if None in done else max(done))


# --- the engine against it ----------------------------------------------------------
def workload(model_type, n=12, seed=0):
    """multi_block rows with different activation and entropy thresholds (the published
    defaults among them) between ordinary block rows of the model's own decoding."""
    rng = random.Random(seed)
    lo, mid, hi = ENTROPY[model_type]
    kinds = [dict(multi_block=True, entropy_threshold=mid),
             dict(policy="threshold", threshold=0.3) if model_type == "llada" else dict(policy="threshold"),
             dict(multi_block=True),  # the published defaults: 0.1, 0.95, 0.4 (only forced commits here)
             dict(multi_block=True, block_add_threshold=0.5, decoded_token_threshold=0.5, entropy_threshold=hi),
             dict(policy="fixed"),
             dict(multi_block=True, block_add_threshold=0.0, decoded_token_threshold=0.75, entropy_threshold=lo)]
    prompts = [[rng.randrange(3, 60) for _ in range(rng.randint(3, 30))] for _ in range(n)]
    params = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        k = rng.randint(2, 5)
        length = k * L if kind.get("multi_block") else k * L - rng.randint(0, 2)
        params.append(SamplingParams(max_new_tokens=length, stop_token_ids=STOPS[model_type] if i % 3 else [],
                                     **kind))
    return prompts, params


def run(model, prompts, params, **kw):
    cfg = dict(block_length=L, steps_per_block=L, cache="none", token_budget=300, max_batch_size=5)
    eng = Engine(model, EngineConfig(**{**cfg, **kw}), record_batches=True)
    return eng.generate(prompts, params), eng


@pytest.fixture(scope="module")
def expected(model):
    prompts, params = workload(model.config.model_type)
    out, traces = [], []
    for pr, sp in zip(prompts, params):
        if sp.multi_block:
            tr = {}
            out.append(multi_block_reference(model, pr, sp, tr))
            traces.append(tr)
        else:
            out.append((reference_decode(model, pr, sp, "none"), None))
    return prompts, params, out, traces


def test_the_workload_fires_every_rule(expected):
    _, params, out, traces = expected
    assert sum(t["early"] for t in traces) > 0  # a block activated while its predecessor still had masks
    assert any(f is not None and f > 0 for t in traces for f in t["fully"][1:])  # full activation mid-decoding
    assert sum(t["forced"] for t in traces) > 0  # the first fully active block forced
    assert sum(t["multi"] for t in traces) > 0  # one step committed masks of several blocks
    assert any(len(tok) < sp.max_new_tokens for (tok, _), sp in zip(out, params) if sp.multi_block)  # a stop
    nfe = [(n, sp.max_new_tokens) for (_, n), sp in zip(out, params) if sp.multi_block]
    assert any(n < g for n, g in nfe)  # fewer forwards than tokens: parallel commits


@pytest.mark.parametrize("scheduler,advance", [("blockserve", "block"), ("blockserve", "step"), ("static", "block"),
                                               ("static", "step"), ("sequential", "block")])
def test_mixed_batches_match_the_reference(model, expected, scheduler, advance):
    prompts, params, ref, _ = expected
    outs, eng = run(model, prompts, params, scheduler=scheduler, advance=advance)
    assert eng.full_canvas  # canvas "auto" on a bidirectional model
    if scheduler != "sequential":  # multi_block rows with several blocks in flight next to block rows
        assert max(len(b.request_ids) for b in eng.batch_log) > 1
    for o, (tokens, nfe), sp in zip(outs, ref, params):
        assert o.token_ids == tokens
        if nfe is not None:
            assert o.num_steps == nfe


def test_block_canvas_and_preemption(model, expected):
    """Under the block canvas and a tight budget, ordinary rows (longer here, without stops)
    grow a block at a time and rows go back to the queue: the multi_block rows (which hold
    every block from admission under either canvas) still give the reference's tokens,
    the block rows the engine's own sequential ones."""
    prompts, params, ref, _ = expected
    params = [sp if sp.multi_block else dataclasses.replace(sp, max_new_tokens=7 * L, stop_token_ids=[])
              for sp in params]
    outs, eng = run(model, prompts, params, canvas="block", token_budget=80)
    assert eng.scheduler.preemptions > 0 and max(len(b.request_ids) for b in eng.batch_log) > 2
    assert all(b.cost <= 80 for b in eng.batch_log)
    alone = run(model, prompts, params, canvas="block", scheduler="sequential")[0]
    for o, a, (tokens, nfe), sp in zip(outs, alone, ref, params):
        assert o.token_ids == (tokens if sp.multi_block else a.token_ids)
        if sp.multi_block:
            assert o.num_steps == nfe


def test_engine_state_follows_the_reference_activation(model, expected):
    """The engine's own record of when each block became active and fully active (the
    forwards before the first that treats it so) equals the reference's, for every block
    the row reached before it stopped."""
    prompts, params, _, traces = expected
    it = iter(traces)
    seen = 0
    for pr, sp in zip(prompts, params):
        if not sp.multi_block:
            continue
        tr = next(it)
        eng = Engine(model, EngineConfig(block_length=L, steps_per_block=L, cache="none", token_budget=300))
        eng.add_request(pr, sp)
        eng.step()
        state = eng.batch.rows[0].state
        while eng.has_unfinished():
            eng.step()
        stopped = len(state.tokens()) > 0  # blocks left in flight: a stop token ended the row
        for mine, theirs in ((state.activated, tr["activated"]), (state.fully_activated, tr["fully"])):
            for e, r in zip(mine, theirs):
                assert e == r if e != -1 else (r is None or stopped)
                seen += e > 0
    assert seen > 0


def test_rows_fail_alone_where_multi_block_cannot_run(model):
    causal = build_model(ModelConfig.tiny("llada", dllm_attention="block_causal"), dtype=torch.float64, seed=0)
    mb = SamplingParams(max_new_tokens=8, multi_block=True, stop_token_ids=[])
    plain = SamplingParams(max_new_tokens=8, stop_token_ids=[])
    cases = [(causal, {}, mb, "block-causal"),
             (model, dict(cache="refresh"), mb, "set cache 'none'"),
             (model, {}, SamplingParams(max_new_tokens=6, multi_block=True), "not a multiple of block_length=4"),
             (model, {}, SamplingParams(max_new_tokens=8, multi_block=True, temperature=0.5),
              "temperature (read by masked-diffusion models): not read by this row's decoding (multi_block)"),
             (model, {}, SamplingParams(max_new_tokens=8, multi_block=True, policy="fixed"), "policy"),
             (model, {}, SamplingParams(max_new_tokens=8, multi_block=True, min_tokens=2), "min_tokens"),
             (model, {}, SamplingParams(max_new_tokens=8, entropy_threshold=1.0),
              "entropy_threshold (read by d3LLM multi-block decoding (multi_block))"),
             (model, {}, SamplingParams(max_new_tokens=8, multi_block=True, entropy_threshold=0.0),
              "entropy_threshold must be"),
             (model, {}, SamplingParams(max_new_tokens=8, multi_block="yes"), "multi_block must be true or false")]
    for m, kw, sp, msg in cases:
        bad, good = run(m, [[5, 6, 7], [5, 6, 7]], [sp, plain], **kw)[0]
        assert bad.finish_reason == "error" and msg in bad.error, (msg, bad.error)
        assert good.finish_reason == "length" and len(good.token_ids) == 8


def test_multi_block_does_not_turn_on_d2f():
    """block_add_threshold is read by multi_block too: with it, the row is not a D2F row."""
    from engine.decoders import rule_for

    assert rule_for(SamplingParams(multi_block=True, block_add_threshold=0.3)).name == "multi_block"
    assert rule_for(SamplingParams(block_add_threshold=0.3)).name == "d2f"
    assert SamplingParams(multi_block=True, block_add_threshold=0.3, policy="fixed").validate() is None


def test_state_rules_by_hand():
    """The bookkeeping on numbers one can check by eye (mask 9, L = 4, 3 blocks)."""
    st = MultiBlockState.fresh(0.25, 0.75, 0.4, 4, 3, 9)
    assert [(b.active, b.fully_active) for b in st.blocks] == [(True, True), (False, False), (False, False)]
    assert st.last_eligible() == 0 and st.force_unit() == 0
    assert st.observe([1, 9, 9, 9] + [9] * 8, 13) == []  # 1/4 >= 0.25: block 1 active, not fully
    assert [(b.active, b.fully_active) for b in st.blocks] == [(True, True), (True, False), (False, False)]
    assert st.activated == [0, 1, -1] and st.last_eligible() == 1 and st.force_unit() == 0
    assert st.observe([1, 2, 3, 9] + [4, 9, 9, 9] + [9] * 4, 13) == []  # 3/4: block 1 fully, block 2 active
    assert [(b.active, b.fully_active) for b in st.blocks] == [(True, True), (True, True), (True, False)]
    assert st.observe([1, 2, 3, 5] + [4, 9, 9, 9] + [9] * 4, 13) == [1, 2, 3, 5]  # block 0 done: committed
    assert st.n_active == 2 and st.committed == 1 and st.force_unit() == 0  # block 1 forced next
    # a block without masks that is not fully active does not extend the eligible range
    st2 = MultiBlockState.fresh(0.25, 1.0, 0.4, 4, 3, 9)
    st2.observe([1, 9, 9, 9] + [2, 3, 4, 5] + [9] * 4, 13)  # block 1 active (1/4), decoded, not fully active
    assert st2.blocks[2].active and st2.last_eligible() == 2  # block 2 active (block 1 has no mask)
    st3 = MultiBlockState.fresh(0.5, 1.0, 0.4, 4, 3, 9)
    st3.observe([1, 9, 9, 9] + [2, 3, 4, 5] + [9] * 4, 13)  # block 1 not active: 1/4 < 0.5
    assert not st3.blocks[1].active and st3.blocks[2].active and st3.last_eligible() == 2


def test_selection_by_hand():
    """The rule's selection on logits one can check by eye: the threshold over every
    eligible block, and the forced mask of the first fully active block that committed none."""
    from types import SimpleNamespace

    from engine.multi_block import MULTI_BLOCK

    V, mask = 8, 9
    st = MultiBlockState.fresh(0.25, 1.0, 0.5, 4, 3, mask)
    st.observe([1, 9, 9, 9] + [9] * 8, 13)  # block 1 active (not fully), block 2 not yet
    sharp, flat = torch.full((V,), -30.0), torch.zeros(V)
    sharp[3] = 0.0  # entropy about 0: under 0.5
    lg = torch.stack([flat] * 12)
    lg[5] = sharp  # block 1's second position
    lg[2] = flat + torch.arange(V) * 0.01  # block 0: all flat; position 2 the least flat (lowest entropy)
    lg[9] = sharp  # block 2 (not active): never eligible
    is_mask = torch.tensor([t == mask for t in st.tokens()]).reshape(3, 4)
    view = SimpleNamespace(n_window=3, block_length=4, rows=[SimpleNamespace(state=st)], is_mask=is_mask,
                           logits=lg[None].double())
    sel = MULTI_BLOCK.select(view, [0], torch.zeros(3, 4, dtype=torch.bool))
    assert sel.flatten().nonzero().flatten().tolist() == [2, 5]  # forced in block 0, threshold in block 1


def test_the_preflight_refuses_settings_every_row_would_fail():
    """The job's preflight (engine.decoders.settings_refusal, torch-free) refuses
    multi_block under a cache before any row runs, and passes it without one."""
    from engine.decoders import settings_refusal
    from engine.layout import Layout
    from engine.sequence import RowShape

    def layout(model_type="llada", **kw):
        cfg = ModelConfig.tiny(model_type, **kw.pop("model", {}))
        return Layout(cfg, RowShape(L, not cfg.block_causal), EngineConfig(block_length=L, **kw))

    sp = SamplingParams(max_new_tokens=8, multi_block=True)
    assert "set cache 'none'" in settings_refusal(sp, layout())  # EngineConfig's default cache: refresh
    assert settings_refusal(sp, layout(cache="none")) is None
    assert settings_refusal(sp, layout("Dream", cache="none")) is None
    assert "block-causal" in settings_refusal(sp, layout(cache="none", model=dict(dllm_attention="block_causal")))


def test_tensor_parallel_2_gives_the_reference_tokens(model, expected, tmp_path):
    """Tensor parallel 2 over gloo (each rank half the heads, MLP and vocabulary; the
    entropies read the gathered logits): every rank decodes the mixed batch's tokens of the
    transcription, with its forwards, as one device does."""
    prompts, params, ref, _ = expected
    ranks = run_ranks(model, str(tmp_path), prompts, params,
                      EngineConfig(block_length=L, steps_per_block=L, cache="none", token_budget=300, max_batch_size=5))
    for got in ranks:
        assert got["held"] < 0.75 * sum(p.numel() for p in model.parameters())  # a shard, not the whole model
        assert got["errors"] == [None] * len(params)
        assert got["tokens"] == [tokens for tokens, _ in ref]
        assert [s for s, sp in zip(got["steps"], params) if sp.multi_block] == \
            [nfe for (_, nfe), sp in zip(ref, params) if sp.multi_block]


# --- the entropies in propose's softmax pass ------------------------------------------
def _softmax_outside_the_model(model, prompts, params, **kw):
    """(outputs, the softmax kernels each denoising step ran outside the model's forward)."""
    from bench.counting import LaunchCounter

    cfg = dict(block_length=L, steps_per_block=L, cache="none", token_budget=300, max_batch_size=5)
    eng = Engine(model, EngineConfig(**{**cfg, **kw}))
    denoise, per_step = eng._denoise, []

    def counted():
        with LaunchCounter(layers=[model]) as c:
            out = denoise()
        names = ("softmax", "_softmax")  # torch.softmax with out= and without
        inside = sum(call["ops"][n] for call in c.calls for n in names)
        per_step.append(sum(c.ops[n] for n in names) - inside)
        return out
    eng._denoise = counted
    return eng.generate(prompts, params), per_step


def test_one_softmax_per_position_a_step(model, expected):
    """The rows' entropies come from propose's float64 softmax (Confidence kind MULTI_BLOCK:
    minus the entropy), not from a second pass: a step of a mixed batch runs one softmax
    kernel outside the model (one chunk of positions), and the tokens are the transcription's."""
    prompts, params, ref, _ = expected
    outs, per_step = _softmax_outside_the_model(model, prompts, params)
    assert [o.token_ids for o in outs] == [tokens for tokens, _ in ref]
    assert per_step and set(per_step) == {1}


@pytest.mark.parametrize("folder", ["GSAI-ML__LLaDA-8B-Instruct", "Dream-org__Dream-v0-Instruct-7B"])
def test_multi_block_step_waits_once(folder):
    """On the stand-in CUDA device (tests/test_host_waits.py): a multi_block step waits once,
    at its designed read (no data-dependent index for the entropies), and gives the CPU's
    tokens."""
    from test_host_waits import _kinds, _serve

    params = SamplingParams(max_new_tokens=16, multi_block=True, entropy_threshold=9.0, ignore_eos=True)
    cpu, *_ = _serve(folder, False, params, cache="none", block_length=8)
    got, steps, e, waits = _serve(folder, True, params, cache="none", block_length=8)
    assert got == cpu
    assert steps and _kinds(steps) == [[("d2h", "_fetch")]] * len(steps)
    assert e.stats.syncs == waits == len(steps)
