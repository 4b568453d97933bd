"""Issue 54: Nemotron-Labs-Diffusion (model_type nemotron_labs_diffusion) exact against its
published code.

The forward: blockray's transformer against transformers' built-in Ministral3Model (the
published model's `encoder`, NOT remote code) in float64, weights mapped from the
checkpoint names (`encoder.*`, `diffusion_head.weight`), on a tiny model from the located
8B config (sizes shrunk, YaRN's and Llama-4's parameters kept and pushed where they act:
a small original_max_position_embeddings so that positions past it scale q, an attention
factor != 1), causally and with the current block bidirectional against a causal prefix.
transformers computes RoPE's frequencies and angles in float32 even in a float64 model
(blockray: float64), hence the forward's tolerance there; the decoding tests below compare
against a float64 transcription (`PublishedNemotron`) at 1e-12.

CONFIG is the 8B config.json as located (../shared/checkpoints/nvidia__Nemotron-Labs-
Diffusion-8B/SOURCE.md: FLX-OSS/FluxServe test/runtime/data/nemotron_checkpoints/8B/
config.json at index commit bba0797, "Official configuration ... HF revision 16c67f05"),
rebuilt key for key from the located values (no byte copy is reachable)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model
from engine.models.families import ConfigRefused

torch.set_num_threads(1)

CONFIG = {
    "ar_loss_weight": 1.0, "architectures": ["NemotronLabsDiffusionModel"], "attention_bias": False,
    "attention_dropout": 0.0, "attn_implementation": "sdpa",
    "auto_map": {"AutoConfig": "configuration_nemotron_labs_diffusion.NemotronLabsDiffusionConfig",
                 "AutoModel": "modeling_nemotron_labs_diffusion.NemotronLabsDiffusionModel"},
    "block_size": 32, "bos_token_id": 1, "dlm_loss_weight": None, "dlm_paradigm": "bidirectional",
    "dp_varying_mask_ratio": False, "eos_token_id": 11, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "mask_token_id": 100, "max_position_embeddings": 262144,
    "mlp_bias": False, "model_type": "nemotron_labs_diffusion", "num_attention_heads": 32, "num_hidden_layers": 34,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_parameters": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 16.0, "llama_4_scaling_beta": 0.1,
                        "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 16384,
                        "rope_theta": 1000000.0, "rope_type": "yarn"},
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "5.0.0",
    "use_cache": False, "vocab_size": 131072}

VOCAB, MASK, EOS = 128, 100, 11


def tiny_config(**rope) -> dict:
    """CONFIG with its sizes shrunk; `rope` overrides rope_parameters' values."""
    return {**CONFIG, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "vocab_size": VOCAB, "max_position_embeddings": 4096,
            "rope_parameters": {**CONFIG["rope_parameters"], **rope}}


# positions past original_max_position_embeddings (8) scale q; mscale 2 makes the attention factor != 1
ACTIVE_ROPE = dict(original_max_position_embeddings=8, factor=4.0, mscale=2.0, rope_theta=10000.0)


def tiny_model(seed: int = 0, **rope):
    cfg = ModelConfig.from_hf(tiny_config(**rope))
    model = build_model(cfg, dtype=torch.float64, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
        model.lm_head.weight[MASK] = 0.0  # never proposes the mask itself, as a trained model
    return model


def checkpoint(model):
    cfg = model.config
    return {cfg.family.checkpoint_name(n): p.detach().double() for n, p in model.named_parameters()}


def hf_encoder(model, **rope):
    """transformers' Ministral3Model with the checkpoint's encoder.* tensors, float64, eager
    (`rope`: the tiny config's rope_parameters overrides the model was built with)."""
    from transformers import Ministral3Config
    from transformers.models.ministral3.modeling_ministral3 import Ministral3Model

    src = tiny_config(**rope)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
            "tie_word_embeddings", "hidden_act")
    conf = Ministral3Config(**{k: src[k] for k in keys}, pad_token_id=None, attn_implementation="eager")
    enc = Ministral3Model(conf).double().eval()
    w = checkpoint(model)
    enc.load_state_dict({k[len("encoder."):]: v for k, v in w.items() if k.startswith("encoder.")}, strict=True)
    return enc, w["diffusion_head.weight"]


def context_mask(T: int, block: int) -> torch.Tensor:
    """Causal, but the last `block` columns bidirectional among themselves."""
    i = torch.arange(T)
    seg = torch.minimum(i, torch.tensor(T - block))
    return seg[None, :] <= seg[:, None]


@pytest.mark.parametrize("rope", [{}, ACTIVE_ROPE], ids=["published_rope", "yarn_and_q_scale_active"])
def test_forward_equals_transformers_ministral3(rope):
    model = tiny_model(**rope)
    enc, head = hf_encoder(model, **rope)
    T = 21
    ids = torch.randint(0, VOCAB, (1, T), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(T)[None]
    for keep in (torch.ones(T, T).tril().bool(), context_mask(T, 5)):
        additive = torch.zeros(T, T, dtype=torch.float64).masked_fill(~keep, float("-inf"))[None, None]
        with torch.no_grad():
            ours = model(ids, pos, keep[None, None])[0]
            theirs = F.linear(enc(input_ids=ids, attention_mask=additive, position_ids=pos).last_hidden_state[0], head)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_the_published_config_parses():
    cfg = ModelConfig.from_hf(CONFIG)
    fam = cfg.family
    assert (fam.name, fam.causal_context, fam.first_position, fam.shift_logits, cfg.block_causal) == (
        "Nemotron-Labs-Diffusion", True, True, False, True)
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.head_dim, cfg.n_kv_heads, cfg.rope_theta, cfg.rms_norm_eps) == (
        100, 11, 128, 8, 1e6, 1e-5)
    assert cfg.rope_yarn.factor == 16.0 and cfg.rope_yarn.attention_factor == 1.0
    assert cfg.rope_yarn.original_max_position_embeddings == 16384 and cfg.q_position_scale == (0.1, 16384)
    assert not cfg.tie_word_embeddings
    names = fam.checkpoint_shapes(ModelConfig.from_hf(tiny_config()))
    assert "diffusion_head.weight" in names and "encoder.layers.1.self_attn.q_proj.weight" in names
    assert "encoder.embed_tokens.weight" in names and "encoder.norm.weight" in names


@pytest.mark.parametrize("key, value", [("dlm_paradigm", "block_diff"), ("dlm_paradigm", "autoregressive"),
                                        ("sliding_window", 4096), ("mlp_bias", True), ("attention_bias", True),
                                        ("hidden_act", "gelu"), ("some_new_key", 1)])
def test_keys_it_does_not_honour_are_refused(key, value):
    with pytest.raises(ConfigRefused, match=key):
        ModelConfig.from_hf({**CONFIG, key: value})


def test_rope_parameters_it_does_not_implement_are_refused():
    for bad, match in (({"rope_type": "default"}, "yarn"), ({"rope_type": "longrope"}, "yarn"),
                       ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
                       ({"llama_4_scaling_beta": None}, "llama_4_scaling_beta")):
        with pytest.raises(ConfigRefused, match=match):
            ModelConfig.from_hf({**CONFIG, "rope_parameters": {**CONFIG["rope_parameters"], **bad}})


def test_config_round_trips():
    cfg = ModelConfig.from_hf(tiny_config(**ACTIVE_ROPE))
    again = ModelConfig.from_hf(cfg.to_hf())
    assert again.rope_yarn == cfg.rope_yarn and again.q_position_scale == cfg.q_position_scale
    assert ModelConfig(**cfg.as_dict()).rope_yarn == cfg.rope_yarn


# --- the published loop, transcribed ----------------------------------------------------------

class PublishedNemotron:
    """NemotronLabsDiffusionModel's encoder + diffusion_head at inference, float64 over the
    checkpoint tensors: Ministral3's layer (yarn RoPE, its attention factor on cos / sin, q
    times 1 + beta ln(1 + floor(pos / original_max)) after RoPE, GQA, eager softmax). The
    attention is the published switch: `causal` (self_attn.diffusion_lm False, a causal mask
    over the cached prefix and the input) or bidirectional (diffusion_lm True: no mask, the
    input sees the cached prefix and itself). `cache` is a DynamicCache ({layer: (K, V)}):
    use_cache=True appends the input's K/V, use_cache=False only reads it."""

    def __init__(self, model):
        self.w = checkpoint(model)
        self.hf = model.config.to_hf()
        self.forwards = 0

    def rms(self, x, key):
        return self.w[key] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.hf["rms_norm_eps"]))

    def rope(self, pos, D):
        """transformers' yarn inverse frequencies and attention factor, in float64."""
        import math
        rp = self.hf["rope_parameters"]
        base, factor, orig = rp["rope_theta"], rp["factor"], rp["original_max_position_embeddings"]
        dim_at = lambda rot: (D * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))  # noqa: E731
        low, high = math.floor(dim_at(rp["beta_fast"])), math.ceil(dim_at(rp["beta_slow"]))
        low, high = max(low, 0), min(high, D - 1)
        pos_freqs = base ** (torch.arange(0, D, 2, dtype=torch.float64) / D)
        ramp = ((torch.arange(D // 2, dtype=torch.float64) - low) / ((high + 0.001 if low == high else high) - low))
        extra = 1 - ramp.clamp(0, 1)
        inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
        emb = torch.cat([pos[:, None] * inv] * 2, -1)
        return emb.cos() * rp["attention_factor"], emb.sin() * rp["attention_factor"]

    def __call__(self, ids, cache, causal, use_cache):
        """Logits [T, V] of ids [T] placed after the cached columns."""
        self.forwards += 1
        hf, w = self.hf, self.w
        T, H, Hkv, D = len(ids), hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
        past = cache[0][0].shape[1] if 0 in cache else 0
        pos = torch.arange(past, past + T, dtype=torch.float64)
        cos, sin = self.rope(pos, D)
        rp = hf["rope_parameters"]
        qscale = (1 + rp["llama_4_scaling_beta"] * torch.log(1 + torch.floor(pos / rp["original_max_position_embeddings"])))
        keep = torch.ones(T, past + T, dtype=torch.bool)
        if causal:
            keep = (torch.arange(past + T)[None] <= (torch.arange(T) + past)[:, None])
        additive = torch.zeros(T, past + T, dtype=torch.float64).masked_fill(~keep, float("-inf"))

        def rotary(t):
            return t * cos + torch.cat([-t[..., D // 2:], t[..., : D // 2]], -1) * sin

        h = w["encoder.embed_tokens.weight"][torch.tensor(ids)]
        for i in range(hf["num_hidden_layers"]):
            p = f"encoder.layers.{i}."
            x = self.rms(h, p + "input_layernorm.weight")
            proj = lambda m, n: F.linear(x, w[p + f"self_attn.{m}_proj.weight"]).view(T, n, D).transpose(0, 1)  # noqa: E731
            q, k, v = rotary(proj("q", H)) * qscale[None, :, None], rotary(proj("k", Hkv)), proj("v", Hkv)
            if i in cache:
                k, v = torch.cat([cache[i][0], k], 1), torch.cat([cache[i][1], v], 1)
            if use_cache:
                cache[i] = (k, v)
            k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
            att = torch.softmax(q @ k.transpose(1, 2) * D ** -0.5 + additive, -1) @ v
            h = h + F.linear(att.transpose(0, 1).reshape(T, H * D), w[p + "self_attn.o_proj.weight"])
            x = self.rms(h, p + "post_attention_layernorm.weight")
            h = h + F.linear(F.silu(F.linear(x, w[p + "mlp.gate_proj.weight"])) * F.linear(x, w[p + "mlp.up_proj.weight"]),
                             w[p + "mlp.down_proj.weight"])
        return F.linear(self.rms(h, "encoder.norm.weight"), w["diffusion_head.weight"])


def generate(model, prompt, max_new_tokens, block_length, threshold=None, eos_token_id=EOS, mask_id=MASK,
             trace=None):
    """modeling_nemotron_labs_diffusion.py generate() for one request, temperature 0,
    causal_context on (its default), no thinking budget: returns the answer as the engine
    returns it, the first `max_new_tokens` tokens before the first eos (generate() itself
    takes a multiple of block_length and returns the eos)."""
    L = block_length
    gen = -(-max_new_tokens // L) * L  # `assert max_new_tokens % block_length == 0`
    cache = {}
    logits = model(prompt, cache, causal=True, use_cache=True)  # the causal prefill
    next_token = int(logits[-1].argmax())
    x = torch.tensor(list(prompt))
    p = len(prompt)
    for nb in range(gen // L):
        block = torch.full((L,), mask_id)
        block[0] = next_token
        x = torch.cat([x, block])
        cols = slice(p + nb * L, p + (nb + 1) * L)
        n = int((x[cols] == mask_id).sum())  # _get_num_transfer_tokens(mask_block_idx0, steps = L)
        schedule = [n // L + (1 if i < n % L else 0) for i in range(L)]
        for i in range(L):
            cur = x[cols].clone()
            mask_index = cur == mask_id
            if not bool(mask_index.any()):
                break
            lg = model(cur.tolist(), cache, causal=False, use_cache=False)
            x0 = lg.argmax(-1)  # _get_transfer_index, temperature 0
            x0_p = torch.softmax(lg, -1).gather(-1, x0[:, None]).squeeze(-1)
            x0 = torch.where(mask_index, x0, cur)
            conf = torch.where(mask_index, x0_p, -torch.inf)
            k = int(mask_index.sum()) if threshold is not None else schedule[i]
            _, sel = torch.topk(conf, k=k)
            transfer = torch.zeros(L, dtype=torch.bool)
            transfer[sel] = True
            if threshold is not None:
                for j in range(1, k):
                    if conf[sel[j]] < threshold:
                        transfer[sel[j]] = False
            cur[transfer] = x0[transfer]
            x[cols] = cur
            if trace is not None:
                trace.append(dict(block=nb, step=i, masks=int(mask_index.sum()), k=k, taken=int(transfer.sum()),
                                  high=int((conf >= (threshold or 2.0)).sum()), threshold=threshold))
            eos = cur == eos_token_id
            if bool(eos.any()):  # eos with no mask before it: the block is done
                before = (cur == mask_id) & ~(eos.cumsum(0) > 0)
                if not bool(before.any()):
                    if trace is not None:
                        trace.append(dict(block=nb, eos_break=True, masks_left=int((cur == mask_id).sum())))
                    break
        logits = model(x[cols].tolist(), cache, causal=True, use_cache=True)  # the block's K/V, the next seed
        next_token = int(logits[-1].argmax())
        if trace is not None:
            trace.append(dict(block=nb, seed=next_token))
        if bool((x[p:] == eos_token_id).any()):
            break
    ans = x[p:p + max_new_tokens].tolist()
    return next((ans[:j] for j, t in enumerate(ans) if t == eos_token_id), ans)


# --- the workload ------------------------------------------------------------------------------

L, BUDGET = 8, 96
LENGTHS = [1, 3, 5, 7, 8, 9, 12, 16, 17, 21, 24, 30]
MAX_NEW = [9, 36, 6, 30, 25, 27, 34, 7, 30, 29, 38, 16]
THRESHOLDS = [None, 0.3, 0.5, None, 0.7, 0.2]  # None: the fixed schedule (one mask a step)


STOPS = [EOS, 54, 70, 75]  # the row's eos (generate()'s eos_token_id; EOS: the config's, the others per row)


def workload():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(12, MASK, (n,), generator=g).tolist() for n in LENGTHS]
    prompts[6][-1] = EOS  # an eos in the prompt never stops the row
    return prompts, [(THRESHOLDS[i % len(THRESHOLDS)], n, STOPS[i % len(STOPS)]) for i, n in enumerate(MAX_NEW)]


def nemotron_model(seed: int = 0):
    model = tiny_model(seed, **ACTIVE_ROPE)  # positions past 8: the q scaling acts in every row
    with torch.no_grad():
        model.lm_head.weight[EOS].mul_(1.3)  # eos now and then
    return model


def params(row):
    threshold, n, stop = row
    return SamplingParams(max_new_tokens=n, policy="fixed" if threshold is None else "threshold",
                          threshold=0.9 if threshold is None else threshold,
                          stop_token_ids=None if stop == EOS else [stop])


@pytest.fixture(scope="module")
def model():
    return nemotron_model(0)


@pytest.fixture(scope="module")
def references(model):
    ref, trace = PublishedNemotron(model), []
    prompts, rows = workload()
    outs = []
    for i, (prompt, (threshold, n, stop)) in enumerate(zip(prompts, rows)):
        start = len(trace)
        outs.append(generate(ref, prompt, n, L, threshold, eos_token_id=stop, trace=trace))
        for t in trace[start:]:
            t["row"] = i
    return prompts, rows, outs, trace


def test_the_transcription_forward_equals_the_engine(model):
    """The transcription's two attentions against the engine's forward at 1e-12: a causal
    prefill into the cache, then a block bidirectional over it, as one causal-context mask."""
    ref = PublishedNemotron(model)
    T, B = 21, 5
    ids = torch.randint(0, VOCAB, (T,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(ids[None], torch.arange(T)[None], context_mask(T, B)[None, None])[0]
        causal = model(ids[None], torch.arange(T)[None], torch.ones(T, T).tril().bool()[None, None])[0]
    cache = {}
    torch.testing.assert_close(causal[:T - B], ref(ids[:T - B].tolist(), cache, causal=True, use_cache=True),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours[T - B:], ref(ids[T - B:].tolist(), cache, causal=False, use_cache=False),
                               rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(causal[T - B:], ref(ids[T - B:].tolist(), cache, causal=True, use_cache=True),
                               rtol=1e-12, atol=1e-12)


def test_the_workload_exercises_every_published_rule(references):
    prompts, rows, outs, trace = references
    steps = [t for t in trace if "step" in t]
    assert any(len(o) < n for o, (_, n, _) in zip(outs, rows))  # rows stopped at their eos
    assert any(len(o) == 0 for o in outs)  # a seed that is the eos
    assert any(t.get("eos_break") and t["masks_left"] > 0 for t in trace)  # eos with no mask before it ends a block
    assert any(len(o) > 2 * L for o in outs)  # several blocks
    fixed = [t for t in steps if t["threshold"] is None]
    assert fixed and all(t["k"] == 1 for t in fixed if t["step"] < L - 1)  # L-1 masks over L steps: one a step
    thr = [t for t in steps if t["threshold"] is not None]
    assert any(t["taken"] > 1 for t in thr)  # the threshold took several
    assert any(t["high"] == 0 and t["taken"] == 1 for t in thr)  # the most confident one alone
    assert any(t["high"] < t["masks"] and t["taken"] < t["masks"] for t in thr)
    assert EOS in prompts[6] and len(outs[6]) > 0


@pytest.mark.parametrize("scheduler, cache", [("blockserve", "persistent"), ("static", "persistent"),
                                              ("sequential", "persistent"), ("blockserve", "none"),
                                              ("static", "refresh"), ("sequential", "dual")])
def test_one_mixed_batch_equals_the_published_loop(model, references, scheduler, cache):
    prompts, rows, outs, _ = references
    cfg = EngineConfig(block_length=L, steps_per_block=L, cache=cache, scheduler=scheduler,
                       token_budget=BUDGET if scheduler == "blockserve" else 4096, max_batch_size=6)
    eng = Engine(model, cfg, record_batches=True)
    got = eng.generate(prompts, [params(r) for r in rows])
    if scheduler != "sequential":
        assert max(len(b.request_ids) for b in eng.batch_log) > 1
    if scheduler == "blockserve":
        assert eng.scheduler.preemptions > 0
    assert [o.token_ids for o in got] == outs


def test_step_advance_and_one_row_at_a_time(model, references):
    """advance='step' (rows join and leave at any step) and each row alone: the same tokens."""
    prompts, rows, outs, _ = references
    cfg = EngineConfig(block_length=L, steps_per_block=L, cache="persistent", advance="step", token_budget=BUDGET,
                       max_batch_size=4)
    got = Engine(model, cfg).generate(prompts, [params(r) for r in rows])
    assert [o.token_ids for o in got] == outs
    alone = EngineConfig(block_length=L, steps_per_block=L, cache="persistent")
    for i in (0, 4, 9):
        assert Engine(model, alone).generate([prompts[i]], params(rows[i]))[0].token_ids == outs[i]


def test_decodings_it_does_not_serve_are_refused(model):
    eng = Engine(model, EngineConfig(block_length=L, steps_per_block=L, cache="persistent"))
    for bad, match in ((SamplingParams(max_new_tokens=8, first_position=False), "first_position"),
                       (SamplingParams(max_new_tokens=8, sub_block_length=4), "one block at a time"),
                       (SamplingParams(max_new_tokens=8, block_add_threshold=0.1, policy="threshold"), "")):
        out = eng.generate([[20, 21]], bad)[0]
        assert out.finish_reason == "error" and match in out.error, out.error
    assert "empty prompt" in eng.generate([[]], SamplingParams(max_new_tokens=8))[0].error
    fewer = Engine(model, EngineConfig(block_length=L, steps_per_block=L // 2, cache="persistent"))
    assert "steps_per_block=4" in fewer.generate([[20, 21]], SamplingParams(max_new_tokens=8, policy="fixed"))[0].error
    assert fewer.generate([[20, 21]], SamplingParams(max_new_tokens=8, policy="threshold"))[0].error is None
    full = Engine(model, EngineConfig(block_length=L, steps_per_block=L, cache="none", canvas="full"))
    assert "canvas" in full.generate([[20, 21]], SamplingParams(max_new_tokens=8))[0].error


def test_the_causal_context_mask():
    """engine.batch.AttentionMask under a causal-context family: left padding never seen, the
    prefix causal, the current block (its first position `context`) bidirectional and seeing
    the whole prefix."""
    from engine.batch import AttentionMask

    lens, W = torch.tensor([7, 5]), 7
    m = AttentionMask.build(lens, torch.tensor([3, 1]), W, 4, True, context=lens - 4)
    got = m.rows()[:, 0]
    for i, n in enumerate(lens.tolist()):
        s = W - n
        want = context_mask(n, 4)
        assert torch.equal(got[i, s:, s:], want) and not got[i, :, :s].any()


@pytest.mark.parametrize("cache", ["persistent", "none"])
def test_the_runner_runs_the_causal_context_attention(model, cache):
    """ModelRunner.forward on a batch of rows of different lengths: the current block
    bidirectional over a causal prefix (generate()'s denoising step): each row's block logits
    equal the transcription's, the prefix prefilled causally, at 1e-12; at the block's
    first step its position 0 reads the causal logit of the column before (the seed)."""
    prompts = [[20 + j for j in range(n)] for n in (3, 9, 6)]
    eng = Engine(model, EngineConfig(block_length=L, steps_per_block=L, cache=cache))
    for p in prompts:
        eng.add_request(p, SamplingParams(max_new_tokens=L))
    for req in eng._intake:  # admitted as step() admits them, the batch laid out as its run() does
        eng.admit(req)
    eng._form_batch()
    b = eng.batch
    with torch.no_grad():
        bidir = eng.runner.forward(b)
    ref = PublishedNemotron(model)
    assert sorted(len(r.prompt) for r in b.rows) == [3, 6, 9]
    for i, p in enumerate(r.prompt for r in b.rows):  # the batch's slot order
        block = [MASK] * L
        cache = {}
        seed = ref(p, cache, causal=True, use_cache=True)[-1]  # at a block's first step position 0 reads the seed's
        want = ref(block, dict(cache), causal=False, use_cache=False)
        torch.testing.assert_close(bidir[i, 0], seed, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(bidir[i, 1:], want[1:], rtol=1e-12, atol=1e-12)
        assert not torch.allclose(bidir[i, 1:], ref(block, dict(cache), causal=True, use_cache=False)[1:])
