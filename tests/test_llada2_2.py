"""Issue 54, acceptance 1: LLaDA2.2's Levenshtein edit loop (engine.indel,
SamplingParams.edit_ops) exact against a float64 transcription, over block routing.

`generate_22` transcribes LLaDA2.2-flash's generate() / `_joint_decode_block` (HF
modeling_llada2_moe.py; not readable first-hand) from its description in
../shared/checkpoints/REFERENCES.md ("LLaDA2.2-flash", steps 1-5) and FLX-OSS/FluxServe
dev-notes/llada2.2-model-support-development-guide.md section 4 (index commit 87355a41):
batch 1, no cache, the whole window re-forwarded every step under the block-causal mask,
greedy. Where those leave a choice open, the choice made (and made the same in engine.indel):
the final round sets the mask, DELETE and SPLIT logits to -inf (FluxServe: "a finalized
generated region has no masks or edit tokens"); the anti-loop retries draw their changed
position with torch.randint from a generator seeded by (seed, tokens before the block,
step, try) instead of the global RNG (so batching never changes a row), and ban each
token they tried; the M2T schedule spreads the block's initial masks (LLaDA's
get_num_transfer_tokens). The network is test_block_routing's block-routed reference.

The model: 2.2-flash's config.json rebuilt from located values (tests/test_not_served.py)
WITH its edit tokens, sizes shrunk (tests/published.py), 32 experts top-4 with
expert_capacity scaled (48 x 32 / 256 = 6), block_size = L = 4; its output head sharpened
(HEAD_SCALE) and the DELETE / SPLIT rows of lm_head raised (EDIT_BOOST x the head's row
scale) so that a random model emits them as a trained one does: the workload's reference
run counts DELETE, SPLIT, anti-loop escapes and final rounds (test_every_rule_fires)."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

import published
from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model
from engine.presets import preset
from test_block_routing import CAPACITY, EXPERTS, TOP_K, BlockRoutedLLaDA2
from test_llada2 import (HEAD_SCALE, L, SETTINGS, block_mask, generate_20, generate_21, most_emitted,
                         published_tokens, sample_greedy, with_biases)
from test_not_served import llada2_2_flash_config
from tp_ranks import run_ranks

torch.set_num_threads(1)
DELETE, SPLIT = 156930, 156931
EDIT_BOOST = {DELETE: 2.6, SPLIT: 2.2}  # DELETE / SPLIT lm_head rows: plus a random row this many head row norms long
NOISE_MASK = 2**62 - 1
ESCAPE_TRIES = 5


def llada2_2_tiny() -> dict:
    """2.2-flash's config.json (edit tokens kept), sizes shrunk, 32 experts top-4, capacity 6, block_size L."""
    hf = published.shrink(llada2_2_flash_config())
    hf.update(num_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=8, topk_group=4, expert_capacity=CAPACITY,
              block_size=L, num_hidden_layers=3)
    return hf


def tiny_model(dtype=torch.float64):
    cfg = ModelConfig.from_hf(llada2_2_tiny())
    model = with_biases(build_model(cfg, dtype=dtype, seed=0))
    with torch.no_grad():
        head = model.lm_head.weight
        head.mul_(HEAD_SCALE)
        scale = head.norm(dim=1).mean()
        g = torch.Generator().manual_seed(11)
        for t in (DELETE, SPLIT):
            head[t] = head[t] + EDIT_BOOST[t] * scale * torch.randn(head.shape[1], generator=g,
                                                                   dtype=head.dtype) / head.shape[1] ** 0.5
    return model


def escape_key(seed, before, step, attempt):
    return hash((seed, before, step, attempt, 22)) & NOISE_MASK


def generate_22(ref, prompt, gen_length, block_length, steps, threshold, editing_threshold=0.0, max_post_steps=16,
                max_steps_per_block=1000, eos_id=156892, mask_id=156895, delete_id=DELETE, split_id=SPLIT, seed=0,
                fired=None, sglang=False):
    """LLaDA2.2's generate() at temperature 0 (see the module docstring); `fired` counts
    what fired (Counter-like dict). `sglang`: SGLang JointThresholdInDel's M2T floor
    (1 + new masks, no schedule), post counter (never reset), step bound (block_length +
    max_post_steps + 1) and anti-loop position (the lowest-confidence changed one, once),
    the rest as HF's."""
    fired = {} if fired is None else fired

    def count(k, n=1):
        fired[k] = fired.get(k, 0) + int(n)

    p = len(prompt)
    num_blocks = (p + gen_length + block_length - 1) // block_length
    mask = block_mask(num_blocks, block_length)
    x = torch.full((num_blocks * block_length,), mask_id, dtype=torch.long)
    x[:p] = torch.tensor(prompt)
    first = p // block_length
    for num_block in range(first, num_blocks):
        start, end = num_block * block_length, (num_block + 1) * block_length
        n_prompt = max(0, p - start)
        blk = x[start:end].tolist()
        is_orig = [j >= n_prompt for j in range(block_length)]
        schedule = num_transfer_tokens_of(block_length - n_prompt, steps)
        post_steps, seen, step = 0, set(), 0
        while True:
            masked = [j >= n_prompt and t == mask_id for j, t in enumerate(blk)]
            n_mask = sum(masked)
            n_orig = sum(m and o for m, o in zip(masked, is_orig))
            if n_orig == 0:
                post_steps += 1
            elif not sglang:
                post_steps = 0
            if sglang:
                max_steps_per_block = block_length + max_post_steps + 1
            final = step >= max_steps_per_block - 1 or (
                post_steps >= max_post_steps if max_post_steps > 0 else n_orig == 0)
            x[start:end] = torch.tensor(blk)
            logits = ref(x[:end], mask[:end, :end])[-block_length:]
            x0, x0_p = sample_greedy(logits)
            # M2T
            if final or (step >= steps and not sglang):
                take = list(masked)
            else:
                need = (1 if sglang else schedule[step]) + (n_mask - n_orig)
                high = [m and float(x0_p[j]) > threshold for j, m in enumerate(masked)]
                if sum(high) >= need:
                    take = high
                else:
                    conf = torch.where(torch.tensor(masked), x0_p, -torch.inf)
                    take = [False] * block_length
                    for j in torch.topk(conf, k=min(need, n_mask)).indices.tolist():
                        take[j] = True
            if max_post_steps == 0 and not final and n_orig > 0 and all(
                    t for t, m, o in zip(take, masked, is_orig) if m and o):
                final = True
            if final:  # the final round writes no control token
                lg = logits.clone()
                lg[:, [mask_id, delete_id, split_id]] = -torch.inf
                x0, x0_p = sample_greedy(lg)
                take = list(masked)
            x0 = x0.tolist()
            # T2T
            edit = [j >= n_prompt and not masked[j] and x0[j] != blk[j] and float(x0_p[j]) > editing_threshold
                    for j in range(block_length)]
            writes = [a or b for a, b in zip(take, edit)]
            count("t2t", sum(edit))
            cand = [x0[j] if writes[j] else blk[j] for j in range(block_length)]
            # anti-loop
            if not final:
                banned = {}
                for attempt in range(1 if sglang else ESCAPE_TRIES):
                    if tuple(cand) not in seen:
                        break
                    changed = [j for j in range(block_length) if writes[j] and cand[j] != blk[j]]
                    if not changed:
                        break
                    if sglang:
                        j = min(changed, key=lambda c: (float(x0_p[c]), c))
                    else:
                        g = torch.Generator().manual_seed(escape_key(seed, (num_block - first) * block_length, step,
                                                                     attempt))
                        j = changed[int(torch.randint(len(changed), (1,), generator=g))]
                    banned.setdefault(j, []).append(cand[j])
                    row = logits[j].clone()
                    row[banned[j]] = -torch.inf
                    cand[j] = int(row.argmax())
                    count("escape")
            seen.add(tuple(cand))
            count("delete", sum(t == delete_id for j, t in enumerate(cand) if writes[j]))
            count("split", sum(t == split_id for j, t in enumerate(cand) if writes[j]))
            # DELETE / SPLIT, left to right; the block kept at block_length
            out, flags = blk[:n_prompt], [False] * n_prompt
            for j in range(n_prompt, block_length):
                if cand[j] == delete_id:
                    continue
                if cand[j] == split_id:
                    out += [mask_id, blk[j]]
                    flags += [False, is_orig[j]]
                else:
                    out.append(cand[j])
                    flags.append(is_orig[j])
            pad = block_length - len(out)
            out, flags = (out + [mask_id] * pad)[:block_length], (flags + [False] * pad)[:block_length]
            if any(not f for f, t in zip(flags[n_prompt:], out[n_prompt:]) if t == mask_id):
                count("new_masks")
            stable = n_mask == 0 and out == blk
            blk, is_orig = out, flags
            step += 1
            if final:
                count("final")
                count("cap", step >= max_steps_per_block)
            elif stable:
                count("stable")
            if final or stable:
                break
        x[start:end] = torch.tensor(blk)
        count("blocks")
        if (x[p:end] == eos_id).any():
            break
    ans = x[p:p + gen_length]
    hits = (ans == eos_id).nonzero().flatten()
    return ans[: (int(hits[0]) + 1 if len(hits) else gen_length)].tolist()


def num_transfer_tokens_of(n, steps):
    base, rem = divmod(n, steps)
    return [base + (t < rem) for t in range(steps)]


# name: (SamplingParams of the row, steps_per_block); "2.2*" rows decode with edit_ops
SETTINGS_22 = {"2.2": (dict(edit_ops=True, threshold=0.5), 4),
               "2.2-post2": (dict(edit_ops=True, threshold=0.3, edit_threshold=0.05, max_post_steps=2), 4),
               "2.2-S2": (dict(edit_ops=True, threshold=0.5, max_post_steps=3, max_steps_per_block=4), 2),
               "2.2-e6": (dict(edit_ops=True, threshold=0.5, edit_threshold=0.6), 4),
               "2.2-sglang": (dict(edit_ops=True, threshold=0.5, max_post_steps=3, edit_ops_variant="sglang"), 4),
               "2.2-post0": (dict(edit_ops=True, threshold=0.5, edit_threshold=0.3, max_post_steps=0), 2)}
ALL = {**SETTINGS_22, **SETTINGS}


def workload(n=24, seed=1):
    rng = random.Random(seed)
    names = list(SETTINGS_22)
    prompts = [[rng.randrange(13, 150000) for _ in range(rng.randint(1, 11))] for _ in range(n)]
    jobs = [(names[i % len(names)], rng.randint(1, 4) * L - rng.randint(0, 2)) for i in range(n)]
    return prompts, jobs


def params_of(name, max_new, eos, seed):
    kw, _ = ALL[name]
    extra = dict(seed=seed) if kw.get("edit_ops") else dict(policy="threshold")
    return SamplingParams(max_new_tokens=max_new, stop_token_ids=[eos], **kw, **extra)


def reference(pub, prompt, name, max_new, seed, fired=None):
    kw, S = ALL[name]
    ids = dict(eos_id=pub.eos, mask_id=pub.mask)
    if name.startswith("2.2"):
        out = generate_22(pub.ref, prompt, max_new, L, S, kw["threshold"], kw.get("edit_threshold") or 0.0,
                          kw.get("max_post_steps", 16), kw.get("max_steps_per_block", 1000), seed=seed, fired=fired,
                          sglang=kw.get("edit_ops_variant") == "sglang", **ids)
    elif name.startswith("2.0"):
        out = generate_20(pub.ref, prompt, max_new, L, S, kw["threshold"], **ids)
    else:
        out = generate_21(pub.ref, prompt, max_new, L, kw["threshold"], kw["edit_threshold"],
                          kw.get("max_post_steps", 16), **ids)
    return published_tokens(out, pub.eos)


@pytest.fixture(scope="module")
def pub():
    """The model, its reference, and a stop id: the token most of the workload's rows emit
    when nothing stops them."""
    model = tiny_model()
    ref = BlockRoutedLLaDA2(model)
    mask = model.config.mask_token_id
    prompts, jobs = workload()
    free = SimpleNamespace(model=model, ref=ref, mask=mask, eos=-1)
    outs = [reference(free, p, name, n, i) for i, (p, (name, n)) in enumerate(zip(prompts, jobs))]
    return SimpleNamespace(model=model, ref=ref, mask=mask, eos=most_emitted([set(o) for o in outs]))


@pytest.fixture(scope="module")
def refs(pub):
    """The workload (24 edit_ops rows, 4 of them SGLang's variant) and, mixed in, test_llada2's 2.0 / 2.1 rows."""
    prompts, jobs = workload()
    per_row = [{} for _ in prompts]
    outs = [reference(pub, p, name, n, i, per_row[i]) for i, (p, (name, n)) in enumerate(zip(prompts, jobs))]
    fired = fired_in(per_row)
    from test_llada2 import workload as workload_21
    p21, j21 = workload_21()
    prompts, jobs = prompts + p21[:6], jobs + j21[:6]
    outs += [reference(pub, p, name, n, None) for p, (name, n) in zip(p21[:6], j21[:6])]
    per_row += [{} for _ in p21[:6]]
    return SimpleNamespace(prompts=prompts, jobs=jobs, outs=outs, fired=fired, per_row=per_row)


COUNTED = ("t2t", "delete", "split", "escape", "final", "stable")  # what engine.indel counts too


def fired_in(rows):
    return {k: sum(r.get(k, 0) for r in rows) for k in {k for r in rows for k in r}}


@pytest.fixture
def engine_fired(monkeypatch):
    """What engine.indel's rows counted (IndelState.count), summed over every row."""
    from engine import indel

    seen = {}
    original = indel.IndelState.count

    def count(self, what, n=1):
        seen[what] = seen.get(what, 0) + int(n)
        original(self, what, n)
    monkeypatch.setattr(indel.IndelState, "count", count)
    return seen


def test_config_is_2_2s_with_edit_tokens(pub):
    cfg = pub.model.config
    assert (cfg.delete_token_id, cfg.split_token_id, cfg.mask_token_id) == (DELETE, SPLIT, 156895)
    assert cfg.moe.block_routed and cfg.moe.expert_capacity == CAPACITY
    assert cfg.to_hf()["delete_token_id"] == DELETE and cfg.to_hf()["split_token_id"] == SPLIT


def test_every_rule_fires(refs):
    """The reference run of the 24 edit_ops rows: DELETE, SPLIT (new masks), T2T rewrites,
    anti-loop escapes, final rounds (some at the hard cap) and stable ends all happen; some
    rows stop, some span blocks."""
    f = refs.fired
    print(f)
    for what in ("delete", "split", "t2t", "escape", "final", "stable", "new_masks", "cap"):
        assert f.get(what, 0) > 0, (what, f)
    n22 = sum(1 for name, _ in refs.jobs if name.startswith("2.2"))
    assert n22 >= 12
    assert any(len(o) < n for o, (_, n) in zip(refs.outs, refs.jobs))
    assert any(len(o) > L for o in refs.outs)
    assert all(t not in (DELETE, SPLIT) for o, (name, _) in zip(refs.outs, refs.jobs) if name.startswith("2.2")
               for t in o)  # consumed, never emitted (the 2.0 / 2.1 rows treat them as tokens)


@pytest.mark.parametrize("scheduler", ["blockserve", "static", "sequential"])
def test_mixed_batches_equal_the_transcribed_loop(pub, refs, scheduler, engine_fired):
    """edit_ops rows with LLaDA2.0 / 2.1 rows in one batch (steps 4), persistent cache,
    under every scheduler (blockserve: a row preempted and readmitted): the transcribed
    loops' tokens exactly."""
    pick = [i for i, (name, _) in enumerate(refs.jobs) if ALL[name][1] == 4]
    cfg = EngineConfig(block_length=L, steps_per_block=4, cache="persistent", scheduler=scheduler,
                       token_budget=32, max_batch_size=4)
    eng = Engine(pub.model, cfg, record_batches=True)
    params = [params_of(refs.jobs[i][0], refs.jobs[i][1], pub.eos, i) for i in pick]
    got = eng.generate([refs.prompts[i] for i in pick], params)
    if scheduler != "sequential":
        assert max(len(b.request_ids) for b in eng.batch_log) > 1
    if scheduler == "blockserve":
        assert eng.scheduler.preemptions > 0
    assert [o.token_ids for o in got] == [refs.outs[i] for i in pick]
    want = fired_in([refs.per_row[i] for i in pick])
    assert {k: engine_fired.get(k, 0) for k in COUNTED} == {k: want.get(k, 0) for k in COUNTED}
    assert all(engine_fired.get(k, 0) > 0 for k in COUNTED)


def test_steps_2_step_advance_and_other_caches(pub, refs):
    """The steps-2 rows (schedule past its end, a hard cap of 4 steps, max_post_steps 0) with
    the 2.0 S=2 rows, under step advance, refresh and no cache: the same tokens."""
    pick = [i for i, (name, _) in enumerate(refs.jobs) if ALL[name][1] == 2]
    assert pick
    params = [params_of(refs.jobs[i][0], refs.jobs[i][1], pub.eos, i) for i in pick]
    for cache, advance in (("persistent", "step"), ("refresh", "block"), ("none", "block")):
        eng = Engine(pub.model, EngineConfig(block_length=L, steps_per_block=2, cache=cache, advance=advance,
                                             token_budget=80, max_batch_size=4))
        got = eng.generate([refs.prompts[i] for i in pick], params)
        assert [o.token_ids for o in got] == [refs.outs[i] for i in pick], cache


def test_a_row_never_depends_on_its_batch(pub, refs):
    """An edit_ops row alone and in a batch: the same tokens (its escapes draw from its seed)."""
    i = next(i for i, (name, _) in enumerate(refs.jobs) if name == "2.2")
    eng = Engine(pub.model, EngineConfig(block_length=L, steps_per_block=4, cache="persistent"))
    alone = eng.generate([refs.prompts[i]], [params_of("2.2", refs.jobs[i][1], pub.eos, i)])[0]
    assert alone.token_ids == refs.outs[i]


def test_edit_ops_is_refused_where_it_cannot_apply(pub):
    """A checkpoint without DELETE / SPLIT ids, options the loop does not read, bad values."""
    from test_block_routing import tiny_model as no_edit_tokens

    out = Engine(no_edit_tokens(), EngineConfig(block_length=L, steps_per_block=L, cache="persistent")).generate(
        [[20, 21]], SamplingParams(max_new_tokens=4, edit_ops=True))[0]
    assert out.finish_reason == "error" and "delete_token_id" in out.error
    eng = Engine(pub.model, EngineConfig(block_length=L, steps_per_block=L, cache="persistent"))
    for bad, word in ((dict(temperature=0.5), "temperature"), (dict(logprobs=1), "logprobs"),
                      (dict(min_tokens=2), "min_tokens"), (dict(edit_ops_variant="x"), "edit_ops_variant"),
                      (dict(max_steps_per_block=1), "max_steps_per_block"),
                      (dict(edit_ops_variant="sglang", max_steps_per_block=9), "max_steps_per_block")):
        try:
            o = eng.generate([[20, 21]], SamplingParams(max_new_tokens=4, edit_ops=True, **bad))[0]
            assert o.finish_reason == "error" and word in o.error, (bad, o.error)
        except ValueError as e:
            assert word in str(e)


def test_the_preflight_refuses_edit_ops_without_edit_tokens():
    """The job's preflight (before Ray) refuses edit_ops on a LLaDA2 checkpoint naming no
    DELETE / SPLIT ids, and passes it on 2.2's."""
    from pipeline.checkpoint_check import check_settings
    from pipeline.errors import CheckpointRefused

    from test_block_routing import llada2_2_tiny as without_edit_tokens

    eng = EngineConfig(block_length=L, steps_per_block=L, cache="persistent")
    for hf, ok in ((without_edit_tokens(), False), (llada2_2_tiny(), True)):
        cfg = ModelConfig.from_hf(hf)
        checkpoint = SimpleNamespace(family=cfg.family, model="tiny", config=cfg, serving=cfg.family.serving)
        if ok:
            check_settings(checkpoint, SamplingParams(edit_ops=True), eng)
        else:
            with pytest.raises(CheckpointRefused, match="edit_ops .*delete_token_id"):
                check_settings(checkpoint, SamplingParams(edit_ops=True), eng)


def test_a_config_naming_one_edit_token_is_refused():
    from engine.models.families import ConfigRefused

    hf = llada2_2_tiny()
    del hf["split_token_id"]
    with pytest.raises(ConfigRefused, match="delete_token_id=156930 but no split_token_id"):
        ModelConfig.from_hf(hf)


def test_preset_is_2_2s_defaults():
    eng, smp = preset("llada2.2")
    assert (eng.block_length, eng.steps_per_block) == (32, 32)
    assert (smp.edit_ops, smp.threshold, smp.edit_threshold, smp.max_post_steps, smp.max_steps_per_block) == (
        True, 0.5, 0.0, 16, 1000)


def tp_jobs(eos: int):
    """The steps-4 rows of the workload (edit_ops rows of every setting, 2.0 and 2.1 rows)."""
    prompts, jobs = workload()
    from test_llada2 import workload as workload_21
    p21, j21 = workload_21()
    prompts, jobs = prompts + p21[:6], jobs + j21[:6]
    pick = [i for i, (name, _) in enumerate(jobs) if ALL[name][1] == 4]
    return pick, [prompts[i] for i in pick], [params_of(jobs[i][0], jobs[i][1], eos, i) for i in pick]


def test_tensor_and_expert_parallel_2_give_the_transcribed_tokens(pub, refs, tmp_path):
    """Tensor parallel 2 over gloo (each rank half the heads, the vocabulary and the experts,
    the router replicated): every rank decodes the transcribed loops' tokens, edit_ops rows
    (DELETE, SPLIT, escapes) among them."""
    pick, prompts, params = tp_jobs(pub.eos)
    got = run_ranks(pub.model, str(tmp_path), prompts, params,
                    EngineConfig(block_length=L, steps_per_block=4, cache="persistent", token_budget=32,
                                 max_batch_size=4))
    assert [g["own"] for g in got] == [list(range(0, EXPERTS // 2)), list(range(EXPERTS // 2, EXPERTS))]
    assert fired_in([refs.per_row[i] for i in pick]).get("delete", 0) > 0
    for g in got:
        assert g["edit_ids"] == [DELETE, SPLIT]
        assert g["tokens"] == [refs.outs[i] for i in pick]


FIXTURE = "inclusionAI__LLaDA2.2-flash"


def test_published_fixture_is_2_2s_located_config():
    """tests/published/inclusionAI__LLaDA2.2-flash: rebuilt from located values (its SOURCE.md),
    2.1-mini's config.json with 2.2's changes and the flash sizes; a rebuilt folder
    (tests/test_published.py runs its 10-row job with the edit loop)."""
    hf = published.config(FIXTURE)
    assert FIXTURE in published.rebuilt_folders()
    want = {**llada2_2_flash_config(), "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 4, "transformers_version": "5.2.0",
            # 2.1-flash's weight shapes (2.2's are the same: SOURCE.md), as tests/shapes/LLaDA2.0-flash-shaped has them
            "intermediate_size": 9216, "moe_intermediate_size": 1024, "max_window_layers": 32}
    assert list(hf) == list(want) and hf == want
    cfg = ModelConfig.from_hf(hf)
    assert (cfg.delete_token_id, cfg.split_token_id, cfg.moe.expert_capacity, cfg.moe.block_size) == (
        DELETE, SPLIT, 48, 32)


def test_generation_configs_two_stop_ids_end_a_row(tmp_path):
    """The fixture's tiny build with 2.2's located generation_config.json (eos_token_id
    [156892, 156900]): both are the checkpoint's stop ids; the preset's edit loop runs on it."""
    import json

    from engine import load_model

    root = published.build_from_config(published.config(FIXTURE), str(tmp_path / "m"))
    with open(f"{root}/generation_config.json", "w") as f:
        json.dump({"eos_token_id": [156892, 156900]}, f)
    model, _ = load_model(root, dtype=torch.float32, tokenizer=False)
    assert model.config.stop_token_ids == [156892, 156900]
    eng_cfg, smp = preset("llada2.2")
    from dataclasses import replace

    outs = Engine(model, replace(eng_cfg, token_budget=512)).generate(
        [[6, 7, 8], [9] * 40], replace(smp, max_new_tokens=8))
    assert [o.error for o in outs] == [None, None] and all(len(o.token_ids) <= 8 for o in outs)


def test_cli_flags_and_preset():
    """--edit-ops, --edit-ops-variant, --max-steps-per-block (generated from SamplingParams, as
    --edit-threshold) and --preset llada2.2 with a flag beside it winning."""
    from pipeline.cli import build_config, parse_args

    s = build_config(parse_args(["--edit-ops", "--edit-ops-variant", "sglang", "--max-steps-per-block", "50"]),
                     0).sampling
    assert (s.edit_ops, s.edit_ops_variant, s.max_steps_per_block) == (True, "sglang", 50)
    cfg = build_config(parse_args(["--preset", "llada2.2", "--threshold", "0.7"]), 0)
    assert (cfg.engine.block_length, cfg.sampling.edit_ops, cfg.sampling.threshold, cfg.sampling.edit_threshold) == (
        32, True, 0.7, 0.0)
