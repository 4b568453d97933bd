"""Issue 27: LLaDA-MoE (inclusionAI/LLaDA-MoE-7B-A1B) exact against its published code.

`PublishedLLaDAMoE` is written from the published modeling_lladamoe.py, reading the
weights under their checkpoint names: per-head QK RMSNorm before (partial) RoPE, eager
attention, the SparseMoeBlock's own loop (softmax in float32, `+= expert_bias`, top-k,
no renormalisation, one_hot / where per expert, index_add), shared expert, dense layers
where moe_layer_freq is 0. LLaDA-MoE's model card `generate` is LLaDA's loop, so the
decoding reference is test_reference_decoding.reference_decode (the full canvas, no
cache) run over that forward, one request at a time. The engine's mixed batches under
every scheduler must give exactly its tokens; the published layout loads through
load_model and runs through the job."""
from __future__ import annotations

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from checkpoints import write_llada_moe
from conftest import read_parts
from test_reference_decoding import L, S, reference_decode, workload
from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model, load_model
from engine.loader import read_config
from engine.models.families.moe import MoESpec
from pipeline import DLLMProcessorConfig
from pipeline.run import run_offline

torch.set_num_threads(1)


def tiny_moe(**kw) -> ModelConfig:
    """Layer 0 dense, layer 1 eight experts (top-2) with expert bias and a shared expert,
    QK norm, partial RoPE: every path of the block in two layers."""
    spec = MoESpec(num_experts=8, top_k=2, expert_size=16, dense_size=48, dense_layers=(True, False),
                   shared_size=24, expert_bias=True)
    return ModelConfig(**dict(dict(model_type="llada_moe", vocab_size=64, hidden_size=32, n_layers=2, n_heads=4,
                                   n_kv_heads=2, intermediate_size=48, mask_token_id=63, eos_token_id=1,
                                   max_seq_len=1024, moe=spec, qk_norm=True, partial_rotary_factor=0.5), **kw))


class PublishedLLaDAMoE:
    """LLaDAMoEModelLM's forward (no cache, full attention) over the checkpoint tensors."""

    def __init__(self, model):
        self.config = cfg = model.config
        self.w = {cfg.family.checkpoint_name(n): p.detach().double() for n, p in model.named_parameters()}
        self.hf = cfg.to_hf()

    def rms(self, x, key):
        return self.w[key] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps))

    def mlp(self, x, p):
        return F.linear(F.silu(F.linear(x, self.w[p + "gate_proj.weight"])) * F.linear(x, self.w[p + "up_proj.weight"]),
                        self.w[p + "down_proj.weight"])

    def sparse_moe_block(self, x, p):  # LLaDAMoESparseMoeBlock.forward
        hf = self.hf
        routing_weights = F.softmax(F.linear(x, self.w[p + "mlp.gate.weight"]), dim=1, dtype=torch.float64)
        if hf["moe_router_enable_expert_bias"]:
            routing_weights += self.w[p + "mlp.expert_bias"]
        routing_weights, selected_experts = torch.topk(routing_weights, hf["num_experts_per_tok"], dim=-1)
        final = torch.zeros_like(x)
        expert_mask = F.one_hot(selected_experts, num_classes=hf["num_experts"]).permute(2, 1, 0)
        for e in range(hf["num_experts"]):
            idx, top_x = torch.where(expert_mask[e])
            final.index_add_(0, top_x, self.mlp(x[top_x], p + f"mlp.experts.{e}.") * routing_weights[top_x, idx, None])
        return final

    def __call__(self, ids, pos, keys, kv, offset):
        assert kv is None and offset == 0 and keys.all()
        hf, w = self.hf, self.w
        T, d, H, Hkv = ids.shape[1], hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
        D = d // H
        r = int(D * hf["partial_rotary_factor"])
        inv = 1.0 / (hf["rope_theta"] ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
        emb = torch.cat([pos[0].double()[:, None] * inv] * 2, -1)
        cos, sin = emb.cos()[None], emb.sin()[None]

        def rotary(t):
            a, rest = t[..., :r], t[..., r:]
            half = torch.cat([-a[..., r // 2:], a[..., : r // 2]], -1)
            return torch.cat([a * cos + half * sin, rest], -1)

        h = w["model.embed_tokens.weight"][ids[0]]
        for i in range(hf["num_hidden_layers"]):
            p = f"model.layers.{i}."
            x = self.rms(h, p + "input_layernorm.weight")
            q, k = F.linear(x, w[p + "self_attn.q_proj.weight"]), F.linear(x, w[p + "self_attn.k_proj.weight"])
            if hf["qk_layernorm"]:
                q = self.rms(q.reshape(-1, D), p + "self_attn.q_norm.weight").reshape(T, -1)
                k = self.rms(k.reshape(-1, D), p + "self_attn.k_norm.weight").reshape(T, -1)
            v = F.linear(x, w[p + "self_attn.v_proj.weight"]).view(T, Hkv, D).transpose(0, 1)
            q, k = rotary(q.view(T, H, D).transpose(0, 1)), rotary(k.view(T, Hkv, D).transpose(0, 1))
            k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
            att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(D), -1) @ v
            h = h + F.linear(att.transpose(0, 1).reshape(T, d), w[p + "self_attn.o_proj.weight"])
            x = self.rms(h, p + "post_attention_layernorm.weight")
            if hf["moe_layer_freq"][i] == 0:
                y = self.mlp(x, p + "mlp.")
            else:
                y = self.sparse_moe_block(x, p)
                if hf["shared_expert_intermediate_size"]:
                    y = y + self.mlp(x, p + "shared_expert.")
            h = h + y
        return F.linear(self.rms(h, "model.norm.weight"), w["lm_head.weight"])[None]


@pytest.fixture(scope="module")
def moe_model():
    return build_model(tiny_moe(), dtype=torch.float64, seed=0)


@pytest.fixture(scope="module")
def moe_references(moe_model):
    prompts, params = workload("llada", n=8)
    ref = PublishedLLaDAMoE(moe_model)
    return prompts, params, [reference_decode(ref, pr, sp, "none") for pr, sp in zip(prompts, params)]


def test_forward_equals_the_published_block(moe_model):
    ids = torch.randint(0, 63, (1, 23), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(23)[None]
    keys = torch.ones(1, 1, 1, 23, dtype=torch.bool)
    with torch.no_grad():
        ours = moe_model(ids, pos, torch.ones(1, 1, 23, 23, dtype=torch.bool))
    torch.testing.assert_close(ours, PublishedLLaDAMoE(moe_model)(ids, pos, keys, None, 0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scheduler", ["blockserve", "static", "sequential"])
def test_llada_moe_mixed_batches_match_the_published_loop(moe_model, moe_references, scheduler):
    prompts, params, ref = moe_references
    cfg = EngineConfig(block_length=L, steps_per_block=S, cache="none", scheduler=scheduler, token_budget=220,
                       max_batch_size=5)
    eng = Engine(moe_model, cfg, record_batches=True)
    assert eng.full_canvas
    outs = eng.generate(prompts, params)
    if scheduler != "sequential":
        assert max(len(b.request_ids) for b in eng.batch_log) > 1
    assert [o.token_ids for o in outs] == ref


def test_active_parameters_per_token_reach_the_budget_and_the_cost_model():
    from engine.budget import activation_bytes_per_token
    from pipeline.sorting.model import ModelProfile

    cfg = tiny_moe()
    dense = tiny_moe(moe=None, qk_norm=False, intermediate_size=int(cfg.active_intermediate_size))
    assert cfg.active_intermediate_size == (48 + 2 * 16 + 24) / 2
    assert activation_bytes_per_token(cfg, torch.float32) == activation_bytes_per_token(dense, torch.float32)
    router = 2.0 * 32 * 8  # one MoE layer's router
    assert ModelProfile(cfg).linear_flops_per_token() == ModelProfile(dense).linear_flops_per_token() + router
    assert cfg.active_params() < cfg.num_params()
    import pickle  # the sorter ships the profile to data workers as config.json's dict

    again = pickle.loads(pickle.dumps(ModelProfile(cfg)))
    assert again.config.moe == cfg.moe and again.linear_flops_per_token() == ModelProfile(cfg).linear_flops_per_token()


@pytest.fixture(scope="module")
def published_moe(tmp_path_factory):
    """LLaDA-MoE's layout, still hand-written (tests/checkpoints.py): none of its published
    files could be found to vendor under tests/published/, unlike LLaDA, Dream and LLaDA2."""
    return write_llada_moe(str(tmp_path_factory.mktemp("pub") / "LLaDA-MoE"))


def test_published_layout_loads_and_runs_through_the_job(published_moe, ray_local, tmp_path):
    cfg = read_config(published_moe)
    assert (cfg.model_type, cfg.mask_token_id, cfg.stop_ids, cfg.vocab_size) == ("llada_moe", 156895, [156892], 157184)
    model, tok = load_model(published_moe, dtype=torch.bfloat16)
    assert model.layers[1].router.weight.dtype == torch.float32  # routers stay float32
    assert tok.convert_tokens_to_ids("<|mask|>") == 156895
    engine = EngineConfig(block_length=4, steps_per_block=4, cache="none", token_budget=2048, max_batch_size=8)
    sampling = SamplingParams(max_new_tokens=4, policy="fixed")  # one block: the 157184-wide head is slow on CPU
    msgs = [[{"role": "user", "content": f"copy: {'abcdefgh'[: i % 8 + 1]}"}] for i in range(10)]
    pq.write_table(pa.table({"id": [f"m{i}" for i in range(10)], "messages": msgs}), str(tmp_path / "in.parquet"))
    config = DLLMProcessorConfig(model=published_moe, batch_size=5, engine=engine, sampling=sampling,
                                 enable_metrics=False)
    summary = run_offline(str(tmp_path / "in.parquet"), str(tmp_path / "out"), config)
    assert (summary["rows"], summary["errors"], summary["status"]) == (10, 0, "ok")
    rows = read_parts(str(tmp_path / "out")).to_pylist()
    assert sorted(r["id"] for r in rows) == [f"m{i}" for i in range(10)]
    assert all(r["prompt"].endswith("<role>ASSISTANT</role>") for r in rows)


def test_moe_bench_smoke(tmp_path):
    from bench import moe_bench

    data = moe_bench.main(["--smoke", "--out", str(tmp_path / "moe.json")])  # asserts batched == one at a time
    assert json.load(open(tmp_path / "moe.json"))["tokens"] == data["tokens"] > 0
    assert 0 < data["share"]["moe_ffn_share_of_forward"] < 1


@pytest.mark.parametrize("change,message", [({"moe_router_score_function": "sigmoid"}, "moe_router_score_function"),
                                            ({"clip_qkv": 8.0}, "clip_qkv"), ({"capacity_factor": 1.25}, "capacity_factor")])
def test_llada_moe_settings_the_engine_would_ignore_are_refused(change, message):
    from checkpoints import LLADA_MOE_CONFIG
    from engine.models.families import ConfigRefused

    ModelConfig.from_hf(LLADA_MOE_CONFIG)  # the published keys are all accounted for
    with pytest.raises(ConfigRefused, match=message):
        ModelConfig.from_hf({**LLADA_MOE_CONFIG, **change})


def test_group_limited_sigmoid_routing_equals_llada2s_published_gate():
    """route() with LLaDA2's settings against LLaDA2MoeGate.forward (modeling_llada2_moe.py):
    sigmoid scores, expert bias for selection only, top-2 sum per group, topk_group groups,
    -inf outside them, weights gathered from the unbiased scores, renormalised, scaled."""
    from engine.models.moe import route

    g = torch.Generator().manual_seed(0)
    E, n_group, topk_group, k, scale = 16, 4, 2, 4, 2.5
    logits, bias = torch.randn(50, E, generator=g, dtype=torch.float64), torch.randn(E, generator=g, dtype=torch.float64)
    spec = MoESpec(num_experts=E, top_k=k, expert_size=8, dense_size=8, dense_layers=(False,), score="sigmoid",
                   expert_bias=True, bias_in_weights=False, renormalize=True, scaling=scale, n_group=n_group,
                   topk_group=topk_group)
    scores = torch.sigmoid(logits)
    routing = scores + bias
    group_scores = routing.view(50, n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)
    group_mask = torch.zeros_like(group_scores).scatter_(1, torch.topk(group_scores, topk_group, -1, sorted=False)[1], 1)
    score_mask = group_mask.unsqueeze(-1).expand(50, n_group, E // n_group).reshape(50, -1)
    _, idx = torch.topk(routing.masked_fill(~score_mask.bool(), float("-inf")), k=k, dim=-1)
    w = torch.gather(scores, 1, idx)
    w = w / (w.sum(-1, keepdim=True) + 1e-20) * scale
    experts, weights = route(logits, spec, bias)
    assert torch.equal(experts, idx)
    torch.testing.assert_close(weights, w, rtol=0, atol=0)
