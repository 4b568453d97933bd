"""Tensor parallelism (issue 39), engine side, in float64 on CPU over gloo: N ranks' shards
give the tokens of one device for every family (bench/tp_parity.CASES: LLaDA with biases
and a padded vocabulary under the dual cache, D2F under the refresh cache, Dream with
tied embeddings, LLaDA-MoE under the static scheduler, LLaDA2.x with token editing and
one K/V head under the persistent cache, LLaDA2.0-mini's published config.json shrunk
with prefix caching (shared preambles, a budget that evicts), SDAR-MoE advancing by
steps, Fast-dLLM v2 with sub-blocks and no cache, DiffusionGemma's transformers modules sharded in place under
the canvas engine), 12 prompts of mixed settings per batch; LLaDA2 on four ranks too.
Each rank of a masked-diffusion model holds total/N + the replicated parts of the
weights and reads only its own shard's ranges of each checkpoint tensor. One spawn of four processes runs every case (ranks
[0, 1] and [2, 3] split the tp=2 cases, then all four run tp=4), while this process
computes the one-device tokens."""
from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from bench.tp_parity import CASES, PREFIX, TP4, baseline, run_case, run_sharded, write_checkpoints
from engine import Engine, EngineConfig, ModelConfig, build_model, load_model
from engine.checkpoint import Checkpoint
from engine.models.families import Shard
from engine.models.sharding import ShardingRefused, ShardPlan

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tp"))
    write_checkpoints(root)
    want, got = run_sharded(root, world=4, while_waiting=lambda: baseline(root, torch.float64, "cpu"))
    return root, want, got


@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_two_ranks_give_the_tokens_of_one_device(runs, case):
    _, want, got = runs
    assert not [row for row in want[case] if row[2]], "the workload itself has refused rows"
    assert sum(len(row[0]) for row in want[case]) > 40  # rows decoded, not all stopped at once
    ranks = got[case][2]
    assert len(ranks) == 2
    for rank in ranks:  # every rank computed the same tokens (SPMD), those of one device
        assert rank["tokens"] == want[case]


def test_a_row_that_draws_noise_without_a_seed_is_refused_on_every_rank(runs):
    """A rank's own random seed would differ from the other ranks' (the Ray side fills
    every row's seed before it broadcasts the rows)."""
    _, _, got = runs
    for sizes in got.values():
        for ranks in sizes.values():
            for rank in ranks:
                assert rank["seedless"][0] == "error" and "seed is required under tensor_parallel_size > 1" in \
                    rank["seedless"][1]


def test_four_ranks_give_the_tokens_of_one_device(runs):
    _, want, got = runs
    assert len(got[TP4][4]) == 4
    for rank in got[TP4][4]:
        assert rank["tokens"] == want[TP4]


def test_prefix_caching_under_tensor_parallel(runs):
    """Issue 40 on several ranks: each rank caches its shard of the same blocks (the ranks
    take the same decisions, so they hit and evict alike), and the tokens are one device's
    without the cache."""
    root, want, got = runs
    hits = {(r["stats"]["prefix_hit_blocks"], r["stats"]["prefix_evictions"]) for r in got[PREFIX][2]}
    assert len(hits) == 1 and min(next(iter(hits))) > 0, hits  # rows took blocks from the cache; it evicted
    case = next(c for c in CASES if c.name == PREFIX)
    plain = dataclasses.replace(case, engine={**case.engine, "enable_prefix_caching": False})
    model, _ = load_model(os.path.join(root, PREFIX), dtype=torch.float64, tokenizer=False)
    assert run_case(plain, model, 1) == want[PREFIX]


def _plans(root, case, size):
    cfg = Checkpoint.open(os.path.join(root, case)).config
    return cfg, [ShardPlan(cfg, r, size) for r in range(size)]


def test_each_rank_reads_only_its_own_ranges(runs):
    """Per tensor, each rank read exactly its plan's ranges (counted bytes included); the
    ranges of split tensors do not overlap across ranks and together cover the tensor; an
    expert is read by its owner only."""
    root, _, got = runs
    checked = 0
    for case, sizes in got.items():
        if case == "diffusion-gemma":  # transformers' from_pretrained reads it whole (engine.canvas.sharding)
            continue
        for size, ranks in sizes.items():
            cfg, plans = _plans(root, case, size)
            shapes = cfg.family.param_shapes(cfg)
            names = {cfg.family.checkpoint_name(n): n for n in shapes}
            covered = {}
            for plan, rank in zip(plans, ranks):
                own_bytes = 0
                for key, (dim, ranges) in rank["reads"].items():
                    name = names[key]
                    piece = plan.piece(name, shapes[name])
                    assert piece is not None and (dim, [list(r) for r in piece.ranges]) == (piece.dim, ranges), key
                    other = math.prod(s for i, s in enumerate(shapes[name]) if i != dim)
                    own_bytes += sum(b - a for a, b in ranges) * other * 8
                    if not plan.replicated(name):
                        covered.setdefault(key, []).extend(map(tuple, ranges))
                held = [n for n in shapes if plan.piece(n, shapes[n]) is not None]
                assert len(rank["reads"]) == len(held)  # nothing else was opened
                assert rank["read_bytes"] == own_bytes
            for key, ranges in covered.items():
                name = names[key]
                dim = next(p.piece(name, shapes[name]) for p in plans if p.piece(name, shapes[name]) is not None)
                cells = sorted(ranges)
                if cfg.n_kv_heads < size and cfg.family.shard_of(name) == Shard.QKV:  # K/V heads replicated
                    q_rows = cfg.n_heads * cfg.head_dim
                    assert all(cells.count(c) == 1 for c in cells if c[0] < q_rows)  # query heads: each once
                    cells = sorted(set(cells))
                assert all(a[1] <= b[0] for a, b in zip(cells, cells[1:])), (case, key, cells)  # disjoint
                assert sum(b - a for a, b in cells) == shapes[name][dim.dim], (case, key, cells)  # covering
                checked += 1
    assert checked > 100


@pytest.mark.parametrize("case,size", [("llada-moe-static", 2), (TP4, 4), ("sdar-moe-step", 2)])
def test_each_rank_holds_its_share_of_the_weights(runs, case, size):
    """Resident weight bytes per rank within 5% of (total - replicated) / N + replicated."""
    root, _, got = runs
    cfg, plans = _plans(root, case, size)
    shapes = cfg.family.param_shapes(cfg)
    total = sum(math.prod(s) for s in shapes.values()) * 8
    replicated = sum(plans[0].replicated_elements(n, s) for n, s in shapes.items()) * 8
    expect = (total - replicated) / size + replicated
    for rank in got[case][size]:
        assert abs(rank["resident_bytes"] - expect) <= 0.05 * expect, (rank["resident_bytes"], expect, total)
        assert rank["resident_bytes"] < 0.75 * total


def test_what_cannot_be_sharded_is_refused():
    with pytest.raises(ShardingRefused, match="attention heads"):
        ShardPlan(ModelConfig.tiny("llada", n_heads=4, n_kv_heads=4), 0, 3)
    with pytest.raises(ShardingRefused, match="intermediate_size 66"):
        ShardPlan(ModelConfig.tiny("llada", intermediate_size=66), 0, 4)
    plan = ShardPlan(ModelConfig.tiny("Dream", n_kv_heads=2), 3, 4)  # 2 K/V heads on 4 ranks: replicated
    assert plan.kv_heads == (1, 2) and plan.local_config().n_kv_heads == 1


def test_an_engine_refuses_a_size_its_model_was_not_loaded_at():
    model = build_model(ModelConfig.tiny("llada"), dtype=torch.float64)
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        Engine(model, EngineConfig(tensor_parallel_size=2, token_budget=64))


def test_a_lora_adapter_merges_per_shard(tmp_path):
    """Each rank's shard of a LoRA-merged model is the shard of the model merged whole:
    the adapter's B rows (column-parallel q, k, v, gate, up; K/V heads replicated on four
    ranks) or A columns (row-parallel o, down) of the shard only. Loading a shard runs no
    collective, so the ranks are loaded here one after the other."""
    from checkpoints import write_lora

    from engine import save_model
    from engine.parallel import TensorParallel

    cfg = ModelConfig.tiny("Dream")  # 4 heads, 2 K/V heads, q/k/v biases
    save_model(build_model(cfg, dtype=torch.float64, seed=3), tmp_path / "base")
    lora = write_lora(str(tmp_path / "lora"), cfg, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"])
    whole, _ = load_model(tmp_path / "base", dtype=torch.float64, tokenizer=False, adapter=lora)
    plain, _ = load_model(tmp_path / "base", dtype=torch.float64, tokenizer=False)
    full = dict(whole.named_parameters())
    assert not torch.equal(full["layers.0.o.weight"], dict(plain.named_parameters())["layers.0.o.weight"])
    for size in (2, 4):
        for rank in range(size):
            shard, _ = load_model(tmp_path / "base", dtype=torch.float64, tokenizer=False, adapter=lora,
                                  tp=TensorParallel(rank, size, None, backend="gloo"))
            plan = ShardPlan(whole.config, rank, size)
            for name, p in shard.named_parameters():
                piece = plan.piece(name, tuple(full[name].shape))
                parts = [full[name].narrow(piece.dim, a, b - a) for a, b in piece.ranges]
                if piece.pad:
                    parts.append(parts[0].new_zeros((piece.pad, *parts[0].shape[1:])))
                assert torch.equal(p, torch.cat(parts, piece.dim)), name
