"""Issue 27: LLaDA2.0 / LLaDA2.1 (model_type llada2_moe) exact against their published code.

`PublishedLLaDA2` is written from the published modeling_llada2_moe.py, reading the
weights under their checkpoint names: fused query_key_value split per head, per-head QK
RMSNorm, partial rotate-half RoPE, eager attention under an additive 0/-inf mask, the
dense output projection, LLaDA2MoeGate (sigmoid, expert bias for selection, top-2 sum per
group, topk_group groups, renormalised, routed_scaling_factor) and moe_infer, shared
experts, first_k_dense_replace dense layers; float64 throughout. `generate_20` and
`generate_21` transcribe the published generate() loops of LLaDA2.0-mini and
LLaDA2.1-mini (one request, no cache, the whole window re-forwarded every step) with the
two deliberate differences: greedy at temperature 0 (2.0's file samples) and a real
block-causal mask (2.1's adds its 0/1 mask to the scores). The engine's mixed batches,
under every scheduler with the persistent cache, must give exactly their tokens.

The model is LLaDA2.0-mini's published file set (tests/published.py: config.json with its
sizes shrunk, the published tensor names; LLaDA2.1-mini's config.json is the same file),
its output head sharpened (HEAD_SCALE) so that over the published 157k-token vocabulary
thresholds, edits and stops fire as a trained model's do; the stop id is a token it emits
often. `tiny_llada2` (a hand-written config of 64 tokens) stays for one mechanism the
random published model never shows: an edit that writes the mask token."""
from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import published
from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model, load_model
from engine.models.families.moe import MoESpec

torch.set_num_threads(1)
L = 4
EOS, MASK = 12, 63  # tiny_llada2's
LLADA2 = "inclusionAI__LLaDA2.0-mini"  # LLaDA2.1-mini's config.json is the same file
HEAD_SCALE = 10.0


def tiny_llada2(**kw) -> ModelConfig:
    """Layer 0 dense, layer 1 eight experts in 4 groups (2 kept), top-2, a shared expert;
    a 64-token vocabulary (test_edits_that_write_the_mask_token_are_decoded_again)."""
    spec = MoESpec(num_experts=8, top_k=2, expert_size=16, dense_size=48, dense_layers=(True, False), shared_size=16,
                   score="sigmoid", expert_bias=True, bias_in_weights=False, renormalize=True, scaling=2.5, n_group=4,
                   topk_group=2)
    base = dict(model_type="llada2_moe", vocab_size=64, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
                intermediate_size=48, mask_token_id=MASK, eos_token_id=EOS, max_seq_len=1024, moe=spec, qk_norm=True,
                partial_rotary_factor=0.5, rope_theta=600000.0, rms_norm_eps=1e-6, attn_out_bias=True,
                dllm_attention="block_causal")
    return ModelConfig(**{**base, **kw})


class PublishedLLaDA2:
    """LLaDA2MoeModelLM.forward (eager attention, no cache) over the checkpoint tensors."""

    def __init__(self, model):
        cfg = model.config
        self.w = {cfg.family.checkpoint_name(n): p.detach().double() for n, p in model.named_parameters()}
        self.hf = cfg.to_hf()

    def rms(self, x, key):
        return self.w[key] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.hf["rms_norm_eps"]))

    def mlp(self, x, p):
        w = self.w
        return F.linear(F.silu(F.linear(x, w[p + "gate_proj.weight"])) * F.linear(x, w[p + "up_proj.weight"]),
                        w[p + "down_proj.weight"])

    def gate(self, x, p):  # LLaDA2MoeGate.forward
        hf = self.hf
        logits = F.linear(x, self.w[p + "mlp.gate.weight"])
        scores = torch.sigmoid(logits)
        routing = scores + self.w[p + "mlp.gate.expert_bias"]
        n, E, G = x.shape[0], hf["num_experts"], hf["n_group"]
        group_scores = routing.view(n, G, -1).topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=hf["topk_group"], dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(n, G, E // G).reshape(n, -1)
        _, topk_idx = torch.topk(routing.masked_fill(~score_mask.bool(), float("-inf")), k=hf["num_experts_per_tok"],
                                 dim=-1)
        w = torch.gather(scores, 1, topk_idx)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) if hf["num_experts_per_tok"] > 1 else w
        return topk_idx, w * hf["routed_scaling_factor"]

    def moe_infer(self, x, topk_ids, topk_weight, p):
        idxs = topk_ids.view(-1).argsort()
        sorted_tokens = x[idxs // topk_ids.shape[1]]
        counts = torch.bincount(topk_ids.view(-1), minlength=self.hf["num_experts"]).tolist()
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n:
                outs.append(self.mlp(sorted_tokens[start:start + n], p + f"mlp.experts.{e}."))
                start += n
        outs = torch.cat(outs)
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        return (new_x.view(*topk_ids.shape, -1) * topk_weight.unsqueeze(-1)).sum(dim=1)

    def __call__(self, ids, keep):
        """Logits [T, V] of ids [T] at positions 0..T-1 under the boolean mask keep [T, T]."""
        hf, w = self.hf, self.w
        T, H, Hkv = ids.shape[0], hf["num_attention_heads"], hf["num_key_value_heads"]
        D = hf["head_dim"]
        r = int(D * hf["partial_rotary_factor"])
        inv = 1.0 / (hf["rope_theta"] ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
        emb = torch.cat([torch.arange(T, dtype=torch.float64)[:, None] * inv] * 2, -1)
        cos, sin = emb.cos(), emb.sin()
        additive = torch.zeros(T, T, dtype=torch.float64).masked_fill(~keep, float("-inf"))

        def rotary(t):  # apply_rotary_pos_emb: rotate_half on the first r dims, the rest passes
            a, rest = t[..., :r], t[..., r:]
            half = torch.cat([-a[..., r // 2:], a[..., : r // 2]], -1)
            return torch.cat([a * cos + half * sin, rest], -1)

        h = w["model.word_embeddings.weight"][ids]
        for i in range(hf["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = self.rms(h, p + "input_layernorm.weight")
            qkv = F.linear(x, w[p + "attention.query_key_value.weight"]).view(T, H + 2 * Hkv, D)
            q, k, v = qkv.split([H, Hkv, Hkv], dim=-2)
            q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
            q = self.rms(q, p + "attention.query_layernorm.weight")
            k = self.rms(k, p + "attention.key_layernorm.weight")
            q, k = rotary(q), rotary(k)
            k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
            att = torch.softmax(q @ k.transpose(1, 2) * D ** -0.5 + additive, -1) @ v
            o = F.linear(att.transpose(0, 1).reshape(T, H * D), w[p + "attention.dense.weight"],
                         w.get(p + "attention.dense.bias"))
            h = h + o
            x = self.rms(h, p + "post_attention_layernorm.weight")
            if i < hf["first_k_dense_replace"]:
                y = self.mlp(x, p + "mlp.")
            else:
                y = self.moe_infer(x, *self.gate(x, p), p)
                if hf["num_shared_experts"] is not None:
                    y = y + self.mlp(x, p + "mlp.shared_experts.")
            h = h + y
        return F.linear(self.rms(h, "model.norm.weight"), w["lm_head.weight"])


def block_mask(n_blocks: int, block_length: int) -> torch.Tensor:
    """generate()'s block_diffusion_attention_mask, as booleans (True: attended)."""
    m = torch.tril(torch.ones(n_blocks, n_blocks))
    return m.repeat_interleave(block_length, 0).repeat_interleave(block_length, 1).bool()


def sample_greedy(logits):
    """_sample_with_temperature_topk_topp at temperature 0 (2.1's; 2.0's samples instead)."""
    probs = F.softmax(logits, dim=-1)
    token = torch.argmax(logits, dim=-1, keepdim=True)
    return token.squeeze(-1), torch.gather(probs, -1, token).squeeze(-1)


def num_transfer_tokens(block_length, steps):
    base, rem = divmod(block_length, steps)
    t = torch.full((steps,), base, dtype=torch.int64)
    t[:rem] += 1
    return t


def _answer(x, p, gen_length, eos_id):
    ans = x[p:p + gen_length]
    hits = (ans == eos_id).nonzero().flatten()
    return ans[: (int(hits[0]) + 1 if len(hits) else gen_length)].tolist()


def generate_20(ref, prompt, gen_length, block_length, steps, threshold, eos_id=EOS, mask_id=MASK):
    """LLaDA2.0-mini's generate() (temperature 0, greedy; minimal_topk=1)."""
    steps = min(steps, gen_length // 1)
    p = len(prompt)
    num_blocks = (p + gen_length + block_length - 1) // block_length
    mask = block_mask(num_blocks, block_length)
    x = torch.full((num_blocks * block_length,), mask_id, dtype=torch.long)
    x[:p] = torch.tensor(prompt)
    schedule = num_transfer_tokens(block_length, steps)
    for num_block in range(p // block_length, num_blocks):
        end = (num_block + 1) * block_length
        cur_x = x[:end]
        for step in range(steps):
            active = cur_x[-block_length:] == mask_id
            if active.sum() == 0:
                break
            x0, x0_p = sample_greedy(ref(cur_x, mask[:end, :end])[-block_length:])
            k = int(schedule[step])
            transfer = torch.zeros_like(x0, dtype=torch.bool)
            confidence = torch.where(active, x0_p, -torch.inf)
            high = confidence > threshold
            if int(high.sum()) >= k:
                transfer = high
            else:
                transfer[torch.topk(confidence, k=min(k, int(active.sum()))).indices] = True
            cur_x[-block_length:][transfer] = x0[transfer]
        if (x[p:end] == eos_id).any():
            break
    return _answer(x, p, gen_length, eos_id)


def generate_21(ref, prompt, gen_length, block_length, threshold, editing_threshold, max_post_steps=16,
                eos_id=EOS, mask_id=MASK, num_to_transfer=1):
    """LLaDA2.1-mini's generate() (temperature 0; eos_early_stop=True, which stops after the
    block holding the first EOS and returns the same tokens)."""
    p = len(prompt)
    num_blocks = (p + gen_length + block_length - 1) // block_length
    mask = block_mask(num_blocks, block_length)
    x = torch.full((num_blocks * block_length,), mask_id, dtype=torch.long)
    x[:p] = torch.tensor(prompt)
    for num_block in range(p // block_length, num_blocks):
        end = (num_block + 1) * block_length
        cur_x = x[:end]
        block_start = num_block * block_length
        post_steps = 0
        while True:
            old = cur_x[-block_length:].clone()
            active = cur_x[-block_length:] == mask_id
            if not active.any():
                post_steps += 1
            if post_steps > max_post_steps:
                break
            prompt_in_block = torch.zeros(block_length, dtype=torch.bool)
            if block_start < p:
                prompt_in_block[: min(p - block_start, block_length)] = True
            x0, x0_p = sample_greedy(ref(cur_x, mask[:end, :end])[-block_length:])
            mask_transfer = torch.zeros_like(x0, dtype=torch.bool)
            if active.sum() > 0:
                conf = torch.where(active, x0_p, -torch.inf)
                high = (conf > threshold) & active
                if int(high.sum()) >= num_to_transfer:
                    mask_transfer = high
                else:
                    mask_transfer[torch.topk(conf, k=min(num_to_transfer, int(active.sum()))).indices] = True
            editable = ~active & ~prompt_in_block
            edit_conf = torch.where(editable, x0_p, -torch.inf)
            editing = (edit_conf > editing_threshold) & editable & (x0 != old)
            final = mask_transfer | editing
            if final.any():
                cur_x[-block_length:][final] = x0[final]
            if active.sum() == 0 and not editing.any():
                break
        generated = x[p:end]
        if (generated == mask_id).sum() == 0 and (generated == eos_id).any():
            break
    return _answer(x, p, gen_length, eos_id)


def published_tokens(out, eos_id=EOS):
    """The engine returns the tokens before the stop token; the published loop includes it."""
    return out[:-1] if out and out[-1] == eos_id else out


def published_llada2(root: str):
    """(folder, model): LLaDA2.0-mini's published files built in `root` (tests/published.py,
    sizes shrunk) and loaded in float64, the output head scaled by HEAD_SCALE: random weights
    over the published 157k-token vocabulary are never confident, so no threshold, edit or
    stop would fire; a sharper head makes them fire as a trained model's do."""
    folder = published.build(LLADA2, root)
    model, _ = load_model(folder, dtype=torch.float64, tokenizer=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(HEAD_SCALE)
    return folder, model


def most_emitted(outs) -> int:
    """The token the outputs (token lists) hold most: a stop id the random model emits."""
    return Counter(t for o in outs for t in o).most_common(1)[0][0]


def with_biases(model):
    """The gate's expert_bias and a dense bias where the config has one: not zero, so they count."""
    with torch.no_grad():
        for layer in model.layers:
            if getattr(layer, "expert_bias", None) is not None:
                layer.expert_bias.normal_(0, 0.5, generator=torch.Generator().manual_seed(3))
            if layer.o.bias is not None:
                layer.o.bias.normal_(0, 0.1, generator=torch.Generator().manual_seed(4))
    return model


@pytest.fixture(scope="module")
def pub(tmp_path_factory):
    """The published LLaDA2.0-mini build in float64 (head sharpened, biases drawn), its
    reference, mask id, and a stop id: the token the published 2.1 loop emits most on the
    workload without one."""
    _, model = published_llada2(str(tmp_path_factory.mktemp("llada2")))
    ref = PublishedLLaDA2(with_biases(model))
    mask = model.config.mask_token_id
    prompts, jobs = workload()
    free = [generate_21(ref, p, n, L, 0.15, 1.0, eos_id=-1, mask_id=mask) for p, (_, n) in zip(prompts, jobs)]
    return SimpleNamespace(model=model, ref=ref, mask=mask, eos=most_emitted(free))


@pytest.fixture(scope="module")
def model(pub):
    return pub.model


@pytest.fixture(scope="module")
def ref(pub):
    return pub.ref


def test_forward_equals_the_published_model(model, ref):
    ids = torch.randint(0, model.config.vocab_size, (13,), generator=torch.Generator().manual_seed(1))
    keep = block_mask(4, L)[:13, :13]
    with torch.no_grad():
        ours = model(ids[None], torch.arange(13)[None], keep[None, None])[0]
    torch.testing.assert_close(ours, ref(ids, keep), rtol=1e-12, atol=1e-12)


# version, SamplingParams, steps_per_block: 2.0 with its schedule floor (S < L and S = L),
# 2.1's loop without editing (edit_threshold 1.0: no probability exceeds it) and with it
SETTINGS = {"2.0": (dict(threshold=0.15), 2), "2.0-S4": (dict(threshold=0.1), 4),
            "2.1": (dict(threshold=0.15, edit_threshold=1.0), 4), "2.1-edit": (dict(threshold=0.15, edit_threshold=0.1), 4),
            "2.1-edit-post1": (dict(threshold=0.2, edit_threshold=0.05, max_post_steps=1), 4)}


def workload(n=12, seed=0):
    rng = random.Random(seed)
    names = list(SETTINGS)
    prompts = [[rng.randrange(13, 60) for _ in range(rng.randint(1, 11))] for _ in range(n)]
    jobs = [(names[i % len(names)], rng.randint(1, 4) * L - rng.randint(0, 2)) for i in range(n)]
    return prompts, jobs


def reference(pub, prompt, name, max_new):
    kw, S = SETTINGS[name]
    ids = dict(eos_id=pub.eos, mask_id=pub.mask)
    if name.startswith("2.0"):
        out = generate_20(pub.ref, prompt, max_new, L, S, kw["threshold"], **ids)
    else:
        out = generate_21(pub.ref, prompt, max_new, L, kw["threshold"], kw["edit_threshold"],
                          kw.get("max_post_steps", 16), **ids)
    return published_tokens(out, pub.eos)


@pytest.fixture(scope="module")
def references(pub):
    prompts, jobs = workload()
    return prompts, jobs, [reference(pub, p, name, n) for p, (name, n) in zip(prompts, jobs)]


def test_the_workload_exercises_every_rule(references, pub):
    """Stops, several blocks, and edits all happen (else equality would prove little)."""
    prompts, jobs, outs = references
    ref, ids = pub.ref, dict(eos_id=pub.eos, mask_id=pub.mask)
    assert any(len(o) < n for o, (_, n) in zip(outs, jobs))  # some row stopped at EOS
    assert any(len(o) > L for o in outs)
    assert any(n < S for (name, n) in jobs for S in [SETTINGS[name][1]] if name.startswith("2.0"))  # min(steps, gen)
    edited = [generate_21(ref, p, n, L, 0.15, 0.1, **ids) != generate_21(ref, p, n, L, 0.15, 1.0, **ids)
              for p, (name, n) in zip(prompts, jobs) if name == "2.1-edit"]
    assert any(edited)
    capped = [generate_21(ref, p, n, L, 0.2, 0.05, 1, **ids) != generate_21(ref, p, n, L, 0.2, 0.05, 16, **ids)
              for p, (name, n) in zip(prompts, jobs) if name == "2.1-edit-post1"]
    assert any(capped)  # max_post_steps ends some blocks


@pytest.mark.parametrize("steps", [2, 4])
@pytest.mark.parametrize("scheduler", ["blockserve", "static", "sequential"])
def test_mixed_batches_equal_the_published_loops(pub, references, scheduler, steps):
    """Rows of 2.0 (threshold + schedule floor) and 2.1 (with and without editing) in one
    batch, persistent cache, under every scheduler: the published tokens exactly."""
    prompts, jobs, outs = references
    pick = [i for i, (name, _) in enumerate(jobs) if SETTINGS[name][1] == steps]
    cfg = EngineConfig(block_length=L, steps_per_block=steps, cache="persistent", scheduler=scheduler,
                       token_budget=48, max_batch_size=4)
    eng = Engine(pub.model, cfg, record_batches=True)
    assert not eng.full_canvas
    params = [SamplingParams(max_new_tokens=jobs[i][1], policy="threshold", stop_token_ids=[pub.eos],
                             **SETTINGS[jobs[i][0]][0]) for i in pick]
    got = eng.generate([prompts[i] for i in pick], params)
    if scheduler != "sequential":
        assert max(len(b.request_ids) for b in eng.batch_log) > 1
    if scheduler == "blockserve" and steps == 4:  # a row evicted at a block boundary and readmitted
        assert eng.scheduler.preemptions > 0
    assert [o.token_ids for o in got] == [outs[i] for i in pick]
    assert all(o.prompt_token_ids == prompts[i] for o, i in zip(got, pick))


def test_step_advance_and_other_caches_give_the_same_tokens(pub, references):
    """Admission at any step, and the refresh / no cache: the same tokens."""
    same_tokens_under_other_caches(pub, references)


def same_tokens_under_other_caches(pub, references):
    """The workload's rows of 4 steps under step advance (persistent), refresh and no cache
    give the reference tokens (test_block_routing's model too)."""
    prompts, jobs, outs = references
    pick = [i for i, (name, _) in enumerate(jobs) if SETTINGS[name][1] == 4]
    params = [SamplingParams(max_new_tokens=jobs[i][1], stop_token_ids=[pub.eos], **SETTINGS[jobs[i][0]][0])
              for i in pick]
    for cache, advance in (("persistent", "step"), ("refresh", "block"), ("none", "block")):
        eng = Engine(pub.model, EngineConfig(block_length=L, steps_per_block=4, cache=cache, advance=advance,
                                         token_budget=80, max_batch_size=4))
        assert [o.token_ids for o in eng.generate([prompts[i] for i in pick], params)] == [outs[i] for i in pick]


def test_edits_that_write_the_mask_token_are_decoded_again():
    """LLaDA2.1's published loop may edit a decoded token into the mask token (the model's
    proposal, over edit_threshold): that position is decoded again, and the block ends only
    when it holds no mask. A model (seed 6) whose workload does that many times: every
    scheduler gives the published tokens (the engine once committed such a block at its
    step cap, masks and all)."""
    model = build_model(tiny_llada2(), dtype=torch.float64, seed=6)
    ref = PublishedLLaDA2(model)
    remasked = []

    class Watch:  # the published loop's forwards: a position decoded at one step and masked at the next
        prev = None

        def __call__(self, x, keep):
            blk = x[-L:].tolist()
            if self.prev is not None and len(self.prev) == len(x):
                remasked.extend(j for j, (a, b) in enumerate(zip(self.prev[-L:], blk)) if a != MASK and b == MASK)
            self.prev = x.tolist()
            return ref(x, keep)

    prompts, jobs = workload()
    pick = [i for i, (name, _) in enumerate(jobs) if name.startswith("2.1")]
    outs = [published_tokens(generate_21(Watch(), prompts[i], jobs[i][1], L, SETTINGS[jobs[i][0]][0]["threshold"],
                                         SETTINGS[jobs[i][0]][0]["edit_threshold"],
                                         SETTINGS[jobs[i][0]][0].get("max_post_steps", 16))) for i in pick]
    assert len(remasked) > 3
    params = [SamplingParams(max_new_tokens=jobs[i][1], stop_token_ids=[EOS], **SETTINGS[jobs[i][0]][0]) for i in pick]
    for scheduler in ("blockserve", "static", "sequential"):
        eng = Engine(model, EngineConfig(block_length=L, steps_per_block=4, cache="persistent", scheduler=scheduler,
                                         token_budget=48, max_batch_size=4))
        assert [o.token_ids for o in eng.generate([prompts[i] for i in pick], params)] == outs, scheduler


def test_editing_is_refused_on_other_families_and_d2f_on_llada2(model):
    m = build_model(ModelConfig.tiny("llada"), dtype=torch.float64)
    out = Engine(m, EngineConfig(block_length=L, steps_per_block=L)).generate([[5, 6]], SamplingParams(
        max_new_tokens=4, edit_threshold=0.5))[0]
    assert out.finish_reason == "error" and "edit_threshold" in out.error
    bad, good = Engine(model, EngineConfig(block_length=L, steps_per_block=L, cache="persistent")).generate(
        [[20, 21, 22], [20, 21, 22]], [SamplingParams(max_new_tokens=8, block_add_threshold=0.5),
                                       SamplingParams(max_new_tokens=8)])
    assert bad.finish_reason == "error" and "D2F" in bad.error and good.finish_reason in ("stop", "length")


# the published LLaDA2.x file sets vendored under tests/published/ (tests/published.py)
LLADA2_FOLDERS = [f for f in published.folders() if published.config(f)["model_type"] == "llada2_moe"]


@pytest.mark.parametrize("change,message", [({"use_sliding_window": True}, "use_sliding_window"),
                                            ({"score_function": "softmax"}, "score_function"),
                                            ({"head_dim": 64}, "head_dim"), ({"num_nextn_predict_layers": 1},
                                                                              "num_nextn_predict_layers"),
                                            ({"moe_capacity": 2}, "moe_capacity")])
def test_llada2_settings_the_engine_would_ignore_are_refused(change, message):
    from engine.models.families import BlockLayout, ConfigRefused

    assert LLADA2_FOLDERS
    for folder in LLADA2_FOLDERS:
        hf = published.config(folder)
        cfg = ModelConfig.from_hf(hf)  # the published keys are all accounted for
        # config.json names no mask nor eos id: generate()'s defaults 156895 / 156892
        assert (cfg.mask_token_id, cfg.eos_token_id, cfg.family.blocks, cfg.block_causal) == (
            156895, 156892, BlockLayout.ABSOLUTE, True)
        with pytest.raises(ConfigRefused, match=message):
            ModelConfig.from_hf({**hf, **change})


@pytest.mark.parametrize("folder", LLADA2_FOLDERS)
def test_published_layout_loads_in_bfloat16_with_float32_routers(folder, tmp_path):
    """The tiny build of the published files (its 10-row job: tests/test_published.py) in
    bfloat16: the routers (mlp.gate.weight, mlp.gate.expert_bias) stay float32, every other
    tensor is bfloat16; ids and vocabulary as published."""
    from engine import load_model

    root = published.build(folder, str(tmp_path / folder))
    model, tok = load_model(root, dtype=torch.bfloat16)
    cfg = model.config
    # vocab_size: config.json; <|mask|> 156895: generate()'s default (config.json names none);
    # 156892: tokenizer_config.json's eos_token <|endoftext|>, config.json's pad_token_id
    assert (cfg.model_type, cfg.mask_token_id, cfg.stop_token_ids, cfg.vocab_size) == ("llada2_moe", 156895,
                                                                                       [156892], 157184)
    assert tok.convert_tokens_to_ids("<|mask|>") == 156895
    dtypes = {cfg.family.checkpoint_name(n): p.dtype for n, p in model.named_parameters()}
    routers = {k for k in dtypes if k.endswith((".mlp.gate.weight", ".mlp.gate.expert_bias"))}
    assert routers == {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.expert_bias"}  # layer 0 dense
    assert {k: v for k, v in dtypes.items() if v != torch.bfloat16} == dict.fromkeys(routers, torch.float32)
