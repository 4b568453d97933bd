"""Issue 54: DreamReasoner (Dream-org/DreamReasoner-8B; config.json model_type "Dream",
architectures ["DreamForCausalLM"]) exact against its published decoding, and never taken
for Dream-v0.

`DiffulexDreamReasoner` is written from SJTU-DENG-Lab/Diffulex (184ba97)
diffulex/model/dream_reasoner.py over the weights under their checkpoint names: q/k/v/o
without bias, per-head q_norm / k_norm before rotate-half RoPE (get_rope's neox style),
attention scaled by head_dim ** -0.5 under the block-causal 0/1 mask, SiLU-gated MLP,
residual adds, final RMSNorm, untied lm_head; float64, with a cache of K/V that a
`store=True` forward appends to.

Two loops are transcribed, one request at a time, greedy:
- `block_diffusion_generate`: the checkpoint's generation_utils.py as a fork copies its
  helpers unchanged (code-index 68946547251: `get_num_transfer_tokens`,
  `sample_with_temperature_topk_topp` at temperature 0, `_select_transfer_index` with
  `low_confidence_dynamic`: k = max(1, schedule[step]), every mask strictly over the
  threshold when at least k are, else the top k; `force_accept` on step == steps - 1), its
  blocks of block_length at absolute positions, the prompt's complete blocks prefilled,
  each block denoised up to steps + 1 forwards and stored by one more, stop ids checked
  after each block. `low_confidence_static` rows (the top k; LLaDA's fixed rule) share the
  batch as rows of another rule.
- `diffulex_generate`: Diffulex's `dream_reasoner` sampler (diffulex/sampler/dream_reasoner.py
  over base/core.py `sample_tokens`: the mask token's logit at -inf, greedy with ties to the
  highest id, confidence its probability; commit every mask whose confidence is strictly
  over accept_threshold, and, when the previous block is semi-complete, the most confident
  one if none is) inside its request's block layout (diffulex/engine/request.py: blocks at
  absolute positions, the prompt's last block padded with masks and editable from the
  prompt's end) with one block in its buffer (buffer_size 1: the previous block is complete
  whenever a block decodes, so the forced top-1 always applies).
At steps = block_length (the published default) the two loops agree token for token (the
test model gives the mask token probability 0, so Diffulex's -inf on it changes nothing).
The engine's ONE mixed batch of 12 prompts under blockserve (with preemption), static and
sequential gives exactly their tokens."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

import published
from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model, save_model
from engine.checkpoint import Checkpoint, CheckpointError
from engine.models.families import BlockLayout, ConfigRefused, ThresholdRule, family_for

torch.set_num_threads(1)
VOCAB, MASK = 96, 95
EOS, IM_END = 33, 28  # two tokens the seeded model emits now and then stand for Qwen's stop ids
STOPS = [IM_END, EOS]
FOLDER = "Dream-org__DreamReasoner-8B"
SEMI_COMPLETE = 0.9  # Diffulex's decoding_thresholds.semi_complete_threshold default


def tiny_reasoner(**kw) -> ModelConfig:
    """Qwen3's layer at toy size: head_dim 12 (not 32 / 4), GQA 4:2, theta 1e6, untied."""
    base = dict(model_type="dream_reasoner", vocab_size=VOCAB, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
                head_dim=12, intermediate_size=48, mask_token_id=MASK, eos_token_id=EOS, max_seq_len=1024,
                qk_norm=True, rope_theta=1e6, rms_norm_eps=1e-6, dllm_attention="block_causal")
    return ModelConfig(**{**base, **kw})


def never_proposes_mask(model):
    """A random model whose mask-token logit is < -1e4 everywhere (probability exactly 0 in
    float64, as a trained model's is in effect): hidden channel 0 is a positive per-token
    value no layer writes to (its o / down rows zero), and the mask's lm_head row reads
    only that channel, scaled by -1e6. Peaked (lm_head x 3) so thresholds are passed."""
    with torch.no_grad():
        model.embed.weight[:, 0] = model.embed.weight[:, 0].abs() + 0.5
        for layer in model.layers:
            layer.o.weight[0] = 0.0
            layer.down.weight[0] = 0.0
        model.lm_head.weight.mul_(3.0)
        model.lm_head.weight[MASK] = 0.0
        model.lm_head.weight[MASK, 0] = -1e6
    return model


class DiffulexDreamReasoner:
    """DreamReasonerForDiffusionLM.forward + compute_logits over the checkpoint tensors;
    `cache` {layer: (K, V)}. Without the per-head q/k norm (a model whose config has none)
    it is Diffulex's StableDiffCoderForDiffusionLM.forward, the same Llama block."""

    def __init__(self, model):
        cfg = model.config
        self.w = {cfg.family.checkpoint_name(n): p.detach().double() for n, p in model.named_parameters()}
        self.hf = cfg.to_hf()
        self.qk_norm = cfg.qk_norm
        self.forwards = 0

    def rms(self, x, key):
        return self.w[key] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.hf["rms_norm_eps"]))

    def __call__(self, ids, pos, mask, cache=None, store=False):
        """Logits [T, V] of ids [T] at positions `pos` under the 0/1 mask [T, K] (K: the
        cached columns and these)."""
        self.forwards += 1
        hf, w = self.hf, self.w
        T, H, Hkv = ids.shape[0], hf["num_attention_heads"], hf["num_key_value_heads"]
        D = hf.get("head_dim") or hf["hidden_size"] // H
        inv = 1.0 / (hf["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        freqs = pos.double()[:, None] * inv
        cos, sin = freqs.cos(), freqs.sin()

        def rope(t):  # neox style: the two halves rotated
            a, b = t[..., : D // 2], t[..., D // 2:]
            return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

        bias = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(mask == 0, float("-inf"))
        h = w["model.embed_tokens.weight"][ids]
        for i in range(hf["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = self.rms(h, p + "input_layernorm.weight")
            q = F.linear(x, w[p + "self_attn.q_proj.weight"]).view(T, H, D)
            k = F.linear(x, w[p + "self_attn.k_proj.weight"]).view(T, Hkv, D)
            v = F.linear(x, w[p + "self_attn.v_proj.weight"]).view(T, Hkv, D)
            if self.qk_norm:
                q, k = self.rms(q, p + "self_attn.q_norm.weight"), self.rms(k, p + "self_attn.k_norm.weight")
            q, k = rope(q.transpose(0, 1)), rope(k.transpose(0, 1))
            v = v.transpose(0, 1)
            if cache is not None and i in cache:
                k, v = torch.cat([cache[i][0], k], 1), torch.cat([cache[i][1], v], 1)
            if cache is not None and store:
                cache[i] = (k, v)
            k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
            att = torch.softmax(q @ k.transpose(1, 2) * D ** -0.5 + bias, -1) @ v
            h = h + F.linear(att.transpose(0, 1).reshape(T, H * D), w[p + "self_attn.o_proj.weight"])
            x = self.rms(h, p + "post_attention_layernorm.weight")
            gate, up = F.linear(x, w[p + "mlp.gate_proj.weight"]), F.linear(x, w[p + "mlp.up_proj.weight"])
            h = h + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
        return F.linear(self.rms(h, "model.norm.weight"), w["lm_head.weight"])


def block_mask(num_blocks, L):
    return torch.tril(torch.ones(num_blocks, num_blocks)).repeat_interleave(L, 0).repeat_interleave(L, 1)


def answer(x, p, gen_length, stop_ids):
    ans = x[p:p + gen_length].tolist()
    return next((ans[:j] for j, t in enumerate(ans) if t in stop_ids), ans)


# --- HF generation_utils.py block_diffusion_generate ---------------------------------------

def get_num_transfer_tokens(block_length, steps):
    base, rem = divmod(block_length, steps)
    t = torch.zeros(steps, dtype=torch.int64) + base
    t[:rem] += 1
    return t


def select_transfer_index(strategy, mask_index, x0_p, num_transfer_tokens, step, threshold, force_accept):
    """_select_transfer_index for one row (low_confidence_dynamic as copied; static: the top k)."""
    if force_accept:
        return mask_index.clone()
    confidence = torch.where(mask_index, x0_p, -torch.inf)
    transfer = torch.zeros_like(mask_index)
    k = max(1, int(num_transfer_tokens[step]))
    if strategy == "low_confidence_dynamic":
        high = confidence > threshold
        if int(high.sum()) >= k:
            return high
    elif strategy != "low_confidence_static":
        raise ValueError(strategy)
    transfer[torch.topk(confidence, k).indices] = True
    return transfer


def block_diffusion_generate(model, prompt, gen_length, block_length, steps, strategy, threshold,
                             stop_ids=STOPS, mask_id=MASK, trace=None):
    L, p = block_length, len(prompt)
    num_blocks = (p + gen_length + L - 1) // L
    bm, position_ids = block_mask(num_blocks, L), torch.arange(num_blocks * L)
    x = torch.full((num_blocks * L,), mask_id, dtype=torch.long)
    x[:p] = torch.tensor(prompt)
    cache, prefill_blocks = {}, p // L
    if prefill_blocks:
        n = prefill_blocks * L
        model(x[:n], position_ids[:n], bm[:n, :n], cache, store=True)
    schedule = get_num_transfer_tokens(L, steps)
    for nb in range(prefill_blocks, num_blocks):
        cols = slice(nb * L, (nb + 1) * L)
        cur_x, mask, pos = x[cols].clone(), bm[cols, :(nb + 1) * L], position_ids[cols]
        for step in range(steps + 1):
            mask_index = cur_x == mask_id
            if not bool(mask_index.any()):
                model(cur_x, pos, mask, cache, store=True)
                break
            logits = model(cur_x, pos, mask, cache)
            probs = torch.softmax(logits, -1)  # sample_with_temperature_topk_topp at temperature 0
            x0 = probs.argmax(-1)
            x0_p = probs.gather(-1, x0[:, None]).squeeze(-1)
            x0 = torch.where(mask_index, x0, cur_x)
            force = step == steps - 1
            transfer = select_transfer_index(strategy, mask_index, x0_p, schedule, step, threshold, force)
            if trace is not None:
                high = int((torch.where(mask_index, x0_p, -torch.inf) > threshold).sum())
                trace.append(dict(strategy=strategy, k=max(1, int(schedule[step])), masks=int(mask_index.sum()),
                                  high=high, taken=int(transfer.sum()), force=force, step=step,
                                  lead=max(0, p - nb * L)))
            cur_x[transfer] = x0[transfer]
        x[cols] = cur_x
        if any(s in x[p:] for s in stop_ids):
            break
    return answer(x, p, gen_length, stop_ids)


# --- Diffulex's dream_reasoner sampler, one block in the buffer -----------------------------

def sample_tokens(logits, mask_id):
    """base/core.py sample_tokens at temperature 0, no top-p / top-k: the mask forbidden,
    the argmax with ties to the highest id, its probability."""
    logits = logits.clone()
    logits[..., mask_id] = float("-inf")
    probs = torch.softmax(logits, -1)
    tie = logits == logits.max(-1).values[:, None]
    x0 = logits.shape[-1] - 1 - tie.flip(-1).int().argmax(-1)
    return probs.gather(-1, x0[:, None]).squeeze(-1), x0


def accepted_ids(prev_semi_complete, confidence, initial_confidence, accept_threshold):
    """DreamReasonerSampler._compute_accepted_ids."""
    high = torch.where(initial_confidence > accept_threshold)[0]
    if prev_semi_complete:
        top = torch.topk(confidence, 1)[1] if len(high) == 0 else torch.tensor([], dtype=torch.long)
        return torch.unique(torch.cat([top, high]))
    return high


def semi_complete(prev, mask_id) -> bool:
    """DreamReasonerSampler: the previous block (None: none) is at least SEMI_COMPLETE decoded."""
    return True if prev is None else float((prev != mask_id).double().mean()) >= SEMI_COMPLETE


def diffulex_generate(model, prompt, gen_length, block_length, threshold, stop_ids=STOPS, mask_id=MASK, trace=None,
                      semi=semi_complete):
    """Diffulex's multi_bd loop, one block in the buffer; `semi(prev, mask_id)` says whether
    the block may force its most confident token (Stable-DiffCoder's sampler: always)."""
    L, p = block_length, len(prompt)
    num_blocks = (p + gen_length + L - 1) // L
    bm, position_ids = block_mask(num_blocks, L), torch.arange(num_blocks * L)
    x = torch.full((num_blocks * L,), mask_id, dtype=torch.long)  # the prompt padded with masks
    x[:p] = torch.tensor(prompt)
    editable = torch.arange(num_blocks * L) >= p
    cache, prefill_blocks = {}, p // L
    if prefill_blocks:
        n = prefill_blocks * L
        model(x[:n], position_ids[:n], bm[:n, :n], cache, store=True)
    for nb in range(prefill_blocks, num_blocks):
        cols = slice(nb * L, (nb + 1) * L)
        prev = x[(nb - 1) * L: nb * L] if nb else None
        while True:
            block = x[cols]
            rel = torch.where((block == mask_id) & editable[cols])[0]  # mask_token_relative_ids
            if len(rel) == 0:
                model(block, position_ids[cols], bm[cols, :(nb + 1) * L], cache, store=True)
                break
            logits = model(block, position_ids[cols], bm[cols, :(nb + 1) * L], cache)
            conf, x0 = sample_tokens(logits[rel], mask_id)
            forced = semi(prev, mask_id)
            ids = accepted_ids(forced, conf, conf, threshold)
            if trace is not None:
                trace.append(dict(masks=len(rel), high=int((conf > threshold).sum()), taken=len(ids), semi=forced,
                                  lead=max(0, p - nb * L)))
            x[nb * L + rel[ids]] = x0[ids]
        if any(s in x[p:] for s in stop_ids):
            break
    return answer(x, p, gen_length, stop_ids)


# --- the workload ---------------------------------------------------------------------------

LENGTHS = [1, 3, 4, 6, 9, 13, 16, 18, 23, 29, 32, 37]
MAX_NEW = [9, 5, 3, 14, 20, 11, 7, 26, 17, 12, 4, 30]
STRATEGIES = ["low_confidence_dynamic", "low_confidence_static", "low_confidence_dynamic", "low_confidence_dynamic"]
THRESHOLDS = [0.5, 0.3, 0.7, 0.9, 0.6, 0.2]
SHAPES = [(4, 4), (8, 8), (8, 3)]  # (block length, steps): the published steps = block length, and fewer


def workload(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(14, MASK, (n,), generator=g).tolist() for n in LENGTHS]
    for i in (4, 7):  # a stop id in the prompt's last (partial) block: it never stops the row
        prompts[i][-1] = EOS if i == 4 else IM_END
    rows = [(STRATEGIES[i % len(STRATEGIES)], THRESHOLDS[i % len(THRESHOLDS)], n) for i, n in enumerate(MAX_NEW)]
    return prompts, rows


def params(row):
    strategy, threshold, max_new = row
    policy = "threshold" if strategy == "low_confidence_dynamic" else "fixed"
    return SamplingParams(max_new_tokens=max_new, policy=policy, threshold=threshold, stop_token_ids=STOPS)


@pytest.fixture(scope="module")
def model():
    return never_proposes_mask(build_model(tiny_reasoner(), dtype=torch.float64, seed=2))


@pytest.fixture(scope="module")
def refs(model):
    """{(L, S): (prompts, rows, HF tokens, HF trace, Diffulex tokens or None, Diffulex trace)}."""
    prompts, rows = workload()
    out = {}
    for L, S in SHAPES:
        ref, trace, dtrace = DiffulexDreamReasoner(model), [], []
        hf = [block_diffusion_generate(ref, p, n, L, S, s, t, trace=trace) for p, (s, t, n) in zip(prompts, rows)]
        dx = None
        if S == L:  # Diffulex has no step count: its rule is the HF one at steps = block length
            dx = [diffulex_generate(ref, p, n, L, t, trace=dtrace) if s == "low_confidence_dynamic" else o
                  for p, (s, t, n), o in zip(prompts, rows, hf)]
        out[(L, S)] = (prompts, rows, hf, trace, dx, dtrace)
    return out


def run_engine(model, L, S, scheduler, token_budget, prompts, rows):
    cfg = EngineConfig(block_length=L, steps_per_block=S, cache="persistent", scheduler=scheduler,
                       token_budget=token_budget, max_batch_size=6)
    eng = Engine(model, cfg, record_batches=True)
    return eng, eng.generate(prompts, [params(r) for r in rows])


# --- tests -----------------------------------------------------------------------------------

def test_forward_equals_diffulex_model(model):
    """The engine's layer against the transcription, under the block mask, and with the
    cache: a prefill stored, then a block read over it; the mask's probability is 0."""
    ref = DiffulexDreamReasoner(model)
    ids = torch.randint(0, MASK + 1, (13,), generator=torch.Generator().manual_seed(1))
    bm = block_mask(4, 4)[:13, :13]
    with torch.no_grad():
        ours = model(ids[None], torch.arange(13)[None], bm.bool()[None, None])[0]
    torch.testing.assert_close(ours, ref(ids, torch.arange(13), bm), rtol=1e-12, atol=1e-12)
    cache = {}
    ref(ids[:8], torch.arange(8), bm[:8, :8], cache, store=True)
    torch.testing.assert_close(ours[8:12], ref(ids[8:12], torch.arange(8, 12), bm[8:12, :12], cache),
                               rtol=1e-12, atol=1e-12)
    assert bool((torch.softmax(ours, -1)[:, MASK] == 0).all()) and float(ours[:, MASK].max()) < -1e4


def test_the_workload_exercises_every_rule(refs):
    """Equality below proves little unless the loops hit their rules: the threshold taking
    several masks, the floor's top-k (k = 1: Diffulex's forced top-1 after a semi-complete
    block), force_accept on a block's last step, stops, several blocks, partial prompt blocks."""
    for (L, S), (prompts, rows, hf, trace, dx, dtrace) in refs.items():
        dyn = [t for t in trace if t["strategy"] == "low_confidence_dynamic"]
        assert any(t["high"] >= t["k"] and t["taken"] > t["k"] for t in dyn), (L, S)  # the threshold took more
        assert any(t["high"] < t["k"] and t["taken"] == t["k"] for t in dyn), (L, S)  # the floor's top k
        assert any(t["force"] and t["taken"] == t["masks"] > 0 for t in trace), (L, S)  # force_accept fired
        assert any(len(o) < n for o, (_, _, n) in zip(hf, rows)), (L, S)  # some rows stopped at a stop id
        assert any(len(o) > L for o in hf), (L, S)  # several blocks
        assert any(t["lead"] > 0 and t["step"] == 0 for t in trace), (L, S)  # a partial prompt block decoded
        if dx is not None:
            assert dx == hf, (L, S)  # Diffulex's sampler is the HF rule at steps = block length
            assert all(t["semi"] for t in dtrace)  # one block at a time: the previous one is complete
            assert any(t["high"] == 0 and t["taken"] == 1 for t in dtrace)  # the forced top-1
            assert any(t["high"] > 1 and t["taken"] == t["high"] for t in dtrace)  # all over accept_threshold
    assert {t["k"] for t in refs[(8, 3)][3]} == {3, 2}  # 8 over 3 steps: 3, 3, 2


@pytest.mark.parametrize("L,S", SHAPES)
@pytest.mark.parametrize("scheduler", ["blockserve", "static", "sequential"])
def test_one_mixed_batch_equals_the_published_loops(model, refs, scheduler, L, S):
    """12 prompts (the family's threshold rule at thresholds 0.2 to 0.9, and fixed-schedule
    rows) in one engine under each scheduler, persistent cache: the published loop's tokens
    (and, at steps = block length, Diffulex's); blockserve under a small token budget evicts
    and readmits rows at block boundaries."""
    prompts, rows, hf, _, dx, _ = refs[(L, S)]
    eng, got = run_engine(model, L, S, scheduler, 84 if scheduler == "blockserve" else 4096, prompts, rows)
    if scheduler != "sequential":
        assert max(len(b.request_ids) for b in eng.batch_log) > 1
    if scheduler == "blockserve":
        assert eng.scheduler.preemptions > 0
    assert [o.token_ids for o in got] == hf
    if dx is not None:
        assert [o.token_ids for o in got] == dx
    assert [o.finish_reason for o in got] == ["stop" if len(o) < n else "length" for o, (_, _, n) in zip(hf, rows)]


# --- config.json: never Dream-v0 ----------------------------------------------------------------

def test_the_rebuilt_config_is_dreamreasoner_never_dream_v0():
    """The config.json rebuilt from the located values (tests/published/Dream-org__DreamReasoner-8B,
    model_type "Dream" as Dream-v0's) is DreamReasoner's: block-causal blocks at absolute
    positions, no shift, q/k norm, no biases, mask 151669, SDAR's floor; Dream-v0's published
    config.json files stay Dream's."""
    hf = published.config(FOLDER)
    assert hf["model_type"] == "Dream" and hf["architectures"] == ["DreamForCausalLM"]
    cfg = ModelConfig.from_hf(hf)
    fam = cfg.family
    assert (fam.name, fam.shift_logits, fam.first_position, fam.blocks, fam.threshold) == (
        "DreamReasoner", False, False, BlockLayout.ABSOLUTE, ThresholdRule.BLOCK_FLOOR)
    assert (cfg.block_causal, cfg.qk_norm, cfg.qkv_bias, cfg.mask_token_id) == (True, True, False, 151669)
    for folder in ("Dream-org__Dream-v0-Base-7B", "Dream-org__Dream-v0-Instruct-7B"):
        dream = ModelConfig.from_hf(published.config(folder))
        assert (dream.family.name, dream.shift_logits, dream.block_causal, dream.qk_norm) == ("Dream", True, False,
                                                                                              False)
    # either of its keys is enough: the architecture, or block_size
    assert family_for({**hf, "architectures": ["DreamModel"]}).name == "DreamReasoner"
    assert family_for({k: v for k, v in hf.items() if k != "block_size"}).name == "DreamReasoner"


def test_its_weights_under_a_dream_v0_config_are_refused(tmp_path):
    """A DreamReasoner checkpoint whose config.json is made Dream-v0's (architectures
    DreamModel, no block_size) is refused for its q/k norm tensors and missing biases: its
    weights are never decoded as Dream-v0's."""
    root = str(tmp_path / "reasoner")
    save_model(build_model(tiny_reasoner(head_dim=8)), root)  # head_dim = hidden / heads: Dream-v0's shapes
    ck = Checkpoint.open(root)
    assert ck.family.name == "DreamReasoner" and ck.config.block_causal
    with open(os.path.join(root, "config.json")) as f:
        hf = json.load(f)
    with pytest.raises(ConfigRefused, match="head_dim"):  # Dream-v0's layout has no head_dim key
        _reopen(root, {**hf, "architectures": ["DreamModel"], "attention_bias": True})
    hf = {k: v for k, v in hf.items() if k != "head_dim"}
    with pytest.raises(CheckpointError) as e:  # its weights: q/k norms, no q/k/v biases
        _reopen(root, {**hf, "architectures": ["DreamModel"], "attention_bias": True})
    assert "q_norm" in str(e.value) or "bias" in str(e.value)


def _reopen(root, hf):
    with open(os.path.join(root, "config.json"), "w") as f:
        json.dump(hf, f)
    assert family_for(hf).name == "Dream"
    return Checkpoint.open(root)


@pytest.mark.parametrize("change,message", [({"use_sliding_window": True}, "use_sliding_window"),
                                            ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
                                            ({"attention_bias": True}, "attention_bias"),
                                            ({"layer_types": ["sliding_attention"] * 2}, "sliding-window"),
                                            ({"num_nextn_predict_layers": 1}, "num_nextn_predict_layers")])
def test_settings_the_engine_would_ignore_are_refused(change, message):
    with pytest.raises(ConfigRefused, match=message):
        ModelConfig.from_hf({**published.config(FOLDER), **change})
