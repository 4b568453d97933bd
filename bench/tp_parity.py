"""Tensor parallel against one device, at the engine level: the same requests through
`Engine` on a whole model and on N ranks' shards (engine.load_model(..., tp=...)), token
for token. One process group serves every case: ranks [0, 1] and [2, 3] run the tp=2
cases (half each, in parallel), then all four the tp=4 case; each rank also records what
it read of the checkpoint and the bytes of weights it holds.

Used by tests/test_tensor_parallel.py (CPU, gloo, float64) and bench/gpu/tp_bench.py
(CUDA, NCCL, when the machine has >= 2 GPUs). Process start and torch's import dominate
the CPU cost, hence one spawn for everything."""
from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from engine import Engine, EngineConfig, ModelConfig, SamplingParams, build_model, load_model, save_model
from engine.models.families.moe import MoESpec

L = 4


def _llada(**kw) -> ModelConfig:  # every linear with a bias, a vocabulary of 63 (the last rank's shard padded)
    return ModelConfig.tiny("llada", linear_bias=True, vocab_size=63, mask_token_id=62, **kw)


def _llada_moe() -> ModelConfig:  # dense layer 0, 8 experts + shared expert, QK norm, partial RoPE
    spec = MoESpec(num_experts=8, top_k=2, expert_size=16, dense_size=48, dense_layers=(True, False), shared_size=24,
                   expert_bias=True)
    return ModelConfig(model_type="llada_moe", vocab_size=64, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       intermediate_size=48, mask_token_id=63, eos_token_id=1, max_seq_len=1024, moe=spec, qk_norm=True,
                       partial_rotary_factor=0.5)


def _llada2() -> ModelConfig:  # fused qkv with biases, ONE K/V head (replicated), groups, sigmoid routing
    spec = MoESpec(num_experts=8, top_k=2, expert_size=16, dense_size=48, dense_layers=(True, False), shared_size=16,
                   score="sigmoid", expert_bias=True, bias_in_weights=False, renormalize=True, scaling=2.5, n_group=4,
                   topk_group=2)
    return ModelConfig(model_type="llada2_moe", vocab_size=64, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=1,
                       intermediate_size=48, mask_token_id=63, eos_token_id=12, max_seq_len=1024, moe=spec, qk_norm=True,
                       qkv_bias=True, partial_rotary_factor=0.5, rope_theta=600000.0, rms_norm_eps=1e-6,
                       attn_out_bias=True, dllm_attention="block_causal")


def _published_llada2() -> ModelConfig:  # LLaDA2.0-mini's config.json as published, its sizes shrunk
    from bench.prefix_bench import tiny_llada2

    return tiny_llada2()


def _sdar_moe() -> ModelConfig:  # Qwen3 layer: head_dim 12 (not 32 / 4), GQA 4:2, QK norm, experts everywhere
    spec = MoESpec(num_experts=8, top_k=2, expert_size=16, dense_size=48, dense_layers=(False, False),
                   score="softmax", renormalize=True)
    return ModelConfig(model_type="sdar_moe", vocab_size=96, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       head_dim=12, intermediate_size=48, mask_token_id=95, eos_token_id=64, max_seq_len=1024,
                       qk_norm=True, rope_theta=1e6, rms_norm_eps=1e-6, dllm_attention="block_causal", moe=spec)


def _v2() -> ModelConfig:  # Fast-dLLM v2: Qwen2.5 layer, q/k/v biases, sub-blocks
    return ModelConfig(model_type="Fast_dLLM_Qwen", vocab_size=64, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
                       intermediate_size=48, mask_token_id=63, eos_token_id=7, max_seq_len=1024, rope_theta=1e6,
                       rms_norm_eps=1e-6, qkv_bias=True, dllm_attention="block_causal")


def _mix(kinds: Sequence[Dict[str, Any]], n: int, seed: int, vocab: int, stop: int):
    """n prompts of 1-11 tokens with rows of every kind, 1-4 blocks each (some not whole)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, vocab - 2) for _ in range(rng.randint(1, 11))] for _ in range(n)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 4) * L - rng.randint(0, 1) * (i % 2) * (
                                 "block_add_threshold" not in kinds[i % len(kinds)]),  # D2F: whole blocks
                             stop_token_ids=[stop] if i % 3 else [], **kinds[i % len(kinds)]) for i in range(n)]
    return prompts, params


NOISY = dict(temperature=0.8, seed=11)
RANDOM = dict(remasking="random", policy="fixed", seed=5)


@dataclass
class Case:
    name: str
    config: Callable[[], ModelConfig]
    engine: Dict[str, Any]
    kinds: List[Dict[str, Any]] = field(default_factory=list)
    seed: int = 0
    shared: int = 0  # a preamble the prompts open with, cut at several lengths (prefix caching)

    def workload(self, n: int = 12):
        cfg = self.config()
        prompts, params = _mix(self.kinds, n, self.seed, cfg.vocab_size, cfg.eos_token_id)
        if self.shared:  # cuts mid-block, at block ends and whole: prompts share 0-3 complete blocks
            rng = random.Random(self.seed)
            pre = [rng.randrange(2, cfg.vocab_size - 2) for _ in range(self.shared)]
            prompts = [pre[:rng.choice((L - 1, L, 2 * L + 1, self.shared))] + p for p in prompts]
        return prompts, params


PREFIX = "llada2-prefix-cache"  # enable_prefix_caching: each rank caches its shard of the same blocks
# 12 prompts each, one mixed batch per case (blockserve unless named); every cache mode, both advances
CASES = [
    Case("llada-dual", _llada, dict(cache="dual", advance="step"),
         [dict(threshold=0.3), dict(policy="fixed"), NOISY, RANDOM, dict(top_k=3, temperature=0.9, seed=3)]),
    Case("d2f-refresh", lambda: _llada(dllm_attention="block_causal"), dict(cache="refresh"),
         [dict(block_add_threshold=0.1, decoded_token_threshold=0.25, threshold=0.6), dict(policy="fixed"),
          dict(block_add_threshold=0.5, decoded_token_threshold=0.75, threshold=0.5, temperature=0.7, seed=5)], 1),
    Case("dream-dual", lambda: ModelConfig.tiny("Dream", tie_word_embeddings=True), dict(cache="dual"),
         [dict(threshold=0.3), dict(remasking="entropy", temperature=0.5, seed=2), dict(top_p=0.9, temperature=1.0, seed=4),
          dict(remasking="margin", policy="fixed"), dict(policy="origin", seed=9)], 2),
    Case("llada-moe-static", _llada_moe, dict(cache="dual", scheduler="static", max_batch_size=5),
         [dict(threshold=0.3), NOISY, dict(policy="fixed")], 3),
    Case("llada2-editing", _llada2, dict(cache="persistent"),
         [dict(threshold=0.15), dict(threshold=0.15, edit_threshold=0.1), dict(threshold=0.2, edit_threshold=0.05,
                                                                             max_post_steps=1)], 4),
    Case("sdar-moe-step", _sdar_moe, dict(cache="persistent", advance="step"),
         [dict(threshold=0.3), dict(policy="entropy_bound", entropy_bound=0.5), NOISY], 5),
    Case("fast-dllm-v2-nocache", _v2, dict(cache="none", scheduler="sequential"),
         [dict(sub_block_length=2, threshold=0.5), dict(threshold=0.4)], 6),
    Case(PREFIX, _published_llada2, dict(cache="refresh", enable_prefix_caching=True, token_budget=96),
         [dict(threshold=0.15), dict(threshold=0.15, edit_threshold=0.1), NOISY], 8, shared=3 * L),
]
TP4 = "llada2-editing"  # the case also run on four ranks
# cases the CPU test leaves out (their compile costs more CPU time than its budget): the
# block-only step through torch.compile (EngineConfig.compile_decode) with the collectives inside
EXTRA_CASES = [
    Case("llada-dual-compiled", _llada, dict(cache="dual", advance="step", compile_decode=True),
         [dict(threshold=0.3), dict(policy="fixed"), NOISY], 7),
]


def engine_config(case: Case, size: int) -> EngineConfig:
    return EngineConfig(**{**dict(block_length=L, steps_per_block=L, token_budget=160, max_batch_size=8), **case.engine,
                           "tensor_parallel_size": size})


def run_case(case: Case, model, size: int, stats: Optional[Dict[str, Any]] = None) -> List[Tuple[List[int], str]]:
    """[token ids, finish reason, error] per row; `stats` gets the engine's counters."""
    prompts, params = case.workload()
    engine = Engine(model, engine_config(case, size))
    outs = engine.generate(prompts, params)
    if stats is not None:
        st = engine.stats
        stats.update(forwards=st.forwards, compiled_forwards=st.compiled_forwards, compile_fallbacks=st.compile_fallbacks,
                     cycles=st.cycles, prefix_hit_blocks=st.prefix_hit_blocks, prefix_evictions=st.prefix_evictions)
    return [[list(o.token_ids), str(o.finish_reason), o.error] for o in outs]


def write_checkpoints(root: str, cases: Sequence[Case] = tuple(CASES)) -> None:
    for case in cases:
        save_model(build_model(case.config(), dtype=torch.float64, seed=case.seed), os.path.join(root, case.name))


def baseline(root: str, dtype: torch.dtype, device: str, cases: Sequence[Case] = tuple(CASES)) -> Dict[str, Any]:
    """Every case on one device."""
    out = {}
    for case in cases:
        model, _ = load_model(os.path.join(root, case.name), dtype=dtype, device=device, tokenizer=False)
        out[case.name] = run_case(case, model, 1)
    return out


def _worker(rank: int, world: int, root: str, dtype_name: str, backend: str, cases: List[str]) -> None:
    import torch.distributed as dist

    from engine.models.sharding import resident_bytes
    from engine.parallel import TensorParallel, destroy_tensor_parallel, init_tensor_parallel

    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    world_tp = init_tensor_parallel(rank, world, f"file://{os.path.join(root, 'rendezvous')}", backend)
    device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
    by_name = {c.name: c for c in CASES + EXTRA_CASES}
    pairs = [list(range(i, min(i + 2, world))) for i in range(0, world, 2)]
    groups = [(ranks, dist.new_group(ranks), dist.new_group(ranks, backend="gloo") if backend == "nccl" else None)
              for ranks in pairs]  # every rank creates every group, in the same order
    phases = [(ranks, g, cg, cases[j::len(pairs)]) for j, (ranks, g, cg) in enumerate(groups) if len(ranks) == 2]
    if world >= 4 and TP4 in cases:
        phases.append((list(range(world)), world_tp.group, world_tp.cpu_group, [TP4]))
    for ranks, group, cpu_group, names in phases:
        if rank in ranks:
            tp = TensorParallel(ranks.index(rank), len(ranks), group, cpu_group)
            for name in names:
                t0 = time.perf_counter()
                model, _ = load_model(os.path.join(root, name), dtype=dtype, device=device, tokenizer=False, tp=tp)
                stats: Dict[str, Any] = {}
                got = run_case(by_name[name], model, tp.size, stats)
                seedless = Engine(model, engine_config(by_name[name], tp.size)).generate(
                    [[5, 6, 7]], SamplingParams(max_new_tokens=L, temperature=0.7))[0]  # no seed: refused, not drawn
                record = dict(tokens=got, stats=stats, seedless=[seedless.finish_reason, seedless.error], seconds=time.perf_counter() - t0, resident_bytes=resident_bytes(model),
                              read_bytes=model.shard_reads.bytes,
                              reads={k: [d, [list(r) for r in rs]] for k, (d, rs) in model.shard_reads.ranges.items()})
                with open(os.path.join(root, "out", f"{name}.tp{tp.size}.rank{tp.rank}.json"), "w") as f:
                    json.dump(record, f)
        dist.barrier()
    destroy_tensor_parallel()


def run_sharded(root: str, world: int = 4, dtype: torch.dtype = torch.float64, backend: str = "gloo",
                cases: Optional[Sequence[str]] = None, while_waiting: Optional[Callable[[], Any]] = None):
    """Spawn `world` ranks once and run the cases on them (records under root/out/);
    `while_waiting` runs in this process meanwhile (the one-device baseline). Returns
    (its result, {case: {size: [rank records]}})."""
    import torch.multiprocessing as mp

    os.makedirs(os.path.join(root, "out"), exist_ok=True)
    names = list(cases or [c.name for c in CASES])
    ctx = mp.start_processes(_worker, args=(world, root, str(dtype).split(".")[-1], backend, names), nprocs=world,
                             join=False, start_method="spawn")
    mine = while_waiting() if while_waiting is not None else None
    while not ctx.join():
        pass
    records: Dict[str, Dict[int, List[Dict[str, Any]]]] = {}
    for fname in sorted(os.listdir(os.path.join(root, "out"))):
        name, size, rank = fname[:-len(".json")].rsplit(".", 2)
        with open(os.path.join(root, "out", fname)) as f:
            records.setdefault(name, {}).setdefault(int(size[2:]), []).append(json.load(f))
    return mine, records


__all__ = ["CASES", "EXTRA_CASES", "PREFIX", "TP4", "Case", "write_checkpoints", "baseline", "run_sharded", "run_case", "engine_config"]
