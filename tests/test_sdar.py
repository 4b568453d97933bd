"""Issue 38: SDAR / TraDo (model_type sdar, sdar_moe) exact against their published code.

`PublishedSDAR` is written from the published modeling_sdar.py / modeling_sdar_moe.py over
the weights under their checkpoint names: q/k/v/o projections, per-head q_norm / k_norm
before rotate-half RoPE, SDPA under the caller's 0/1 block mask made additive, a
DynamicCache whose `store_kv=True` forwards append and whose `store_kv=False` forwards
only read it, SDARMLP, and SDARMoeSparseMoeBlock's loop (softmax router, top-k,
renormalised when norm_topk_prob, one_hot / where per expert, index_add); float64
throughout (the published router's float32 softmax is float64 here, as the engine routes a
float64 model). `block_diffusion_generate` transcribes JetAstra/SDAR's generate.py (prefill
of the prompt's complete blocks, each later block denoised up to steps times and stored by
one more forward, the three remasking strategies, stop ids checked in x[prompt_length:]),
one request at a time, with the two choices of the authors' evaluation decoder
(huggingface_bd3.py): greedy at temperature 0 with the confidence the probability of the
argmax over the full vocabulary, and `x0 = where(mask_index, x0, cur_x)` (a top-k that
reaches past the masks writes nothing). The engine's ONE mixed batch of 12 prompts under
blockserve (with preemption), static and sequential, persistent cache, at block lengths 4
and 16, gives exactly its tokens."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import published
from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model
from engine.checkpoint import Checkpoint
from engine.decoding import RowParams, select
from engine.models.families import BlockLayout, ConfigRefused, ThresholdRule
from engine.models.families.moe import MoESpec

torch.set_num_threads(1)
VOCAB, MASK = 96, 95
# two tokens the seeded model below emits now and then stand for <|endoftext|> 151643 and
# <|im_end|> 151645 (a 152k vocabulary costs ~0.4 CPU-s a step in float64)
EOS, IM_END = 64, 28
STOPS = [IM_END, EOS]  # generation_config.json's order


def tiny_sdar(experts: bool = False, **kw) -> ModelConfig:
    """Qwen3's layer at toy size: head_dim 12 (not 32 / 4), GQA 4:2, theta 1e6, untied
    embeddings; MoE: 8 experts (top-2, renormalised) in every layer."""
    base = dict(model_type="sdar_moe" if experts else "sdar", vocab_size=VOCAB, hidden_size=32, n_layers=2, n_heads=4,
                n_kv_heads=2, head_dim=12, intermediate_size=48, mask_token_id=MASK, eos_token_id=EOS,
                max_seq_len=1024, qk_norm=True, rope_theta=1e6, rms_norm_eps=1e-6,
                dllm_attention="block_causal")
    if experts:
        base["moe"] = MoESpec(num_experts=8, top_k=2, expert_size=16, dense_size=48, dense_layers=(False, False),
                              score="softmax", renormalize=True)
    return ModelConfig(**{**base, **kw})


class PublishedSDAR:
    """SDARForCausalLM / SDARMoeForCausalLM.forward over the checkpoint tensors; `cache` is
    a DynamicCache ({layer: (K, V)})."""

    def __init__(self, model):
        cfg = model.config
        self.w = {cfg.family.checkpoint_name(n): p.detach().double() for n, p in model.named_parameters()}
        self.hf = cfg.to_hf()
        self.forwards = 0

    def rms(self, x, key):
        return self.w[key] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.hf["rms_norm_eps"]))

    def mlp(self, x, p):  # SDARMLP / SDARMoeMLP
        w = self.w
        return F.linear(F.silu(F.linear(x, w[p + "gate_proj.weight"])) * F.linear(x, w[p + "up_proj.weight"]),
                        w[p + "down_proj.weight"])

    def sparse_moe_block(self, x, p):  # SDARMoeSparseMoeBlock.forward
        hf = self.hf
        router_logits = F.linear(x, self.w[p + "mlp.gate.weight"])
        routing_weights = F.softmax(router_logits, dim=1, dtype=x.dtype)
        routing_weights, selected = torch.topk(routing_weights, hf["num_experts_per_tok"], dim=-1)
        if hf["norm_topk_prob"]:
            routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        expert_mask = F.one_hot(selected, num_classes=hf["num_experts"]).permute(2, 1, 0)
        for e in range(hf["num_experts"]):
            idx, top_x = torch.where(expert_mask[e])
            cur = self.mlp(x[top_x], p + f"mlp.experts.{e}.") * routing_weights[top_x, idx, None]
            out.index_add_(0, top_x, cur)
        return out

    def sparse(self, i):
        hf = self.hf
        return "num_experts" in hf and i not in (hf.get("mlp_only_layers") or []) and (
            (i + 1) % hf.get("decoder_sparse_step", 1) == 0)

    def __call__(self, ids, pos, mask, cache=None, store_kv=False):
        """Logits [T, V] of ids [T] at positions `pos` under the 0/1 mask [T, K] (K: the cached
        columns and these)."""
        self.forwards += 1
        hf, w = self.hf, self.w
        T, H, Hkv, D = ids.shape[0], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
        inv = 1.0 / (hf["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        emb = torch.cat([pos.double()[:, None] * inv] * 2, -1)
        cos, sin = emb.cos(), emb.sin()

        def rotary(t):
            return t * cos + torch.cat([-t[..., D // 2:], t[..., : D // 2]], -1) * sin

        mask = mask.double()  # the published 0/1 mask, made additive (1 -> 0, 0 -> finfo.min)
        additive = torch.where(mask > 0, torch.zeros_like(mask), torch.full_like(mask, torch.finfo(torch.float64).min))
        h = w["model.embed_tokens.weight"][ids]
        for i in range(hf["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = self.rms(h, p + "input_layernorm.weight")
            q = self.rms(F.linear(x, w[p + "self_attn.q_proj.weight"]).view(T, H, D), p + "self_attn.q_norm.weight")
            k = self.rms(F.linear(x, w[p + "self_attn.k_proj.weight"]).view(T, Hkv, D), p + "self_attn.k_norm.weight")
            v = F.linear(x, w[p + "self_attn.v_proj.weight"]).view(T, Hkv, D)
            q, k, v = rotary(q.transpose(0, 1)), rotary(k.transpose(0, 1)), v.transpose(0, 1)
            if cache is not None and i in cache:  # past_key_value.update (store_kv) or a read-only concat
                k, v = torch.cat([cache[i][0], k], 1), torch.cat([cache[i][1], v], 1)
            if cache is not None and store_kv:
                cache[i] = (k, v)
            k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
            att = torch.softmax(q @ k.transpose(1, 2) * D ** -0.5 + additive, -1) @ v
            h = h + F.linear(att.transpose(0, 1).reshape(T, H * D), w[p + "self_attn.o_proj.weight"])
            x = self.rms(h, p + "post_attention_layernorm.weight")
            h = h + (self.sparse_moe_block(x, p) if self.sparse(i) else self.mlp(x, p + "mlp."))
        h = self.rms(h, "model.norm.weight")
        return F.linear(h, w.get("lm_head.weight", w["model.embed_tokens.weight"]))


def num_transfer_tokens(block_length, steps):
    base, rem = divmod(block_length, steps)
    t = torch.full((steps,), base, dtype=torch.int64)
    t[:rem] += 1
    return t


def transfer_index(strategy, cur_x, x0_p, k, threshold, mask_id=MASK):
    """One step's selection of generate.py (batch of one row)."""
    mask_index = cur_x == mask_id
    transfer = torch.zeros_like(mask_index)
    if strategy == "sequential":
        first = int(mask_index.nonzero()[0].min())
        transfer[first:first + k] = True
    elif strategy == "low_confidence_static":
        confidence = torch.where(mask_index, x0_p, -torch.inf)
        transfer[torch.topk(confidence, k).indices] = True
    elif strategy == "low_confidence_dynamic":
        confidence = torch.where(mask_index, x0_p, -torch.inf)
        high = confidence > threshold
        if int(high.sum()) >= k:
            transfer = high
        else:
            transfer[torch.topk(confidence, k).indices] = True
    else:
        raise ValueError(strategy)
    return transfer


def entropy_bounded(cur_x, probs, eb_threshold, mask_id=MASK):
    """JetEngine's entropy_bounded (Labman42/JetEngine jetengine/engine/scheduler.py,
    postprocess_loop): the masks' entropies of `probs` (clamped at 1e-12), sorted ascending;
    k = searchsorted(cumsum, eb_threshold) (how many running sums stay below it), at least
    1; the k lowest-entropy masks. The sort is stable here: ties go to the lower position
    (JetEngine's torch.sort leaves their order to the kernel)."""
    mask_index = cur_x == mask_id
    P = probs[mask_index].clamp_min(1e-12)
    entropies = -(P * P.log()).sum(-1)
    ent_sorted, order = torch.sort(entropies, descending=False, stable=True)
    k = max(1, int(torch.searchsorted(torch.cumsum(ent_sorted, 0), torch.tensor(eb_threshold, dtype=P.dtype))))
    transfer = torch.zeros_like(mask_index)
    transfer[mask_index.nonzero(as_tuple=True)[0][order[:k]]] = True
    return transfer


def block_diffusion_generate(model, prompt, gen_length, block_length, steps, strategy, threshold=0.85,
                             stop_ids=STOPS, mask_id=MASK, trace=None):
    """generate.py's block_diffusion_generate (greedy; see the module docstring); returns the
    answer as the engine returns it: x[p:p + gen_length] before its first stop id."""
    L, p = block_length, len(prompt)
    cache = {}
    num_blocks = (p + gen_length + L - 1) // L
    bm = torch.tril(torch.ones(num_blocks, num_blocks)).repeat_interleave(L, 0).repeat_interleave(L, 1)
    position_ids = torch.arange(num_blocks * L)
    x = torch.full((num_blocks * L,), mask_id, dtype=torch.long)
    x[:p] = torch.tensor(prompt)
    prefill_blocks = p // L
    if prefill_blocks:
        n = prefill_blocks * L
        model(x[:n], position_ids[:n], bm[:n, :n], cache, store_kv=True)
    k_sched = num_transfer_tokens(L, steps)
    for nb in range(prefill_blocks, num_blocks):
        cols = slice(nb * L, (nb + 1) * L)
        cur_x, mask, pos = x[cols].clone(), bm[cols, :(nb + 1) * L], position_ids[cols]
        for step in range(steps + 1):
            mask_index = cur_x == mask_id
            if mask_index.sum() == 0:
                model(cur_x, pos, mask, cache, store_kv=True)  # the block's K/V, stored by one more forward
                break
            logits = model(cur_x, pos, mask, cache, store_kv=False)
            probs = torch.softmax(logits, -1)
            x0 = logits.argmax(-1)
            x0_p = probs.gather(-1, x0[:, None]).squeeze(-1)
            x0 = torch.where(mask_index, x0, cur_x)
            if strategy == "entropy_bounded":  # JetEngine's, no schedule; `threshold` is its eb_threshold
                k, transfer = 0, entropy_bounded(cur_x, probs, threshold)
            else:
                k = int(k_sched[step])  # an IndexError at step == steps, as published, if masks remain
                transfer = transfer_index(strategy, cur_x, x0_p, k, threshold)
            if trace is not None:
                high = int((torch.where(mask_index, x0_p, -torch.inf) > threshold).sum())
                trace.append(dict(strategy=strategy, k=k, masks=int(mask_index.sum()), high=high,
                                  taken=int((transfer & mask_index).sum()), step=step, block=nb,
                                  lead=max(0, p - nb * L)))
            cur_x[transfer] = x0[transfer]
        x[cols] = cur_x
        if any(s in x[p:] for s in stop_ids):
            break
    ans = x[p:p + gen_length].tolist()
    return next((ans[:j] for j, t in enumerate(ans) if t in stop_ids), ans)


# --- the workload ---------------------------------------------------------------------------

LENGTHS = [1, 3, 4, 6, 9, 13, 16, 18, 23, 29, 32, 37]  # < 4, = 4, < 16, = 16, 2 x 16, partial blocks
MAX_NEW = [9, 5, 3, 14, 20, 11, 7, 26, 17, 12, 4, 30]  # dynamic rows < steps: the schedule is not capped
STRATEGIES = ["low_confidence_dynamic", "low_confidence_static", "low_confidence_dynamic", "sequential"]
THRESHOLDS = [0.5, 0.3, 0.7, 0.4, 0.6, 0.2]
SHAPES = {4: 4, 16: 6}  # block length: steps (SDAR's default 4 / 4; 16 / 6: k = 3, 3, 3, 3, 2, 2)


def workload(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(14, MASK, (n,), generator=g).tolist() for n in LENGTHS]
    for i in (4, 7):  # a stop id in the prompt's last (partial) block: it never stops the row
        prompts[i][-1] = EOS if i == 4 else IM_END
    rows = [(STRATEGIES[i % len(STRATEGIES)], THRESHOLDS[i % len(THRESHOLDS)], n) for i, n in enumerate(MAX_NEW)]
    return prompts, rows


def params(row):
    strategy, threshold, max_new = row
    policy, remasking = {"low_confidence_dynamic": ("threshold", "low_confidence"),
                         "low_confidence_static": ("fixed", "low_confidence"),
                         "sequential": ("fixed", "sequential")}[strategy]
    return SamplingParams(max_new_tokens=max_new, policy=policy, remasking=remasking, threshold=threshold,
                          stop_token_ids=STOPS)


def sdar_model(cfg: ModelConfig, seed: int):
    """A random model that never proposes the mask token (a trained one does not: the
    published loop would raise an IndexError at step `steps` on a block still masked)."""
    model = build_model(cfg, dtype=torch.float64, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)  # peaked: some confidences pass the thresholds
        model.lm_head.weight[MASK] = 0.0
    return model


@pytest.fixture(scope="module")
def dense():
    return sdar_model(tiny_sdar(), seed=2)


@pytest.fixture(scope="module")
def moe():
    return sdar_model(tiny_sdar(True), seed=2)


def references(model, L, trace=None):
    ref = PublishedSDAR(model)
    prompts, rows = workload()
    outs = [block_diffusion_generate(ref, p, n, L, SHAPES[L], s, t, trace=trace) for p, (s, t, n) in zip(prompts, rows)]
    return prompts, rows, outs, ref.forwards


@pytest.fixture(scope="module")
def dense_refs(dense):
    traces = {L: [] for L in SHAPES}
    return {L: references(dense, L, traces[L]) for L in SHAPES}, traces


def run_engine(model, L, scheduler, token_budget, prompts, rows, cache="persistent", advance="block"):
    cfg = EngineConfig(block_length=L, steps_per_block=SHAPES[L], cache=cache, scheduler=scheduler, advance=advance,
                       token_budget=token_budget, max_batch_size=6)
    eng = Engine(model, cfg, record_batches=True)
    return eng, eng.generate(prompts, [params(r) for r in rows])


# --- tests -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["dense", "dense-tied", "moe", "moe-dense-layer"])
def test_forward_equals_the_published_model(kind, dense, moe):
    """The engine's layer against the transcription, under the block mask, and with the
    cache: a prefill stored, then a block read over it."""
    if kind == "moe-dense-layer":  # mlp_only_layers: layer 1 a dense SDARMoeMLP; no renormalisation
        spec = MoESpec(num_experts=8, top_k=2, expert_size=16, dense_size=48, dense_layers=(False, True))
        model = build_model(tiny_sdar(True, moe=spec), dtype=torch.float64, seed=3)
    elif kind == "dense-tied":
        model = build_model(tiny_sdar(tie_word_embeddings=True), dtype=torch.float64, seed=3)
    else:
        model = dense if kind == "dense" else moe
    ref = PublishedSDAR(model)
    ids = torch.randint(0, MASK, (13,), generator=torch.Generator().manual_seed(1))
    bm = torch.tril(torch.ones(4, 4)).repeat_interleave(4, 0).repeat_interleave(4, 1)[:13, :13]
    with torch.no_grad():
        ours = model(ids[None], torch.arange(13)[None], bm.bool()[None, None])[0]
    torch.testing.assert_close(ours, ref(ids, torch.arange(13), bm), rtol=1e-12, atol=1e-12)
    cache = {}
    ref(ids[:8], torch.arange(8), bm[:8, :8], cache, store_kv=True)
    torch.testing.assert_close(ours[8:12], ref(ids[8:12], torch.arange(8, 12), bm[8:12, :12], cache),
                               rtol=1e-12, atol=1e-12)


def test_the_workload_exercises_every_published_rule(dense_refs):
    """Equality below proves little unless the workload hits every rule of the published loop."""
    refs, traces = dense_refs
    prompts, rows, _, _ = refs[4]
    for L, (_, _, outs, _) in refs.items():
        trace = traces[L]
        assert any(len(o) < n for o, (_, _, n) in zip(outs, rows)), L  # some rows stopped at a stop id
        assert any(len(o) > L for o in outs), L  # several blocks
        lens = [len(p) for p in prompts]
        assert any(n < L for n in lens) and any(n % L == 0 for n in lens) and any(n > L and n % L for n in lens)
        assert any(t["lead"] > 0 and t["step"] == 0 for t in trace), L  # a partial prompt block decoded
        dyn = [t for t in trace if t["strategy"] == "low_confidence_dynamic"]
        assert any(t["high"] >= t["k"] and t["taken"] > t["k"] for t in dyn), L  # the threshold took more than k
        assert any(t["high"] < t["k"] <= t["masks"] and t["taken"] == t["k"] for t in dyn), L  # the floor's top-k
        assert any(t["taken"] < t["masks"] for t in dyn), L  # confidence is not 1 (a top_k=1 sampler's)
        assert max(t["step"] for t in trace) == SHAPES[L] - 1  # blocks that needed every step (steps + 1 forwards)
        for i in (4, 7):  # a stop id in the prompt's tail: the row goes on past its first block
            assert prompts[i][-1] in STOPS and len(outs[i]) > L - len(prompts[i]) % L, (L, i)
    assert {t["k"] for t in traces[16]} == {3, 2}  # 16 over 6 steps: 3, 3, 3, 3, 2, 2
    assert any(t["k"] > t["masks"] for t in traces[16])  # a top-k reaching past the masks writes nothing


@pytest.mark.parametrize("L", sorted(SHAPES))
@pytest.mark.parametrize("scheduler", ["blockserve", "static", "sequential"])
def test_one_mixed_batch_equals_the_published_loop(dense, dense_refs, scheduler, L):
    """12 prompts (dynamic, static and sequential rows, thresholds from 0.2 to 0.7) in one
    engine under each scheduler, persistent cache: the published loop's tokens exactly;
    blockserve under a small token budget evicts and readmits rows at block boundaries."""
    prompts, rows, outs, _ = dense_refs[0][L]
    eng, got = run_engine(dense, L, scheduler, 84 if scheduler == "blockserve" else 4096, prompts, rows)
    if scheduler != "sequential":
        assert max(len(b.request_ids) for b in eng.batch_log) > 1
    if scheduler == "blockserve":
        assert eng.scheduler.preemptions > 0
    assert [o.token_ids for o in got] == outs
    assert [o.finish_reason for o in got] == ["stop" if len(o) < n else "length" for o, (_, _, n) in zip(outs, rows)]
    assert all(o.prompt_token_ids == p for o, p in zip(got, prompts))


@pytest.mark.parametrize("L", sorted(SHAPES))
def test_sdar_moe_mixed_batch_equals_the_published_loop(moe, L):
    """SDAR-MoE: the same batch under blockserve with preemption, the published loop's tokens."""
    prompts, rows, outs, _ = references(moe, L)
    eng, got = run_engine(moe, L, "blockserve", 84, prompts, rows)
    assert eng.scheduler.preemptions > 0
    assert [o.token_ids for o in got] == outs


def test_step_advance_and_other_caches_give_the_same_tokens(dense, dense_refs):
    """Admission at any step, the refresh cache and no cache: the same tokens (block-causal,
    so every cached column is final)."""
    prompts, rows, outs, _ = dense_refs[0][4]
    for cache, advance in (("persistent", "step"), ("refresh", "block"), ("none", "block")):
        _, got = run_engine(dense, 4, "blockserve", 4096, prompts, rows, cache=cache, advance=advance)
        assert [o.token_ids for o in got] == outs, (cache, advance)


def test_the_threshold_is_strict_and_its_floor_is_the_blocks_schedule():
    """generate.py's rule on crafted confidences, against the engine's select: a confidence
    equal to the threshold is not taken by it (only by the floor), k is the step's share of
    the block over steps_per_block steps whatever max_new_tokens (LLaDA2.0 caps the steps at
    max_new_tokens), and sequential takes the leftmost masks."""
    conf = torch.tensor([[0.9, 0.9, 0.95, 0.2, 0.1, 0.3]], dtype=torch.float64)
    is_mask = torch.tensor([[False, True, True, True, True, True]])
    cur = torch.where(is_mask[0], MASK, 7)
    for strategy, threshold, step, max_new in [("low_confidence_dynamic", 0.9, 2, 1), ("low_confidence_dynamic", 0.9, 0, 1),
                                               ("low_confidence_dynamic", 0.25, 3, 1), ("low_confidence_static", 0.9, 0, 1),
                                               ("sequential", 0.9, 0, 1)]:
        k = int(num_transfer_tokens(6, 4)[step])  # 2, 2, 1, 1
        want = transfer_index(strategy, cur, conf[0], k, threshold) & is_mask[0]
        sp = params((strategy, threshold, max_new))
        rp = RowParams.build([sp], [None], "cpu", threshold=ThresholdRule.BLOCK_FLOOR)
        c = conf if strategy != "sequential" else -torch.arange(6, dtype=torch.float64)[None]
        got = select(c, is_mask, torch.tensor([step]), rp, 6, 4)
        assert got[0].tolist() == want.tolist(), (strategy, threshold, step)
    # the first case: 0.9 (position 1) is not > 0.9: 0.95 alone passes, and k = 1 (max_new_tokens 1 caps nothing)
    assert transfer_index("low_confidence_dynamic", cur, conf[0], 1, 0.9).tolist() == [False, False, True] + [False] * 3


def test_sdar_config_files_resolve_as_published():
    """The four vendored config.json files parse; the mask is the tokenizer's <|MASK|> 151669
    (config.json names none; the dense added_tokens.json's <MASK> is no token of the
    tokenizer), stops 151643 then 151645 (config.json, generation_config.json), blocks at
    absolute positions, block-causal, the floor over the block's steps."""
    folders = [f for f in published.folders() if published.config(f)["model_type"] in ("sdar", "sdar_moe")]
    assert len(folders) == 4
    for folder in folders:
        ckpt = Checkpoint.open(published.path(folder), weights=False)
        cfg = ckpt.config
        assert (cfg.mask_token_id, ckpt.ids["mask_token_id"], cfg.stop_token_ids) == (
            151669, "the tokenizer files", [151643, 151645]), folder
        assert (cfg.family.blocks, cfg.block_causal, cfg.family.threshold, cfg.qk_norm, cfg.head_dim,
                cfg.rope_theta) == (BlockLayout.ABSOLUTE, True, ThresholdRule.BLOCK_FLOOR, True, 128, 1e6)
        assert (cfg.moe is not None) == (cfg.model_type == "sdar_moe")
    moe = ModelConfig.from_hf(published.config("JetLM__SDAR-30B-A3B-Chat")).moe
    assert (moe.num_experts, moe.top_k, moe.renormalize, moe.score, moe.shared_size, any(moe.dense_layers)) == (
        128, 8, True, "softmax", None, False)


@pytest.mark.parametrize("change,message", [({"use_sliding_window": True}, "use_sliding_window"),
                                            ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
                                            ({"attention_bias": True}, "attention_bias"),
                                            ({"layer_types": ["sliding_attention"] * 36}, "sliding-window"),
                                            ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers")])
def test_sdar_settings_the_engine_would_ignore_are_refused(change, message):
    hf = published.config("JetLM__SDAR-4B-Chat")
    with pytest.raises(ConfigRefused, match=message):
        ModelConfig.from_hf({**hf, **change})


def test_trado_presets_are_its_published_evaluation_settings(dense):
    """--preset trado-eval / trado-longcot-eval: dLLM-RL's trado_eval.yaml and
    trado_longcot_eval.yaml rollout settings; they run on an SDAR model (sampled, seeded)."""
    from dataclasses import replace

    from engine.presets import preset

    eng, sp = preset("trado-eval")
    assert (eng.block_length, eng.steps_per_block, eng.cache) == (4, 4, "persistent")
    assert (sp.policy, sp.remasking, sp.threshold, sp.temperature, sp.top_k, sp.top_p, sp.max_new_tokens,
            list(sp.stop_token_ids)) == ("threshold", "low_confidence", 0.9, 1.0, 0, 1.0, 2000, [151643])
    _, long_cot = preset("trado-longcot-eval")
    assert (long_cot.max_new_tokens, list(long_cot.stop_token_ids)) == (10000, [151643, 151645])
    out = Engine(dense, replace(eng, token_budget=256)).generate(
        [workload()[0][5]], replace(sp, max_new_tokens=12, stop_token_ids=STOPS, seed=7))[0]
    assert out.error is None and out.finish_reason in ("stop", "length")


# --- JetEngine's entropy_bounded ------------------------------------------------------------

BOUNDS = [0.35, 2.0, 0.05, 6.0, 1.0, 40.0]  # JetEngine's default first; 40: a whole block at once


@pytest.mark.parametrize("L", sorted(SHAPES))
def test_entropy_bounded_mixed_batch_equals_jetengine(dense, L):
    """policy entropy_bound: the 12 prompts, bounds from 0.05 to 40, in one batch under
    blockserve at a small budget, the transcription's tokens (JetEngine's selection inside
    generate.py's loop, run with denoising_steps = L so that its step cap, which would leave
    masks in a block, never binds; the engine's steps_per_block does not cap this policy)."""
    prompts, _ = workload()
    rows = [("entropy_bounded", BOUNDS[i % len(BOUNDS)], n) for i, n in enumerate(MAX_NEW)]
    ref, trace = PublishedSDAR(dense), []
    outs = [block_diffusion_generate(ref, p, n, L, L, s, t, trace=trace) for p, (s, t, n) in zip(prompts, rows)]
    assert any(t["taken"] == 1 < t["masks"] for t in trace)  # the floor of one (the bound below the first entropy)
    assert any(1 < t["taken"] < t["masks"] for t in trace)  # the bound stopped the running sum
    assert any(t["taken"] == t["masks"] > 1 for t in trace)  # all of a block's masks at once
    sps = [SamplingParams(max_new_tokens=n, policy="entropy_bound", entropy_bound=b, stop_token_ids=STOPS)
           for _, b, n in rows]
    eng = Engine(dense, EngineConfig(block_length=L, steps_per_block=SHAPES[L], cache="persistent",
                                     scheduler="blockserve", token_budget=84, max_batch_size=6), record_batches=True)
    got = eng.generate(prompts, sps)
    assert [o.token_ids for o in got] == outs
    assert max(len(b.request_ids) for b in eng.batch_log) > 1


def test_entropy_bound_is_minus_jetengines_entropy_at_the_rows_temperature():
    """The confidence the policy ranks by: minus the entropy of softmax(logits / T) with
    probabilities clamped at 1e-12 (JetEngine's), the model's own softmax at T = 0; a row
    of another policy keeps its confidence; entropy_bound set under another policy is refused."""
    from engine.decoding import propose

    logits = torch.randn(2, 5, VOCAB, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 4
    sps = [SamplingParams(policy="entropy_bound", temperature=0.7, seed=1), SamplingParams(policy="entropy_bound")]
    need = torch.ones(2, 5, dtype=torch.bool)
    _, conf = propose(logits, RowParams.build(sps, [None, None], "cpu"), None, need)
    for i, t in enumerate((0.7, 1.0)):
        P = torch.softmax(logits[i] / t, -1).clamp_min(1e-12)
        torch.testing.assert_close(conf[i], (P * P.log()).sum(-1), rtol=0, atol=1e-14)
    _, other = propose(logits, RowParams.build([SamplingParams(), sps[1]], [None, None], "cpu"), None, need)
    torch.testing.assert_close(other[0], torch.softmax(logits[0], -1).max(-1).values, rtol=0, atol=1e-14)
    assert "remasking" in SamplingParams(policy="entropy_bound", remasking="entropy").validate()
    eng = Engine(sdar_model(tiny_sdar(), seed=2), EngineConfig(block_length=4, steps_per_block=4))
    out = eng.generate([[20, 21]], SamplingParams(entropy_bound=0.5, max_new_tokens=4))[0]
    assert out.error and "policy 'entropy_bound'" in out.error


def test_sequential_remasking_needs_the_fixed_policy():
    assert "needs policy 'fixed'" in SamplingParams(policy="threshold", remasking="sequential").validate()
    assert SamplingParams(policy="fixed", remasking="sequential").validate() is None


def test_sdar_bench_smoke_writes_json(tmp_path):
    """bench/engine_bench.py --workload sdar: the SDAR-shaped model under blockserve, static
    and sequential (persistent cache); every run gives the same tokens."""
    import json

    from bench import engine_bench

    out = tmp_path / "sdar.json"
    engine_bench.main(["--workload", "sdar", "--smoke", "--cache", "persistent", "--out", str(out), "--threads", "1"])
    d = json.loads(out.read_text())
    assert d["workload"]["name"] == "sdar" and d["decoding"]["block_length"] == 4 and d["outputs_agree"] is True
    assert {s["error"] for s in d["schedulers"].values()} == {None}
    assert (tmp_path / "sdar.png").stat().st_size > 0
