"""Issue 54: iLLaDA (GSAI-ML/iLLaDA-8B-Instruct, -Base; architecture ILLaDAForCausalLM) exact
against its published code, and told apart from LLaDA and Llama configs.

`PublishedILLaDA` is written from the published modeling file of ILLaDAForCausalLM (public
code index; never run) over the checkpoint tensors as blockray writes them (save_model, read
back by their published names: model.embed_tokens, model.layers.{i}.input_layernorm /
self_attn.{q,k,v,o}_proj / post_attention_layernorm / mlp.{gate,up,down}_proj, model.norm, and
no lm_head.weight: tied to the embedding as config.json says): ILLaDARMSNorm, rotate-half
RoPE with head_dim = hidden / heads and the default rope type, repeat_kv for GQA, SDPA with
is_causal=False and no mask (every position sees every position), SwiGLU without bias, no
logit shift; float64 throughout (the published norm's and rotary's float32 upcasts are
float64 here, as the engine runs a float64 model).

`generate` transcribes ML-GSAI/LLaDA generate.py's `generate()` (which the iLLaDA release note
says iLLaDA reuses with mask_id=5) for one request, no padding: the canvas is the prompt and
gen_length masks; per block, `get_num_transfer_tokens` over the block's masks and `steps`
steps, each a forward over the whole canvas, `add_gumbel_noise` (exp(logits) / (-log u) **
temperature) and argmax, the confidence of low_confidence (softmax probability of x0) or
random remasking, -inf past the block and off the masks, top-k of the schedule's count. The
mask is 5 as published. Rows of LLaDA's other rules share the batch: Fast-dLLM's threshold
and factor selections (`transfer_threshold`, `transfer_factor` of tests/test_reference_decoding.py,
looping until the block has no mask).

Two conventions are the engine's own (tests/test_reference_decoding.py): the noise u and the
random-remasking draws come from a generator seeded per (request seed, block offset, step)
over the block instead of torch's global RNG, and a row's answer ends at its first stop id
(generate() has no stop; the engine stops a row after the block that emits one). The
engine's ONE mixed batch of 12 prompts under blockserve (a token budget that makes rows
wait; the published canvas never grows, so nothing is preempted), static and sequential,
no cache (generate() has none), gives exactly these tokens."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

import published
from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model, save_model
from engine.models.families import BlockLayout, ConfigRefused, FamilyNotSupported, ThresholdRule, family_for
from test_reference_decoding import num_transfer_tokens, transfer_factor, transfer_threshold

torch.set_num_threads(1)
FOLDER = "GSAI-ML__iLLaDA-8B-Instruct"
VOCAB, MASK = 96, 5  # the published mask id: <[MASK]>, added token 5
STOP = 63  # a token the seeded model emits now and then stands for the published eos 2
L, S = 8, 4  # blocks of 8, 4 steps a block: two tokens a step on the fixed schedule
SEED = 0


def tiny_illada(**kw) -> ModelConfig:
    """iLLaDA's layer at toy size: GQA 4:2, tied embeddings, theta 5e5, eps 1e-6."""
    base = dict(model_type="illada", vocab_size=VOCAB, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
                intermediate_size=48, mask_token_id=MASK, eos_token_id=STOP, max_seq_len=1024, rope_theta=5e5,
                rms_norm_eps=1e-6, tie_word_embeddings=True)
    return ModelConfig(**{**base, **kw})


def illada_model(seed):
    """A random tied model, peaked like a trained one (the embedding, hence the head, x3),
    that never proposes the mask: its embedding row, hence its logit, is zero (a tied
    random model otherwise predicts each position's own input, the mask at every mask)."""
    model = build_model(tiny_illada(), dtype=torch.float64, seed=seed)
    with torch.no_grad():
        model.embed.weight.mul_(3.0)
        model.embed.weight[MASK] = 0.0
    return model


class PublishedILLaDA:
    """ILLaDAForCausalLM.forward at inference (no attention mask, positions 0..T-1)."""

    def __init__(self, tensors, hf):
        self.w, self.hf = tensors, hf

    def rms(self, x, key):
        return self.w[key] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.hf["rms_norm_eps"]))

    def __call__(self, ids):
        """Logits [T, V] of the canvas ids [T]."""
        hf, w = self.hf, self.w
        T, H, Hkv = ids.shape[0], hf["num_attention_heads"], hf["num_key_value_heads"]
        D = hf["hidden_size"] // H  # ILLaDAAttention.head_dim
        inv = 1.0 / (hf["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        emb = torch.cat([torch.arange(T, dtype=torch.float64)[:, None] * inv] * 2, -1)
        cos, sin = emb.cos(), emb.sin()

        def rotary(t):
            return t * cos + torch.cat([-t[..., D // 2:], t[..., : D // 2]], -1) * sin

        def repeat_kv(t):  # [Hkv, T, D] -> [H, T, D], each K/V head for its H / Hkv query heads in turn
            return t[:, None].expand(Hkv, H // Hkv, T, D).reshape(H, T, D)

        h = w["model.embed_tokens.weight"][ids]
        for i in range(hf["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = self.rms(h, p + "input_layernorm.weight")
            def proj(m, n):
                return F.linear(x, w[p + f"self_attn.{m}_proj.weight"]).view(T, n, D).transpose(0, 1)

            q, k, v = rotary(proj("q", H)), repeat_kv(rotary(proj("k", Hkv))), repeat_kv(proj("v", Hkv))
            att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(D), -1) @ v  # SDPA, is_causal=False, no mask
            h = h + F.linear(att.transpose(0, 1).reshape(T, H * D), w[p + "self_attn.o_proj.weight"])
            x = self.rms(h, p + "post_attention_layernorm.weight")
            gate, up = F.linear(x, w[p + "mlp.gate_proj.weight"]), F.linear(x, w[p + "mlp.up_proj.weight"])
            h = h + F.linear(F.silu(gate) * up, w[p + "mlp.down_proj.weight"])
        head = w["model.embed_tokens.weight"] if hf["tie_word_embeddings"] else w["lm_head.weight"]
        return F.linear(self.rms(h, "model.norm.weight"), head)


def noise(sp, block, step):
    """The engine's noise for (request seed, block offset, step): u over the block's logits,
    then the random-remasking draws (tests/test_reference_decoding.py's convention)."""
    g = torch.Generator().manual_seed(hash((sp.seed, block * L, step)) & (2**62 - 1))
    u = torch.rand((L, VOCAB), generator=g, dtype=torch.float64) if sp.temperature > 0 else None
    drawn = torch.rand(L, generator=g, dtype=torch.float64) if sp.remasking == "random" else None
    return u, drawn


def generate(model, prompt, sp, trace=None):
    """generate.py generate(steps = K S, gen_length = K L, block_length = L, temperature,
    remasking, mask_id=5) for one request; the answer as the engine returns it."""
    p, K = len(prompt), math.ceil(sp.max_new_tokens / L)
    x = torch.tensor(prompt + [MASK] * (K * L))
    for b in range(K):
        lo, hi = p + b * L, p + (b + 1) * L
        schedule = num_transfer_tokens(int((x[lo:hi] == MASK).sum()), S)  # get_num_transfer_tokens
        for i in range(S):
            mask_index = x == MASK
            logits = model(x)
            u, drawn = noise(sp, b, i)
            with_noise = logits.clone()
            if u is not None:  # add_gumbel_noise on the block (the only columns that can be taken)
                with_noise[lo:hi] = logits[lo:hi].exp() / (-torch.log(u)) ** sp.temperature
            x0 = with_noise.argmax(-1)
            if sp.remasking == "low_confidence":
                x0_p = torch.softmax(logits, -1).gather(-1, x0[:, None])[:, 0]
            else:
                x0_p = torch.full((x.shape[0],), -math.inf, dtype=torch.float64)
                x0_p[lo:hi] = drawn
            x0_p[hi:] = -math.inf
            x0 = torch.where(mask_index, x0, x)
            confidence = torch.where(mask_index, x0_p, torch.tensor(-math.inf, dtype=torch.float64))
            take = torch.topk(confidence, k=schedule[i]).indices
            if trace is not None:
                trace.append(dict(rule="generate", taken=len(take), masks=int(mask_index[lo:hi].sum()),
                                  mask_taken=bool((x0[take] == MASK).any())))
            x[take] = x0[take]
    return answer(x[p:].tolist(), sp)


def fast_dllm(model, prompt, sp, trace=None):
    """Fast-dLLM's generate (no cache) for LLaDA: each block decoded until it has no mask,
    get_transfer_index's threshold or factor rule on the block (temperature 0)."""
    p, K = len(prompt), math.ceil(sp.max_new_tokens / L)
    x = torch.tensor(prompt + [MASK] * (K * L))
    for b in range(K):
        lo, hi = p + b * L, p + (b + 1) * L
        while (x[lo:hi] == MASK).any():
            logits = model(x)[lo:hi]
            x0 = logits.argmax(-1)
            conf = torch.softmax(logits, -1).gather(-1, x0[:, None])[:, 0].tolist()
            masked = [j for j in range(L) if x[lo + j] == MASK]
            take = (transfer_threshold(conf, masked, sp.threshold) if sp.policy == "threshold"
                    else transfer_factor(conf, masked, sp.factor))
            if trace is not None:
                trace.append(dict(rule=sp.policy, taken=len(take), masks=len(masked),
                                  mask_taken=any(int(x0[j]) == MASK for j in take)))
            for j in take:
                x[lo + j] = x0[j]
    return answer(x[p:].tolist(), sp)


def answer(gen, sp):
    stops = [j for j, t in enumerate(gen) if t in sp.stop_token_ids]
    return gen[: min(stops[0], sp.max_new_tokens)] if stops else gen[: sp.max_new_tokens]


# iLLaDA's published loop (generate(), low_confidence at temperature 0, as the README's example), its
# random remasking and Gumbel noise, and LLaDA's other rules (Fast-dLLM's threshold and factor)
FIXED, RANDOM = dict(policy="fixed"), dict(policy="fixed", remasking="random")
KINDS = [FIXED, dict(policy="threshold", threshold=0.3), dict(RANDOM, seed=3), dict(policy="factor", factor=1.5),
         dict(FIXED, temperature=0.7, seed=5), FIXED, FIXED, dict(policy="threshold", threshold=0.8),
         dict(RANDOM, seed=4), dict(policy="factor", factor=0.5), dict(FIXED, temperature=0.5, seed=6), FIXED]
LENGTHS = [3, 9, 17, 5, 12, 30, 7, 21, 4, 14, 26, 10]
MAX_NEW = [16, 9, 24, 20, 8, 13, 31, 6, 17, 22, 12, 27]


def workload():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(6, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    prompts[4][-1] = STOP  # a stop id in the prompt never stops the row
    params = [SamplingParams(max_new_tokens=n, stop_token_ids=[STOP], **KINDS[i])
              for i, n in enumerate(MAX_NEW)]
    return prompts, params


@pytest.fixture(scope="module")
def model():
    return illada_model(SEED)


@pytest.fixture(scope="module")
def checkpoint(model, tmp_path_factory):
    """The tiny model as a checkpoint on disk: {published name: tensor} and its config.json."""
    root = tmp_path_factory.mktemp("illada")
    save_model(model, str(root))
    with safe_open(os.path.join(root, "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k).double() for k in f.keys()}
    with open(os.path.join(root, "config.json"), encoding="utf-8") as f:
        return tensors, json.load(f)


@pytest.fixture(scope="module")
def references(checkpoint):
    ref, trace = PublishedILLaDA(*checkpoint), []
    prompts, params = workload()
    outs = [(generate if sp.policy == "fixed" else fast_dllm)(ref, pr, sp, trace) for pr, sp in zip(prompts, params)]
    return prompts, params, outs, trace


def test_the_checkpoint_has_the_published_tensor_names(checkpoint):
    """save_model writes ILLaDAForCausalLM's names, and no lm_head (tied)."""
    tensors, hf = checkpoint
    assert hf["architectures"] == ["ILLaDAForCausalLM"] and hf["tie_word_embeddings"] is True
    per_layer = {"input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert set(tensors) == {"model.embed_tokens.weight", "model.norm.weight"} | {
        f"model.layers.{i}.{m}.weight" for i in range(2) for m in per_layer}
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (2 * 8, 32)  # 2 K/V heads of 32 / 4


def test_forward_equals_the_published_model(model, checkpoint):
    ref = PublishedILLaDA(*checkpoint)
    ids = torch.randint(0, VOCAB, (13,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids[None], torch.arange(13)[None], torch.ones(1, 1, 1, 13, dtype=torch.bool))[0]
    torch.testing.assert_close(ours, ref(ids), rtol=1e-12, atol=1e-12)
    # bidirectional: the first position's logits move with the last token
    other = ids.clone()
    other[-1] = (other[-1] + 1) % VOCAB
    assert not torch.allclose(ref(other)[0], ref(ids)[0])


def test_the_workload_exercises_every_rule(references):
    prompts, params, outs, trace = references
    assert not any(t["mask_taken"] for t in trace)  # the model never proposed the mask where it was taken
    assert any(len(o) < sp.max_new_tokens for o, sp in zip(outs, params))  # stops
    assert any(len(o) > 2 * L for o in outs)  # several blocks
    gen = [t for t in trace if t["rule"] == "generate"]
    assert {t["taken"] for t in gen} == {2}  # the fixed schedule: 8 masks over 4 steps
    thr = [t for t in trace if t["rule"] == "threshold"]
    assert any(t["taken"] > 1 for t in thr) and any(t["taken"] == 1 and t["masks"] > 1 for t in thr)
    assert [t for t in trace if t["rule"] == "factor"]
    assert {sp.remasking for sp in params} == {"low_confidence", "random"} and any(sp.temperature for sp in params)
    assert STOP in prompts[4] and outs[4]  # the prompt's stop id ends nothing


@pytest.mark.parametrize("scheduler", ["blockserve", "static", "sequential"])
def test_one_mixed_batch_equals_the_published_loop(model, references, scheduler):
    prompts, params, outs, _ = references
    cfg = EngineConfig(block_length=L, steps_per_block=S, cache="none", scheduler=scheduler,
                       token_budget=120 if scheduler == "blockserve" else 4096, max_batch_size=6)
    eng = Engine(model, cfg, record_batches=True)
    assert eng.full_canvas  # the published loop's canvas: the prompt and every block of masks
    got = eng.generate(prompts, params)
    if scheduler != "sequential":
        assert max(len(b.request_ids) for b in eng.batch_log) > 1
    if scheduler == "blockserve":  # a budget that makes rows wait (a full-canvas row's width is fixed at
        # admission, p + K L: nothing grows, so blockserve never preempts one)
        assert all(b.cost <= cfg.token_budget for b in eng.batch_log)
        assert max(len(b.request_ids) for b in eng.batch_log) < min(cfg.max_batch_size, len(prompts))
        assert eng.scheduler.preemptions == 0
    assert {o.finish_reason for o in got} == {"stop", "length"}
    assert [o.token_ids for o in got] == outs


# --- config.json: iLLaDA, not LLaDA, not Llama ----------------------------------------------

def test_the_published_config_parses_as_illada():
    hf = published.config(FOLDER)
    cfg = ModelConfig.from_hf(hf)
    fam = cfg.family
    assert (fam.name, cfg.model_type) == ("iLLaDA", "illada")
    assert (fam.shift_logits, fam.first_position, fam.blocks, fam.threshold, cfg.block_causal) == (
        False, False, BlockLayout.AFTER_PROMPT, ThresholdRule.AT_LEAST_TOP1, False)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
        155136, 4096, 32, 32, 8, 128)
    assert cfg.tie_word_embeddings and not (cfg.qkv_bias or cfg.linear_bias or cfg.attn_out_bias or cfg.qk_norm)
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id, cfg.max_seq_len) == (5, 2, 1, 8192)
    assert "lm_head.weight" not in fam.checkpoint_shapes(cfg)
    # the mask is the tokenizer's <[MASK]> where tokenizer files name it
    assert fam.tokenizer_ids(hf, {"<[MASK]>": 5}, 2) == {"mask_token_id": 5}
    assert fam.tokenizer_ids(hf, {"<[MASK]>": 7}, 2) == {"mask_token_id": 7}


def test_an_illada_config_is_not_llada_nor_llama():
    hf = published.config(FOLDER)
    assert family_for(hf).name == "iLLaDA"
    # whatever its unconfirmed model_type says, the architecture decides: never LLaDA's HF-keys refusal
    assert family_for({**hf, "model_type": "llada"}).name == "iLLaDA"
    assert family_for({k: v for k, v in hf.items() if k != "model_type"}).name == "iLLaDA"
    assert family_for({k: v for k, v in hf.items() if k != "architectures"}).name == "iLLaDA"  # save_model's own
    with pytest.raises(FamilyNotSupported):  # model_type "illada" over another architecture
        family_for({**hf, "architectures": ["LlamaForCausalLM"]})
    # LLaDA's own published config stays LLaDA's
    assert family_for(published.config("GSAI-ML__LLaDA-8B-Instruct")).name == "LLaDA"
    # the same keys as an autoregressive Llama's config.json: not served, never decoded as iLLaDA
    llama = {**hf, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    with pytest.raises(FamilyNotSupported, match="model_type 'llama'"):
        ModelConfig.from_hf(llama)
    # model_type "illada" with another architecture is refused, not taken for iLLaDA
    with pytest.raises(ConfigRefused, match="architectures"):
        ModelConfig.from_hf({**hf, "architectures": ["ILLaDAForCausalLM", "LlamaForCausalLM"]})


@pytest.mark.parametrize("key,value", [("rope_scaling", {"rope_type": "linear", "factor": 2.0}),
                                       ("layer_norm_eps", 1e-5), ("attention_bias", True), ("mlp_bias", True),
                                       ("hidden_act", "gelu"), ("head_dim", 96), ("sliding_window", 4096),
                                       ("mask_schedule", "cosine")])
def test_a_key_the_engine_does_not_honour_is_refused(key, value):
    """Each changes the published network (or is unknown): refused naming the key."""
    with pytest.raises(ConfigRefused, match=key):
        ModelConfig.from_hf({**published.config(FOLDER), key: value})


def test_keys_that_cannot_change_the_math_are_accepted():
    hf = {**published.config(FOLDER), "attention_dropout": 0.0, "resid_pdrop": 0.0, "head_dim": 128,
          "layer_norm_eps": None, "rope_scaling": None, "hidden_act": "silu", "use_cache": False}
    assert ModelConfig.from_hf(hf).head_dim == 128
    with pytest.raises(KeyError, match="rope_theta"):  # Checkpoint.open: "config.json lacks 'rope_theta'"
        ModelConfig.parse({k: v for k, v in hf.items() if k != "rope_theta"}, family_for(hf))
