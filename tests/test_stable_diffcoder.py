"""Issue 54: Stable-DiffCoder (ByteDance-Seed/Stable-DiffCoder-8B-Instruct; config.json
model_type "llama", architectures ["StableDiffcoderForCausalLM"]) exact against its published
decoding, and a plain Llama config.json never taken for it (nor served).

`DiffulexStableDiffCoder` is written from SJTU-DENG-Lab/Diffulex (184ba97)
diffulex/model/stable_diffcoder.py over the weights under their checkpoint names: Llama's
layer (q/k/v/o and the SwiGLU MLP without bias, rotate-half RoPE of get_rope's neox style,
attention scaled by head_dim ** -0.5 under the block-causal 0/1 mask, GQA), final RMSNorm,
untied lm_head; float64, K/V cached by `store=True` forwards.

`diffulex_generate` transcribes Diffulex's `stable_diffcoder` sampler
(diffulex/sampler/stable_diffcoder.py over base/core.py `sample_tokens` at temperature 0:
the mask token's logit at -inf, the argmax with ties to the highest id, its probability;
commit every mask whose confidence is strictly greater than accept_threshold, else the
single most confident one) inside its request's layout (diffulex/engine/request.py: blocks
at absolute positions, the prompt's last block padded with masks and editable from the
prompt's end, the prompt's complete blocks prefilled), one block in the buffer (Diffulex's
multi-block buffer is not served), stop ids checked after each block. Rows of another rule
(the fixed schedule's top k, LLaDA's) share the batch, checked against the fixed-schedule
loop of tests/test_dream_reasoner.py. No HF generate() of this model was located."""
from __future__ import annotations

import pytest
import torch

import published
from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model
from engine.models.families import BlockLayout, ConfigRefused, FamilyNotSupported, ThresholdRule, family_for
from test_dream_reasoner import DiffulexDreamReasoner, block_diffusion_generate, block_mask, never_proposes_mask
from test_dream_reasoner import diffulex_generate as dream_reasoner_generate

torch.set_num_threads(1)
VOCAB, MASK = 96, 95
FOLDER = "ByteDance-Seed__Stable-DiffCoder-8B-Instruct"


def tiny_coder(**kw) -> ModelConfig:
    """Llama's layer at toy size: GQA 4:2, head_dim 8, theta 5e5, untied."""
    base = dict(model_type="stable_diffcoder", vocab_size=VOCAB, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
                intermediate_size=48, mask_token_id=MASK, eos_token_id=2, max_seq_len=1024, rope_theta=5e5,
                rms_norm_eps=1e-6, dllm_attention="block_causal")
    return ModelConfig(**{**base, **kw})


# StableDiffCoderForDiffusionLM.forward + lm_head over the checkpoint tensors: Diffulex's
# dream_reasoner forward without the q/k norm (this config has none)
DiffulexStableDiffCoder = DiffulexDreamReasoner


def diffulex_generate(model, prompt, gen_length, block_length, threshold, stop_ids, mask_id=MASK, trace=None):
    """StableDiffCoderSampler: DreamReasoner's sampler whose _compute_accepted_ids always
    takes the most confident token when none is over the threshold (no semi-complete test)."""
    return dream_reasoner_generate(model, prompt, gen_length, block_length, threshold, stop_ids, mask_id, trace,
                                   semi=lambda prev, mask_id: True)


# --- the workload ---------------------------------------------------------------------------

LENGTHS = [1, 3, 4, 6, 9, 13, 16, 18, 23, 29, 32, 37]
MAX_NEW = [9, 5, 3, 14, 20, 11, 7, 26, 17, 12, 4, 30]
RULES = ["threshold", "fixed", "threshold", "threshold"]
THRESHOLDS = [0.5, 0.3, 0.7, 0.9, 0.6, 0.2]
SHAPES = [(4, 4), (8, 3)]  # (block length, steps: the fixed rows' schedule; the threshold rule has none)


@pytest.fixture(scope="module")
def model():
    return never_proposes_mask(build_model(tiny_coder(), dtype=torch.float64, seed=5))


@pytest.fixture(scope="module")
def stops(model):
    """Two tokens the seeded model emits in a few rows (not most), standing for Seed's eos."""
    prompts, rows = workload()
    ref, counts = DiffulexStableDiffCoder(model), {}
    for p, (_, t, n) in zip(prompts, rows):
        for tok in set(diffulex_generate(ref, p, n, 4, t, [])):
            counts[tok] = counts.get(tok, 0) + 1
    few = sorted((c, t) for t, c in counts.items() if 2 <= c <= 5)
    assert len(few) >= 2, counts
    return [few[-1][1], few[-2][1]]


def workload(seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(14, MASK, (n,), generator=g).tolist() for n in LENGTHS]
    rows = [(RULES[i % len(RULES)], THRESHOLDS[i % len(THRESHOLDS)], n) for i, n in enumerate(MAX_NEW)]
    return prompts, rows


@pytest.fixture(scope="module")
def refs(model, stops):
    prompts, rows = workload()
    out = {}
    for L, S in SHAPES:
        ref, trace = DiffulexStableDiffCoder(model), []
        outs = [diffulex_generate(ref, p, n, L, t, stops, trace=trace) if rule == "threshold"
                else block_diffusion_generate(ref, p, n, L, S, "low_confidence_static", t, stop_ids=stops)
                for p, (rule, t, n) in zip(prompts, rows)]
        out[(L, S)] = (prompts, rows, outs, trace)
    return out


# --- tests -----------------------------------------------------------------------------------

def test_forward_equals_diffulex_model(model):
    ref = DiffulexStableDiffCoder(model)
    ids = torch.randint(0, MASK + 1, (13,), generator=torch.Generator().manual_seed(1))
    bm = block_mask(4, 4)[:13, :13]
    with torch.no_grad():
        ours = model(ids[None], torch.arange(13)[None], bm.bool()[None, None])[0]
    torch.testing.assert_close(ours, ref(ids, torch.arange(13), bm), rtol=1e-12, atol=1e-12)
    cache = {}
    ref(ids[:8], torch.arange(8), bm[:8, :8], cache, store=True)
    torch.testing.assert_close(ours[8:12], ref(ids[8:12], torch.arange(8, 12), bm[8:12, :12], cache),
                               rtol=1e-12, atol=1e-12)
    assert bool((torch.softmax(ours, -1)[:, MASK] == 0).all())  # Diffulex's -inf on the mask changes nothing


def test_the_workload_exercises_the_sampler(refs):
    """The sampler's two branches (every mask over the threshold; the single most confident
    one), stops, several blocks and partial prompt blocks."""
    for (L, S), (prompts, rows, outs, trace) in refs.items():
        assert any(t["high"] == 0 and t["taken"] == 1 for t in trace), L  # the most confident one
        assert any(t["high"] > 1 and t["taken"] == t["high"] < t["masks"] for t in trace), L  # all over it, not all
        assert any(t["lead"] > 0 for t in trace), L
        assert any(len(o) < n for o, (_, _, n) in zip(outs, rows)), L  # some rows stopped
        assert any(len(o) == n for o, (_, _, n) in zip(outs, rows)), L
        assert any(len(o) > L for o in outs), L


@pytest.mark.parametrize("L,S", SHAPES)
@pytest.mark.parametrize("scheduler", ["blockserve", "static", "sequential"])
def test_one_mixed_batch_equals_diffulex(model, refs, stops, scheduler, L, S):
    """12 prompts (the family's rule at thresholds 0.2 to 0.9, and fixed-schedule rows) in one
    engine under each scheduler, persistent cache: Diffulex's tokens; blockserve under a
    small token budget evicts and readmits rows."""
    prompts, rows, outs, _ = refs[(L, S)]
    cfg = EngineConfig(block_length=L, steps_per_block=S, cache="persistent", scheduler=scheduler,
                       token_budget=84 if scheduler == "blockserve" else 4096, max_batch_size=6)
    eng = Engine(model, cfg, record_batches=True)
    got = eng.generate(prompts, [SamplingParams(max_new_tokens=n, policy=rule, threshold=t, stop_token_ids=stops)
                                 for rule, t, n in rows])
    if scheduler != "sequential":
        assert max(len(b.request_ids) for b in eng.batch_log) > 1
    if scheduler == "blockserve":
        assert eng.scheduler.preemptions > 0
    assert [o.token_ids for o in got] == outs
    assert [o.finish_reason for o in got] == ["stop" if len(o) < n else "length" for o, (_, _, n) in zip(outs, rows)]


# --- config.json: never an autoregressive Llama ------------------------------------------------

def test_the_rebuilt_config_is_stable_diffcoder():
    """The config.json rebuilt from the located values (model_type llama) is Stable-DiffCoder's:
    block-causal blocks at absolute positions, no shift, the strict threshold at least the
    most confident, mask <[MASK_TOKEN]> (5 where no tokenizer names it), eos 2, theta 5e5."""
    hf = published.config(FOLDER)
    assert hf["model_type"] == "llama"
    cfg = ModelConfig.from_hf(hf)
    fam = cfg.family
    assert (fam.name, fam.shift_logits, fam.first_position, fam.blocks, fam.threshold, fam.mask_token) == (
        "Stable-DiffCoder", False, False, BlockLayout.ABSOLUTE, ThresholdRule.GREATER_AT_LEAST_TOP1,
        "<[MASK_TOKEN]>")
    assert (cfg.block_causal, cfg.qk_norm, cfg.qkv_bias, cfg.mask_token_id, cfg.eos_token_id, cfg.rope_theta) == (
        True, False, False, 5, 2, 500000.0)
    assert fam.tokenizer_ids(hf, {"<[MASK_TOKEN]>": 7}, None) == {"mask_token_id": 7}  # the tokenizer's wins
    # the auto_map alone is enough (Diffulex's is_stable_diffcoder_config)
    assert family_for({**hf, "architectures": ["LlamaForCausalLM"]}).name == "Stable-DiffCoder"


@pytest.mark.parametrize("arch", [["LlamaForCausalLM"], None, ["MistralForCausalLM"]])
def test_a_plain_llama_config_is_refused(arch):
    """model_type llama without Stable-DiffCoder's architecture or auto_map: refused as an
    autoregressive Llama, never served as Stable-DiffCoder (nor as anything else)."""
    hf = {k: v for k, v in published.config(FOLDER).items() if k not in ("architectures", "auto_map")}
    if arch is not None:
        hf["architectures"] = arch
    with pytest.raises(FamilyNotSupported, match="an autoregressive Llama"):
        ModelConfig.from_hf(hf)


@pytest.mark.parametrize("change,message", [({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
                                            ({"attention_bias": True}, "attention_bias"),
                                            ({"mlp_bias": True}, "mlp_bias"),
                                            ({"hidden_act": "gelu"}, "hidden_act"),
                                            ({"sliding_window": 4096}, "sliding_window")])
def test_settings_the_engine_would_ignore_are_refused(change, message):
    with pytest.raises(ConfigRefused, match=message):
        ModelConfig.from_hf({**published.config(FOLDER), **change})
