"""Every family's engine steps on fake CUDA in bfloat16 (issue 51, acceptance 4), and the
attention kernel each family's calls get there (bench/gpu/fake_cuda.py).

Each model has its published attention layout (heads, K/V heads, head_dim, widths, experts,
vocabulary) and two layers. Its weights are FakeTensors on cuda. Device work is faked,
host bookkeeping is real, and the step's read returns harness tokens. So a host tensor mixed
into a device op, a data-dependent op, or a device -> host copy before the read fails the
test here, not on a lent GPU. Rows of very different widths make the forward attend in two
runs of cache slots, with masks whose widths are not multiples of 8."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench import gpu_shape
from bench.counting import StandInCuda
from bench.gpu.fake_cuda import FakeCuda, published_layout
from engine import EngineConfig, SamplingParams
from engine.models import attention
from engine.models.families import BlockLayout

FAMILIES = sorted(gpu_shape.FAMILIES)  # llada, dream, sdar, fast_dllm_v2, llada_moe, llada2, sdar_moe, illada, nemotron_labs_diffusion
PROMPTS = [list(range(40, 40 + n)) for n in (9, 14, 20, 2600)]
GREEDY = SamplingParams(max_new_tokens=64, policy="fixed", ignore_eos=True)
# Dream's rows with top-p/top-k (temperature 0: a CUDA generator cannot be faked)
PARAMS = {"dream": SamplingParams(max_new_tokens=64, top_p=0.9, top_k=20, ignore_eos=True),
          # generate()'s fixed schedule is one mask a step over block_length steps: the threshold here
          "nemotron_labs_diffusion": SamplingParams(max_new_tokens=64, policy="threshold", threshold=0.9,
                                                    ignore_eos=True)}
# what each family's layers get on an H200 (engine.models.attention's module docstring)
BACKENDS = {"llada": "efficient", "llada_moe": "efficient", "dream": "efficient, GQA folded x7",
            "fast_dllm_v2": "efficient, GQA folded x7", "sdar": "efficient, GQA folded x4",
            "llada2": "efficient, GQA folded x4", "sdar_moe": "efficient, GQA folded x8",
            "illada": "efficient, GQA folded x4", "nemotron_labs_diffusion": "efficient, GQA folded x4"}


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


def serve(family: str):
    cfg = EngineConfig(block_length=32, steps_per_block=4, canvas="block", advance="step", token_budget=16384,
                       max_batch_size=4)
    return FakeCuda(published_layout(family)).serve(cfg, PROMPTS, PARAMS.get(family, GREEDY))


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_steps_on_fake_cuda_in_bfloat16(family):
    """Every request served to its end, 64 tokens in blocks of 32: two blocks, or three where
    the family's blocks sit at absolute positions (the prompt's tail opens the first). Each
    block takes two steps: the harness's first read leaves the block masked, so the next step
    is a cached mid-block one. Each step reads once, a [4, 32] cuda tensor of token ids, and
    EngineStats.syncs counts it."""
    run = serve(family)
    e = run.engine
    assert not e.has_unfinished()
    assert e.stats.steps == len(run.reads) == e.stats.syncs == 2 * (2 + (published_layout(family).family.blocks
                                                                         == BlockLayout.ABSOLUTE))
    assert {(tuple(r.shape), r.dtype, r.device.type) for r in run.reads} == {((4, 32), torch.long, "cuda")}
    # every attention call is one the memory-efficient kernel takes: no GQA, bf16 mask aligned
    assert run.attention and [c.refusals for c in run.attention if c.refusals] == []
    assert {c.dtype for c in run.attention} == {torch.bfloat16}
    assert all(not c.enable_gqa and c.q[1] == c.k[1] for c in run.attention)
    assert len({c.k[2] for c in run.attention}) > 2  # prompt catch-ups, and the block step's two runs


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_gets_the_memory_efficient_kernel_on_cuda(family):
    cfg = published_layout(family)
    assert attention.backend(cfg.n_heads, cfg.n_kv_heads, "cuda") == BACKENDS[family]
    assert attention.backend(cfg.n_heads, cfg.n_kv_heads, "cpu").startswith("flash (CPU kernel)")


def test_the_check_refuses_the_calls_torch_would_send_to_math(monkeypatch):
    """Dream's calls shaped as on the CPU (GQA through enable_gqa, the mask's rows as wide as
    its keys) are ones the memory-efficient kernel does not take. In 2.13, flash takes no
    mask either, so they would run on math (or cuDNN where torch prefers it)."""
    monkeypatch.setattr(attention, "fused", lambda device: False)
    run = serve("dream")  # rows as wide as their prompts and blocks (SDAR's are multiples of 32)
    refusals = {r.split(":")[0].split(" (")[0] for c in run.attention for r in c.refusals}
    assert "head counts differ" in refusals
    assert any(r.startswith("mask strides") for c in run.attention for r in c.refusals)


def test_folded_gqa_attends_as_enable_gqa_does():
    """In float64, on the stand-in CUDA device (CPU values): the folded call, with a mask whose
    rows differ, whose width is not a multiple of 8, and whose kept rows are picked, gives what
    SDPA's enable_gqa gives on the CPU."""
    torch.manual_seed(0)
    n, H, Hkv, T, S, D = 3, 8, 2, 5, 13, 16
    q = torch.randn(n, H, T, D, dtype=torch.float64)
    k, v = torch.randn(2, n, Hkv, S, D, dtype=torch.float64)
    allowed = torch.rand(n, 1, T, S) < 0.7
    allowed[..., -1] = True  # every query sees a key
    keep = torch.tensor([[4, 1], [0, 2], [3, 3]])
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True).transpose(1, 2)
    want_kept = want.gather(1, keep[..., None, None].expand(-1, -1, H, D))
    with StandInCuda() as s:
        qd, kd, vd, md, keepd = (t.to("cuda") for t in (q, k, v, allowed, keep))
        mask = attention.additive_mask(md, torch.float64, attention.group(H, Hkv, md.device))
        assert tuple(mask.shape) == (n, 1, 4 * T, S) and attention.is_aligned(mask)
        got = attention.attend(qd, kd, vd, mask)
        kept_mask = attention.keep_rows(mask, keepd, T, 4)
        assert attention.is_aligned(kept_mask)
        got_kept = attention.attend(qd.gather(2, keepd[:, None, :, None].expand(-1, H, -1, D)), kd, vd, kept_mask)
        got, got_kept = s.host(got), s.host(got_kept)
    assert got.shape == (n, T, H, D)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_kept, want_kept, rtol=0, atol=1e-12)


@pytest.mark.parametrize("family", ["llada", "dream", "llada2"])
def test_the_cuda_path_gives_the_cpu_tokens(family, monkeypatch):
    """In float64, rows of four widths, each attending in a run of its own (no overhead
    allowance), so every run's first key is rounded down on CUDA. The stand-in device takes
    the CUDA path on CPU values: the mask folded and aligned, GQA folded, first keys rounded.
    It decodes the CPU's tokens."""
    from engine import Engine, build_model
    from engine import runner

    def serve(stand_in: bool):
        model = build_model(gpu_shape.config(family), dtype=torch.float64)
        cfg = EngineConfig(block_length=8, steps_per_block=4, canvas="block", advance="step", token_budget=4096,
                           max_batch_size=4)
        params = SamplingParams(max_new_tokens=16, policy="fixed", ignore_eos=True)
        with StandInCuda() if stand_in else torch.no_grad() as s:
            if stand_in:
                s.move(model)
            e = Engine(model, cfg)
            for n in (5, 13, 30, 47):
                e.add_request(list(range(40, 40 + n)), params)
            outs = []
            while e.has_unfinished():
                outs += e.step()
        return sorted((o.request_id, o.token_ids) for o in outs)

    monkeypatch.setattr(runner, "ATTENTION_OVERHEAD_KEYS_DEVICE", 0)
    assert serve(True) == serve(False)


def test_the_harness_refuses_what_a_gpu_would_stall_on():
    """Host values stay real inside the session; what a GPU would stall on, or refuse, raises."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

    from bench.gpu.fake_cuda import HostWait, fake_engines

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_engines(mode):
        host = torch.tensor([3, 0, 5])
        assert host.nonzero().flatten().tolist() == [0, 2] and host.pin_memory().tolist() == [3, 0, 5]
        dev = torch.zeros(3, dtype=torch.long, device="cuda")
        assert dev.device.type == "cuda"
        with pytest.raises(HostWait):
            dev.cpu()  # a device -> host copy before the read
        with pytest.raises(DataDependentOutputException):
            dev.sum().item()
        with pytest.raises(DynamicOutputShapeException):
            torch.ops.aten.nonzero.default(dev)  # (Tensor.nonzero's binding refuses a CPU build's cuda first)
        with pytest.raises(Exception, match="device"):
            dev + host  # a host tensor in a device op
        with pytest.raises(HostWait):
            torch.cuda.synchronize()
