"""Issue 38: Fast-dLLM v2 (model_type Fast_dLLM_Qwen) exact against its published code.

`PublishedFastDLLMv2` is written from the published modeling.py over the weights under their
checkpoint names: Qwen2's layer (q/k/v with bias, o without), rotate-half RoPE, SDPA under
the eval mask (block(q) >= block(k), the query positions offset by the cached length, the
block size the caller passes: 32 unless given), a DynamicCache that forwards with
`update_past_key_values=True` append to and the others only read; float64 throughout.
`batch_sample` transcribes v2/generation_functions.py for a batch of one: the prompt's
complete blocks prefilled when the prompt is longer than a block (and, when it ends on a
block boundary, the argmax of its last logit opening the first block), each block decoded
in small blocks left to right (logits shifted as Dream's; every masked position whose
probability is strictly greater than the threshold, and the most probable one), once
complete run again to store its K/V and its last logit's argmax opening the next block
(the AR step), a stop token committed ending the request after its block; greedy
(temperature 0: the argmax and the full softmax). The engine's ONE mixed batch of 12
prompts under blockserve (with preemption), static and sequential, persistent cache, gives
exactly its tokens.

Its config.json is not in ../shared/checkpoints (SOURCE.md: no vendored copy): CONFIG below is
the one published in Satgoy152/DualDiffusion `FastDLLM_inferencing/Fast_dLLM_v2_7B/config.json`
(commit d3a3470), whose values are those the HF page shows (SOURCE.md)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model
from engine.models.families import BlockLayout, ConfigRefused, ThresholdRule

torch.set_num_threads(1)
VOCAB, MASK = 96, 95
STOP = 75  # a token the seeded model emits now and then stands for <|im_end|> 151645, batch_sample's stop_token
L, BUDGET, SEED = 8, 96, 0

CONFIG = {
    "architectures": ["Fast_dLLM_QwenForCausalLM"], "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration.Fast_dLLM_QwenConfig", "AutoModel": "modeling.Fast_dLLM_QwenModel",
                 "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM"},
    "bd_size": 32, "bos_token_id": 151643, "conplemenrary_mask": True, "eos_token_id": 151645, "hidden_act": "silu",
    "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944, "layer_types": ["full_attention"] * 28,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "Fast_dLLM_Qwen",
    "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4, "pad_token_id": 151645,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.53.1", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 152064}


def tiny_v2(**kw) -> ModelConfig:
    base = dict(model_type="Fast_dLLM_Qwen", vocab_size=VOCAB, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
                intermediate_size=48, mask_token_id=MASK, eos_token_id=STOP, max_seq_len=1024, rope_theta=1e6,
                rms_norm_eps=1e-6, qkv_bias=True, dllm_attention="block_causal")
    return ModelConfig(**{**base, **kw})


class PublishedFastDLLMv2:
    """Fast_dLLM_QwenForCausalLM.forward at inference; `cache` a DynamicCache ({layer: (K, V)})."""

    def __init__(self, model):
        cfg = model.config
        self.w = {cfg.family.checkpoint_name(n): p.detach().double() for n, p in model.named_parameters()}
        self.hf = cfg.to_hf()

    def rms(self, x, key):
        return self.w[key] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.hf["rms_norm_eps"]))

    def __call__(self, ids, cache, update_past_key_values=False, block_size=32):
        """Logits [T, V] of ids [T] placed after the cached columns."""
        hf, w = self.hf, self.w
        T, H, Hkv = ids.shape[0], hf["num_attention_heads"], hf["num_key_value_heads"]
        D = hf["hidden_size"] // H
        past = cache[0][0].shape[1] if 0 in cache else 0
        pos = torch.arange(past, past + T, dtype=torch.float64)
        inv = 1.0 / (hf["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
        emb = torch.cat([pos[:, None] * inv] * 2, -1)
        cos, sin = emb.cos(), emb.sin()
        q_idx, k_idx = torch.arange(T) + past, torch.arange(T + past)  # eval_mask / eval_block_diff_mask
        keep = (q_idx[:, None] // block_size) >= (k_idx[None] // block_size)
        additive = torch.zeros(T, T + past, dtype=torch.float64).masked_fill(~keep, float("-inf"))

        def rotary(t):
            return t * cos + torch.cat([-t[..., D // 2:], t[..., : D // 2]], -1) * sin

        h = w["model.embed_tokens.weight"][ids]
        for i in range(hf["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = self.rms(h, p + "input_layernorm.weight")
            proj = lambda m, n: F.linear(x, w[p + f"self_attn.{m}_proj.weight"], w[p + f"self_attn.{m}_proj.bias"]  # noqa: E731
                                         ).view(T, n, D).transpose(0, 1)
            q, k, v = rotary(proj("q", H)), rotary(proj("k", Hkv)), proj("v", Hkv)
            if i in cache:
                k, v = torch.cat([cache[i][0], k], 1), torch.cat([cache[i][1], v], 1)
            if update_past_key_values:
                cache[i] = (k, v)
            k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
            att = torch.softmax(q @ k.transpose(1, 2) * D ** -0.5 + additive, -1) @ v
            h = h + F.linear(att.transpose(0, 1).reshape(T, H * D), w[p + "self_attn.o_proj.weight"])
            x = self.rms(h, p + "post_attention_layernorm.weight")
            h = h + F.linear(F.silu(F.linear(x, w[p + "mlp.gate_proj.weight"])) * F.linear(x, w[p + "mlp.up_proj.weight"]),
                             w[p + "mlp.down_proj.weight"])
        return F.linear(self.rms(h, "model.norm.weight"), w["lm_head.weight"])


def batch_sample(model, prompt, block_size, max_new_tokens, small_block_size, threshold, mask_id=MASK,
                 stop_token=STOP, trace=None):
    """v2/generation_functions.py batch_sample for one request (temperature 0); returns the
    answer as the engine returns it: the first max_new_tokens tokens after the prompt,
    before the first stop token."""
    x = torch.tensor([prompt])
    p, cache = len(prompt), {}
    num_blocks = max_new_tokens // block_size + p // block_size
    if p > block_size:  # min_len > block_size: the prompt's complete blocks
        logits = model(x[0, :p // block_size * block_size], cache, update_past_key_values=True, block_size=block_size)
        if p % block_size == 0:
            x = torch.cat([x, logits[-1:].argmax(-1)[None]], 1)
            if trace is not None:
                trace.append(dict(ar=True, from_prefill=True))
    finished = False
    for block_idx in range(p // block_size, num_blocks):
        if finished:
            break
        x_t = torch.cat([x, torch.full((1, block_size - x.shape[1] % block_size), mask_id)], 1)
        while True:
            mask_idx = x_t[:, -block_size:] == mask_id
            if mask_idx.sum() == 0:
                if finished:
                    break
                logits = model(x_t[0, -block_size:], cache, update_past_key_values=True, block_size=block_size)
                x_t = torch.cat([x_t, logits[-1:].argmax(-1)[None]], 1)  # the AR step
                if trace is not None:
                    trace.append(dict(ar=True, from_prefill=False))
                break
            for sb in range(block_size // small_block_size):
                start = -block_size + sb * small_block_size
                end = None if block_size == (sb + 1) * small_block_size else start + small_block_size
                while True:
                    mask_idx = x_t[:, -block_size:] == mask_id
                    if mask_idx[:, start:end].sum() == 0:
                        break
                    logits = model(x_t[0, -block_size:], cache)[None]  # block_size: the forward's default
                    logits = torch.cat([logits[:, :1], logits[:, :-1]], 1)[:, start:end]
                    p_1t = torch.softmax(logits, -1)
                    x_1 = p_1t.argmax(-1)
                    x1_p = torch.gather(p_1t, -1, x_1[..., None]).squeeze(-1)
                    x1_p = torch.where(mask_idx[:, start:end], x1_p, -torch.inf)
                    unmask = x1_p > threshold
                    unmask[torch.arange(1), x1_p.argmax(-1)] = True
                    unmask = unmask & mask_idx[:, start:end]
                    x_t[:, start:end][unmask] = x_1[unmask]
                    finished = finished or bool(((x_1 == stop_token) & unmask).any())
                    if trace is not None:
                        trace.append(dict(ar=False, masks=int(mask_idx[:, start:end].sum()), taken=int(unmask.sum()),
                                          high=int((x1_p > threshold).sum()), sub=small_block_size, block=block_idx,
                                          lead=max(0, p - block_idx * block_size)))
        x = x_t
    ans = x[0, p:p + max_new_tokens].tolist()
    return next((ans[:j] for j, t in enumerate(ans) if t == stop_token), ans)


def v2_model(seed):
    """A random model that never proposes the mask token, peaked like a trained one."""
    model = build_model(tiny_v2(), dtype=torch.float64, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
        model.lm_head.weight[MASK] = 0.0
    return model


LENGTHS = [1, 3, 5, 7, 9, 12, 16, 17, 21, 24, 29, 35]  # < L, > L partial, 2L and 3L (an AR step from the prefill)
MAX_NEW = [9, 20, 6, 14, 25, 11, 18, 7, 30, 13, 22, 16]
SUBS = [2, 4, 8]  # small_block_size (8: the whole block)
THRESHOLDS = [0.5, 0.3, 0.7, 0.9, 0.4]


def workload():
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(14, MASK, (n,), generator=g).tolist() for n in LENGTHS]
    prompts[5][-1] = STOP  # a stop token in the prompt's tail never stops the row
    rows = [(SUBS[i % 3], THRESHOLDS[i % 5], n) for i, n in enumerate(MAX_NEW)]
    return prompts, rows


@pytest.fixture(scope="module")
def model():
    return v2_model(SEED)


@pytest.fixture(scope="module")
def references(model):
    ref, trace = PublishedFastDLLMv2(model), []
    prompts, rows = workload()
    # enough blocks for max_new_tokens past the prompt's tail (batch_sample decodes max_new // L of them)
    outs = [batch_sample(ref, p, L, n + 2 * L, sb, t, trace=trace)[:n] for p, (sb, t, n) in zip(prompts, rows)]
    return prompts, rows, outs, trace



def params(row):
    sb, threshold, n = row
    return SamplingParams(max_new_tokens=n, policy="threshold", threshold=threshold, sub_block_length=sb,
                          stop_token_ids=[STOP])


def test_forward_equals_the_published_model(model):
    ref = PublishedFastDLLMv2(model)
    ids = torch.randint(0, MASK, (13,), generator=torch.Generator().manual_seed(1))
    keep = (torch.arange(13)[:, None] // 4) >= (torch.arange(13)[None] // 4)
    with torch.no_grad():
        ours = model(ids[None], torch.arange(13)[None], keep[None, None])[0]
    torch.testing.assert_close(ours, ref(ids, {}, block_size=4), rtol=1e-12, atol=1e-12)
    cache = {}
    ref(ids[:8], cache, update_past_key_values=True, block_size=4)
    torch.testing.assert_close(ours[8:12], ref(ids[8:12], cache, block_size=4), rtol=1e-12, atol=1e-12)


def test_the_workload_exercises_every_published_rule(references):
    prompts, rows, outs, trace = references
    assert any(len(o) < n for o, (_, _, n) in zip(outs, rows))  # stops
    assert any(len(o) > 2 * L for o in outs)  # several blocks
    assert any(t["ar"] and t["from_prefill"] for t in trace) and any(t["ar"] and not t["from_prefill"] for t in trace)
    steps = [t for t in trace if not t["ar"]]
    assert any(t["high"] > 1 and t["taken"] > 1 for t in steps)  # the threshold took several
    assert any(t["high"] == 0 and t["taken"] == 1 for t in steps)  # the most probable one alone
    assert any(t["sub"] < L and t["masks"] < t["sub"] for t in steps)  # sub-blocks decoded one after another
    assert any(t["lead"] > 0 for t in steps)  # a prompt's tail in the first block
    assert STOP in prompts[5] and len(outs[5]) > L - len(prompts[5]) % L


@pytest.mark.parametrize("scheduler", ["blockserve", "static", "sequential"])
def test_one_mixed_batch_equals_the_published_loop(model, references, scheduler):
    prompts, rows, outs, _ = references
    cfg = EngineConfig(block_length=L, steps_per_block=L, cache="persistent", scheduler=scheduler,
                       token_budget=BUDGET if scheduler == "blockserve" else 4096, max_batch_size=6)
    eng = Engine(model, cfg, record_batches=True)
    got = eng.generate(prompts, [params(r) for r in rows])
    if scheduler != "sequential":
        assert max(len(b.request_ids) for b in eng.batch_log) > 1
    if scheduler == "blockserve":
        assert eng.scheduler.preemptions > 0
    assert [o.token_ids for o in got] == outs



def test_the_published_config_parses_as_fast_dllm_v2():
    cfg = ModelConfig.from_hf(CONFIG)
    fam = cfg.family
    assert (fam.shift_logits, fam.first_position, fam.blocks, fam.threshold, cfg.block_causal, cfg.qkv_bias) == (
        True, True, BlockLayout.ABSOLUTE, ThresholdRule.GREATER_AT_LEAST_TOP1, True, True)
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.head_dim, cfg.rope_theta) == (151665, 151645, 128, 1e6)
    with pytest.raises(ConfigRefused, match="use_sliding_window"):
        ModelConfig.from_hf({**CONFIG, "use_sliding_window": True})
    bad = SamplingParams(sub_block_length=3, max_new_tokens=4)
    out = Engine(build_model(tiny_v2(), dtype=torch.float64), EngineConfig(block_length=L, cache="persistent")).generate(
        [[20, 21]], bad)[0]
    assert out.finish_reason == "error" and "sub_block_length=3 must divide block_length=8" in out.error


def test_the_published_config_loads_and_runs_the_job(ray_local, tmp_path):
    """CONFIG (Fast-dLLM v2's config.json; its other files are in no stored source) shrunk as
    tests/test_published.py shrinks every published set, tiny weights under the family's
    names: load_model, the preflight and a 10-row job of pre-tokenized prompts (no
    tokenizer published), decoded as docs/models/fast_dllm_v2.md runs it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import published
    from engine import load_model
    from pipeline import DLLMProcessorConfig, run_offline
    from pipeline.preflight import preflight

    root = published.build_from_config(CONFIG, str(tmp_path / "fast_dllm_v2"))
    model, tok = load_model(root, dtype=torch.float32)
    assert tok is None and (model.config.family.name, model.config.mask_token_id) == ("Fast-dLLM v2", 151665)
    inp, out = str(tmp_path / "in.parquet"), str(tmp_path / "out")
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(10)],
                             "prompt_token_ids": [list(range(100, 103 + 4 * i)) for i in range(10)]}), inp)
    config = DLLMProcessorConfig(model=root, batch_size=5, enable_metrics=False,
                                 engine=EngineConfig(block_length=32, steps_per_block=32, cache="persistent"),
                                 sampling=SamplingParams(max_new_tokens=8, threshold=0.9, sub_block_length=8))
    assert preflight(inp, str(tmp_path / "checked"), config).source.num_rows == 10
    summary = run_offline(inp, out, config)
    assert (summary["rows"], summary["errors"], summary["status"]) == (10, 0, "ok")
    assert summary["stop_token_ids"] == {"151645": "config.json eos_token_id"}


def test_the_threshold_is_strict_at_least_the_most_probable():
    """batch_sample's rule on crafted confidences against the engine's select: a probability
    equal to the threshold is not taken (only the most probable one is, as ever)."""
    from engine.decoding import RowParams, select

    conf = torch.tensor([[0.9, 0.95, 0.2, 0.9]], dtype=torch.float64)
    is_mask = torch.tensor([[True, True, True, True]])
    rp = RowParams.build([params((4, 0.9, 4))], [None], "cpu", threshold=ThresholdRule.GREATER_AT_LEAST_TOP1)
    assert select(conf, is_mask, torch.tensor([1]), rp, 4, 4)[0].tolist() == [False, True, False, False]
    rp = RowParams.build([params((4, 0.96, 4))], [None], "cpu", threshold=ThresholdRule.GREATER_AT_LEAST_TOP1)
    assert select(conf, is_mask, torch.tensor([1]), rp, 4, 4)[0].tolist() == [False, True, False, False]
