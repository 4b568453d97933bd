"""Issue 51 part 3: a MoE layer's experts as two grouped GEMMs over experts stacked at load,
with the same kernels whatever the routing and no host wait. Counted on the published
expert layouts (LLaDA2.0-mini: 256 experts top-8 in 8 groups, SDAR-30B-A3B: 128 top-8,
LLaDA-MoE-7B-A1B: 64 top-8) with tiny hidden sizes; the float32 grouped path gives the
reference per-expert loop's tokens (the loop float64 runs: grouped_mm has no float64)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import published
from bench.counting import DATA_DEPENDENT, LaunchCounter
from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model
from engine.models import moe
from engine.models.families.moe import MoESpec
from engine.models.transformer import DLLM

torch.set_num_threads(1)

PUBLISHED = {"llada2": ("inclusionAI__LLaDA2.0-mini", ("num_experts", "num_experts_per_tok", "n_group", "topk_group")),
             "sdar_moe": ("JetLM__SDAR-30B-A3B-Chat", ("num_experts", "num_experts_per_tok"))}
# kernel launches of one routed layer call (attention included) and of its ffn alone, 128 tokens
LAYER_LAUNCHES = {"llada2": 42, "sdar_moe": 31, "llada_moe": 32}
FFN_LAUNCHES = {"llada2": 30, "sdar_moe": 19, "llada_moe": 20}
FAMILIES = sorted(LAYER_LAUNCHES)


def layout(family: str) -> ModelConfig:
    """The family's published expert count, top-k and groups; hidden 16, experts 8 wide."""
    if family == "llada_moe":  # LLaDA-MoE-7B-A1B: 64 experts top-8, expert bias, a shared expert (not vendored)
        spec = MoESpec(num_experts=64, top_k=8, expert_size=8, dense_size=32, dense_layers=(True, False),
                       shared_size=8, expert_bias=True)
        return ModelConfig(model_type="llada_moe", vocab_size=64, hidden_size=16, n_layers=2, n_heads=2,
                           n_kv_heads=2, intermediate_size=32, mask_token_id=63, eos_token_id=1, moe=spec, qk_norm=True)
    folder, keys = PUBLISHED[family]
    hf = published.config(folder)
    tiny = published.shrink(hf)
    tiny.update({k: hf[k] for k in keys}, moe_intermediate_size=8)
    return ModelConfig.from_hf(tiny)


def inputs(seed: int = 0, B: int = 2, T: int = 64, vocab: int = 64, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, T), generator=g).to(device)
    return ids, torch.arange(T, device=device).expand(B, T), torch.ones(B, 1, T, T, dtype=torch.bool, device=device)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    cfg = layout(request.param)
    return request.param, cfg, build_model(cfg, dtype=torch.float32)


def test_published_layouts(family):
    name, cfg, model = family
    spec = cfg.moe
    assert (spec.num_experts, spec.top_k, spec.n_group) == {"llada2": (256, 8, 8), "sdar_moe": (128, 8, 1),
                                                             "llada_moe": (64, 8, 1)}[name]
    if name == "llada2":  # every other published routing setting kept
        assert (spec.score, spec.topk_group, spec.expert_bias, spec.scaling) == ("sigmoid", 4, True, 2.5)
    for layer in model.layers:
        if layer.routed:  # stacked, and each expert's parameters are slices of the stack
            assert layer.w13.shape == (spec.num_experts, 16, 16) and layer.w2.shape == (spec.num_experts, 16, 8)
            e = layer.experts[5]
            assert e.gate.weight.data_ptr() == layer.w13[5].data_ptr() and e.down.weight.data_ptr() == layer.w2[5].data_ptr()
            assert e.w13.data_ptr() == layer.w13[5].data_ptr()


def test_launches_per_moe_layer_are_fixed_whatever_the_routing(family):
    """LaunchCounter on 128 tokens, twice with other tokens (other routing): the same count."""
    name, cfg, model = family
    routed = [i for i, layer in enumerate(model.layers) if layer.routed]
    with torch.inference_mode():
        for seed in (0, 1):
            with LaunchCounter(model.layers) as count:
                model(*inputs(seed))
            assert [count.calls[i]["launches"] for i in routed] == [LAYER_LAUNCHES[name]] * len(routed)
            assert count.calls[routed[0]]["ops"]["_grouped_mm"] + count.calls[routed[0]]["ops"]["grouped_mm"] == 2
            x = torch.randn(2, 64, cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
            with LaunchCounter() as ffn:
                model.layers[routed[0]].ffn(x)
            assert ffn.total == FFN_LAUNCHES[name]


class HostWaits(TorchDispatchMode):
    """Counts the ops whose output the host must read: data-dependent sizes, .item()."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in DATA_DEPENDENT or func is torch.ops.aten._local_scalar_dense.default:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def fake_model(cfg: ModelConfig, mode: FakeTensorMode, device: str, dtype: torch.dtype) -> DLLM:
    """The model built on meta, every tensor it holds (parameters, fused stacks) made a fake
    tensor on `device`: `to_empty` inside the mode would set `.data`, which a CPU build of
    torch refuses for fake CUDA tensors."""
    with torch.device("meta"):
        model = DLLM(cfg).fuse_()

    def fake(t: torch.Tensor) -> torch.Tensor:
        meta = torch.empty_strided(t.shape, t.stride(), dtype=dtype if t.is_floating_point() else t.dtype, device="meta")
        return FakeTensor(mode, meta, torch.device(device))
    for m in model.modules():
        for k, p in m._parameters.items():
            if p is not None:
                m._parameters[k] = nn.Parameter(fake(p), requires_grad=False)
        for k, v in list(vars(m).items()):
            if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter):
                setattr(m, k, fake(v))
    return model


def test_no_host_wait_in_the_forward(family):
    """No data-dependent op (nonzero, bincount, masked_select, .item()) in a forward, and a
    forward under fake tensors (which refuse them) runs in bfloat16."""
    name, cfg, model = family
    with torch.inference_mode(), HostWaits() as waits:
        model(*inputs())
    assert waits.ops == Counter()
    mode = FakeTensorMode()
    fake = fake_model(cfg, mode, "cpu", torch.bfloat16)
    with mode, torch.inference_mode():
        out = fake(*inputs())
    assert out.shape == (2, 64, cfg.embedding_size) and out.dtype == torch.bfloat16


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="a CPU build of torch runs no fake CUDA op that "
                    "needs a device guard (aten.mm, index): 'not linked with support for cuda devices', dense too")
@pytest.mark.parametrize("name", FAMILIES + ["llada"])
def test_forward_under_fake_cuda_tensors(name):
    cfg = ModelConfig.from_hf(published.shrink(published.config("GSAI-ML__LLaDA-8B-Instruct"))) \
        if name == "llada" else layout(name)
    mode = FakeTensorMode()
    fake = fake_model(cfg, mode, "cuda", torch.bfloat16)
    with mode, torch.inference_mode():
        out = fake(*inputs(device="cuda"))
    assert out.device.type == "cuda" and out.shape == (2, 64, cfg.embedding_size)


def test_no_graph_break(family):
    import torch._dynamo

    name, cfg, model = family
    torch._dynamo.reset()
    with torch.inference_mode():
        explained = torch._dynamo.explain(model)(*inputs())
    torch._dynamo.reset()
    assert explained.graph_break_count == 0 and explained.graph_count == 1


def test_grouped_experts_give_the_reference_loops_tokens(family, monkeypatch):
    """The engine in float32, grouped against the per-expert loop: the same tokens, logits
    within float32 rounding."""
    name, cfg, model = family
    prompts = [[int(t) for t in torch.randint(3, 60, (n,), generator=torch.Generator().manual_seed(n))]
               for n in (5, 11, 17)]
    params = [SamplingParams(max_new_tokens=16, policy="fixed", stop_token_ids=[]) for _ in prompts]
    ecfg = EngineConfig(block_length=8, steps_per_block=4, cache="none", max_batch_size=4)
    with torch.inference_mode():
        grouped = Engine(model, ecfg).generate(prompts, params)
        logits = model(*inputs())
        monkeypatch.setattr(moe, "groupable", lambda *a: False)
        looped = Engine(model, ecfg).generate(prompts, params)
        reference = model(*inputs())
    assert [o.token_ids for o in grouped] == [o.token_ids for o in looped]
    assert all(len(o.token_ids) == 16 for o in grouped)
    torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_parallel_partials(ranks, monkeypatch):
    """Each rank's partial mixture over its own stacked experts (the others' pairs past
    every group) equals the loop's, and the partials sum to the whole mixture."""
    cfg = layout("llada2")
    model = build_model(cfg, dtype=torch.float32)
    layer, spec = model.layers[1], cfg.moe
    x = torch.randn(2, 64, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    E = spec.num_experts
    with torch.inference_mode():
        whole = moe.experts_forward(x, layer.router.weight, layer.expert_bias, layer.w13, layer.w2, spec)
        parts = []
        for r in range(ranks):
            own = range(r * E // ranks, (r + 1) * E // ranks)
            w13, w2 = layer.w13[own.start:own.stop], layer.w2[own.start:own.stop]
            parts.append(moe.experts_forward(x, layer.router.weight, layer.expert_bias, w13, w2, spec, own))
            with monkeypatch.context() as m:
                m.setattr(moe, "groupable", lambda *a: False)
                loop = moe.experts_forward(x, layer.router.weight, layer.expert_bias, w13, w2, spec, own)
            torch.testing.assert_close(parts[-1], loop, rtol=1e-6, atol=1e-6)
    assert all(p.abs().sum() > 0 for p in parts)
    torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-5)


def test_sharded_layer_stacks_only_its_experts():
    """Under expert parallelism the other ranks' experts are nn.Identity: the stack holds
    the rank's own, and follows a dtype change."""
    cfg = layout("sdar_moe")
    model = build_model(cfg, dtype=torch.float32)
    layer = model.layers[0]
    own = range(32, 64)
    layer.owned = own
    for j in range(cfg.moe.num_experts):
        if j not in own:
            layer.experts[j] = nn.Identity()
    model = model.to(torch.bfloat16)
    assert layer.w13.shape == (32, 16, 16) and layer.w13.dtype == torch.bfloat16
    assert layer.experts[40].up.weight.data_ptr() == layer.w13[8, 8:].data_ptr()
    x = torch.randn(1, 8, cfg.hidden_size, dtype=torch.bfloat16)
    assert torch.isfinite(layer.ffn(x)).all()

