"""The tensor-parallel memory plan (issue 39, acceptance 4): `blockray plan` prints, from
config.json alone (no GPU, no weights), what LLaDA2.0-mini (its published config.json)
and a LLaDA2.0-flash-shaped config (tests/shapes/: no published copy was found, its
SOURCE.md says where each size comes from) need per H200 in bf16 on 1, 2, 4 and 8 GPUs,
with the device memory it assumes; the job's preflight refuses flash on one H200, naming
the smallest tensor_parallel_size that fits, and accepts it at that size. The plan reads
the real sizes (102.9 B parameters), not the shrunken ones of the published test
fixtures, because it never materialises a tensor."""
from __future__ import annotations

import os
import re

import pytest
import torch

from engine import EngineConfig
from engine.budget import GiB, ShardBytes, parallel_plan, smallest_tensor_parallel_size
from engine.checkpoint import Checkpoint
from pipeline.cli import main
from pipeline.config import DLLMProcessorConfig
from pipeline.errors import JobError
from pipeline.resources import Cluster, check_gpu_memory

HERE = os.path.dirname(os.path.abspath(__file__))
FLASH = os.path.join(HERE, "shapes", "LLaDA2.0-flash-shaped")
MINI = os.path.join(os.path.dirname(os.path.dirname(HERE)), "shared", "checkpoints", "inclusionAI__LLaDA2.0-mini")
H200 = 141 * GiB


def rows(text: str):
    return {int(m[1]): m[2].split() for m in re.finditer(r"^\s+(\d)\s+(.*)$", text, re.M)}


@pytest.mark.skipif(not os.path.isdir(MINI), reason="../shared/checkpoints is absent on a clean clone")
def test_the_plan_of_llada2_mini(capsys):
    assert main(["plan", "--model", MINI, "--gpu", "h200", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "device memory assumed: H200: 141 GiB per GPU" in out and "16.26 B parameters" in out
    table = rows(out)
    assert sorted(table) == [1, 2, 4, 8] and all(r[-1] == "yes" for r in table.values())
    assert "smallest tensor_parallel_size that fits: 1" in out


@pytest.mark.parametrize("model", [FLASH, os.path.join(HERE, "published", "inclusionAI__LLaDA2.2-flash")],
                         ids=["2.0-flash-shaped", "2.2-flash-rebuilt"])
def test_the_plan_of_llada2_flash(model, capsys):
    """LLaDA2.0-flash's shape, and LLaDA2.2-flash's rebuilt config.json (the same weights'
    shapes: its SOURCE.md): ~100B, two H200s at least."""
    assert main(["plan", "--model", model, "--gpu", "H200"]) == 0
    out = capsys.readouterr().out
    print(out)
    assert "102.89 B parameters (6.15 B active per token)" in out
    table = rows(out)
    assert [table[n][-1] for n in (1, 2, 4, 8)] == ["no", "yes", "yes", "yes"]
    assert "smallest tensor_parallel_size that fits: 2" in out
    assert main(["plan", "--model", model, "--gpu", "h200", "--tensor-parallel-size", "1"]) == 2


def test_per_device_weights_are_a_share_plus_the_replicated_parts():
    cfg = Checkpoint.open(FLASH, weights=False).config
    whole = parallel_plan(cfg, torch.bfloat16, EngineConfig(), H200, 1).weights_bytes
    for n in (2, 4, 8):
        shard = ShardBytes.of(cfg, torch.bfloat16, n)
        expect = (whole - shard.replicated) / n + shard.replicated
        assert abs(shard.weights - expect) <= 0.01 * expect  # the routers' float32 and the vocab padding
        assert shard.local.n_heads == 32 // n and shard.local.n_kv_heads == max(1, 4 // n)


def test_the_preflight_refuses_flash_on_one_h200_naming_the_size_that_fits():
    ckpt = Checkpoint.open(FLASH, weights=False)
    node = {"CPU": 64.0, "GPU": 8.0, "accelerator_type:H200": 8.0}
    cluster = Cluster(dict(node), [node], what="an 8 x H200 node", gpu_memory=H200, gpu_type="H200")
    cfg = DLLMProcessorConfig(model=FLASH, engine=EngineConfig())
    with pytest.raises(JobError) as e:
        check_gpu_memory(cfg, ckpt, cluster)
    print(e.value.message)
    assert "Use --tensor-parallel-size 2 (the smallest of 1, 2, 4, 8" in e.value.message
    assert "its weights take 191.6 GiB" in e.value.message and "(H200)" in e.value.message
    assert "tensor_parallel_size" in e.value.options
    check_gpu_memory(DLLMProcessorConfig(model=FLASH, engine=EngineConfig(tensor_parallel_size=2)), ckpt, cluster)
    assert smallest_tensor_parallel_size(ckpt.config, torch.bfloat16, EngineConfig(), H200) == 2


def test_a_size_that_does_not_divide_the_heads_is_refused_naming_it(capsys):
    ckpt = Checkpoint.open(FLASH, weights=False)
    node = {"CPU": 64.0, "GPU": 8.0, "accelerator_type:H200": 8.0}
    cluster = Cluster(dict(node), [node], what="an 8 x H200 node", gpu_memory=H200, gpu_type="H200")
    with pytest.raises(JobError, match=r"tensor_parallel_size=3: 32 attention heads do not divide into 3 ranks") as e:
        check_gpu_memory(DLLMProcessorConfig(model=FLASH, engine=EngineConfig(tensor_parallel_size=3)), ckpt, cluster)
    assert e.value.options == ("tensor_parallel_size",)
    assert main(["plan", "--model", FLASH, "--gpu", "141", "--tensor-parallel-size", "3"]) == 2
    assert "no: tensor_parallel_size=3: 32 attention heads do not divide" in capsys.readouterr().out


def test_a_rank_plans_its_budget_from_its_own_config():
    """An engine on a shard (engine.Engine) plans from its model's config, already the
    rank's, as one device: the same K/V and activations per token as the preflight's
    plan of the whole model at that size."""
    from engine.budget import engine_plan

    cfg = Checkpoint.open(FLASH, weights=False).config
    for n in (2, 4, 8):
        whole = engine_plan(cfg, torch.bfloat16, EngineConfig(tensor_parallel_size=n), H200, H200)
        local = engine_plan(ShardBytes.of(cfg, torch.bfloat16, n).local, torch.bfloat16, EngineConfig(), H200, H200)
        assert (whole.kv_per_token, whole.activations_per_token, whole.logits_per_row) == \
            (local.kv_per_token, local.activations_per_token, local.logits_per_row)
        assert whole.token_budget == local.token_budget  # weights loaded: the same free memory
